"""Block allocator of the paged KV cache: ref counts, fork / copy-on-write, prefix caching, LRU eviction.

Pure Python, no torch: a scheduler process can manage blocks without importing a tensor library. The
allocator only hands out block *ids* (ints ``0 .. num_blocks - 1``); the device memory they index lives in
a ``PagedKVCache`` pool, and every copy it asks for (copy-on-write) is done by the caller on the device.

States of a block
-----------------
Every block is in exactly one of three states:

* **free**: ref count 0, no hash. Held in a FIFO free list.
* **cached**: ref count 0, holds the hash of its (full) content. Its KV can be reused by
  :meth:`BlockAllocator.match_prefix`, and it can be evicted by :meth:`BlockAllocator.allocate`. Held in an
  LRU queue (``OrderedDict``: O(1) append, O(1) pop of the oldest, O(1) removal from the middle when a
  prefix match revives it).
* **referenced**: ref count >= 1 (one per sequence holding it), with or without a hash.

:meth:`~BlockAllocator.allocate` takes free blocks first and evicts the least recently used cached blocks
only when the free list is empty, so cached KV survives as long as possible. Every operation is O(1) per
block it touches.

Prefix caching
--------------
A full block is identified by a hash chain: the hash of block ``i`` covers the hash of block ``i - 1``, the
block's token ids and the request's extra keys (LoRA adapter, cache salt, multimodal input hashes), so equal
hashes mean equal *prefixes*, not just equal blocks. The hash is SHA-256 over a canonical, type-tagged byte
encoding, truncated to 64 bits (see :func:`hash_block_tokens`): stable across processes, machines and Python
versions (Python's ``hash()`` is salted per process), so a scheduler and its workers agree on it.

Typical use by a scheduler (the last prompt token is left out of the matched prefix, so its logits are
computed by the prefill)::

    >>> alloc = BlockAllocator(num_blocks=8, block_size=4)
    >>> prompt = list(range(10))
    >>> hashes = alloc.hash_blocks(prompt[:-1])      # full blocks of all tokens but the last: 2
    >>> table = alloc.match_prefix(hashes)           # cold cache: no hit
    >>> table += alloc.allocate(3 - len(table))      # ceil(10 / 4) blocks in all
    >>> table
    [0, 1, 2]
    >>> # ... the prefill writes the KV of the tokens not matched into the blocks of `table` ...
    >>> alloc.cache_blocks(table[:2], hashes)        # publish the full blocks once written
    >>> alloc.free(table)                            # request done: blocks 0, 1 stay cached, 2 is free
    >>> alloc.match_prefix(alloc.hash_blocks(prompt[:-1]))   # the same prompt again: both blocks hit
    [0, 1]
    >>> alloc.stats.hit_rate
    0.5

The allocator is not thread-safe: one scheduler owns it. ``BlockAllocator(..., check_thread=True)`` (a debug
mode) makes every operation check that it runs on the thread that made the first one, and raise
``RuntimeError`` otherwise; without it nothing is checked and nothing is paid.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import replace

from .block_hash import HASH_BITS, _as_int, _as_list, hash_block_tokens, hash_blocks
from .prefix_cache import PrefixCacheMixin, PrefixCacheStats

__all__ = ["BlockAllocator", "PrefixCacheStats", "hash_block_tokens", "hash_blocks", "HASH_BITS"]

# -------------------------------------------------------------------------------------------- allocator


class BlockAllocator(PrefixCacheMixin):
    """Ref-counted manager of the blocks of a paged KV cache, with prefix caching and LRU eviction.

    Parameters
    ----------
    num_blocks : int
        Blocks in the pool (>= 1); block ids are ``0 .. num_blocks - 1``.
    block_size : int
        Tokens per block (>= 1). Used by :meth:`hash_blocks`; the allocator itself counts blocks.
    enable_prefix_caching : bool
        With False, :meth:`match_prefix` always returns ``[]``, :meth:`cache_blocks` validates its arguments and
        registers nothing, and freed blocks always go back to the free list (so the engine's code path is the
        same either way).
    check_thread : bool
        Debug mode: the first operation (``allocate``, ``can_allocate``, ``free``, ``fork``, ``copy_on_write``,
        ``match_prefix``, ``cache_blocks``, ``reset_prefix_cache``, ``reset_stats``) binds the allocator to its
        thread; any later one from another thread raises ``RuntimeError`` before changing anything. The
        allocator is not thread-safe (one scheduler owns it); this catches a second owner. Off by default (no
        cost).

    Notes
    -----
    Running out of blocks is a value (:meth:`allocate` and :meth:`copy_on_write` return ``None``); misuse
    (unknown block id, double free, writing a block that is not held) raises ``ValueError`` or ``TypeError``
    naming the argument, before anything is changed. See the module docstring for the block states.
    """

    _THREAD_CHECKED = ("allocate", "can_allocate", "free", "fork", "copy_on_write", "match_prefix", "cache_blocks",
                       "reset_prefix_cache", "reset_stats")

    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True, check_thread: bool = False
    ) -> None:
        n = _as_int("num_blocks", num_blocks)
        if n < 1:
            raise ValueError(f"num_blocks: expected an int >= 1, got {n}")
        bs = _as_int("block_size", block_size)
        if bs < 1:
            raise ValueError(f"block_size: expected an int >= 1, got {bs}")
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching: expected a bool, got {type(enable_prefix_caching).__name__}")
        self._num_blocks = n
        self._block_size = bs
        self._enable_prefix_caching = enable_prefix_caching
        self._ref: list[int] = [0] * n
        self._hash: list[int | None] = [None] * n
        self._hash_to_block: dict[int, int] = {}
        self._free: deque[int] = deque(range(n))  # free, never-cached blocks (FIFO)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._num_used = 0  # blocks with ref count >= 1
        self._stats = PrefixCacheStats()
        self._listener = None  # set_listener: told of evictions, registrations and resets
        self._evicted: list[tuple[int, int]] = []  # (block, hash) evicted by the operation in progress
        if not isinstance(check_thread, bool):
            raise TypeError(f"check_thread: expected a bool, got {type(check_thread).__name__}")
        self._owner: int | None = None
        if check_thread:
            # instance attributes shadow the methods: the check costs nothing when it is off
            for name in self._THREAD_CHECKED:
                setattr(self, name, self._thread_checked(getattr(self, name)))

    def _thread_checked(self, method):  # type: ignore[no-untyped-def]
        @functools.wraps(method)
        def checked(*args, **kwargs):  # type: ignore[no-untyped-def]
            me = threading.get_ident()
            if self._owner is None:
                self._owner = me
            elif self._owner != me:
                raise RuntimeError(
                    f"BlockAllocator.{method.__name__}: called from thread {threading.current_thread().name!r} "
                    f"(id {me}), but the allocator belongs to thread id {self._owner}, which made its first "
                    "operation; the allocator is not thread-safe (one scheduler owns it)"
                )
            return method(*args, **kwargs)

        return checked

    # ------------------------------------------------------------------------------------ properties

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether full blocks can be cached and matched."""
        return self._enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        """Blocks :meth:`allocate` could hand out now: free blocks + cached unreferenced (evictable) blocks."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref count >= 1."""
        return self._num_used

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a registered hash (matchable by :meth:`match_prefix`), referenced or not."""
        return len(self._hash_to_block)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks with ref count 0 (reusable by a prefix match, or evicted by :meth:`allocate`)."""
        return len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of the pool that is referenced: ``num_used_blocks / num_blocks``."""
        return self._num_used / self._num_blocks

    @property
    def stats(self) -> PrefixCacheStats:
        """A copy of the prefix-cache counters (queries, hits, misses, evictions, hit_rate)."""
        return replace(self._stats)

    def reset_stats(self) -> None:
        """Zero the prefix-cache counters."""
        self._stats = PrefixCacheStats()

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(num_blocks={self._num_blocks}, block_size={self._block_size}, "
            f"enable_prefix_caching={self._enable_prefix_caching}, used={self._num_used}, "
            f"free={len(self._free)}, evictable={len(self._evictable)}, cached={len(self._hash_to_block)})"
        )

    # ---------------------------------------------------------------------------------- validation

    def _block_id(self, name: str, value: object) -> int:
        b = _as_int(name, value)
        if not 0 <= b < self._num_blocks:
            raise ValueError(f"{name}: expected block ids in [0, {self._num_blocks}), got {b}")
        return b

    def _block_ids(self, name: str, values: object) -> list[int]:
        return [self._block_id(name, v) for v in _as_list(name, values, "block ids")]

    def _held_block_ids(self, name: str, values: object, action: str) -> list[int]:
        ids = self._block_ids(name, values)
        for b in ids:
            if self._ref[b] == 0:
                raise ValueError(f"{name}: block {b} is not allocated (ref count 0); only held blocks can be {action}")
        return ids

    # ------------------------------------------------------------------------------------- queries

    def ref_count(self, block_id: int) -> int:
        """Number of holders of ``block_id`` (0: free or cached-unreferenced).

        Raises
        ------
        TypeError, ValueError
            ``block_id`` is not an int in ``[0, num_blocks)``.
        """
        return self._ref[self._block_id("block_id", block_id)]

    def block_hash(self, block_id: int) -> int | None:
        """The hash ``block_id`` is cached under, or None when it is not cached.

        Raises
        ------
        TypeError, ValueError
            ``block_id`` is not an int in ``[0, num_blocks)``.
        """
        return self._hash[self._block_id("block_id", block_id)]

    def hash_blocks(
        self, token_ids: Sequence[int], *, extra_keys: tuple = (), parent_hash: int | None = None
    ) -> list[int]:
        """:func:`hash_blocks` with this allocator's ``block_size`` (computed even with prefix caching off)."""
        return hash_blocks(token_ids, self._block_size, extra_keys=extra_keys, parent_hash=parent_hash)

    # ---------------------------------------------------------------------------------- allocation

    def _check_n(self, n: object) -> int:
        v = _as_int("n", n)
        if v < 0:
            raise ValueError(f"n: expected a number of blocks >= 0, got {v}")
        return v

    def can_allocate(self, n: int) -> bool:
        """Whether :meth:`allocate` ``(n)`` would succeed now (``n <= num_free_blocks``).

        Raises
        ------
        TypeError, ValueError
            ``n`` is not an int >= 0.
        """
        return self._check_n(n) <= self.num_free_blocks

    def _take(self) -> int:
        """One block for a new holder: a free block, else the least recently used cached one (evicted)."""
        if self._free:
            return self._free.popleft()
        b, _ = self._evictable.popitem(last=False)
        del self._hash_to_block[self._hash[b]]
        self._forget(b)
        self._stats.evictions += 1
        return b

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks, each with ref count 1 and no hash.

        Free blocks are taken first (in FIFO order: a new allocator hands out ``0, 1, 2, ...``); then the least
        recently used cached unreferenced blocks are evicted (their hashes dropped, counted in
        ``stats.evictions``).

        Parameters
        ----------
        n : int
            Number of blocks (>= 0).

        Returns
        -------
        list of int or None
            The block ids; ``[]`` for ``n == 0``; None when fewer than ``n`` blocks are available, in which case
            nothing is changed.

        Raises
        ------
        TypeError, ValueError
            ``n`` is not an int >= 0.
        """
        n = self._check_n(n)
        if n > self.num_free_blocks:
            return None
        out = [self._take() for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        self._num_used += n
        self._notify_evicted()
        return out

    def _release(self, b: int) -> None:
        r = self._ref[b] - 1
        self._ref[b] = r
        if r == 0:
            self._num_used -= 1
            if self._hash[b] is None:
                self._free.append(b)
            else:
                self._evictable[b] = None  # most recently used end

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block.

        A block whose ref count reaches 0 becomes *cached* (evictable, at the most recently used end of the LRU)
        if it holds a hash, else *free*. The ids are released in **reverse order**: pass a sequence's block
        table in order (first block first) and its last blocks become the least recently used, so they are
        evicted before the blocks of its prefix (a prefix match stops at the first missing block, so a chain
        loses least when it is evicted from its tail).

        Parameters
        ----------
        block_ids : iterable of int
            Held blocks; an id may repeat up to its ref count.

        Raises
        ------
        TypeError
            ``block_ids`` is not an iterable of ints.
        ValueError
            An id is out of range, not allocated (double free) or repeated more often than its ref count.
            The whole call is validated first: on error nothing is changed.
        """
        ids = self._block_ids("block_ids", block_ids)
        for b, count in Counter(ids).items():
            ref = self._ref[b]
            if ref == 0:
                raise ValueError(f"block_ids: block {b} is not allocated (ref count 0): double free")
            if count > ref:
                raise ValueError(f"block_ids: block {b} is freed {count} times but its ref count is {ref}")
        for b in reversed(ids):
            self._release(b)

    def fork(self, block_ids: Iterable[int]) -> list[int]:
        """Share held blocks with a new holder (a forked sequence: beam search, parallel sampling).

        Each block's ref count grows by one. Before writing into a shared block, a holder calls
        :meth:`copy_on_write`.

        Parameters
        ----------
        block_ids : iterable of int
            Held blocks (ref count >= 1), normally a sequence's whole block table.

        Returns
        -------
        list of int
            The same ids, as the new holder's block table.

        Raises
        ------
        TypeError, ValueError
            An id is not an int, out of range or not allocated; nothing is changed.
        """
        ids = self._held_block_ids("block_ids", block_ids, "forked")
        for b in ids:
            self._ref[b] += 1
        return ids

    def copy_on_write(self, block_id: int) -> int | None:
        """Make ``block_id`` writable by its caller; call it before writing into a held block.

        A block can be written in place only when the caller is its sole holder (ref count 1) and it is not
        cached: a cached block's content must keep matching its hash, since other requests may match it.

        Parameters
        ----------
        block_id : int
            A block the caller holds (ref count >= 1).

        Returns
        -------
        int or None
            * ``block_id`` itself: write in place. Either the block is exclusive and uncached, or it is
              exclusive and cached but no other block is available, in which case its hash is dropped (the
              cached prefix is lost; no copy is needed).
            * another block id ``new``: a fresh block (ref count 1) now replaces ``block_id`` for the caller,
              whose reference to ``block_id`` was dropped (as :meth:`free`). The caller copies the content of
              ``block_id`` into ``new`` on the device and updates its block table before writing.
            * None: a copy is needed (the block is shared) but no block is available; nothing is changed.

        Raises
        ------
        TypeError, ValueError
            ``block_id`` is not an int, out of range or not allocated; nothing is changed.
        """
        b = self._block_id("block_id", block_id)
        ref = self._ref[b]
        if ref == 0:
            raise ValueError(f"block_id: block {b} is not allocated (ref count 0); only held blocks can be written")
        if ref == 1 and self._hash[b] is None:
            return b
        if self._free or self._evictable:
            new = self._take()  # before releasing b: b must not be evicted into its own copy
            self._ref[new] = 1
            self._num_used += 1
            self._release(b)
            self._notify_evicted()
            return new
        if ref == 1:
            del self._hash_to_block[self._hash[b]]
            self._forget(b)
            self._notify_evicted()
            return b
        return None

    # ---------------------------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Verify the internal bookkeeping (O(num_blocks); for tests and debugging).

        Checks that every block is in exactly one state (free: ref 0, no hash, in the free list; cached: ref 0,
        hash, in the LRU; referenced: ref >= 1, in neither), that ref counts are ints >= 0, that the hash map
        and the per-block hashes agree both ways, that ``free + cached-unreferenced + referenced == num_blocks``,
        and that the counters are consistent.

        Raises
        ------
        RuntimeError
            On the first inconsistency found (never ``assert``: checks survive ``python -O``).
        """

        def fail(msg: str) -> None:
            raise RuntimeError(f"BlockAllocator corrupted: {msg}")

        n = self._num_blocks
        if len(self._ref) != n or len(self._hash) != n:
            fail(f"per-block tables have {len(self._ref)} / {len(self._hash)} entries for {n} blocks")
        free = set(self._free)
        if len(free) != len(self._free):
            fail("a block is in the free list twice")
        evictable = set(self._evictable)
        if free & evictable:
            fail(f"blocks {sorted(free & evictable)} are both free and evictable")
        used = 0
        for b in range(n):
            ref, h = self._ref[b], self._hash[b]
            if not isinstance(ref, int) or ref < 0:
                fail(f"block {b} has ref count {ref!r}")
            if ref > 0:
                used += 1
                if b in free or b in evictable:
                    fail(f"block {b} has ref count {ref} but is in the {'free list' if b in free else 'LRU'}")
            elif b in free:
                if h is not None:
                    fail(f"free block {b} holds hash {h}")
            elif b in evictable:
                if h is None:
                    fail(f"evictable block {b} holds no hash")
            else:
                fail(f"block {b} has ref count 0 but is neither free nor evictable (leaked)")
            if h is not None and self._hash_to_block.get(h) != b:
                fail(f"block {b} holds hash {h}, which maps to block {self._hash_to_block.get(h)}")
        for h, b in self._hash_to_block.items():
            if not (isinstance(b, int) and 0 <= b < n) or self._hash[b] != h:
                fail(f"hash {h} maps to block {b}, which holds {self._hash[b] if 0 <= b < n else None}")
        if not self._enable_prefix_caching and self._hash_to_block:
            fail("prefix caching is disabled but blocks are cached")
        if used != self._num_used:
            fail(f"{used} blocks are referenced but the counter says {self._num_used}")
        if len(free) + len(evictable) + used != n:
            fail(f"free {len(free)} + evictable {len(evictable)} + referenced {used} != {n} blocks")
        s = self._stats
        if min(s.queries, s.hits, s.misses, s.evictions) < 0:
            fail(f"negative counters {s}")
