"""Memory tiers behind the prefix cache: blocks evicted from the paged pool are kept in a pinned host pool (its own
LRU) and, optionally, in checksummed files on disk, found again through the same block-hash chain and brought back
on a prefix hit instead of being recomputed.

:class:`TieredCache` is the :class:`~kvcache.paged.BlockAllocator`'s listener (``allocator.set_listener``): when
the allocator evicts cached blocks it copies them one tier down (asynchronously on CUDA, see
:mod:`kvcache.paged.tiers.host`); a block the host already holds is not copied again. When the host tier is full its
least recently used block goes to the disk tier (if any) and leaves the host. A request's prefix is looked up on the
device first (``match_prefix``), then, for the blocks after it, in the host tier, then on disk
(:meth:`TieredCache.lookup` / :meth:`TieredCache.fetch` / :meth:`TieredCache.load`); the lower tiers keep their copy
when a block goes back up. Every change is reported as a :mod:`kvcache.paged.events` event when an event log is
given, and counted per tier (:class:`TierStats`).

Blocks in flight
----------------
On CUDA a block coming back is copied on the tiers' host-to-device stream (blocks going down on a device-to-host
stream, at the same time); :meth:`TieredCache.ready` says (without waiting) whether every block of a block table has
arrived, so a scheduler runs a request only once its own blocks are there. A block whose copy back is still in flight
and that is evicted again is not copied down again when the host still holds it (no duplicate), and the compute
stream waits for the copy before anything can overwrite the block. A copy out of a host slot waits for the copy into
it, and a copy into a slot for the copy out of it (events per slot), so a slot is never rewritten while it is read.

Example
-------
>>> import torch
>>> from kvcache.paged import BlockAllocator, PagedConfig, PagedKVCache
>>> cache = PagedKVCache(PagedConfig(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=4,
...                                  dtype=torch.float32, device="cpu"))
>>> tiers = TieredCache(cache, host_bytes=8 * tiers_block_bytes(cache))
>>> alloc = BlockAllocator(4, 4); alloc.set_listener(tiers)
>>> hashes = alloc.hash_blocks(list(range(16)))
>>> blocks = alloc.allocate(4); alloc.cache_blocks(blocks, hashes); alloc.free(blocks)
>>> _ = alloc.allocate(4)                       # evicts the four cached blocks: copied to the host tier
>>> tiers.lookup(hashes)                        # all four can come back
4
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ..._validate import check_int
from ..block_hash import _as_hash, _as_list
from ..events import AllBlocksCleared, KVEventLog
from .disk import DiskTier, cache_fingerprint, weights_identity
from .host import HostTier, SlotArena, Transfers, slot_shapes, tiers_block_bytes
from .stats import TierStats

if TYPE_CHECKING:
    from ..cache import PagedKVCache

__all__ = ["TieredCache", "TierStats", "Fetched", "HostTier", "DiskTier", "cache_fingerprint", "weights_identity",
           "tiers_block_bytes", "DEFAULT_DISK_BYTES"]

DEFAULT_DISK_BYTES = 16 * 2**30  # the disk tier's budget when none is given


class Fetched:
    """Blocks found below the device by :meth:`TieredCache.fetch`, ready for :meth:`TieredCache.load`.

    Attributes
    ----------
    hashes : list of int
        The blocks' hashes, a prefix of the hashes asked for.

    Example
    -------
    >>> f = tiers.fetch(hashes, limit=len(blocks))               # doctest: +SKIP
    >>> f.num_blocks, f.hashes == hashes[:f.num_blocks]          # doctest: +SKIP
    (3, True)
    >>> tiers.load(f, blocks[:f.num_blocks])                     # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.hashes: list[int] = []
        self._src: list[tuple[SlotArena, list[int]]] = []  # (arena, slots) in order
        self._src_tier: list[str] = []  # the tier of each piece of _src
        self._tiers: list[str] = []  # the tier of each block

    @property
    def num_blocks(self) -> int:
        """``len(hashes)``."""
        return len(self.hashes)

    def _add(self, h: int, tier: str, arena: SlotArena, slot: int) -> None:
        if tier == "host" and self._src and self._tiers[-1] == "host":
            self._src[-1][1].append(slot)
        else:
            self._src.append((arena, [slot]))
            self._src_tier.append(tier)
        self.hashes.append(h)
        self._tiers.append(tier)


def _hashes(hashes: object) -> list[int]:
    return [_as_hash("hashes", h) for h in _as_list("hashes", hashes, "block hashes")]


def _model_id(model_id: object) -> str:
    """The identity ``model_id`` gives (a str, or a callable's result): TypeError / ValueError naming it."""
    value = model_id() if callable(model_id) else model_id
    if not isinstance(value, str):
        what = "returned " if callable(model_id) else "got "
        raise TypeError(f"model_id: expected the model's identity (a non-empty str, or a callable returning one) "
                        f"with a disk tier, {what}{type(value).__name__}")
    return value  # an empty one is refused by cache_fingerprint


class TieredCache:
    """The host and disk tiers of one :class:`~kvcache.paged.PagedKVCache` (module docstring).

    Parameters
    ----------
    cache : PagedKVCache
        The device pool.
    host_bytes : int
        Bytes of the host tier (pinned on CUDA): ``host_bytes // tiers_block_bytes(cache)`` block slots; 0: no host
        tier (evicted blocks go straight to disk when there is one). Between 1 and one block's bytes is refused.
    disk_dir : str or os.PathLike, optional
        The disk tier's directory (off when None).
    disk_bytes : int
        The disk tier's budget (default 16 GiB).
    model_id : str or callable, optional
        The model's identity in the disk tier's fingerprint (required with ``disk_dir``): a str the user vouches
        for (``"org/model@revision"``), kept as it is for the tiers' life, or a callable returning the identity
        (``lambda: weights_identity(model.named_parameters())``), called now and again on :meth:`cleared` (the
        allocator's ``reset_prefix_cache``, after new weights): a new identity switches the disk tier to the new
        fingerprint's folder, so blocks computed with the old weights are never read back.
    events : KVEventLog, optional
        Where to report blocks stored / removed per tier (``"device"``, ``"host"``, ``"disk"``).

    Raises
    ------
    TypeError, ValueError
        A bad argument, named (``host_bytes``, ``disk_dir``, ``disk_bytes``, ``model_id``, ``events``); OSError
        naming ``disk_dir`` when its folder cannot be created.

    Example
    -------
    >>> tiers = TieredCache(cache, host_bytes=2**30)                      # doctest: +SKIP
    >>> allocator.set_listener(tiers)                                     # doctest: +SKIP
    """

    def __init__(self, cache: PagedKVCache, *, host_bytes: int = 0, disk_dir: str | os.PathLike | None = None,
                 disk_bytes: int = DEFAULT_DISK_BYTES, model_id: str | Callable[[], str] | None = None,
                 events: KVEventLog | None = None) -> None:
        from ..cache import PagedKVCache

        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache: expected a PagedKVCache, got {type(cache).__name__}")
        block = tiers_block_bytes(cache)
        host_bytes = check_int("host_bytes", host_bytes, lo=0)
        if 0 < host_bytes < block:
            raise ValueError(f"host_bytes: expected 0 or at least one block ({block} bytes), got {host_bytes}")
        if events is not None and not isinstance(events, KVEventLog):
            raise TypeError(f"events: expected a KVEventLog or None, got {type(events).__name__}")
        if disk_dir is None and (model_id is not None or disk_bytes != DEFAULT_DISK_BYTES):
            name = "model_id" if model_id is not None else "disk_bytes"
            raise ValueError(f"{name}: a setting of the disk tier, given without disk_dir (expected the default)")
        self.model_id: str | None = None
        if disk_dir is not None:  # checked before any memory or folder is taken
            if not isinstance(disk_dir, (str, os.PathLike)):
                raise TypeError(f"disk_dir: expected a str or os.PathLike, got {type(disk_dir).__name__}")
            check_int("disk_bytes", disk_bytes, lo=1)
            self.model_id = _model_id(model_id)
            fingerprint = cache_fingerprint(cache, self.model_id)
        self.cache = cache
        self.events = events
        self._identity = model_id if callable(model_id) else None  # recomputed on cleared()
        self.transfers = Transfers(cache)
        self.host = HostTier(cache, host_bytes // block) if host_bytes else None
        self.disk = None
        if disk_dir is not None:
            try:
                self.disk = DiskTier(disk_dir, fingerprint, disk_bytes, slot_shapes(cache))
            except OSError as e:
                raise OSError(e.errno, f"disk_dir: {str(e.strerror).removeprefix('directory: ')}") from e
        self._loading: dict[int, torch.cuda.Event] = {}  # device block -> event after its copy back
        self._counts = {name: TierStats() for name in ("device", "host", "disk")}

    # ---------------------------------------------------------------------------------- the allocator's listener

    def evicted(self, block_ids: list[int], hashes: list[int]) -> None:
        """The allocator evicted cached ``block_ids`` (hashes ``hashes``): copy them one tier down, once (called by
        :class:`~kvcache.paged.BlockAllocator` once the tiers are its listener).

        Example
        -------
        >>> allocator.set_listener(tiers); allocator.allocate(4)     # evictions reach tiers.evicted  # doctest: +SKIP
        """
        self._settle_loads(block_ids)
        self._counts["device"].removed += len(hashes)
        self._emit("removed", hashes, "device")
        if self.host is not None:
            self._to_host(block_ids, hashes)
        elif self.disk is not None:
            self._to_disk(block_ids, hashes)

    def cached(self, block_ids: list[int], hashes: list[int]) -> None:
        """The allocator registered ``block_ids`` under ``hashes``: reported as stored on the device.

        Example
        -------
        >>> allocator.cache_blocks(ids, hashes)       # calls tiers.cached(ids, hashes)   # doctest: +SKIP
        """
        self._counts["device"].stored += len(hashes)
        self._emit("stored", hashes, "device")

    def cleared(self) -> None:
        """The allocator dropped every hash (``reset_prefix_cache``: new weights, a dropped salt): the host tier
        forgets its blocks too. The disk tier is keyed by its fingerprint: with a callable ``model_id`` the identity
        is recomputed, and a new one moves the disk tier to its own folder (the old files are kept for engines of
        the old weights, never read by this one: ``AllBlocksCleared("disk")``); a str ``model_id`` is kept.

        Example
        -------
        >>> allocator.reset_prefix_cache()            # calls tiers.cleared()             # doctest: +SKIP
        True
        """
        self.wait()
        if self.events is not None:
            self.events.record(AllBlocksCleared("device"))
        self.clear()
        if self.disk is not None and self._identity is not None:
            model_id = _model_id(self._identity)
            if model_id != self.model_id:
                self._counts["disk"].removed += len(self.disk)
                if self.events is not None and len(self.disk):
                    self.events.record(AllBlocksCleared("disk"))
                self.disk.switch(cache_fingerprint(self.cache, model_id))
                self.model_id = model_id

    def clear(self) -> None:
        """Drop every block of the host tier (files on disk are kept).

        Example
        -------
        >>> tiers.clear(); tiers.lookup(hashes)                     # doctest: +SKIP
        0
        """
        if self.host is not None:
            self.wait()
            dropped = self.host.clear()
            self._counts["host"].removed += len(dropped)
            if self.events is not None and dropped:
                self.events.record(AllBlocksCleared("host"))

    # ---------------------------------------------------------------------------------- going down

    def _to_host(self, block_ids: list[int], hashes: list[int]) -> None:
        host = self.host
        todo = [(b, h) for b, h in zip(block_ids, hashes) if host.slot(h) is None]  # held ones: touched, not copied
        if len(todo) > host.num_slots:  # more than the tier holds: the most recently evicted stay, the rest go down
            over, todo = todo[:-host.num_slots], todo[-host.num_slots:]
            if self.disk is not None:
                self._to_disk([b for b, _ in over], [h for _, h in over])
        if not todo:
            return
        slots, victims = [], []
        for _, h in todo:
            s, v = host.reserve(h)
            slots.append(s)
            if v is not None:
                victims.append((v, s))
        for v, s in victims:  # before the slot is overwritten: the victim goes to disk
            self._spill(v, host.block(s))
        self._emit("removed", [v for v, _ in victims], "host")
        self._counts["host"].removed += len(victims)
        ev = self.transfers.to_host([b for b, _ in todo], host.arena, slots, after=host.read(slots))
        host.set_written(slots, ev)
        self._counts["host"].stored += len(todo)
        self._emit("stored", [h for _, h in todo], "host")

    def _to_disk(self, block_ids: list[int], hashes: list[int]) -> None:
        todo = [(b, h) for b, h in zip(block_ids, hashes) if h not in self.disk]
        if not todo:
            return
        tmp = SlotArena.allocate(len(todo), slot_shapes(self.cache), pin=False)
        ev = self.transfers.to_host([b for b, _ in todo], tmp, list(range(len(todo))))
        if ev is not None:
            ev.synchronize()
        for i, (_, h) in enumerate(todo):
            self._spill(h, tmp.block(i))

    def _spill(self, h: int, tensors: list[torch.Tensor]) -> None:
        """Write one block to the disk tier (if any)."""
        if self.disk is None:
            return
        written, dropped = self.disk.write(h, tensors)
        d = self._counts["disk"]
        d.removed += len(dropped)
        self._emit("removed", dropped, "disk")
        if written:
            d.stored += 1
            self._emit("stored", [h], "disk")

    # ---------------------------------------------------------------------------------- coming back

    def lookup(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (a chain, in order), from the first, the host or disk tier holds (files not read:
        :meth:`fetch` may find fewer when one is refused). Changes nothing.

        Raises
        ------
        TypeError, ValueError
            ``hashes`` is not a sequence of block hashes (ints in ``[0, 2**64)``).

        Example
        -------
        >>> tiers.lookup(allocator.hash_blocks(prompt[:-1]))      # doctest: +SKIP
        3
        """
        n = 0
        for h in _hashes(hashes):
            if not ((self.host is not None and h in self.host) or (self.disk is not None and h in self.disk)):
                break
            n += 1
        return n

    def fetch(self, hashes: Sequence[int], limit: int | None = None) -> Fetched:
        """The longest prefix of ``hashes`` (at most ``limit`` blocks) the lower tiers can give back: host blocks
        (made most recently used), then disk files read and verified (a refused file ends the prefix: it is deleted
        and its block recomputed). Allocate the device blocks before fetching: their evictions may push host blocks
        out, and a fetched host block must stay in its slot until :meth:`load`.

        Raises
        ------
        TypeError, ValueError
            ``hashes`` is not a sequence of block hashes; ``limit`` is not None or an int (TypeError), or < 0
            (ValueError).

        Example
        -------
        >>> f = tiers.fetch(hashes, limit=len(blocks)); f.num_blocks     # doctest: +SKIP
        3
        """
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise TypeError(f"limit: expected None or an int >= 0, got {type(limit).__name__}")
        if limit is not None and limit < 0:
            raise ValueError(f"limit: expected None or an int >= 0, got {limit}")
        out = Fetched()
        for h in _hashes(hashes)[:limit]:
            s = self.host.slot(h) if self.host is not None else None
            if s is not None:
                out._add(h, "host", self.host.arena, s)
                continue
            if self.disk is None or h not in self.disk:
                break
            before = self.disk.refused
            tensors = self.disk.read(h)
            if tensors is None:
                refused = self.disk.refused - before
                self._counts["disk"].refused += refused
                self._counts["disk"].removed += refused
                self._emit("removed", [h] if refused else [], "disk")
                break
            out._add(h, "disk", SlotArena([[t.unsqueeze(0) for t in tensors]]), 0)
        return out

    def load(self, fetched: Fetched, block_ids: Sequence[int]) -> None:
        """Copy ``fetched``'s blocks into device ``block_ids`` (one each, in order; asynchronous on CUDA: see
        :meth:`ready`). The caller registers them in its prefix cache.

        Raises
        ------
        TypeError, ValueError
            ``fetched`` is not a :class:`Fetched`; ``block_ids`` are not as many distinct block ids of the cache as
            the fetched blocks. Nothing is copied.

        Example
        -------
        >>> n = f.num_blocks                                                  # doctest: +SKIP
        >>> tiers.load(f, blocks[:n]); allocator.cache_blocks(blocks[:n], f.hashes)   # doctest: +SKIP
        """
        if not isinstance(fetched, Fetched):
            raise TypeError(f"fetched: expected a Fetched, got {type(fetched).__name__}")
        ids = self.cache._block_ids("block_ids", block_ids).tolist()
        if len(set(ids)) != len(ids):
            raise ValueError(f"block_ids: expected distinct block ids, got {ids[:8]}")
        if len(ids) != fetched.num_blocks:
            raise ValueError(f"block_ids: expected {fetched.num_blocks} ids (the fetched blocks), got {len(ids)}")
        host_slots = [s for (_, slots), tier in zip(fetched._src, fetched._src_tier) if tier == "host" for s in slots]
        ev = self.transfers.to_device(fetched._src, ids, after=self.host.written(host_slots) if host_slots else ())
        if host_slots:
            self.host.set_read(host_slots, ev)
        if ev is not None:
            for b in ids:
                self._loading[b] = ev
        for t in fetched._tiers:
            self._counts[t].hits += 1

    def ready(self, block_ids: Sequence[int]) -> bool:
        """Whether no block of ``block_ids`` is still being copied back (never waits; always True on the CPU).

        Example
        -------
        >>> tiers.ready(seq.block_table)                    # doctest: +SKIP
        True
        """
        if not self._loading:
            return True
        for b in block_ids:
            ev = self._loading.get(b)
            if ev is not None:
                if not ev.query():
                    return False
                del self._loading[b]
        return True

    @property
    def loading(self) -> bool:
        """Some copy back may still be in flight."""
        return bool(self._loading)

    def wait(self) -> None:
        """Block the host until every copy back has finished (nothing to wait for on the CPU).

        Example
        -------
        >>> tiers.wait(); tiers.loading                           # doctest: +SKIP
        False
        """
        for ev in set(self._loading.values()):
            ev.synchronize()
        self._loading.clear()

    def _settle_loads(self, block_ids: list[int]) -> None:
        """Order the compute stream after the copies back into ``block_ids`` (they are about to be rewritten)."""
        if not self._loading:
            return
        stream = torch.cuda.current_stream(self.cache.device)
        for b in block_ids:
            ev = self._loading.pop(b, None)
            if ev is not None:
                stream.wait_event(ev)

    # ---------------------------------------------------------------------------------- reporting

    def _emit(self, kind: str, hashes: list[int], medium: str) -> None:
        if self.events is not None and hashes:
            getattr(self.events, kind)(hashes, medium)

    def stats(self) -> dict[str, TierStats]:
        """Counters per tier present (``"device"``: blocks published in the pool's prefix cache and evicted from it, its
        ``hits`` 0 here: the device's matches are the allocator's count, ``BlockAllocator.stats.hits``, which the
        engine copies in and ``reset_stats`` clears; ``"host"``, ``"disk"``), since the tiers were built (copies in
        flight are counted once finished).

        Example
        -------
        >>> tiers.stats()["host"].hits                      # doctest: +SKIP
        12
        """
        self.transfers.settle()
        dv = self._counts["device"]
        out = {"device": TierStats(stored=dv.stored, removed=dv.removed)}
        tr = self.transfers
        if self.host is not None:
            h = self._counts["host"]
            out["host"] = TierStats(hits=h.hits, stored=h.stored, removed=h.removed, bytes_in=tr.nbytes["to_host"],
                                    bytes_out=tr.nbytes["to_device"], seconds_in=tr.seconds["to_host"],
                                    seconds_out=tr.seconds["to_device"])
        if self.disk is not None:
            d = self._counts["disk"]
            out["disk"] = TierStats(hits=d.hits, stored=d.stored, removed=d.removed, refused=d.refused,
                                    bytes_in=self.disk.io_bytes["write"], bytes_out=self.disk.io_bytes["read"],
                                    seconds_in=self.disk.seconds["write"], seconds_out=self.disk.seconds["read"])
        return out
