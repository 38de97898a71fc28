"""Counters of one memory tier below the paged pool (:class:`TierStats`), torch-free."""

from __future__ import annotations

import dataclasses

__all__ = ["TierStats"]


@dataclasses.dataclass
class TierStats:
    """Counters of one tier (``"device"``, ``"host"`` or ``"disk"``) of a :class:`~kvcache.paged.tiers.TieredCache`.

    Attributes
    ----------
    hits : int
        Blocks brought back from this tier to the device (their prefill skipped); for ``"device"``, blocks matched in
        the pool itself. The device tier counts only ``hits``, ``stored`` (published) and ``removed`` (evicted).
        The device's ``hits`` is the allocator's own count (``BlockAllocator.stats.hits``), read when the stats are
        taken: ``BlockAllocator.reset_stats()`` sets it back to 0, so a difference of two readings taken across a
        reset (``llm.stats.tiers`` of a ``generate`` call during which it was reset) is wrong, possibly negative;
        reset between calls, not during one.
    stored : int
        Blocks written into this tier (a block it already held is not written again, nor counted).
    removed : int
        Blocks dropped from it: its budget's evictions, and refused entries.
    refused : int
        Entries refused on reading (disk: damaged, truncated, of another fingerprint): recomputed, never used.
    bytes_in, bytes_out : int
        Bytes copied into / out of the tier. Host: device -> host and host -> device copies (every block brought
        back crosses host -> device, disk hits included); disk: bytes of the files written / read.
    seconds_in, seconds_out : float
        Time of those copies (CUDA: events around the copies on the tiers' stream; CPU and disk: wall time).

    Example
    -------
    >>> s = TierStats(bytes_in=2 * 10**9, seconds_in=0.1)
    >>> round(s.gbps_in, 1), (s + s).bytes_in
    (20.0, 4000000000)
    """

    hits: int = 0
    stored: int = 0
    removed: int = 0
    refused: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds_in: float = 0.0
    seconds_out: float = 0.0

    @property
    def gbps_in(self) -> float:
        """``bytes_in / seconds_in / 1e9`` (0.0 before any copy)."""
        return self.bytes_in / self.seconds_in / 1e9 if self.seconds_in > 0 else 0.0

    @property
    def gbps_out(self) -> float:
        """``bytes_out / seconds_out / 1e9`` (0.0 before any copy)."""
        return self.bytes_out / self.seconds_out / 1e9 if self.seconds_out > 0 else 0.0

    def __add__(self, other: TierStats) -> TierStats:
        return TierStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)})

    def __sub__(self, other: TierStats) -> TierStats:
        return TierStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)})
