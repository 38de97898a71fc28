"""The host tier: a pinned host pool of block slots with its own LRU, and the copies between a
:class:`~kvcache.paged.PagedKVCache`'s blocks and host slots.

A slot holds one block of every layer: ``data`` ``[num_slots, L, *block]`` in the cache's storage dtype (``block``:
``PagedConfig.pool_shape()[1:]``) and, with a params pool, ``params`` float32 ``[num_slots, L, *param_block]``: the
bytes of ``cache.buffer[:, b]`` / ``cache.params_buffer[:, b]``, so a block comes back bit-exact.

Copies on CUDA run on two side streams, one per direction (PCIe copies both ways at once): a block leaving the
device is gathered on the compute stream (ordered before any later write of the block) and copied to its slot on the
device-to-host stream after it; a block coming back is copied on the host-to-device stream after everything the
compute stream queued so far, and the event recorded after it tells when the block may be read. Each slot remembers
the event of the last copy into it and of the last copy out of it: a copy out of a slot waits for the copy into it,
a copy into a slot waits for the copy out of it (a slot is never rewritten while it is read). On the CPU the same
calls copy at once and return no event.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..._validate import check_int

if TYPE_CHECKING:
    from ..cache import PagedKVCache

__all__ = ["HostTier", "SlotArena", "Transfers", "CHUNK_BLOCKS", "SEGMENT_BYTES", "block_tensors", "slot_shapes",
           "tiers_block_bytes"]

CHUNK_BLOCKS = 64  # blocks per copy batch: bounds the device staging (64 blocks of a Llama-3-8B bf16 cache: 128 MiB)


SEGMENT_BYTES = 2**30  # the host tier's largest pinned allocation


def block_tensors(cache: PagedKVCache) -> list[torch.Tensor]:
    """The tensors a block of ``cache`` lives in: ``[cache.buffer]`` or, with a params pool, ``[cache.buffer,
    cache.params_buffer]`` (block ``b`` of each: ``t[:, b]``, every layer).

    Example
    -------
    >>> [tuple(t.shape) for t in block_tensors(cache)]      # doctest: +SKIP
    [(2, 8, 2, 2, 4, 16)]
    """
    return [cache.buffer] + ([cache.params_buffer] if cache.params_buffer is not None else [])


def slot_shapes(cache: PagedKVCache) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """``(dtype, [L, *block])`` of each of :func:`block_tensors`: one block of every layer, as a host slot and a disk
    file hold it.

    Example
    -------
    >>> slot_shapes(cache)                                 # doctest: +SKIP
    [(torch.float16, (2, 2, 2, 4, 16))]
    """
    return [(t.dtype, (t.shape[0], *t.shape[2:])) for t in block_tensors(cache)]


def tiers_block_bytes(cache: PagedKVCache) -> int:
    """Bytes one block of ``cache`` takes in the host tier (every layer, data and params): ``host_bytes`` holds
    ``host_bytes // tiers_block_bytes(cache)`` blocks.

    Example
    -------
    >>> tiers_block_bytes(cache)      # doctest: +SKIP
    4096
    """
    return sum(t[:, 0].numel() * t.element_size() for t in block_tensors(cache))


class SlotArena:
    """Block slots over one or more segments of host tensors: segment ``k`` holds slots ``first[k] ..
    first[k] + rows - 1``, slot ``s`` at row ``s - first[k]`` of each of its tensors (``[data]`` or ``[data, params]``,
    ``[rows, L, *block]``).

    Pinned host memory comes from PyTorch's caching host allocator, which rounds every allocation up to a power of
    two (a 17 GiB tensor takes 32 GiB); a pool of segments each sized at most a power of two, greedily (1 GiB, then the
    largest power of two the rest fills), wastes less than one slot per segment instead.

    Example
    -------
    >>> arena = SlotArena([[torch.zeros(4, 2)], [torch.ones(3, 2)]])
    >>> arena.num_slots, arena.runs([2, 3, 4, 5])     # split where segment 0 ends
    (7, [(0, 0, 2, 2), (2, 1, 0, 2)])
    """

    def __init__(self, segments: list[list[torch.Tensor]]) -> None:
        self.segments = segments
        self.first: list[int] = []
        n = 0
        for seg in segments:
            self.first.append(n)
            n += seg[0].shape[0]
        self.num_slots = n

    @classmethod
    def allocate(cls, num_slots: int, shapes: list[tuple[torch.dtype, tuple[int, ...]]], *, pin: bool) -> SlotArena:
        """``num_slots`` slots of tensors ``(dtype, per-slot shape)``, in segments sized as the class docstring says
        (pinned with ``pin``: needs CUDA).

        Raises
        ------
        TypeError, ValueError
            ``num_slots`` not an int >= 1; ``shapes`` not a non-empty list of ``(torch.dtype, shape)``; ``pin`` not
            a bool.

        Example
        -------
        >>> arena = SlotArena.allocate(5, [(torch.float16, (2, 4, 16)), (torch.float32, (2, 4))], pin=False)
        >>> arena.num_slots, [tuple(t.shape) for t in arena.block(4)]
        (5, [(2, 4, 16), (2, 4)])
        """
        check_int("num_slots", num_slots, lo=1)
        if not isinstance(shapes, list) or not shapes or not all(
                isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], torch.dtype) for x in shapes):
            raise TypeError(f"shapes: expected a non-empty list of (torch.dtype, shape) pairs, got {shapes!r}")
        if not isinstance(pin, bool):
            raise TypeError(f"pin: expected a bool, got {type(pin).__name__}")
        per_slot = [torch.empty((), dtype=d).element_size() * int(torch.Size(sh).numel()) for d, sh in shapes]
        segments, left = [], num_slots
        while left:
            rows = left
            for b in per_slot:  # each tensor is rounded on its own: every one within a power of two <= what is left
                cap = min(SEGMENT_BYTES, 1 << ((left * b).bit_length() - 1))
                rows = min(rows, max(1, cap // b))
            segments.append([torch.empty((rows, *sh), dtype=d, pin_memory=pin) for d, sh in shapes])
            left -= rows
        return cls(segments)

    def locate(self, slot: int) -> tuple[int, int]:
        """``(segment, row)`` of ``slot``."""
        k = bisect.bisect_right(self.first, slot) - 1
        return k, slot - self.first[k]

    def block(self, slot: int) -> list[torch.Tensor]:
        """The tensors of one slot, ``[L, *block]`` each."""
        k, r = self.locate(slot)
        return [t[r] for t in self.segments[k]]

    def runs(self, slots: Sequence[int]) -> list[tuple[int, int, int, int]]:
        """``(position in slots, segment, first row, length)`` of each run of consecutive slots of one segment.

        Example
        -------
        >>> SlotArena([[torch.zeros(4, 2)], [torch.ones(3, 2)]]).runs([0, 1, 3, 4, 6])
        [(0, 0, 0, 2), (2, 0, 3, 1), (3, 1, 0, 1), (4, 1, 2, 1)]
        """
        out: list[tuple[int, int, int, int]] = []
        for i, s in enumerate(slots):
            k, r = self.locate(s)
            if out and out[-1][1] == k and out[-1][2] + out[-1][3] == r and slots[i - 1] == s - 1:
                p, kk, rr, n = out[-1]
                out[-1] = (p, kk, rr, n + 1)
            else:
                out.append((i, k, r, 1))
        return out


class Transfers:
    """Block copies between ``cache`` and host tensors, timed; on a side stream on CUDA.

    ``seconds[key]`` and ``nbytes[key]`` accumulate each finished copy's time and bytes under ``key``
    (``"to_host"``, ``"to_device"``): on CUDA the time between events recorded around the copies on the side stream,
    read once they completed (:meth:`settle`), on the CPU the wall time of the copies.
    """

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.cuda = cache.device.type == "cuda"
        # one stream per direction: a D2H of evicted blocks and an H2D of blocks coming back run at once
        self.streams = {k: torch.cuda.Stream(cache.device) if self.cuda else None for k in ("to_host", "to_device")}
        self.seconds = {"to_host": 0.0, "to_device": 0.0}
        self.nbytes = {"to_host": 0, "to_device": 0}
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event, str]] = []

    def _after(self, key: str, events: Sequence[torch.cuda.Event | None], compute: bool) -> None:
        """Order the ``key`` stream after ``events`` (and the compute stream's queued work with ``compute``)."""
        if not self.cuda:
            return
        stream = self.streams[key]
        if compute:  # read outside the side stream's context: inside it, the current stream is the side stream
            stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        for ev in {id(e): e for e in events if e is not None}.values():
            stream.wait_event(ev)

    def to_host(self, ids: Sequence[int], dst: SlotArena, slots: Sequence[int],
                after: Sequence[torch.cuda.Event | None] = ()) -> torch.cuda.Event | None:
        """Copy device blocks ``ids`` into slots ``slots`` of ``dst`` (its tensors matching ``cache.buffer`` and
        ``cache.params_buffer`` per block), after ``after`` (copies still reading those slots). Returns the event
        after the copies (None on the CPU)."""
        pairs = sorted(zip(slots, ids))  # in slot order: each run of consecutive slots is one copy
        event = None
        self._after("to_host", after, compute=False)
        for i in range(0, len(pairs), CHUNK_BLOCKS):
            part = pairs[i:i + CHUNK_BLOCKS]
            idx = torch.tensor([b for _, b in part], dtype=torch.int64).to(self.cache.device, non_blocking=self.cuda)
            # gathered on the compute stream, [n, L, *block]: before any later write of these blocks
            staged = [t.transpose(0, 1).index_select(0, idx) for t in block_tensors(self.cache)]
            self._after("to_host", (), compute=True)
            with self._on("to_host"):
                start = self._start("to_host")
                for p, k, r, n in dst.runs([s for s, _ in part]):
                    for a, b in zip(staged, dst.segments[k]):
                        b[r:r + n].copy_(a[p:p + n], non_blocking=self.cuda)
                if self.cuda:
                    for a in staged:
                        a.record_stream(self.streams["to_host"])
                event = self._stop(start, "to_host", len(part))
        return event

    def to_device(self, src: Sequence[tuple[SlotArena, Sequence[int]]], ids: Sequence[int],
                  after: Sequence[torch.cuda.Event | None] = ()) -> torch.cuda.Event | None:
        """Copy host blocks into device blocks ``ids``: ``src`` is a list of (arena, its slots), whose slots,
        concatenated, give ``ids`` in order; after ``after`` (copies still writing those slots) and the compute
        stream's queued work. Returns the event after the copies (None on the CPU)."""
        entries, at = [], 0
        for k, (_, slots) in enumerate(src):  # each source in slot order: a run of consecutive slots is one copy
            entries += [(k, s, b) for s, b in sorted(zip(slots, ids[at:at + len(slots)]))]
            at += len(slots)
        dev, event = self.cache.device, None
        if entries:  # the blocks were written or gathered by work queued on the compute stream
            self._after("to_device", after, compute=True)
        for i in range(0, len(entries), CHUNK_BLOCKS):
            part = entries[i:i + CHUNK_BLOCKS]
            with self._on("to_device"):
                staged = [torch.empty((len(part), *t.shape[:1], *t.shape[2:]), dtype=t.dtype, device=dev)
                          for t in block_tensors(self.cache)]
                start = self._start("to_device")
                j = 0
                while j < len(part):  # runs of one source's consecutive slots
                    n = 1
                    while j + n < len(part) and part[j + n][0] == part[j][0]:
                        n += 1
                    arena = src[part[j][0]][0]
                    for p, k, r, m in arena.runs([s for _, s, _ in part[j:j + n]]):
                        for st, t in zip(staged, arena.segments[k]):
                            st[j + p:j + p + m].copy_(t[r:r + m], non_blocking=self.cuda)
                    j += n
                idx = torch.tensor([b for _, _, b in part], dtype=torch.int64).to(dev, non_blocking=self.cuda)
                for t, st in zip(block_tensors(self.cache), staged):
                    _bytes_view(t).transpose(0, 1).index_copy_(0, idx, _bytes_view(st))
                event = self._stop(start, "to_device", len(part))
        return event

    def _on(self, key: str) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.streams[key]) if self.cuda else contextlib.nullcontext()

    def _start(self, key: str) -> object:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.streams[key])
        return ev

    def _stop(self, start: object, key: str, n_blocks: int) -> torch.cuda.Event | None:
        self.nbytes[key] += n_blocks * tiers_block_bytes(self.cache)
        if not self.cuda:
            self.seconds[key] += time.perf_counter() - start  # type: ignore[operator]
            return None
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.streams[key])
        self._timed.append((start, end, key))  # type: ignore[arg-type]
        return end

    def settle(self) -> None:
        """Add the time of every finished timed copy to :attr:`seconds` (copies still running stay pending)."""
        left = []
        for start, end, key in self._timed:
            if end.query():
                self.seconds[key] += start.elapsed_time(end) / 1e3
            else:
                left.append((start, end, key))
        self._timed = left


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as uint8 when it holds 1-byte floats (fp8: index_copy_ has no float8 kernel on the CPU)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


class HostTier:
    """``num_slots`` block slots in (pinned, on CUDA) host memory, keyed by block hash, least recently used first.

    Parameters
    ----------
    cache : PagedKVCache
        The pool whose blocks the slots hold (shapes and dtypes taken from it).
    num_slots : int
        Slots (>= 1; TypeError / ValueError naming ``num_slots`` otherwise).

    Attributes
    ----------
    arena : SlotArena
        The slots: per block ``data`` ``[L, *block]`` in the cache's storage dtype and, with a params pool, float32
        ``params`` ``[L, *param_block]``, on the CPU (pinned on CUDA).

    Example
    -------
    >>> host = HostTier(cache, 64)                           # doctest: +SKIP
    >>> slot, victim = host.reserve(block_hash)              # doctest: +SKIP
    """

    name = "host"

    def __init__(self, cache: PagedKVCache, num_slots: int) -> None:
        self.arena = SlotArena.allocate(num_slots, slot_shapes(cache), pin=cache.device.type == "cuda")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slots 0, 1, 2, ... first
        self._written: list[torch.cuda.Event | None] = [None] * num_slots  # after the last copy into each slot
        self._read: list[torch.cuda.Event | None] = [None] * num_slots  # after the last copy out of each slot

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def hashes(self) -> list[int]:
        """Held hashes, least recently used first."""
        return list(self._slot_of)

    def slot(self, block_hash: int, *, touch: bool = True) -> int | None:
        """The slot holding ``block_hash`` (None: not held); ``touch`` makes it the most recently used."""
        s = self._slot_of.get(block_hash)
        if s is not None and touch:
            self._slot_of.move_to_end(block_hash)
        return s

    def reserve(self, block_hash: int) -> tuple[int, int | None]:
        """A slot for ``block_hash`` (most recently used): a free one, else the least recently used one's, whose hash
        is returned as the victim (its bytes are still in the slot until the caller copies into it).

        Example
        -------
        >>> host = HostTier(cache, 1)                            # doctest: +SKIP
        >>> host.reserve(11), host.reserve(12)                   # doctest: +SKIP
        ((0, None), (0, 11))
        """
        if self._free:
            s, victim = self._free.pop(), None
        else:
            victim, s = self._slot_of.popitem(last=False)
        self._slot_of[block_hash] = s
        return s, victim

    def set_written(self, slots: Sequence[int], event: torch.cuda.Event | None) -> None:
        """Record ``event`` as the end of the latest copy into ``slots``.

        Example
        -------
        >>> ev = transfers.to_host(ids, host.arena, slots, after=host.read(slots))   # doctest: +SKIP
        >>> host.set_written(slots, ev)                                               # doctest: +SKIP
        """
        for s in slots:
            self._written[s] = event

    def set_read(self, slots: Sequence[int], event: torch.cuda.Event | None) -> None:
        """Record ``event`` as the end of the latest copy out of ``slots``.

        Example
        -------
        >>> ev = transfers.to_device([(host.arena, slots)], ids, after=host.written(slots))   # doctest: +SKIP
        >>> host.set_read(slots, ev)                                                           # doctest: +SKIP
        """
        for s in slots:
            self._read[s] = event

    def written(self, slots: Sequence[int]) -> list[torch.cuda.Event | None]:
        """The events after the latest copies into ``slots`` (a copy out of them waits for these; None: nothing in
        flight, always on the CPU).

        Example
        -------
        >>> host.written([0, 1])                                 # doctest: +SKIP
        [None, None]
        """
        return [self._written[s] for s in slots]

    def read(self, slots: Sequence[int]) -> list[torch.cuda.Event | None]:
        """The events after the latest copies out of ``slots`` (a copy into them waits for these; None: nothing in
        flight, always on the CPU).

        Example
        -------
        >>> host.read([0, 1])                                    # doctest: +SKIP
        [None, None]
        """
        return [self._read[s] for s in slots]

    def wait(self, slot: int) -> None:
        """Block the host until the latest copy into ``slot`` has finished (before the host reads it)."""
        ev = self._written[slot]
        if ev is not None:
            ev.synchronize()
            self._written[slot] = None

    def block(self, slot: int) -> list[torch.Tensor]:
        """The slot's tensors (``[data]`` or ``[data, params]``, ``[L, ...]`` each) once the copy into it finished."""
        self.wait(slot)
        return self.arena.block(slot)

    def clear(self) -> list[int]:
        """Drop every entry; returns the hashes dropped."""
        out = list(self._slot_of)
        self._slot_of.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        return out
