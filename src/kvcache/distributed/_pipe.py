"""The chunk pipeline of KV transfers: one peer's messages (:class:`Channel`), the sender's pack -> checksum ->
send loop and the receiver's receive -> checksum -> checked write loop (:mod:`.wire` describes the messages).

Overlap. Messages are ``isend`` / ``irecv``; ``Work.wait()`` under NCCL makes the current CUDA stream wait for
the message (the host does not), and NCCL's stream waits for the current stream when a message is posted. So
on a GPU the sender's current stream packs and checksums chunk ``i + 1`` while NCCL sends chunk ``i``, and the
receiver checks and scatters chunk ``i`` while chunk ``i + 1`` arrives; :data:`DEPTH` staging buffers per side,
a buffer reused once the message that used it is done. Under gloo the same calls run on the host (a wait blocks
until the message is through). The pipeline's one host sync is the receiver's final look at the checksums (a
receiver of fp8 blocks that does not adopt the sender's scales also compares them once chunk 0 is in).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from . import wire as W
from ._comm import comm_device
from ._kernels import checksum_into

DEPTH = 3  # staging buffers (chunks in flight) on each side

# fill(c, prefix, parts) writes chunk c's prefix (None past chunk 0) and part views (uint8 [k * part bytes]);
# sink(c, prefix, parts, check) takes them from a received chunk; check is (got, want), int32 [2] each, or None
Fill = Callable[[int, "torch.Tensor | None", list[torch.Tensor]], None]
Sink = Callable[[int, "torch.Tensor | None", list[torch.Tensor], "tuple[torch.Tensor, torch.Tensor] | None"], None]


class _Pending:
    __slots__ = ("work", "buf", "into")

    def __init__(self, work: dist.Work, buf: torch.Tensor, into: torch.Tensor | None) -> None:
        self.work, self.buf, self.into = work, buf, into

    def wait(self) -> None:
        self.work.wait()
        if self.into is not None:  # received on the comm device, used on another
            self.into.copy_(self.buf)


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:<current>`` (a tensor's device always has its index: ``cuda`` would compare unequal)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Channel:
    """Messages to and from ``peer``: tensors of the work device, staged through the comm device (the one the
    group's backend reads) when it is another."""

    def __init__(self, group: dist.ProcessGroup | None, peer: int, work: torch.device) -> None:
        self.group, self.peer = group, peer
        self.work, self.comm = _indexed(work), _indexed(comm_device(group, work))  # compared with tensors' devices

    def isend(self, t: torch.Tensor) -> _Pending:
        buf = t if t.device == self.comm else t.to(self.comm)
        return _Pending(dist.isend(buf, dst=self.peer, group=self.group), buf, None)

    def irecv(self, t: torch.Tensor) -> _Pending:
        if t.device == self.comm:
            return _Pending(dist.irecv(t, src=self.peer, group=self.group), t, None)
        buf = torch.empty(t.shape, dtype=t.dtype, device=self.comm)
        return _Pending(dist.irecv(buf, src=self.peer, group=self.group), buf, t)

    def ints(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int64, device=self.work)


class _Chunk:
    """Views of one chunk's message in a staging buffer: the message, its body as int32 words, the prefix (chunk
    0 only, else None), the parts, the padding between sections, the trailer (int32 [4])."""

    __slots__ = ("msg", "words", "prefix", "parts", "pads", "trailer")

    def __init__(self, buf: torch.Tensor, layout: W.Layout, c: int) -> None:
        secs = layout.sections(c)
        body = layout.body_bytes(c)
        self.msg = buf[:body + W.TRAILER]
        self.words = buf[:body].view(torch.int32)
        self.prefix = buf[:layout.prefix] if c == 0 and layout.prefix else None
        self.parts = [buf[off:off + n] for off, n in secs[1:]]
        ends = [off + n for off, n in secs]
        starts = [off for off, _ in secs[1:]] + [body]
        self.pads = [buf[e:s] for e, s in zip(ends, starts) if s > e]
        self.trailer = buf[body:body + W.TRAILER].view(torch.int32)


class _Staging:
    """:data:`DEPTH` staging buffers (fewer for fewer chunks), each as large as chunk 0's message (the largest),
    and the views of chunk ``c`` in buffer ``c % DEPTH``, made once per buffer and chunk shape (every chunk but
    the first and the last has the same): a few microseconds of host time saved per chunk."""

    def __init__(self, layout: W.Layout, device: torch.device) -> None:
        self.layout = layout
        n = min(DEPTH, layout.chunks)
        size = layout.body_bytes(0) + W.TRAILER if n else 0
        self.bufs = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(n)]
        self._views: dict[tuple[int, bool, int], _Chunk] = {}

    def chunk(self, c: int) -> _Chunk:
        slot = c % len(self.bufs)
        r0, r1 = self.layout.rows_of(c)
        key = (slot, c == 0, r1 - r0)
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = _Chunk(self.bufs[slot], self.layout, c)
        return v


class ChunkSender:
    """Packs chunks into staging buffers (:meth:`pack`, chunk 0 may be packed before the answer arrives) and
    sends them (:meth:`send`), packing chunk ``i + 1`` while chunk ``i`` is on the wire."""

    def __init__(self, ch: Channel, layout: W.Layout, fill: Fill, checksum: bool) -> None:
        self.ch, self.layout, self.fill, self.checksum = ch, layout, fill, checksum
        self.staging = _Staging(layout, ch.work)
        self.pending: list[_Pending | None] = [None] * len(self.staging.bufs)
        self.packed = -1

    def pack(self, c: int) -> None:
        slot = c % len(self.pending)
        if self.pending[slot] is not None:  # the buffer's previous chunk must be through first
            self.pending[slot].wait()  # type: ignore[union-attr]
            self.pending[slot] = None
        v = self.staging.chunk(c)
        self.fill(c, v.prefix, v.parts)
        for p in v.pads:
            p.zero_()
        v.trailer.zero_()
        if self.checksum:
            checksum_into(v.words, c, v.trailer[:2])
        self.packed = c

    def send(self) -> None:
        """Send every chunk (packing those not packed yet); returns once every message is through (on CUDA:
        once the current stream waits for them)."""
        for c in range(self.layout.chunks):
            if c > self.packed:
                self.pack(c)
            self.pending[c % len(self.pending)] = self.ch.isend(self.staging.chunk(c).msg)
        for i, p in enumerate(self.pending):
            if p is not None:
                p.wait()
                self.pending[i] = None


def receive_chunks(ch: Channel, layout: W.Layout, sink: Sink, checksum: bool) -> int:
    """Receive every chunk of ``layout`` and hand each to ``sink`` with its check; returns the index of the
    first chunk whose checksum differs from the sender's, or -1. Every chunk is received whatever happens to
    the others (the peers stay in step). One host sync, at the end (with ``checksum``)."""
    n = layout.chunks
    if not n:
        return -1
    staging = _Staging(layout, ch.work)
    depth = len(staging.bufs)
    pending = [ch.irecv(staging.chunk(c).msg) for c in range(depth)]
    sums = torch.zeros(n, 2, dtype=torch.int32, device=ch.work) if checksum else None
    wants = torch.empty(n, 2, dtype=torch.int32, device=ch.work) if checksum else None
    for c in range(n):
        pending[c % depth].wait()
        v = staging.chunk(c)
        check = None
        if sums is not None and wants is not None:
            checksum_into(v.words, c, sums[c])
            wants[c].copy_(v.trailer[:2])
            check = (sums[c], wants[c])
        sink(c, v.prefix, v.parts, check)
        if c + depth < n:  # posted after the sink's work: NCCL's stream waits for it before writing
            pending[c % depth] = ch.irecv(staging.chunk(c + depth).msg)
    if sums is None or wants is None:
        return -1
    bad = (sums != wants).any(dim=1)
    first = int(torch.where(bad, torch.arange(n, device=bad.device), n).min().item())
    return -1 if first == n else first
