"""Continuous-batching scheduler of the paged engine: chunked prefill mixed with decode, prefix caching,
preemption by recompute. No torch, no model: it only decides, each step, which tokens of which requests run.

Each step has a token budget (``max_num_batched_tokens``):

1. Running requests first, oldest first: each gets its remaining tokens (one for a decode, the rest of its
   prompt, or a chunk of it when the budget is short). Blocks for those tokens are allocated; when the pool is
   out, the newest running request is preempted (its blocks freed, its KV recomputed later from its tokens:
   prompt and generated so far), and so on until the allocation succeeds or the request preempts itself.
2. Then waiting requests, in arrival order (preempted ones first), while the budget, ``max_num_seqs`` and the
   pool allow: the longest cached prefix of the request's tokens (``BlockAllocator.match_prefix`` over the full
   blocks of all tokens but the last, whose logits must be computed) is taken, then blocks for its first chunk,
   provided the pool holds what this request and the running ones are expected to hold until they finish
   (:mod:`kvcache.engine.admission`; by default, nothing admitted is preempted while requests run to max_tokens).
   A request whose prefix is being prefilled by a running request right now waits for it (one step or a few),
   so a system prompt shared by a burst of requests is prefilled once, then hit by all the others.

After the model ran, :meth:`Scheduler.postprocess` advances the requests, publishes every newly full block in
the prefix cache (its KV is written) and releases finished requests at once.

Layer groups (:mod:`kvcache.paged.groups`): a model whose layers have different sliding windows gives the
scheduler one allocator per group (``windows[g]``: the group's window, None for full attention) and every request
one block table per group. A step's tokens are allocated in every group or in none (a group that is out preempts as
above). Before allocating, a window group gives back the request's blocks that lie wholly before
``num_computed - window + 1`` (no later query reads them; :func:`~kvcache.paged.groups.first_live_block`); their
slots keep an id no request holds (the allocator's ``num_blocks``: the engine's scratch block), outside every
window, so the attention never reads them. A prefix hit of ``k`` blocks takes, in a full group, the chain's first
``k`` blocks and, in a window group, only the blocks from ``first_live_block(window, k * block_size)`` on, all
cached; ``k`` is the longest prefix every group can serve. A model of one full-attention group runs the
single-allocator code as before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq

from .._validate import cdiv
from ..ops.paged.block_keys import blocks_for_tokens
from ..paged import BlockAllocator
from ..paged.groups import first_live_block, match_groups, peak_blocks
from ..paged.tiers import TieredCache
from .admission import DecodeReserve
from .sequence import ScheduledBatch, Sequence, SequenceStatus

__all__ = ["ScheduledBatch", "Scheduler"]


class Scheduler:
    """Decides each step's batch over a :class:`~kvcache.BlockAllocator`.

    Parameters
    ----------
    allocator : BlockAllocator or sequence of BlockAllocator
        Owns the block ids of the cache (prefix caching on or off there); one per layer group (the same
        ``block_size`` and ``enable_prefix_caching`` each).
    max_num_seqs : int
        Running requests at most.
    max_num_batched_tokens : int
        Token budget of one step (prefill chunks + decodes).
    max_blocks_per_seq : int
        Block-table width: requests longer than ``max_blocks_per_seq * block_size`` tokens are refused by
        :meth:`add`.
    tiers : TieredCache, optional
        Host / disk tiers below the pool (the allocator's listener): a prefix that continues past the device's
        cached blocks is brought back from them at admission. A request whose blocks are still being copied back
        holds its place among the running requests but runs only once they have arrived (other requests do not
        wait for them); when nothing else can run, the step waits for the copies. One allocator only.
    windows : sequence of int or None, optional
        Each allocator's sliding window (None: full attention); default all None. A window group frees the blocks
        no later query of a request reads (see the module docstring).
    decode_reserve : float, optional
        A fixed :attr:`~kvcache.engine.admission.DecodeReserve.ratio`; None: learned (see
        :mod:`kvcache.engine.admission`). A waiting request is admitted only when the pool holds what it and the
        running requests are expected to hold until they finish.
    spare_block : bool, optional
        A request whose last block is partial holds the block after it too (``kv_dtype="int4b"``: the partial
        block's int8 key rows spill into it): :meth:`blocks_for`. One full-attention group only.

    Attributes
    ----------
    allocator : BlockAllocator
        The first group's (the only one of most models); ``allocators`` holds every group's.

    Example
    -------
    >>> from kvcache.engine.sampling import SamplingParams
    >>> s = Scheduler(BlockAllocator(8, 4), max_num_seqs=2, max_num_batched_tokens=16, max_blocks_per_seq=8)
    >>> s.add(Sequence(0, [1, 2, 3, 4, 5], SamplingParams(max_tokens=2)))
    >>> b = s.schedule(); b.num_tokens, b.sample
    ([5], [True])

    A window group gives back what its window no longer reads (window 4, blocks of 4; 12 tokens computed):

    >>> s = Scheduler([BlockAllocator(8, 4), BlockAllocator(8, 4)], windows=[None, 4], max_num_seqs=1,
    ...               max_num_batched_tokens=16, max_blocks_per_seq=8)
    >>> s.add(Sequence(0, list(range(12)), SamplingParams(max_tokens=4)))
    >>> first = s.schedule(); s.postprocess(first, [7]) and None
    >>> s.schedule().seqs[0].block_tables, s.used_blocks()   # the query at 12 sees 9..12: blocks 0, 1 go back
    ([[0, 1, 2, 3], [8, 8, 2, 3]], [4, 2])
    """

    def __init__(self, allocator: BlockAllocator | Seq[BlockAllocator], *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_blocks_per_seq: int, tiers: TieredCache | None = None,
                 windows: Seq[int | None] | None = None, decode_reserve: float | None = None,
                 spare_block: bool = False) -> None:
        allocators = [allocator] if isinstance(allocator, BlockAllocator) else allocator
        if not isinstance(allocators, (list, tuple)) or not allocators or \
                not all(isinstance(a, BlockAllocator) for a in allocators):
            raise TypeError(f"allocator: expected a BlockAllocator or a non-empty list of them, got "
                            f"{type(allocator).__name__}")
        a0 = allocators[0]
        if any((a.block_size, a.enable_prefix_caching) != (a0.block_size, a0.enable_prefix_caching)
               for a in allocators):
            raise ValueError("allocator: expected the same block_size and enable_prefix_caching in every group, got "
                             f"{[(a.block_size, a.enable_prefix_caching) for a in allocators]}")
        windows = [None] * len(allocators) if windows is None else list(windows)
        if len(windows) != len(allocators) or any(w is not None and (type(w) is not int or w < 1) for w in windows):
            raise ValueError(f"windows: expected one int >= 1 or None per allocator ({len(allocators)}), got "
                             f"{windows!r}")
        if tiers is not None and not isinstance(tiers, TieredCache):
            raise TypeError(f"tiers: expected a TieredCache or None, got {type(tiers).__name__}")
        if tiers is not None and len(allocators) > 1:
            raise ValueError(f"tiers: the memory tiers hold one pool's blocks, got {len(allocators)} layer groups")
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_blocks_per_seq", max_blocks_per_seq)):
            if type(v) is not int or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        self.allocator = a0
        self.allocators = list(allocators)
        self.windows = windows
        # one full-attention group: the single-allocator code, nothing per group
        self._plain = len(allocators) == 1 and windows[0] is None
        self._window_groups = [(g, w) for g, w in enumerate(windows) if w is not None]
        self.tiers = tiers
        self._awaiting: dict[int, Sequence] = {}  # id(seq) -> running request whose blocks are still coming back
        self.block_size = a0.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens taken from the prefix cache at admission
        self._pending: dict[int, int] = {}  # hash of a block being prefilled -> request id
        if spare_block and not self._plain:
            raise ValueError("spare_block: expected one full-attention layer group, got windows "
                             f"{windows!r}")
        self.spare_block = bool(spare_block)
        self.reserve = DecodeReserve(self.block_size, windows, max_num_batched_tokens, ratio=decode_reserve,
                                     spare_block=self.spare_block)

    # ----------------------------------------------------------------------------------- requests

    def add(self, seq: Sequence) -> None:
        """Queue a request (validated first by :meth:`check`)."""
        self.check(seq)
        if not self._plain:
            seq.block_tables = [[] for _ in self.allocators]
            seq.num_freed = [0] * len(self.allocators)
        self.waiting.append(seq)

    def check(self, seq: Sequence) -> None:
        """Raise ValueError if ``seq`` could never run: more blocks than one block table or a group's pool hold (a
        window group: the most blocks it holds at once, with prefill chunks of the token budget)."""
        total = seq.num_prompt_tokens + seq.params.max_tokens
        for a, w in zip(self.allocators, self.windows):
            # a window group's table keeps a slot for every block of the context: the table's width bounds it too
            need = peak_blocks(w, total, self.max_num_batched_tokens, self.block_size) + self.spare_block
            limit = min(self.max_blocks_per_seq, a.num_blocks)
            if w is not None and cdiv(total, self.block_size) > self.max_blocks_per_seq:
                need, limit = cdiv(total, self.block_size), self.max_blocks_per_seq
            if need > limit:
                where = "" if w is None else f" in the pool of the layers with sliding window {w}"
                raise ValueError(
                    f"prompts: request {seq.request_id} needs up to {seq.num_prompt_tokens} + {seq.params.max_tokens} "
                    f"tokens = {need} blocks of {self.block_size}{where}, expected at most {limit} (the pool or "
                    "max_model_len)")

    def abort_all(self) -> None:
        """Drop every request, waiting or running, and free their blocks (after an error in a step)."""
        for seq in self.running:
            self._release(seq)
            seq.status = SequenceStatus.FINISHED
        self.running.clear()
        self.waiting.clear()
        self._pending.clear()
        self._awaiting.clear()

    def has_unfinished(self) -> bool:
        """Requests are waiting or running."""
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------------------------- blocks

    def _hashes(self, seq: Sequence, n_tokens: int) -> list[int]:
        """The hash chain of the full blocks among the first ``n_tokens`` tokens (extended on demand); empty
        without prefix caching (nothing is published or matched, so nothing is hashed)."""
        if not self.allocator.enable_prefix_caching:
            return []
        n_full = n_tokens // self.block_size
        h = seq.block_hashes
        if len(h) < n_full:
            bs = self.block_size
            parent = h[-1] if h else None
            h.extend(self.allocator.hash_blocks(seq.token_ids[len(h) * bs:n_full * bs], parent_hash=parent))
        return h[:n_full]

    def used_blocks(self) -> list[int]:
        """Blocks held by requests now, one count per layer group.

        Example
        -------
        >>> s = Scheduler(BlockAllocator(8, 4), max_num_seqs=1, max_num_batched_tokens=8, max_blocks_per_seq=8)
        >>> s.used_blocks()
        [0]
        """
        return [a.num_used_blocks for a in self.allocators]

    def _grow(self, seq: Sequence, num_new: int) -> bool:
        """Allocate the blocks ``num_new`` more tokens need, in every group or none; False (nothing allocated) when
        a pool is out. A window group first gives back the blocks its window no longer reads."""
        if self._plain:
            need = self.blocks_for(seq.num_computed + num_new) - len(seq.block_table)
            if need <= 0:
                return True
            blocks = self.allocator.allocate(need)
            if blocks is None:
                return False
            seq.block_table.extend(blocks)
            return True
        for g, w in self._window_groups:
            self._free_outside_window(seq, g, w)
        end = cdiv(seq.num_computed + num_new, self.block_size)
        tables = seq.block_tables
        if any(end - len(t) > a.num_free_blocks for t, a in zip(tables, self.allocators)):
            return False
        for t, a in zip(tables, self.allocators):
            if end > len(t):
                t.extend(a.allocate(end - len(t)))
        return True

    def blocks_for(self, tokens: int) -> int:
        """Blocks a request of ``tokens`` tokens holds in a full-attention group: ``ceil(tokens / block_size)``, one
        more with ``spare_block`` while its last block is partial (int4b keeps that block's keys in the next one).

        Example
        -------
        >>> Scheduler(BlockAllocator(8, 4), max_num_seqs=1, max_num_batched_tokens=8, max_blocks_per_seq=8,
        ...           spare_block=True).blocks_for(5)
        3
        """
        return blocks_for_tokens(tokens, self.block_size) if self.spare_block else cdiv(tokens, self.block_size)

    def _free_outside_window(self, seq: Sequence, g: int, window: int) -> None:
        """Give back group ``g``'s blocks of ``seq`` wholly before ``num_computed - window + 1`` (no query at a
        position >= ``num_computed`` sees them); their slots take the id no request holds."""
        lo = min(first_live_block(window, seq.num_computed, self.block_size), len(seq.block_tables[g]))
        k = seq.num_freed[g]
        if lo > k:
            t = seq.block_tables[g]
            self.allocators[g].free(t[k:lo])
            t[k:lo] = [self.allocators[g].num_blocks] * (lo - k)
            seq.num_freed[g] = lo

    def _drop_blocks(self, seq: Sequence) -> None:
        """Free every block ``seq`` holds, in every group."""
        if self._plain:
            self.allocator.free(seq.block_table)
            seq.block_table = []
            return
        for g, a in enumerate(self.allocators):
            a.free(seq.block_tables[g][seq.num_freed[g]:])
        seq.block_tables = [[] for _ in self.allocators]
        seq.num_freed = [0] * len(self.allocators)

    def _release(self, seq: Sequence) -> None:
        self._awaiting.pop(id(seq), None)
        self._drop_blocks(seq)
        seq.num_published = 0
        for h in [h for h, rid in self._pending.items() if rid == seq.request_id]:
            del self._pending[h]

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.reserve.preempted()
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _mark_pending(self, seq: Sequence) -> None:
        """Record the prompt blocks ``seq`` will prefill, so requests sharing them wait for its KV."""
        if not self.allocator.enable_prefix_caching:
            return
        for h in self._hashes(seq, len(seq.token_ids) - 1)[seq.num_computed // self.block_size:]:
            self._pending.setdefault(h, seq.request_id)

    # ----------------------------------------------------------------------------------- the step

    def schedule(self) -> ScheduledBatch:
        """Choose the next step's batch (it may be empty only when nothing is left)."""
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._awaiting and id(seq) in self._awaiting:  # its blocks were coming back at admission
                if not self.tiers.ready(seq.block_table):
                    i += 1
                    continue
                del self._awaiting[id(seq)]
            n = min(seq.num_uncomputed, budget)
            while not self._grow(seq, n):
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                seqs.append(seq)
                counts.append(n)
                budget -= n
                i += 1
                continue
            break  # seq preempted itself: nothing newer is left to run
        if not preempted:
            self._admit(seqs, counts, budget)
        if not seqs and self._awaiting:
            self.tiers.wait()  # only requests whose blocks are coming back: wait for them
            self._awaiting.clear()
            batch = self.schedule()
            batch.preempted[:0] = preempted
            return batch
        return ScheduledBatch(seqs, counts, [s.num_computed + n == len(s.token_ids) for s, n in zip(seqs, counts)],
                              preempted)

    def schedule_next_decode(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The decode step after ``batch`` (in flight, its tokens not yet known), for overlapping the host's work
        with the device: the same requests in the same order, each one token further on.

        Only when nothing else could change the step: ``batch`` is a decode step of every running request, no
        request waits, and each has room for one more token (blocks for ``num_computed + 2`` tokens are
        allocated now). Returns None otherwise (then :meth:`schedule` decides, after ``batch`` is processed).
        A request that ``batch``'s token finishes has run one step too many: the caller drops that row. When it
        returns None, requests checked before the one that stopped it may hold one block more than they need yet
        (they will use it next step, or free it when they finish).

        Example
        -------
        >>> from kvcache.engine.sampling import SamplingParams
        >>> s = Scheduler(BlockAllocator(8, 4), max_num_seqs=2, max_num_batched_tokens=16, max_blocks_per_seq=8)
        >>> s.add(Sequence(0, [1, 2, 3], SamplingParams(max_tokens=8)))
        >>> first = s.schedule(); s.postprocess(first, [7]) and None
        >>> step = s.schedule(); step.num_tokens
        [1]
        >>> s.schedule_next_decode(step).num_tokens    # the step after it, launched before its token is known
        [1]
        """
        if self.waiting or not batch.is_decode or len(batch.seqs) != len(self.running) or not all(batch.sample):
            return None
        for seq in batch.seqs:
            if seq.num_generated + 1 >= seq.params.max_tokens or not self._grow(seq, 2):
                return None
        return ScheduledBatch(list(batch.seqs), [1] * len(batch.seqs), [True] * len(batch.seqs), [])

    def _admit(self, seqs: list[Sequence], counts: list[int], budget: int) -> None:
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hashes = self._hashes(seq, len(seq.token_ids) - 1)
            if self._pending and any(h in self._pending for h in hashes):
                deferred.append(self.waiting.popleft())  # its prefix is being prefilled: hit it next step
                continue
            if self._plain:
                seq.block_table = list(self.allocator.match_prefix(hashes))
            elif (tables := match_groups(self.allocators, self.windows, hashes)) is not None:
                seq.block_tables = tables
                seq.num_freed = [t.count(a.num_blocks) for t, a in zip(tables, self.allocators)]
            seq.num_computed = len(seq.block_table) * self.block_size
            # every block is free, cached and unreferenced, or held by a request: the requests' room is the pool
            if self.running and not self.reserve.admits(self.running, seq, [a.num_blocks for a in self.allocators]):
                self._unadmit(seq)  # the running requests' expected growth leaves it no room (admission.py)
                break
            self._bring_back(seq, hashes)
            seq.num_published = len(seq.block_table)
            seq.num_computed = len(seq.block_table) * self.block_size
            if self.tiers is not None and self.tiers.loading and not self.tiers.ready(seq.block_table):
                self._start(seq)  # runs once its blocks have arrived: takes no budget this step
                self._awaiting[id(seq)] = seq
                continue
            n = min(seq.num_uncomputed, budget)
            if not self._grow(seq, n):
                self._unadmit(seq)
                break
            self._start(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        self.waiting.extendleft(reversed(deferred))

    def _unadmit(self, seq: Sequence) -> None:
        """Give back what admitting the first waiting request took (it stays first in the queue)."""
        self._drop_blocks(seq)
        seq.num_published, seq.num_computed = 0, 0

    def _start(self, seq: Sequence) -> None:
        """Move the first waiting request (its cached prefix taken) to the running ones."""
        self.waiting.popleft()
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed
            self.num_cached_tokens += seq.num_computed
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._mark_pending(seq)

    def _bring_back(self, seq: Sequence, hashes: list[int]) -> None:
        """Extend ``seq``'s matched prefix with the blocks after it that the host / disk tiers hold (up to a block
        the device still caches): blocks are allocated first (their evictions go down the tiers), then the tiers'
        blocks are fetched, copied into them and registered. Nothing is brought back when the pool is short."""
        tiers, k = self.tiers, len(seq.block_table)
        if tiers is None or k == len(hashes):
            return
        rest = hashes[k:]
        for j, h in enumerate(rest):
            if self.allocator.lookup(h) is not None:
                rest = rest[:j]
                break
        n = tiers.lookup(rest)
        blocks = self.allocator.allocate(n) if n else None
        if not blocks:
            return
        fetched = tiers.fetch(rest, limit=n)  # after the allocation: its evictions may have pushed host blocks out
        m = fetched.num_blocks
        self.allocator.free(blocks[m:])
        if m:
            tiers.load(fetched, blocks[:m])
            self.allocator.cache_blocks(blocks[:m], fetched.hashes)
            seq.block_table.extend(blocks[:m])

    def postprocess(self, batch: ScheduledBatch, new_tokens: list[int | None]) -> list[Sequence]:
        """Advance the step's requests; ``new_tokens[i]`` is the sampled token of ``batch.seqs[i]`` (None when
        it sampled nothing). The caller decides finishing through ``finish(seq)`` afterwards; this method only
        publishes full blocks. A request finished since the step was scheduled is skipped (its row is dropped).
        Returns the requests of the batch that sampled a token."""
        sampled = []
        for seq, n, tok in zip(batch.seqs, batch.num_tokens, new_tokens):
            if seq.status is SequenceStatus.FINISHED:  # finished after the step was launched: its row is dropped
                continue
            seq.num_computed += n
            self._publish(seq)
            if tok is not None:
                seq.token_ids.append(tok)
                sampled.append(seq)
        return sampled

    def _publish(self, seq: Sequence) -> None:
        hashes = self._hashes(seq, seq.num_computed)
        k = seq.num_published
        if len(hashes) > k:
            if self._plain:
                self.allocator.cache_blocks(seq.block_table[k:len(hashes)], hashes[k:])
            else:
                for g, a in enumerate(self.allocators):
                    lo = max(k, seq.num_freed[g])
                    a.cache_blocks(seq.block_tables[g][lo:len(hashes)], hashes[lo:])
            for h in hashes[k:]:
                if self._pending.get(h) == seq.request_id:
                    del self._pending[h]
            seq.num_published = len(hashes)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish a request at once: a running one releases its blocks (its full blocks stay cached for later
        prefix hits); a preempted one (waiting, no blocks) leaves the queue."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if seq.status is not SequenceStatus.FINISHED:
            self.reserve.finished(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
