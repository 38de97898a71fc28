"""KV cache events: blocks stored in, removed from and cleared out of a tier of the prefix cache, for a cache-aware
router (vLLM's ``kv_events`` ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, TensorRT-LLM's event API).

Each event names its tier (``medium``): ``"device"`` (the paged pool's prefix cache), ``"host"`` (the pinned host
tier) or ``"disk"`` (the disk tier), and the block hashes of :func:`kvcache.paged.block_hash.hash_blocks` (the same
64-bit chain every process computes). A block moved from one tier to another is a ``BlockRemoved`` of the tier it
left (when it left it) and a ``BlockStored`` of the tier it reached; the host and disk tiers keep their copy when a
block is brought back to the device, so a hit stores on the device and removes nothing below.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEvent", "KVEventLog", "MEDIA"]

MEDIA = ("device", "host", "disk")


def _hashes(block_hashes: Iterable[int]) -> tuple[int, ...]:
    out = tuple(block_hashes)
    for h in out:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < 2**64:
            raise ValueError(f"block_hashes: expected block hashes in [0, 2**64), got {h!r}")
    return out


def _medium(medium: object) -> str:
    if medium not in MEDIA:
        raise ValueError(f"medium: expected one of {MEDIA}, got {medium!r}")
    return medium  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class _BlockEvent:
    """Blocks of ``medium``, in chain order (the body :class:`BlockStored` and :class:`BlockRemoved` share)."""

    block_hashes: tuple[int, ...]
    medium: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_hashes", _hashes(self.block_hashes))
        _medium(self.medium)


@dataclasses.dataclass(frozen=True)
class BlockStored(_BlockEvent):
    """Blocks that became matchable in ``medium``, in chain order.

    Example
    -------
    >>> BlockStored((7, 9), "host")
    BlockStored(block_hashes=(7, 9), medium='host')
    """


@dataclasses.dataclass(frozen=True)
class BlockRemoved(_BlockEvent):
    """Blocks that ``medium`` no longer holds (evicted, or refused as damaged / of another model on the disk).

    Example
    -------
    >>> BlockRemoved((7,), "device").medium
    'device'
    >>> BlockRemoved((7,), "device") == BlockStored((7,), "device")
    False
    """


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    """Every block of ``medium`` was dropped (``BlockAllocator.reset_prefix_cache``, ``TieredCache.clear``).

    Example
    -------
    >>> AllBlocksCleared("host")
    AllBlocksCleared(medium='host')
    """

    medium: str

    def __post_init__(self) -> None:
        _medium(self.medium)


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """A bounded queue of :data:`KVEvent` s, read with :meth:`drain`.

    Parameters
    ----------
    maxlen : int
        Events kept at most (>= 1); when full the oldest is dropped and counted in :attr:`dropped` (a reader that
        sees ``dropped`` grow has lost track and should resynchronise, as after ``AllBlocksCleared``).

    Example
    -------
    >>> log = KVEventLog(maxlen=4)
    >>> log.record(BlockStored((1, 2), "device"))
    >>> log.drain(), log.drain()
    ([BlockStored(block_hashes=(1, 2), medium='device')], [])
    """

    def __init__(self, maxlen: int = 1 << 16) -> None:
        if isinstance(maxlen, bool) or not isinstance(maxlen, int) or maxlen < 1:
            raise ValueError(f"maxlen: expected an int >= 1, got {maxlen!r}")
        self._events: deque[KVEvent] = deque()
        self._maxlen = maxlen
        self.dropped = 0

    def record(self, event: KVEvent) -> None:
        """Append ``event`` (dropping the oldest when full; a block event of no hashes is not kept).

        Raises
        ------
        TypeError
            ``event`` is not a :data:`KVEvent`.

        Example
        -------
        >>> log = KVEventLog(maxlen=1)
        >>> log.record(BlockStored((1,), "host")); log.record(BlockRemoved((1,), "host"))
        >>> len(log), log.dropped
        (1, 1)
        """
        if not isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
            raise TypeError(f"event: expected a BlockStored, BlockRemoved or AllBlocksCleared, got "
                            f"{type(event).__name__}")
        if isinstance(event, _BlockEvent) and not event.block_hashes:
            return
        if len(self._events) == self._maxlen:
            self._events.popleft()
            self.dropped += 1
        self._events.append(event)

    def stored(self, hashes: Iterable[int], medium: str) -> None:
        """Record a :class:`BlockStored` (nothing for no hashes)."""
        self.record(BlockStored(tuple(hashes), medium))

    def removed(self, hashes: Iterable[int], medium: str) -> None:
        """Record a :class:`BlockRemoved` (nothing for no hashes)."""
        self.record(BlockRemoved(tuple(hashes), medium))

    def drain(self) -> list[KVEvent]:
        """Every event recorded since the last drain, oldest first (the log is left empty).

        Example
        -------
        >>> log = KVEventLog()
        >>> log.stored([3, 4], "device"); log.removed([3], "device")
        >>> [type(e).__name__ for e in log.drain()], log.drain()
        (['BlockStored', 'BlockRemoved'], [])
        """
        out = list(self._events)
        self._events.clear()
        return out

    def __len__(self) -> int:
        return len(self._events)
