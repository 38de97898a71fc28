"""KV transfer of :class:`~kvcache.KVSnapshot` prefixes between ranks (``send_snapshot`` / ``recv_snapshot``): the
header, answer and checksummed chunks of :mod:`.transfer`, over a snapshot's K / V segments instead of paged blocks.
Both ranks must call the matching pair in the same order."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import _validate
from ..linear import KVSnapshot
from . import wire as W
from ._comm import check_peer, comm_device
from ._pipe import Channel, receive_chunks
from .transfer import _answer, _bool, _chunk_bytes, _damaged, _expect_layout, _recv_header, _reject_first, _send

__all__ = ["send_snapshot", "recv_snapshot"]


def _snapshot_segments(snapshot: KVSnapshot) -> list[tuple[int, torch.Tensor]]:
    """The snapshot's bytes as ``(offset, uint8 view)`` segments, back to back."""
    if snapshot.flat is not None:
        return [(0, snapshot.flat.reshape(-1).view(torch.uint8))]
    out, pos = [], 0
    for t in snapshot.layers:
        b = t.reshape(-1).view(torch.uint8)
        out.append((pos, b))
        pos += b.numel()
    return out


def _snapshot_layout(data: int, layers: int, chunk_rows: int | None = None,
                     chunk_bytes: int | None = None) -> W.Layout:
    rows = -(-data // W.ALIGN)
    if chunk_rows is not None:
        return W.Layout(16 * layers, (W.ALIGN,), rows, max(1, chunk_rows))
    return W.Layout.build(16 * layers, (W.ALIGN,), rows, chunk_bytes)


def send_snapshot(
    snapshot: KVSnapshot,
    dst: int,
    group: dist.ProcessGroup | None = None,
    *,
    checksum: bool = True,
    chunk_bytes: int | None = None,
) -> None:
    """Send a :class:`~kvcache.KVSnapshot` (every layer) to rank ``dst``, which calls :func:`recv_snapshot`.

    Parameters
    ----------
    snapshot : KVSnapshot
        Layers ``[2, H_i, seq_len, D_i]`` (float16 / bfloat16 / float8_e4m3fn), packed or not.
    dst : int
        Global rank of the receiver.
    group : ProcessGroup, optional
        Default: the world (NCCL for CUDA snapshots, gloo for host ones or through the host).
    checksum : bool
        Send each chunk's checksum, checked on arrival.
    chunk_bytes : int, optional
        Payload bytes per chunk (rounded down to a multiple of 16), at most 1 GiB. Default: an eighth of the
        payload, 16-64 MiB.

    Raises
    ------
    ValueError
        Bad arguments, or the receiver expected another dtype, number of layers or seq_len.

    Example
    -------
    >>> send_snapshot(cache.save(0, 128), dst=1)  # doctest: +SKIP
    """
    if not isinstance(snapshot, KVSnapshot):
        raise TypeError(f"snapshot: expected a kvcache.KVSnapshot, got {type(snapshot).__name__}")
    _bool("checksum", checksum)
    chunk = _chunk_bytes(chunk_bytes)
    dst = check_peer("dst", dst, group)
    L, data = snapshot.num_layers, snapshot.nbytes
    layout = _snapshot_layout(data, L, chunk_bytes=chunk)
    h = W.new_header(W.KIND_SNAPSHOT)
    h[W.F_DTYPE], h[W.F_LAYERS], h[W.F_COUNT] = W.DTYPE_CODES[snapshot.dtype], L, snapshot.seq_len
    h[W.F_DATA], h[W.F_HAS_SUM] = data, int(checksum)
    layout.fields(h)
    specs = torch.tensor(snapshot.layer_specs, dtype=torch.int64).view(-1)
    segments = _snapshot_segments(snapshot)

    def fill(c: int, prefix: torch.Tensor | None, parts: list[torch.Tensor]) -> None:
        if prefix is not None:
            prefix.view(torch.int64).copy_(specs)
        r0, r1 = layout.rows_of(c)
        lo, hi = r0 * W.ALIGN, min(r1 * W.ALIGN, data)
        out = parts[0]
        for start, seg in segments:
            a, b = max(lo, start), min(hi, start + seg.numel())
            if a < b:
                out[a - lo:b - lo].copy_(seg[a - start:b - start])
        if out.numel() > hi - lo:
            out[hi - lo:].zero_()

    _send(h, layout, fill, checksum, dst, group, snapshot.device, "snapshot")


def recv_snapshot(
    src: int,
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    layer_specs: Sequence[tuple[int, int]] | None = None,
    seq_len: int | None = None,
) -> KVSnapshot:
    """Receive a :class:`~kvcache.KVSnapshot` sent by :func:`send_snapshot` on rank ``src``.

    Parameters
    ----------
    src : int
        Global rank of the sender.
    group : ProcessGroup, optional
        Default: the world.
    device : torch.device or str, optional
        Where the snapshot lives: default the CUDA device of this process under NCCL, the host under gloo.
    dtype, layer_specs, seq_len : optional
        What the caller expects (checked on arrival, ValueError on a difference; dtype and seq_len, and the
        number of layers, before the payload moves, on both ranks).

    Returns
    -------
    KVSnapshot
        Packed (one buffer), bit-exact copy of the sender's. A damaged chunk raises ValueError naming it, once
        every chunk has arrived.

    Example
    -------
    >>> snap = recv_snapshot(src=0, device="cuda")  # doctest: +SKIP
    >>> cache.restore(snap, batch_idx=0)  # doctest: +SKIP
    """
    if dtype is not None:
        _validate.check_kv_dtype("dtype", dtype)
    specs_want = None
    if layer_specs is not None:
        if isinstance(layer_specs, (str, bytes)) or not isinstance(layer_specs, Sequence):
            raise TypeError(f"layer_specs: expected a sequence of (num_kv_heads, head_dim), got "
                            f"{type(layer_specs).__name__}")
        specs_want = [(int(h), int(d)) for h, d in layer_specs]
    if seq_len is not None:
        _validate.check_int("seq_len", seq_len, 0)
    src = check_peer("src", src, group)
    work = torch.device(device) if device is not None else comm_device(group, torch.device("cpu"))
    ch = Channel(group, src, work)
    got = _recv_header(ch, "a snapshot")
    expect = {W.F_KIND: W.KIND_SNAPSHOT}
    if dtype is not None:
        expect[W.F_DTYPE] = W.DTYPE_CODES[dtype]
    if specs_want is not None:
        expect[W.F_LAYERS] = len(specs_want)
    if seq_len is not None:
        expect[W.F_COUNT] = seq_len
    _reject_first(got, expect, ch, "a snapshot")
    L, data = got[W.F_LAYERS], got[W.F_DATA]
    if got[W.F_DTYPE] not in W.DECODE[W.F_DTYPE] or L < 1 or data < 0 or got[W.F_PARAMS]:
        _answer(ch, W.REJECT, W.F_LAYERS, -1)
        raise ValueError(f"src: rank {src} sent an inconsistent snapshot header {got[:W.F_HAS_SUM]}")
    layout = _snapshot_layout(data, L, chunk_rows=got[W.F_CHUNK_ROWS])
    _expect_layout(got, layout, ch, "a snapshot")
    _answer(ch, W.ACCEPT, 0, 0)
    flat = torch.empty(data, dtype=torch.uint8, device=work)
    specs_t = torch.empty(L, 2, dtype=torch.int64, device=work)

    def sink(c: int, prefix: torch.Tensor | None, parts: list[torch.Tensor], check: object) -> None:
        if prefix is not None:
            specs_t.view(-1).copy_(prefix.view(torch.int64))
        r0, r1 = layout.rows_of(c)
        lo, hi = r0 * W.ALIGN, min(r1 * W.ALIGN, data)
        flat[lo:hi].copy_(parts[0][:hi - lo])

    bad = receive_chunks(ch, layout, sink, bool(got[W.F_HAS_SUM]))
    if bad >= 0:
        raise _damaged("snapshot", src, bad, layout, "no snapshot is returned")
    return _snapshot_from(flat, specs_t, specs_want, got, src)


def _snapshot_from(flat: torch.Tensor, specs_t: torch.Tensor, specs_want: list[tuple[int, int]] | None,
                   got: list[int], src: int) -> KVSnapshot:
    """The received layers as views of ``flat``, after checking the layer specs against the data bytes."""
    specs = [(int(h), int(d)) for h, d in specs_t.tolist()]
    if specs_want is not None and specs != specs_want:
        raise ValueError(f"layer_specs: expected {specs_want}, rank {src} sent {specs}")
    dt = W.DECODE[W.F_DTYPE][got[W.F_DTYPE]]
    elt = torch.empty((), dtype=dt).element_size()
    s_len, data = got[W.F_COUNT], got[W.F_DATA]
    if any(h < 1 or d < 1 for h, d in specs) or sum(2 * h * s_len * d for h, d in specs) * elt != data:
        raise ValueError(f"src: rank {src} sent layer specs {specs} that do not match its {data} data bytes")
    layers, pos = [], 0
    for h, d in specs:
        nb = 2 * h * s_len * d * elt
        layers.append(flat[pos:pos + nb].view(dt).view(2, h, s_len, d))
        pos += nb
    return KVSnapshot(layers)
