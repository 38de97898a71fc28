"""A request's state while it runs (``Sequence``) and what :meth:`LLM.generate` returns (``RequestOutput``)."""

from __future__ import annotations

import dataclasses
import enum

import torch

from .sampling import SamplingParams

__all__ = ["RequestOutput", "ScheduledBatch", "Sequence", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestOutput:
    """The result of one prompt.

    Attributes
    ----------
    request_id : int
        Position of the prompt in the ``generate`` call.
    prompt_token_ids : list of int
        The prompt as token ids (after the chat template, if the prompt was a conversation).
    token_ids : list of int
        Generated tokens; an EOS or stop token that ended generation is included.
    text : str
        ``token_ids`` decoded (special tokens skipped); cut before a stop string.
    finish_reason : str
        ``"stop"`` (EOS, a stop token or a stop string) or ``"length"`` (``max_tokens`` reached).
    num_cached_tokens : int
        Prompt tokens whose KV came from the prefix cache (or a restored system prompt) at admission.
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int = 0


class Sequence:
    """One request in the engine: its tokens, how many have KV in the cache, and its blocks (paged mode).

    ``token_ids`` holds prompt + generated tokens. ``num_computed`` tokens have their KV in the cache; the
    next step feeds ``token_ids[num_computed:]`` (a prefill chunk, or the last sampled token). A step that
    reaches the end of ``token_ids`` yields the logits of the next token. Preemption frees the blocks and
    sets ``num_computed = 0``: the request is recomputed from its tokens (prompt and generated so far).
    """

    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "params", "generator", "status", "num_computed",
                 "block_tables", "num_freed", "block_hashes", "num_published", "num_cached_tokens", "finish_reason",
                 "stop_text", "num_preemptions", "slot")

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.status = SequenceStatus.WAITING
        self.num_computed = 0
        # one block table per layer group of the paged engine (group 0: ``block_table``); a window group's leading
        # ``num_freed[g]`` slots were given back (no query reads them) and hold an id no request owns
        self.block_tables: list[list[int]] = [[]]
        self.num_freed: list[int] = [0]
        self.block_hashes: list[int] = []  # hash chain of the full blocks of token_ids (grown on demand)
        self.num_published = 0  # leading blocks registered in the prefix cache
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.stop_text: str | None = None
        self.num_preemptions = 0
        self.slot = -1  # linear mode: the cache slot

    @property
    def block_table(self) -> list[int]:
        """The block table of the first layer group (the only one of most models)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_ids(self) -> list[int]:
        """The generated tokens."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to feed before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed

    def __repr__(self) -> str:
        blocks = self.block_tables if len(self.block_tables) > 1 else self.block_table
        return (f"Sequence(id={self.request_id}, status={self.status.value}, len={len(self.token_ids)}, "
                f"computed={self.num_computed}, blocks={blocks})")


@dataclasses.dataclass
class ScheduledBatch:
    """What one step runs: ``seqs[i]`` feeds ``num_tokens[i]`` tokens from ``seqs[i].num_computed`` on.

    ``sample[i]``: the chunk reaches the end of the request's tokens, so its last row's logits give a token.
    ``preempted``: requests preempted while scheduling this step.
    """

    seqs: list[Sequence]
    num_tokens: list[int]
    sample: list[bool]
    preempted: list[Sequence]

    @property
    def total_tokens(self) -> int:
        """Rows of the step."""
        return sum(self.num_tokens)

    @property
    def is_decode(self) -> bool:
        """Every request feeds exactly one token and samples (a pure decode step: CUDA-graph eligible; a one-token
        chunk of a longer prompt samples nothing and makes the step a prefill one)."""
        return bool(self.seqs) and all(n == 1 for n in self.num_tokens) and all(self.sample)
