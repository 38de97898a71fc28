"""Admission control of the paged scheduler: a waiting request starts only while the pool keeps room for what the
running requests are expected to generate, so that admitting it does not force a preemption later.

A request may still generate ``max_tokens - num_generated`` tokens; it is expected to generate ``ratio`` of that
(rounded up). ``ratio`` starts at 1.0: with no evidence every request may use its whole budget, and nothing the
scheduler admits is preempted (TensorRT-LLM's guaranteed-no-evict). It then follows the finished requests: an
exponential average (weight 1/8) of ``num_generated / max_tokens``, so requests that stop early (EOS, a stop string)
let more of them in, the way SGLang's new-token ratio does. A preemption shows the estimate ran short: ``ratio``
moves halfway back to 1.0. It never drops below 0.05. ``LLM(decode_reserve=r)`` fixes it instead: 1.0 never
preempts, 0.0 reserves nothing (a request is admitted while its next chunk fits: vLLM's policy).

A preempted request is recomputed from its tokens (prompt and generated), a prefill of everything it held. Admitting
by the pool's free blocks alone (what the scheduler did before) refills the pool with the prompts of new requests
while the running ones still grow, then preempts them one by one as they do: at a fixed 4 GiB budget on an
8B-shaped model (192 requests x (512 + 512) tokens), 125 of 192 requests were preempted with bf16 KV.

Blocks are counted per layer group: a window group's request holds at most :func:`~kvcache.paged.groups.peak_blocks`
blocks, however long it grows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq

from .._validate import cdiv
from ..paged.groups import peak_blocks
from .sequence import Sequence

__all__ = ["DecodeReserve"]


class DecodeReserve:
    """The blocks running requests are expected to still need, and the estimate behind it.

    Parameters
    ----------
    block_size : int
        Tokens per block.
    windows : sequence of int or None
        Each layer group's sliding window (None: full attention).
    chunk : int
        Tokens a request is fed per step at most (the scheduler's token budget): bounds a window group's blocks.
    ratio : float, optional
        A fixed ratio in [0, 1] (never learned); None (default): learned, starting at 1.0.

    Attributes
    ----------
    ratio : float
        The fraction of its remaining ``max_tokens`` a running request is expected to generate: in [0.05, 1] when
        learned.
    learned : bool
        Whether ``ratio`` follows the finished requests and the preemptions.

    Example
    -------
    >>> from kvcache.engine.sampling import SamplingParams
    >>> r = DecodeReserve(block_size=4, windows=[None], chunk=16)
    >>> seq = Sequence(0, [1, 2, 3, 4, 5], SamplingParams(max_tokens=8))
    >>> r.blocks(seq)          # 5 + 8 tokens: 4 blocks, none held yet
    [4]
    >>> seq.token_ids += [9] * 2; r.finished(seq); round(r.ratio, 3)   # it stopped after 2 of 8 tokens
    0.906
    """

    INITIAL_RATIO = 1.0
    MIN_RATIO = 0.05
    WEIGHT = 0.125

    def __init__(self, block_size: int, windows: Seq[int | None], chunk: int, ratio: float | None = None) -> None:
        for name, v in (("block_size", block_size), ("chunk", chunk)):
            if type(v) is not int or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if not windows or any(w is not None and (type(w) is not int or w < 1) for w in windows):
            raise ValueError(f"windows: expected a non-empty list of ints >= 1 or None, got {windows!r}")
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or
                                  not 0 <= ratio <= 1):
            raise ValueError(f"ratio: expected a float in [0, 1] or None, got {ratio!r}")
        self.block_size = block_size
        self.windows = list(windows)
        self.chunk = chunk
        self.learned = ratio is None
        self.ratio = self.INITIAL_RATIO if ratio is None else float(ratio)

    def expected_tokens(self, seq: Sequence) -> int:
        """Tokens ``seq`` is expected to hold when it finishes: its tokens now (an unfed prompt included) plus
        ``ratio`` of its remaining ``max_tokens``, rounded up."""
        remaining = max(seq.params.max_tokens - seq.num_generated, 0)
        return len(seq.token_ids) + math.ceil(self.ratio * remaining)

    def blocks(self, seq: Sequence) -> list[int]:
        """Blocks each group must still give ``seq`` for :meth:`expected_tokens` (beyond those it holds); none at
        ``ratio`` 0 (no reserve: a request is admitted while its next chunk fits)."""
        if self.ratio == 0:
            return [0] * len(self.windows)
        total = self.expected_tokens(seq)
        out = []
        for g, w in enumerate(self.windows):
            live = len(seq.block_tables[g]) - seq.num_freed[g]
            peak = cdiv(total, self.block_size) if w is None else peak_blocks(w, total, self.chunk, self.block_size)
            out.append(max(peak - live, 0))
        return out

    def total(self, seqs: Seq[Sequence]) -> list[int]:
        """:meth:`blocks` summed over ``seqs``, per group."""
        out = [0] * len(self.windows)
        for seq in seqs:
            for g, n in enumerate(self.blocks(seq)):
                out[g] += n
        return out

    def finished(self, seq: Sequence) -> None:
        """Learn from a request that finished: it generated ``num_generated`` of its ``max_tokens``."""
        if not self.learned:
            return
        used = min(seq.num_generated / max(seq.params.max_tokens, 1), 1.0)
        self.ratio = max(self.MIN_RATIO, self.ratio + self.WEIGHT * (used - self.ratio))

    def preempted(self) -> None:
        """A running request was preempted: the estimate ran short, so it moves halfway back to 1.0."""
        if self.learned:
            self.ratio = (self.ratio + 1.0) / 2
