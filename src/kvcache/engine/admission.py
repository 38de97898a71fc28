"""Admission control of the paged scheduler: a waiting request starts only while the pool keeps room for what the
running requests are expected to generate, so that admitting it does not force a preemption later.

A request may still generate ``max_tokens - num_generated`` tokens; it is expected to generate ``ratio`` of that
(rounded up), one token a step, then finish and give its blocks back; a request whose prompt is not fed yet holds
all of it at once and finishes later by the steps the token budget needs to feed it and every older unfed prompt. A
request is admitted when, at every step until the last of them is expected to finish, the blocks it and the running
requests are expected to hold fit in the pool (its free blocks and those the requests hold, a shared prefix block
once; checked just before each expected finish: between finishes the blocks in use only grow). Crediting the
finishes lets requests of staggered lengths fill the pool without preemption; the plain sum of every request's
remaining growth would cap a pool of requests at mid-life to about 3/4 of it. Not counted: a wait for host-tier
copies (:mod:`kvcache.paged.tiers`), which delays a request's finish by the steps the copies take.

``ratio`` starts at 1.0: with no evidence every request may use its whole budget, and nothing the scheduler admits
is preempted while requests run to ``max_tokens`` (TensorRT-LLM's guaranteed-no-evict). It then follows the finished
requests: an exponential average (weight 1/8) of ``num_generated / max_tokens``, so requests that stop early (EOS, a
stop string) let more of them in, the way SGLang's new-token ratio does. A preemption shows the estimate ran short:
``ratio`` moves halfway back to 1.0. It never drops below 0.05. ``LLM(decode_reserve=r)`` fixes it instead: 1.0
never preempts, 0.0 reserves nothing (a request is admitted while its next chunk fits: vLLM's policy).

A preempted request is recomputed from its tokens (prompt and generated), a prefill of everything it held. Admitting
by the pool's free blocks alone (``decode_reserve=0``) refills the pool with the prompts of new requests
while the running ones still grow, then preempts them one by one as they do: at a fixed 4 GiB budget on an
8B-shaped model (192 requests x (512 + 512) tokens), 125 of 192 requests were preempted with bf16 KV.

Blocks are counted per layer group. A window group's request holds at most :func:`~kvcache.paged.groups.peak_blocks`
blocks however long it grows: there the sum of what each request still needs must fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq

from .._validate import cdiv
from ..paged.groups import peak_blocks
from .sequence import Sequence

__all__ = ["DecodeReserve"]


class DecodeReserve:
    """Whether a waiting request may start: the blocks it and the running requests are expected to hold, step by
    step until they are expected to finish, against the blocks they may hold at once.

    Parameters
    ----------
    block_size : int
        Tokens per block.
    windows : sequence of int or None
        Each layer group's sliding window (None: full attention).
    chunk : int
        The scheduler's token budget of a step: how fast prompts are fed, and a window group's blocks.
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
    >>> r.expected_tokens(seq), r.admits([], seq, room=[3]), r.admits([], seq, room=[2])   # its last token unstored
    (13, True, False)
    >>> seq.token_ids += [9] * 2; r.finished(seq); round(r.ratio, 3)   # it stopped after 2 of 8 tokens
    0.906
    """

    INITIAL_RATIO = 1.0
    MIN_RATIO = 0.05
    WEIGHT = 0.125

    def __init__(self, block_size: int, windows: Seq[int | None], chunk: int, ratio: float | None = None,
                 spare_block: bool = False) -> None:
        for name, v in (("block_size", block_size), ("chunk", chunk)):
            if type(v) is not int or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if not windows or any(w is not None and (type(w) is not int or w < 1) for w in windows):
            raise ValueError(f"windows: expected a non-empty list of ints >= 1 or None, got {windows!r}")
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))):
            raise TypeError(f"ratio: expected a float in [0, 1] or None, got {type(ratio).__name__}")
        if ratio is not None and not 0 <= ratio <= 1:
            raise ValueError(f"ratio: expected a float in [0, 1] or None, got {ratio!r}")
        self.block_size = block_size
        self.spare_block = bool(spare_block)  # a request may hold one block more than its tokens fill (int4b)
        self.windows = list(windows)
        self.chunk = chunk
        self.learned = ratio is None
        self.ratio = self.INITIAL_RATIO if ratio is None else float(ratio)

    def expected_tokens(self, seq: Sequence) -> int:
        """Tokens ``seq`` is expected to hold when it finishes: its tokens now (an unfed prompt included) plus
        ``ratio`` of its remaining ``max_tokens``, rounded up."""
        return len(seq.token_ids) + self._steps(seq)

    def _steps(self, seq: Sequence) -> int:
        return math.ceil(self.ratio * max(seq.params.max_tokens - seq.num_generated, 0))

    def admits(self, running: Seq[Sequence], seq: Sequence, room: Seq[int]) -> bool:
        """Whether ``seq`` may start beside ``running`` (oldest first), ``room[g]``: the blocks of group ``g`` the
        requests may hold at once (the pool: its free blocks and those the requests hold, a shared one once).

        A full-attention group: at every step until the last of them is expected to finish, each request holds its
        tokens now plus one a step (its whole prompt at once), and gives its blocks back when it is expected to
        finish: after ``ratio`` of its remaining ``max_tokens``, plus, while its prompt is unfed, the steps the
        budget needs to feed it and every older unfed prompt. A window group (a request holds at most its window):
        the most each request holds, summed. Always True at ``ratio`` 0.

        Raises
        ------
        ValueError
            ``room`` does not give one count per group.
        """
        if len(room) != len(self.windows):
            raise ValueError(f"room: expected one count per group ({len(self.windows)}), got {len(room)}")
        if self.ratio == 0:
            return True
        reqs = [*running, seq]
        for g, w in enumerate(self.windows):
            if w is None:
                if not self._fits_over_time(reqs, room[g]):
                    return False
            elif sum(peak_blocks(w, self.expected_tokens(q), min(self.chunk, max(q.num_uncomputed, 1)),
                                 self.block_size) for q in reqs) > room[g]:
                return False
        return True

    def _fits_over_time(self, reqs: Seq[Sequence], room: int) -> bool:
        # Step 1 is the step being scheduled. A request samples its next token at step d (1 for a decode; for an unfed
        # prompt, the steps the budget needs to feed it and the older unfed prompts), then one a step: it finishes
        # at step d + r - 1 (r = _steps) and never stores its last token. Up to then it holds at most
        # tokens_i - 1 + s tokens at step s >= 1 (its whole prompt at once). A check just before each expected
        # finish (the blocks in use only grow between finishes): the blocks of the n requests alive at step s,
        # sum(ceil((tokens_i - 1 + s) / block_size)), lie between ceil((T + n * s) / block_size) and
        # (T + n * (s + block_size - 1)) // block_size (T = sum(tokens_i - 1)): the exact sum is taken only when the
        # room falls between the two. Shared blocks count once per holder: an upper bound.
        bs, feed = self.block_size, max(self.chunk - len(reqs), 1)
        items, unfed = [], 0
        for q in reqs:  # oldest first, as the scheduler feeds prompts (a decode feeds 1 token: its last sampled one)
            pending = q.num_uncomputed if q.num_uncomputed > 1 else 0
            unfed += pending
            first = cdiv(unfed, feed) if pending else 1
            items.append((max(first + self._steps(q) - 1, 1), len(q.token_ids) - 1))
        items.sort()
        tokens = sum(t for _, t in items)
        for i, (steps, t) in enumerate(items):
            alive = len(items) - i
            left = room - alive * self.spare_block  # each request's spare block, counted whole: an upper bound
            if (tokens + alive * (steps + bs - 1)) // bs > left and (
                    cdiv(tokens + alive * steps, bs) > left or
                    sum(cdiv(u + steps, bs) for _, u in items[i:]) > left):
                return False
            tokens -= t
        return True

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
