"""The prefix cache of :class:`~kvcache.paged.BlockAllocator`: counters, and the operations on cached blocks
(match a prefix's block hashes, publish written blocks, drop every cached hash, look a hash up) and the listener
told of those changes (a memory tier below the pool). A mixin of the allocator: it uses the allocator's block
state (ref counts, hashes, the hash index, the LRU queue of evictable blocks)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .block_hash import _as_hash, _as_list

__all__ = ["PrefixCacheMixin", "PrefixCacheStats"]


# -------------------------------------------------------------------------------------------- stats


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters of a :class:`BlockAllocator` (counted only with prefix caching enabled).

    Attributes
    ----------
    queries : int
        Calls of :meth:`BlockAllocator.match_prefix`.
    hits : int
        Blocks matched (over all queries).
    misses : int
        Blocks queried but not matched: ``len(block_hashes) - len(matched)`` per query.
    evictions : int
        Cached blocks whose hash :meth:`BlockAllocator.allocate` dropped to reuse the block.
    """

    queries: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits / (hits + misses)``; 0.0 before any block was queried."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class PrefixCacheMixin:
    """Prefix-cache operations of :class:`~kvcache.paged.BlockAllocator` (see its docstring)."""

    # -------------------------------------------------------------------------------- prefix cache

    def match_prefix(self, block_hashes: Sequence[int]) -> list[int]:
        """Blocks of the longest cached prefix of a hash chain; each matched block gains a reference.

        A matched cached-unreferenced block leaves the LRU queue (O(1)). Counts one query, ``len(matched)``
        hits and ``len(block_hashes) - len(matched)`` misses in :attr:`stats`.

        Parameters
        ----------
        block_hashes : sequence of int
            The request's chain from :meth:`hash_blocks`. To have the prefill compute the last prompt token
            (its logits are needed), hash ``prompt[:-1]``: the last token then never lies in a matched block.

        Returns
        -------
        list of int
            Block ids for ``block_hashes[:k]`` with ``k`` maximal; ``[]`` with prefix caching disabled (then
            nothing is counted). The caller owns one reference to each and frees them like allocated blocks.

        Raises
        ------
        TypeError, ValueError
            A hash is not an int in ``[0, 2**64)``; nothing is changed.
        """
        hashes = [_as_hash("block_hashes", h) for h in _as_list("block_hashes", block_hashes, "block hashes")]
        if not self._enable_prefix_caching:
            return []
        out: list[int] = []
        for h in hashes:
            b = self._hash_to_block.get(h)
            if b is None:
                break
            out.append(b)
        for b in out:
            if self._ref[b] == 0:
                del self._evictable[b]
                self._num_used += 1
            self._ref[b] += 1
        self._stats.queries += 1
        self._stats.hits += len(out)
        self._stats.misses += len(hashes) - len(out)
        return out

    def cache_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[int]) -> None:
        """Register full blocks under their hashes, once their content has been written.

        Parameters
        ----------
        block_ids : sequence of int
            Held blocks (ref count >= 1), in chain order.
        block_hashes : sequence of int
            Their hashes (from :meth:`hash_blocks`), as many as ``block_ids``.

        Notes
        -----
        * A block already cached under the same hash is left as is (re-registering a prefix is harmless).
        * When a hash is already registered to *another* block (two requests computed the same prefix at the
          same time), the existing entry is kept and the new block stays uncached: it is freed to the free list
          rather than the LRU, and the cache never holds two copies of one prefix.
        * With prefix caching disabled the arguments are validated and nothing is registered.

        Raises
        ------
        TypeError
            Non-int ids or hashes.
        ValueError
            Lengths differ; an id out of range or not allocated; a hash outside ``[0, 2**64)``; a block already
            cached under a different hash, or given two different hashes. Nothing is changed.
        """
        ids = self._held_block_ids("block_ids", block_ids, "cached")
        hashes = [_as_hash("block_hashes", h) for h in _as_list("block_hashes", block_hashes, "block hashes")]
        if len(ids) != len(hashes):
            raise ValueError(
                f"block_hashes: expected one hash per block ({len(ids)} block ids), got {len(hashes)} hashes"
            )
        given: dict[int, int] = {}
        for b, h in zip(ids, hashes):
            cur = self._hash[b]
            if cur is not None and cur != h:
                raise ValueError(f"block_hashes: block {b} is already cached under hash {cur}, got {h}")
            if given.setdefault(b, h) != h:
                raise ValueError(f"block_hashes: block {b} is given two hashes, {given[b]} and {h}")
        if not self._enable_prefix_caching:
            return
        new: list[int] = []
        for b, h in zip(ids, hashes):
            if self._hash[b] is None and h not in self._hash_to_block:
                self._hash[b] = h
                self._hash_to_block[h] = b
                new.append(b)
        if new and self._listener is not None:
            self._listener.cached(new, [self._hash[b] for b in new])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (after a weight update, or to drop a salt's entries).

        Every hash is dropped, referenced blocks' included: cached unreferenced blocks move to the free list;
        referenced blocks keep their content for their holders but can no longer be matched, and go to the free
        list when released. The stats are kept (see :meth:`reset_stats`).

        The listener's ``cleared()`` is called every time, hashes dropped or not: the tiers below may hold blocks
        the device no longer does.

        Returns
        -------
        bool
            True if any hash was dropped, False if nothing was cached.
        """
        if not self._hash_to_block:
            if self._listener is not None:
                self._listener.cleared()
            return False
        for b in self._hash_to_block.values():
            self._hash[b] = None
        self._hash_to_block.clear()
        self._free.extend(self._evictable)  # oldest first
        self._evictable.clear()
        if self._listener is not None:
            self._listener.cleared()
        return True

    def set_listener(self, listener: object | None) -> None:
        """Tell ``listener`` of every change to the set of cached blocks (a memory tier below the pool, an event log).

        ``listener.evicted(block_ids, hashes)`` is called once per :meth:`allocate` / :meth:`copy_on_write` that
        evicted cached blocks, before it returns (so before the new holder writes them: their content is still the
        cached prefix); ``listener.cached(block_ids, hashes)`` once per :meth:`cache_blocks` with the blocks it
        newly registered; ``listener.cleared()`` on every :meth:`reset_prefix_cache` (hashes dropped or not: the
        tiers below may still hold blocks). None removes it.

        Example
        -------
        >>> class Log:
        ...     def evicted(self, ids, hashes): print("evicted", ids)
        ...     def cached(self, ids, hashes): print("cached", ids)
        ...     def cleared(self): print("cleared")
        >>> from kvcache import BlockAllocator
        >>> alloc = BlockAllocator(num_blocks=1, block_size=2); alloc.set_listener(Log())
        >>> b = alloc.allocate(1); alloc.cache_blocks(b, alloc.hash_blocks([5, 6])); alloc.free(b)
        cached [0]
        >>> _ = alloc.allocate(1)
        evicted [0]
        """
        if listener is not None:
            for name in ("evicted", "cached", "cleared"):
                if not callable(getattr(listener, name, None)):
                    raise TypeError(f"listener: expected an object with evicted, cached and cleared methods, "
                                    f"{type(listener).__name__} has no {name}")
        self._listener = listener

    def lookup(self, block_hash: int) -> int | None:
        """The block cached under ``block_hash`` (referenced or not), or None; changes nothing (no LRU touch, no
        counter).

        Raises
        ------
        TypeError, ValueError
            ``block_hash`` is not an int in ``[0, 2**64)``.
        """
        return self._hash_to_block.get(_as_hash("block_hash", block_hash))

    def _notify_evicted(self) -> None:
        if self._evicted:
            ids, hashes = [b for b, _ in self._evicted], [h for _, h in self._evicted]
            self._evicted = []
            if self._listener is not None:
                self._listener.evicted(ids, hashes)

    def _forget(self, b: int) -> None:
        """Block ``b`` leaves the prefix cache for a new holder (its hash index entry already removed): recorded for
        the listener, which :meth:`_notify_evicted` tells once the operation in progress ends."""
        if self._listener is not None:
            self._evicted.append((b, self._hash[b]))
        self._hash[b] = None
