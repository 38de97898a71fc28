"""What :class:`~kvcache.engine.LLM` needs of a cache mode: the :class:`EngineCore` protocol, and the
:class:`EngineStats` a ``generate`` call fills.

Two cores implement it: :class:`~kvcache.engine.paged_core.PagedEngineCore` (``cache="paged"``: pool, allocator,
scheduler, runner, step loop) and :class:`~kvcache.engine.linear_runner.LinearEngineCore` (``cache="linear"``: one
slot per request). Each is built as ``Core(model, config)`` from the engine's forward and its
:class:`~kvcache.engine.EngineConfig`; ``LLM`` picks one by ``config.cache`` and calls only the members below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from .sequence import Sequence

__all__ = ["EngineCore", "EngineStats", "FinishReason", "Progress"]

FinishReason = Callable[[Sequence], str | None]  # (seq) -> "stop" | "length" | None after a token was added
Progress = Callable[[int, int, int], None]  # (finished requests, total requests, generated tokens)


@dataclasses.dataclass
class EngineStats:
    """Counters of the last :meth:`LLM.generate` call.

    Attributes
    ----------
    requests, prompt_tokens, generated_tokens : int
    elapsed_s : float
        Wall time of the call.
    tokens_per_s : float
        ``generated_tokens / elapsed_s``.
    cached_prompt_tokens : int
        Prompt tokens whose KV came from the prefix cache (paged) or a restored snapshot (linear).
    prefix_cache_hit_rate : float
        ``cached_prompt_tokens / prompt_tokens``.
    blocks_used : int
        Peak blocks held by running requests (paged); peak slots in use (linear).
    num_blocks : int
        Blocks in the pool (paged); slots (linear).
    cache_bytes : int
        Bytes of the KV cache allocation (quantization parameters included).
    kv_dtype, cache : str
    preemptions, steps, graph_steps, overlapped_steps : int
        Requests preempted (recomputed), engine steps, decode steps run as CUDA graphs, steps launched before the
        host had read the step before them (the host's work hidden behind the device's).
    attention : str
        ``"paged_attention"`` (in place), ``"slot-sdpa"`` (linear).
    """

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    tokens_per_s: float = 0.0
    cached_prompt_tokens: int = 0
    prefix_cache_hit_rate: float = 0.0
    blocks_used: int = 0
    num_blocks: int = 0
    cache_bytes: int = 0
    kv_dtype: str = "auto"
    cache: str = "paged"
    preemptions: int = 0
    steps: int = 0
    graph_steps: int = 0
    overlapped_steps: int = 0
    attention: str = ""


class EngineCore(Protocol):
    """A cache mode of the engine, built as ``Core(model: LlamaForward, config: EngineConfig)``.

    Attributes
    ----------
    cache : PagedKVCache or LinearKVCache
        The KV cache the core runs on.
    max_model_len : int
        Longest request (prompt + max_tokens) it runs.
    num_blocks : int
        Blocks in the pool (paged) or slots (linear): ``EngineStats.num_blocks``.
    cache_bytes : int
        Bytes of the cache allocation: ``EngineStats.cache_bytes``.
    attention : str
        The attention path, ``EngineStats.attention``.

    Example
    -------
    >>> core = PagedEngineCore(LlamaForward(hf_model), EngineConfig(block_size=8))    # doctest: +SKIP
    >>> core.check(seq); core.run([seq], EngineStats(), finish_reason, None)         # doctest: +SKIP
    """

    cache: Any
    max_model_len: int
    num_blocks: int
    cache_bytes: int
    attention: str

    def check(self, seq: Sequence) -> None:
        """Raise ValueError if ``seq`` could never run on this core (before anything is queued)."""
        ...

    def run(self, seqs: list[Sequence], stats: EngineStats, finish_reason: FinishReason,
            progress: Progress | None) -> None:
        """Queue ``seqs`` (checked) and run them to the end; the step counters (``steps``, ``blocks_used``,
        ``cached_prompt_tokens``, ``preemptions``, ``graph_steps``, ``overlapped_steps``) go to ``stats``."""
        ...

    def abort_all(self) -> None:
        """Drop every request and free its cache memory (after an error in :meth:`run`)."""
        ...
