"""KV transfer between ranks by torch.distributed point-to-point (NCCL on GPUs, gloo on CPUs): paged blocks of
every layer (any kv_dtype; int8 / int4 scale / zero and fp8 scales included) and :class:`~kvcache.KVSnapshot`
prefixes, for disaggregated serving (prefill on one rank, decode on another).

Each transfer is a header, an answer and one packed payload (see :mod:`kvcache.distributed.wire`): the
receiver checks format and shape against its own before anything moves, takes its blocks from its own
allocator, checks the payload's checksum, and only then writes into its cache. Both ranks must call the
matching pair (``send_blocks`` / ``recv_blocks``, ``send_snapshot`` / ``recv_snapshot``) in the same order.

Arguments are validated before the first message: a rank that raises there leaves its peer waiting (until the
process group's timeout). After the header, a mismatch raises ValueError on both ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import _validate
from ..linear import KVSnapshot
from ..paged import BlockAllocator, PagedKVCache
from . import wire as W
from ._comm import as_bytes, check_peer, comm_device

__all__ = ["send_blocks", "recv_blocks", "send_snapshot", "recv_snapshot"]


def _block_ids(cache: PagedKVCache, block_ids: object) -> list[int]:
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"block_ids: expected a 1-d int32 / int64 tensor, got {block_ids.dtype} "
                             f"{list(block_ids.shape)}")
        vals = [int(x) for x in block_ids.tolist()]
    else:
        if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Sequence):
            raise TypeError(f"block_ids: expected a sequence of ints, got {type(block_ids).__name__}")
        vals = [_validate.check_int(f"block_ids[{i}]", x) for i, x in enumerate(block_ids)]
    nb = cache.config.num_blocks
    bad = [x for x in vals if not 0 <= x < nb]
    if bad:
        raise ValueError(f"block_ids: expected ids in [0, {nb}), got {bad[:8]}")
    return vals


def _check_cache(cache: object) -> PagedKVCache:
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a kvcache.PagedKVCache, got {type(cache).__name__}")
    return cache


def _bool(name: str, value: object) -> bool:
    if type(value) is not bool:
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def _layout(cache: PagedKVCache, n: int) -> tuple[int, int, int, int]:
    """(data, params, scales, padded total) payload bytes of ``n`` blocks of ``cache``."""
    buf = cache.buffer
    data = buf.shape[0] * n * (buf[0, 0].numel() * buf.element_size())
    params = 0
    if cache.params_buffer is not None:
        pb = cache.params_buffer
        params = pb.shape[0] * n * pb[0, 0].numel() * pb.element_size()
    scales = cache.num_layers * 2 * 4 if cache.config.kv_dtype == "fp8" else 0
    total = W.align(W.align(W.align(data) + params) + scales, W.CHUNK) if n else 0
    return data, params, scales, total


def _block_header(cache: PagedKVCache, n: int) -> list[int]:
    c = cache.config
    data, params, scales, total = _layout(cache, n)
    h = W.new_header(W.KIND_BLOCKS)
    h[W.F_KV_DTYPE] = W.KV_DTYPE_CODES[c.kv_dtype]
    h[W.F_LAYOUT] = W.LAYOUT_CODES[c.layout]
    h[W.F_DTYPE] = W.DTYPE_CODES[c.dtype]
    h[W.F_LAYERS], h[W.F_HEADS], h[W.F_HEAD_DIM], h[W.F_BLOCK_SIZE] = c.num_layers, c.num_kv_heads, c.head_dim, \
        c.block_size
    h[W.F_COUNT], h[W.F_NBYTES], h[W.F_DATA], h[W.F_PARAMS], h[W.F_SCALES] = n, total, data, params, scales
    return h


def _wide(pool: torch.Tensor) -> torch.Tensor:
    """``[L, num_blocks, *block]`` pool as ``[L, num_blocks, words]`` of the widest integer dtype dividing a
    block's bytes: packing and scattering move 8-byte words, not bytes (several times faster)."""
    b = pool.view(torch.uint8).view(pool.shape[0], pool.shape[1], -1)
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if b.shape[2] % size == 0:
            return b.view(dt)
    return b


def _parts(payload: torch.Tensor, cache: PagedKVCache, n: int) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                        torch.Tensor | None]:
    """Views of the payload's parts: data and params as :func:`_wide` of the pools with ``n`` blocks, fp8
    scales as float32 ``[L, 2]``."""
    data, params, scales, _ = _layout(cache, n)
    dw = _wide(cache.buffer)
    d = payload[:data].view(dw.dtype).view(dw.shape[0], n, dw.shape[2])
    p = s = None
    off = W.align(data)
    if cache.params_buffer is not None:
        pw = _wide(cache.params_buffer)
        p = payload[off:off + params].view(pw.dtype).view(pw.shape[0], n, pw.shape[2])
    off = W.align(off + params)
    if scales:
        s = payload[off:off + scales].view(torch.float32).view(cache.num_layers, 2)
    return d, p, s


def _zero_gaps(payload: torch.Tensor, used: list[tuple[int, int]]) -> None:
    pos = 0
    for start, end in used:
        if start > pos:
            payload[pos:start].zero_()
        pos = end
    if pos < payload.numel():
        payload[pos:].zero_()


def _send_with_answer(header: list[int], csum: torch.Tensor | None, payload: torch.Tensor, dst: int,
                      group: dist.ProcessGroup | None, dev: torch.device, what: str) -> int:
    """Send the header, wait for the answer; on ACCEPT send the payload. Returns the answer's status."""
    dist.send(W.header_tensor(header, csum, payload.device).to(dev), dst=dst, group=group)
    ack = torch.empty(W.ACK_LEN, dtype=torch.int64, device=dev)
    dist.recv(ack, src=dst, group=group)
    status, field, theirs = ack.tolist()
    if status == W.REJECT:
        raise ValueError(f"dst: rank {dst} rejected the {what}: it expects {W.FIELD_NAMES.get(field, field)} "
                         f"{W.describe(field, theirs)}, these have {W.describe(field, header[field])}")
    if status == W.ACCEPT and header[W.F_NBYTES]:
        dist.send(payload.to(dev), dst=dst, group=group)
    return status


def _recv_header(src: int, group: dist.ProcessGroup | None, dev: torch.device) -> list[int]:
    h = torch.empty(W.HEADER_LEN, dtype=torch.int64, device=dev)
    dist.recv(h, src=src, group=group)
    return h.tolist()


def _answer(status: int, field: int, value: int, src: int, group: dist.ProcessGroup | None,
            dev: torch.device) -> None:
    dist.send(torch.tensor([status, field, value], dtype=torch.int64, device=dev), dst=src, group=group)


def _reject_first(got: list[int], expect: dict[int, int], src: int, group: dist.ProcessGroup | None,
                  dev: torch.device, what: str) -> None:
    """Answer REJECT and raise ValueError at the first header field that differs from ``expect``."""
    for field, want in expect.items():
        if got[field] != want:
            _answer(W.REJECT, field, want, src, group, dev)
            raise ValueError(f"src: rank {src} sent {what} with {W.FIELD_NAMES[field]} "
                             f"{W.describe(field, got[field])}, expected {W.describe(field, want)}")


def _recv_payload(header: list[int], src: int, group: dist.ProcessGroup | None, dev: torch.device,
                  device: torch.device, what: str) -> torch.Tensor:
    payload = torch.empty(header[W.F_NBYTES], dtype=torch.uint8, device=dev)
    if payload.numel():
        dist.recv(payload, src=src, group=group)
    payload = payload.to(device)
    if header[W.F_HAS_SUM]:
        got = int(W.checksum(payload).item())
        if got != header[W.F_SUM]:
            raise ValueError(f"src: the {what} from rank {src} arrived damaged (checksum {got}, the sender's "
                             f"{header[W.F_SUM]}); nothing was written")
    return payload


# ------------------------------------------------------------------------------------------------ blocks


def send_blocks(
    cache: PagedKVCache,
    block_ids: Sequence[int] | torch.Tensor,
    dst: int,
    group: dist.ProcessGroup | None = None,
    *,
    checksum: bool = True,
) -> bool:
    """Send blocks of every layer of ``cache`` to rank ``dst``, which calls :func:`recv_blocks`.

    The blocks' bytes (data pool, int8 / int4 scale / zero, fp8 K / V scales) are packed on the cache's device
    into one payload and sent after the receiver has accepted the header.

    Parameters
    ----------
    cache : PagedKVCache
        The sending cache; the blocks are read, not freed (free them in your allocator once this returns).
    block_ids : sequence of int or torch.Tensor
        Block ids in ``[0, num_blocks)``, in the order the receiver's new ids will follow.
    dst : int
        Global rank of the receiver.
    group : ProcessGroup, optional
        Default: the world. NCCL for CUDA caches (messages stay on the GPU), gloo for CPU caches (and CUDA
        caches, through host memory).
    checksum : bool
        Send a checksum of the payload (one extra read of it on each side), checked on arrival.

    Returns
    -------
    bool
        True when sent; False when the receiver's allocator had no room (nothing was sent).

    Raises
    ------
    ValueError
        Bad arguments (before any message), or the receiver's cache has another format or shape (kv_dtype,
        layout, dtype, layers, heads, head_dim, block size): the message names the field and both values.

    Example
    -------
    >>> # rank 0 (prefill)                                   # rank 1 (decode)
    >>> send_blocks(cache, [3, 7, 8], dst=1)  # doctest: +SKIP
    >>> ids = recv_blocks(cache, allocator, src=0)          # doctest: +SKIP
    """
    cache = _check_cache(cache)
    ids = _block_ids(cache, block_ids)
    _bool("checksum", checksum)
    dst = check_peer("dst", dst, group)
    dev = comm_device(group, cache.device)
    n = len(ids)
    header = _block_header(cache, n)
    data, params, scales, total = _layout(cache, n)
    payload = torch.empty(total, dtype=torch.uint8, device=cache.device)
    csum = None
    if n:
        d, p, s = _parts(payload, cache, n)
        idx = torch.tensor(ids, dtype=torch.int64, device=cache.device)
        torch.index_select(_wide(cache.buffer), 1, idx, out=d)
        used = [(0, data)]
        if p is not None:
            torch.index_select(_wide(cache.params_buffer), 1, idx, out=p)  # type: ignore[arg-type]
            used.append((W.align(data), W.align(data) + params))
        if s is not None:
            s.copy_(cache.kv_scales)
            off = W.align(W.align(data) + params)
            used.append((off, off + scales))
        _zero_gaps(payload, used)
        if checksum:
            csum = W.checksum(payload)
    return _send_with_answer(header, csum, payload, dst, group, dev, "blocks") == W.ACCEPT


def recv_blocks(
    cache: PagedKVCache,
    allocator: BlockAllocator,
    src: int,
    group: dist.ProcessGroup | None = None,
    *,
    adopt_scales: bool = False,
) -> list[int] | None:
    """Receive blocks sent by :func:`send_blocks` on rank ``src`` into new blocks of ``cache``, taken from
    ``allocator``.

    Checked on arrival, before anything is written: the sender's kv_dtype, layout, model dtype, layers, KV
    heads, head_dim and block size must be this cache's (else ValueError here and on the sender, no block
    taken); the payload's checksum (else ValueError, blocks given back); for fp8, the sender's K / V scales must
    equal this cache's bit for bit, unless ``adopt_scales``.

    Parameters
    ----------
    cache : PagedKVCache
        The receiving cache.
    allocator : BlockAllocator
        Owner of ``cache``'s blocks (same ``num_blocks`` and ``block_size``); the new blocks are allocated from
        it (reference count 1, the caller's).
    src : int
        Global rank of the sender.
    group : ProcessGroup, optional
        Default: the world.
    adopt_scales : bool
        fp8 only: set this cache's ``kv_scales`` to the sender's instead of requiring them equal (they decode
        every fp8 block of a layer: only for a cache whose other blocks do not matter, such as a fresh one).

    Returns
    -------
    list of int or None
        The new block ids, in the sender's order (a block table's row for a sequence sent in order); None when
        the allocator had no room for them (the sender's call returns False).

    Example
    -------
    >>> ids = recv_blocks(cache, allocator, src=0)  # doctest: +SKIP
    >>> table = torch.tensor([ids], dtype=torch.int32)  # doctest: +SKIP
    """
    cache = _check_cache(cache)
    if not isinstance(allocator, BlockAllocator):
        raise TypeError(f"allocator: expected a kvcache.BlockAllocator, got {type(allocator).__name__}")
    c = cache.config
    if allocator.num_blocks != c.num_blocks or allocator.block_size != c.block_size:
        raise ValueError(f"allocator: expected {c.num_blocks} blocks of {c.block_size} tokens (the cache's), got "
                         f"{allocator.num_blocks} of {allocator.block_size}")
    _bool("adopt_scales", adopt_scales)
    src = check_peer("src", src, group)
    dev = comm_device(group, cache.device)
    got = _recv_header(src, group, dev)
    mine = _block_header(cache, 0)
    fields = (W.F_MAGIC, W.F_KIND, W.F_KV_DTYPE, W.F_LAYOUT, W.F_DTYPE, W.F_LAYERS, W.F_HEADS, W.F_HEAD_DIM,
              W.F_BLOCK_SIZE)
    _reject_first(got, {f: mine[f] for f in fields}, src, group, dev, "blocks")
    n = got[W.F_COUNT]
    sizes = _block_header(cache, n) if n >= 0 else mine
    _reject_first(got, {f: sizes[f] for f in (W.F_COUNT, W.F_NBYTES, W.F_DATA, W.F_PARAMS, W.F_SCALES)}, src,
                  group, dev, "blocks")
    ids = allocator.allocate(n) if n else []
    if ids is None:
        _answer(W.NO_ROOM, W.F_COUNT, allocator.num_free_blocks, src, group, dev)
        return None
    try:
        _answer(W.ACCEPT, 0, 0, src, group, dev)
        if not n:
            return []
        payload = _recv_payload(got, src, group, dev, cache.device, "blocks")
        d, p, s = _parts(payload, cache, n)
        if s is not None and not adopt_scales and not torch.equal(s.view(torch.int32),
                                                                  cache.kv_scales.contiguous().view(torch.int32)):
            raise ValueError(f"src: rank {src} sent fp8 blocks with K / V scales {s.tolist()}, this cache has "
                             f"{cache.kv_scales.tolist()} (pass adopt_scales=True to take the sender's)")
        idx = torch.tensor(ids, dtype=torch.int64, device=cache.device)
        _wide(cache.buffer).index_copy_(1, idx, d)
        if p is not None:
            _wide(cache.params_buffer).index_copy_(1, idx, p)  # type: ignore[arg-type]
        if s is not None and adopt_scales:
            cache.kv_scales.copy_(s)
    except BaseException:
        allocator.free(ids)
        raise
    return ids


# ------------------------------------------------------------------------------------------------ snapshots


def send_snapshot(
    snapshot: KVSnapshot,
    dst: int,
    group: dist.ProcessGroup | None = None,
    *,
    checksum: bool = True,
) -> None:
    """Send a :class:`~kvcache.KVSnapshot` (every layer, one payload) to rank ``dst``, which calls
    :func:`recv_snapshot`.

    Parameters
    ----------
    snapshot : KVSnapshot
        Layers ``[2, H_i, seq_len, D_i]`` (float16 / bfloat16 / float8_e4m3fn), packed or not.
    dst : int
        Global rank of the receiver.
    group : ProcessGroup, optional
        Default: the world (NCCL for CUDA snapshots, gloo for host ones or through the host).
    checksum : bool
        Send a checksum of the payload, checked on arrival.

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
    dst = check_peer("dst", dst, group)
    dev = comm_device(group, snapshot.device)
    L = snapshot.num_layers
    specs = 16 * L
    data = snapshot.nbytes
    total = W.align(W.align(specs) + data, W.CHUNK)
    h = W.new_header(W.KIND_SNAPSHOT)
    h[W.F_DTYPE], h[W.F_LAYERS], h[W.F_COUNT] = W.DTYPE_CODES[snapshot.dtype], L, snapshot.seq_len
    h[W.F_NBYTES], h[W.F_DATA], h[W.F_SPECS] = total, data, specs
    payload = torch.empty(total, dtype=torch.uint8, device=snapshot.device)
    payload[:specs].view(torch.int64).copy_(torch.tensor(snapshot.layer_specs, dtype=torch.int64).view(-1))
    off = W.align(specs)
    if snapshot.flat is not None:
        payload[off:off + data].copy_(as_bytes(snapshot.flat))
    else:
        pos = off
        for t in snapshot.layers:
            nb = t.numel() * t.element_size()
            payload[pos:pos + nb].copy_(as_bytes(t))
            pos += nb
    _zero_gaps(payload, [(0, specs), (off, off + data)])
    csum = W.checksum(payload) if checksum else None
    _send_with_answer(h, csum, payload, dst, group, dev, "snapshot")


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
        Packed (one buffer), bit-exact copy of the sender's.

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
    dev = comm_device(group, torch.device(device) if device is not None else torch.device("cpu"))
    device = dev if device is None else torch.device(device)
    got = _recv_header(src, group, dev)
    expect = {W.F_MAGIC: W.MAGIC, W.F_KIND: W.KIND_SNAPSHOT}
    if dtype is not None:
        expect[W.F_DTYPE] = W.DTYPE_CODES[dtype]
    if specs_want is not None:
        expect[W.F_LAYERS] = len(specs_want)
    if seq_len is not None:
        expect[W.F_COUNT] = seq_len
    _reject_first(got, expect, src, group, dev, "a snapshot")
    L, s_len, specs_b, data_b = got[W.F_LAYERS], got[W.F_COUNT], got[W.F_SPECS], got[W.F_DATA]
    if got[W.F_DTYPE] not in W.DECODE[W.F_DTYPE] or L < 1 or specs_b != 16 * L or got[W.F_NBYTES] != W.align(
            W.align(specs_b) + data_b, W.CHUNK):
        _answer(W.REJECT, W.F_NBYTES, -1, src, group, dev)
        raise ValueError(f"src: rank {src} sent an inconsistent snapshot header {got[:W.F_HAS_SUM]}")
    _answer(W.ACCEPT, 0, 0, src, group, dev)
    payload = _recv_payload(got, src, group, dev, device, "snapshot")
    specs = [tuple(x) for x in payload[:specs_b].view(torch.int64).view(L, 2).tolist()]
    if specs_want is not None and specs != specs_want:
        raise ValueError(f"layer_specs: expected {specs_want}, rank {src} sent {specs}")
    dt = W.DECODE[W.F_DTYPE][got[W.F_DTYPE]]
    elt = torch.empty((), dtype=dt).element_size()
    if any(h < 1 or d < 1 for h, d in specs) or sum(2 * h * s_len * d for h, d in specs) * elt != data_b:
        raise ValueError(f"src: rank {src} sent layer specs {specs} that do not match its {data_b} data bytes")
    layers, pos = [], W.align(specs_b)
    for h, d in specs:
        nb = 2 * h * s_len * d * elt
        layers.append(payload[pos:pos + nb].view(dt).view(2, h, s_len, d))
        pos += nb
    return KVSnapshot(layers)
