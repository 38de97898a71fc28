"""The paged engine's generate loop: steps launched ahead of the host's reading of their tokens.

With overlap on (``LLM(cuda_graphs=...)`` on, the default on CUDA) the host never waits for a step before launching
the next one:

* **Decode steps as CUDA graphs**: while graph step t runs, the host schedules step t + 1
  (:meth:`Scheduler.schedule_next_decode`: same requests, one token further) and launches it with its input ids
  taken from step t's greedy tokens on the device, then reads step t's tokens.
* **Eager steps** (prefill chunks, mixed prefill + decode) whose sampled rows are all greedy: their tokens are
  picked on the device (:meth:`PagedRunner.pick_greedy`) and the host advances the requests at once, each
  sampled request ending in a placeholder token (:data:`PLACEHOLDER`). The next step is scheduled and launched
  from that state, its placeholder inputs taken from the device; only then does the host read the tokens
  (:meth:`_resolve`), fill the placeholders in and finish requests.

What the host decides before the tokens are known is what it can: a request reaching ``max_tokens`` is finished at
once (its reason becomes "stop" if the token turns out to be EOS / a stop token). A request finished by its token
(EOS, stop) has run one step too many: that row's result is dropped and its KV write went to its own blocks,
freed only after the write was queued (later steps are stream-ordered after it). A request preempted while its
token is unread gets the token filled in where it waits. A request whose unread token will finish it still holds its
place (blocks, budget) in the step scheduled meanwhile, so preemptions may differ from the step-by-step loop's;
tokens do not. With overlap off every step is run, read and processed before the next is scheduled: the reference
loop the tests compare with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .paged_runner import PLACEHOLDER, PagedRunner, PendingTokens
from .sampling import sample
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, SequenceStatus

__all__ = ["PagedLoop"]

_FINISHED = SequenceStatus.FINISHED


class PagedLoop:
    """Runs scheduled steps until every request has finished (one ``LLM.generate``).

    Parameters
    ----------
    scheduler : Scheduler
    runner : PagedRunner
    finish_reason : callable
        ``(seq) -> "stop" | "length" | None`` for a request whose last token was just added.
    overlap : bool
        Launch each step before the host reads the previous one's tokens (see the module docstring).

    Example
    -------
    >>> PagedLoop(sched, runner, llm._finish_reason, overlap=True).run(seqs, stats, None)   # doctest: +SKIP
    """

    def __init__(self, scheduler: Scheduler, runner: PagedRunner, finish_reason: Callable[[Sequence], str | None],
                 *, overlap: bool) -> None:
        self.sched = scheduler
        self.runner = runner
        self.finish_reason = finish_reason
        self.overlap = overlap

    def run(self, seqs: list[Sequence], st: Any, progress: Callable[[int, int, int], None] | None) -> None:
        """Run ``seqs`` (already queued in the scheduler) to the end; counters go to ``st`` (``EngineStats``),
        ``progress(finished, total, generated)`` is called after every step whose tokens were read.

        Example
        -------
        >>> loop.run(seqs, EngineStats(), None)                   # doctest: +SKIP
        """
        sched, runner = self.sched, self.runner
        self._st, self._progress, self._total, self._counts = st, progress, len(seqs), [0, 0]
        inflight = None  # a graph step in flight (DecodeStep)
        pending: PendingTokens | None = None  # an eager step whose tokens the host has not read
        while inflight is not None or pending is not None or sched.has_unfinished():
            if inflight is None:
                if not sched.has_unfinished():
                    pending = self._resolve(pending)
                    continue
                batch = sched.schedule()
                self._track_blocks()
                if not batch.seqs:
                    if pending is not None:  # its requests may finish and free blocks
                        pending = self._resolve(pending)
                        continue
                    raise RuntimeError("scheduler: no request could be scheduled (pool too small for one request)")
                if runner.can_launch_decode(batch) and all(s.params.greedy for s in batch.seqs):
                    inflight = runner.launch_decode(batch, pending=pending)
                    st.overlapped_steps += pending is not None
                    pending = self._resolve(pending)
                    continue
                logits = runner.run(batch, pending=pending)
                st.overlapped_steps += pending is not None
                pending = self._resolve(pending)
                sampled = [s for s, f in zip(batch.seqs, batch.sample) if f]
                if self.overlap and all(s.params.greedy for s in sampled):
                    pending = self._advance(batch, logits)
                    continue
                toks = sample(logits, [s.params for s in sampled], [s.generator for s in sampled]) if sampled else []
                by_seq = dict(zip(map(id, sampled), toks))
                self._process(batch, [by_seq.get(id(s)) for s in batch.seqs])
                continue
            # the graph step in flight: launch the one after it before waiting for its tokens
            nxt = sched.schedule_next_decode(inflight.batch)
            ahead = runner.launch_decode(nxt, ahead=True) if nxt is not None else None
            st.overlapped_steps += ahead is not None
            self._track_blocks()
            self._process(inflight.batch, inflight.greedy_tokens())
            if ahead is not None and any(s.status is _FINISHED for s in ahead.batch.seqs):
                # a request finished by its last token (EOS, stop): the step ahead ran it once too often. Processing
                # it drops that row (postprocess skips finished requests); the next step is scheduled afresh
                self._process(ahead.batch, ahead.greedy_tokens())
                ahead = None
            inflight = ahead

    def _track_blocks(self) -> None:
        """The peak blocks held: ``blocks_used`` over every group, and each group's (``GenerateStats.groups``)."""
        st, sched = self._st, self.sched
        if len(sched.allocators) == 1:
            st.blocks_used = max(st.blocks_used, sched.allocator.num_used_blocks)
            return
        used = sched.used_blocks()
        st.blocks_used = max(st.blocks_used, sum(used))
        for group, n in zip(getattr(st, "groups", ()), used):
            group.blocks_used = max(group.blocks_used, n)

    def _report(self, finished: int, generated: int) -> None:
        self._counts[0] += finished
        self._counts[1] += generated
        if self._progress is not None:
            self._progress(self._counts[0], self._total, self._counts[1])

    def _process(self, batch: ScheduledBatch, new_tokens: list[int | None]) -> None:
        """Advance a finished step: append its tokens, publish full blocks, finish requests, report progress (rows
        of requests finished meanwhile are skipped)."""
        self._st.steps += 1
        sampled = self.sched.postprocess(batch, new_tokens)
        done = [(s, r) for s in sampled if (r := self.finish_reason(s)) is not None]
        for s, reason in done:
            self.sched.finish(s, reason)
        self._report(len(done), len(sampled))

    def _advance(self, batch: ScheduledBatch, logits: Any) -> PendingTokens:
        """Pick ``batch``'s greedy tokens on the device and advance its requests without reading them: each sampled
        request ends in a placeholder; one that reaches ``max_tokens`` finishes now."""
        live = [f and s.status is not _FINISHED for s, f in zip(batch.seqs, batch.sample)]
        sampled = self.sched.postprocess(batch, [PLACEHOLDER if ok else None for ok in live])
        at = {id(s): len(s.token_ids) - 1 for s in sampled}
        rows = [(s, at.get(id(s), -1)) for s, f in zip(batch.seqs, batch.sample) if f]
        pend = self.runner.pick_greedy(logits, rows)
        for s in sampled:
            if s.num_generated >= s.params.max_tokens:
                self.sched.finish(s, "length")
        return pend

    def _resolve(self, pending: PendingTokens | None) -> None:
        """Read an advanced step's tokens (waits for it): fill the placeholders in, finish requests whose token
        ends them, report progress. Returns None (the caller's pending step is done)."""
        if pending is None:
            return None
        self._st.steps += 1
        toks = pending.tokens()
        rows = [(s, i, t) for (s, i), t in zip(pending.rows, toks) if i >= 0]
        for s, i, t in rows:
            s.token_ids[i] = t
        finished = 0
        for s, _, _ in rows:
            reason = self.finish_reason(s)
            if s.status is _FINISHED:  # finished by length when advanced: EOS / a stop token takes precedence
                s.finish_reason = reason or s.finish_reason
                finished += 1
            elif reason is not None:
                self.sched.finish(s, reason)
                finished += 1
        self._report(finished, len(rows))
        return None

