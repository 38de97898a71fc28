"""The host tier: a pinned host pool of block slots with its own LRU, and the copies between a
:class:`~kvcache.paged.PagedKVCache`'s blocks and host slots.

A slot holds one block of every layer: ``data`` ``[num_slots, L, *block]`` in the cache's storage dtype (``block``:
``PagedConfig.pool_shape()[1:]``) and, for int8 / int4, ``params`` float32 ``[num_slots, L, *param_block]``: the
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

import contextlib
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..cache import PagedKVCache

__all__ = ["HostTier", "Transfers", "CHUNK_BLOCKS"]

CHUNK_BLOCKS = 64  # blocks per copy batch: bounds the device staging (64 blocks of a Llama-3-8B bf16 cache: 128 MiB)


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(position, first slot, length)`` of each run of consecutive slots in ``slots``."""
    out: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if out and out[-1][1] + out[-1][2] == s:
            p, f, n = out[-1]
            out[-1] = (p, f, n + 1)
        else:
            out.append((i, s, 1))
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

    def _tensors(self) -> list[torch.Tensor]:
        c = self.cache
        return [c.buffer] + ([c.params_buffer] if c.params_buffer is not None else [])

    def block_bytes(self) -> int:
        """Bytes of one block over every layer (data and params)."""
        return sum(t[:, 0].numel() * t.element_size() for t in self._tensors())

    def _after(self, key: str, events: Sequence[torch.cuda.Event | None], compute: bool) -> None:
        """Order the ``key`` stream after ``events`` (and the compute stream's queued work with ``compute``)."""
        if not self.cuda:
            return
        stream = self.streams[key]
        if compute:  # read outside the side stream's context: inside it, the current stream is the side stream
            stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        for ev in {id(e): e for e in events if e is not None}.values():
            stream.wait_event(ev)

    def to_host(self, ids: Sequence[int], dst: Sequence[torch.Tensor], slots: Sequence[int],
                after: Sequence[torch.cuda.Event | None] = ()) -> torch.cuda.Event | None:
        """Copy device blocks ``ids`` into ``dst[k][slots[i]]`` (``dst``: the host tensors ``[n, L, *block]`` matching
        ``cache.buffer`` and ``cache.params_buffer``), after ``after`` (copies still reading those slots). Returns the
        event after the copies (None on the CPU)."""
        pairs = sorted(zip(slots, ids))  # in slot order: each run of consecutive slots is one copy
        event = None
        self._after("to_host", after, compute=False)
        for i in range(0, len(pairs), CHUNK_BLOCKS):
            part = pairs[i:i + CHUNK_BLOCKS]
            idx = torch.tensor([b for _, b in part], dtype=torch.int64).to(self.cache.device, non_blocking=self.cuda)
            # gathered on the compute stream, [n, L, *block]: before any later write of these blocks
            staged = [t.transpose(0, 1).index_select(0, idx) for t in self._tensors()]
            self._after("to_host", (), compute=True)
            with self._on("to_host"):
                start = self._start("to_host")
                for p, s, n in _runs([s for s, _ in part]):
                    for a, b in zip(staged, dst):
                        b[s:s + n].copy_(a[p:p + n], non_blocking=self.cuda)
                if self.cuda:
                    for a in staged:
                        a.record_stream(self.streams["to_host"])
                event = self._stop(start, "to_host", len(part))
        return event

    def to_device(self, src: Sequence[tuple[Sequence[torch.Tensor], Sequence[int]]], ids: Sequence[int],
                  after: Sequence[torch.cuda.Event | None] = ()) -> torch.cuda.Event | None:
        """Copy host blocks into device blocks ``ids``: ``src`` is a list of (host tensors like ``dst`` of
        :meth:`to_host`, their slots), whose slots, concatenated, give ``ids`` in order; after ``after`` (copies still
        writing those slots) and the compute stream's queued work. Returns the event after the copies (None on the
        CPU)."""
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
                          for t in self._tensors()]
                start = self._start("to_device")
                j = 0
                while j < len(part):  # runs of one source's consecutive slots
                    k, s, _ = part[j]
                    n = 1
                    while j + n < len(part) and part[j + n][0] == k and part[j + n][1] == s + n:
                        n += 1
                    for st, t in zip(staged, src[k][0]):
                        st[j:j + n].copy_(t[s:s + n], non_blocking=self.cuda)
                    j += n
                idx = torch.tensor([b for _, _, b in part], dtype=torch.int64).to(dev, non_blocking=self.cuda)
                for t, st in zip(self._tensors(), staged):
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
        self.nbytes[key] += n_blocks * self.block_bytes()
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
        Slots (>= 1).

    Attributes
    ----------
    data : torch.Tensor
        ``[num_slots, L, *block]``, the cache's storage dtype, on the CPU.
    params : torch.Tensor or None
        float32 ``[num_slots, L, *param_block]`` for int8 / int4, else None.

    Example
    -------
    >>> host = HostTier(cache, 64)                           # doctest: +SKIP
    >>> slot, victim = host.reserve(block_hash)              # doctest: +SKIP
    """

    name = "host"

    def __init__(self, cache: PagedKVCache, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots: expected an int >= 1, got {num_slots!r}")
        pin = cache.device.type == "cuda"
        b = cache.buffer
        self.data = torch.empty((num_slots, b.shape[0], *b.shape[2:]), dtype=b.dtype, pin_memory=pin)
        p = cache.params_buffer
        self.params = (torch.empty((num_slots, p.shape[0], *p.shape[2:]), dtype=p.dtype, pin_memory=pin)
                       if p is not None else None)
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slots 0, 1, 2, ... first
        self._written: list[torch.cuda.Event | None] = [None] * num_slots  # after the last copy into each slot
        self._read: list[torch.cuda.Event | None] = [None] * num_slots  # after the last copy out of each slot

    @property
    def tensors(self) -> list[torch.Tensor]:
        """``[data]`` or ``[data, params]``: the host tensors of :class:`Transfers`."""
        return [self.data] + ([self.params] if self.params is not None else [])

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
        is returned as the victim (its bytes are still in the slot until the caller copies into it)."""
        if self._free:
            s, victim = self._free.pop(), None
        else:
            victim, s = self._slot_of.popitem(last=False)
        self._slot_of[block_hash] = s
        return s, victim

    def set_written(self, slots: Sequence[int], event: torch.cuda.Event | None) -> None:
        """Record ``event`` as the end of the latest copy into ``slots``."""
        for s in slots:
            self._written[s] = event

    def set_read(self, slots: Sequence[int], event: torch.cuda.Event | None) -> None:
        """Record ``event`` as the end of the latest copy out of ``slots``."""
        for s in slots:
            self._read[s] = event

    def written(self, slots: Sequence[int]) -> list[torch.cuda.Event | None]:
        """The events after the latest copies into ``slots`` (a copy out of them waits for these)."""
        return [self._written[s] for s in slots]

    def read(self, slots: Sequence[int]) -> list[torch.cuda.Event | None]:
        """The events after the latest copies out of ``slots`` (a copy into them waits for these)."""
        return [self._read[s] for s in slots]

    def wait(self, slot: int) -> None:
        """Block the host until the latest copy into ``slot`` has finished (before the host reads it)."""
        ev = self._written[slot]
        if ev is not None:
            ev.synchronize()
            self._written[slot] = None

    def block(self, slot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(data[slot], params[slot] or None)`` once its copy has finished."""
        self.wait(slot)
        return self.data[slot], (self.params[slot] if self.params is not None else None)

    def clear(self) -> list[int]:
        """Drop every entry; returns the hashes dropped."""
        out = list(self._slot_of)
        self._slot_of.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        return out
