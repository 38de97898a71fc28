"""KV transfer between ranks by torch.distributed point-to-point (NCCL on GPUs, gloo on CPUs): paged blocks of
every layer (any kv_dtype; int8 / int4 / k8v4 scale / zero, fp8k key scales and fp8 scales included), for
disaggregated serving (prefill on one rank, decode on another); :mod:`.snapshots` sends :class:`~kvcache.KVSnapshot`
prefixes the same way, with the helpers below.

Each transfer is a header, an answer and the payload in checksummed chunks (see
:mod:`kvcache.distributed.wire`): the receiver checks format and shape against its own before anything moves
and takes its blocks from its own allocator; the sender packs chunk ``i + 1`` while chunk ``i`` travels, the
receiver checks each chunk's checksum on the device and scatters it into the new blocks only if it matches.
Both ranks must call the matching pair (``send_blocks`` / ``recv_blocks``, ``send_snapshot`` /
``recv_snapshot``) in the same order.

Arguments are validated before the first message: a rank that raises there leaves its peer waiting (until the
process group's timeout). After the header, a mismatch raises ValueError on both ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import _validate
from ..ops.paged.format import kv_format
from ..paged import BlockAllocator, PagedKVCache
from . import wire as W
from ._comm import check_peer
from ._kernels import scatter_rows
from ._pipe import Channel, ChunkSender, receive_chunks

__all__ = ["send_blocks", "recv_blocks"]


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


def _chunk_bytes(value: object) -> int | None:
    return None if value is None else _validate.check_int("chunk_bytes", value, 1, W.MAX_CHUNK)


def _wide(pool: torch.Tensor) -> torch.Tensor:
    """``[L, num_blocks, *block]`` pool as ``[L * num_blocks, words]`` rows (row ``l * num_blocks + b``: block
    ``b`` of layer ``l``) of the widest integer dtype dividing a block's bytes: packing and scattering move
    8-byte words where they can, not bytes (several times faster)."""
    b = pool.view(torch.uint8).view(pool.shape[0] * pool.shape[1], -1)
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if b.shape[1] % size == 0:
            return b.view(dt)
    return b


def _pools(cache: PagedKVCache) -> list[torch.Tensor]:
    """The row views (:func:`_wide`) of the data pool and, for int8 / int4 / k8v4 / fp8k, the params pool."""
    return [_wide(cache.buffer)] + ([_wide(cache.params_buffer)] if cache.params_buffer is not None else [])


def _rows_index(cache: PagedKVCache, ids: list[int]) -> torch.Tensor:
    """int64 ``[L * n]``: the pool row of payload row ``l * n + j`` (block ``ids[j]`` of layer ``l``)."""
    idx = torch.tensor(ids, dtype=torch.int64, device=cache.device)
    layers = torch.arange(cache.num_layers, dtype=torch.int64, device=cache.device) * cache.config.num_blocks
    return (layers[:, None] + idx[None, :]).reshape(-1)


def _block_layout(cache: PagedKVCache, n: int, chunk_rows: int | None = None,
                  chunk_bytes: int | None = None) -> W.Layout:
    parts = tuple(p.shape[1] * p.element_size() for p in _pools(cache))
    prefix = cache.num_layers * 2 * 4 if kv_format(cache.config.kv_dtype).per_layer_scale and n else 0
    if chunk_rows is not None:
        return W.Layout(prefix, parts, cache.num_layers * n, max(1, chunk_rows))
    return W.Layout.build(prefix, parts, cache.num_layers * n, chunk_bytes)


def _block_header(cache: PagedKVCache, n: int, layout: W.Layout, checksum: bool) -> list[int]:
    c = cache.config
    h = W.new_header(W.KIND_BLOCKS)
    h[W.F_KV_DTYPE] = W.KV_DTYPE_CODES[c.kv_dtype]
    h[W.F_LAYOUT] = W.LAYOUT_CODES[c.layout]
    h[W.F_DTYPE] = W.DTYPE_CODES[c.dtype]
    h[W.F_LAYERS], h[W.F_HEADS], h[W.F_HEAD_DIM], h[W.F_BLOCK_SIZE] = c.num_layers, c.num_kv_heads, c.head_dim, \
        c.block_size
    h[W.F_COUNT], h[W.F_HAS_SUM] = n, int(checksum)
    h[W.F_DATA] = layout.parts[0]
    h[W.F_PARAMS] = layout.parts[1] if len(layout.parts) > 1 else 0
    layout.fields(h)
    return h


def _send(header: list[int], layout: W.Layout, fill, checksum: bool, dst: int,  # type: ignore[no-untyped-def]
          group: dist.ProcessGroup | None, device: torch.device, what: str) -> int:
    """Send the sealed header; pack chunk 0 while the answer travels; on ACCEPT send every chunk. Returns the
    answer's status (ValueError on REJECT)."""
    ch = Channel(group, dst, device)
    sent = ch.isend(torch.tensor(W.seal(header), dtype=torch.int64, device=device))
    ack = ch.ints(W.ACK_LEN)
    answer = ch.irecv(ack)
    sender = ChunkSender(ch, layout, fill, checksum)
    if layout.chunks:
        sender.pack(0)
    answer.wait()
    sent.wait()
    status, field, theirs = ack.tolist()
    if status == W.REJECT:
        if field in (W.F_SEAL_A, W.F_SEAL_B):
            raise ValueError(f"dst: rank {dst} rejected the {what}: the header arrived damaged")
        raise ValueError(f"dst: rank {dst} rejected the {what}: it expects {W.FIELD_NAMES.get(field, field)} "
                         f"{W.describe(field, theirs)}, these have {W.describe(field, header[field])}")
    if status == W.ACCEPT:
        sender.send()
    return status


def _recv_header(ch: Channel, what: str) -> list[int]:
    """The sender's header; REJECT and ValueError if it is of another protocol or arrived damaged."""
    t = ch.ints(W.HEADER_LEN)
    ch.irecv(t).wait()
    got = t.tolist()
    _reject_first(got, {W.F_MAGIC: W.MAGIC}, ch, what)
    if not W.sealed(got):
        _answer(ch, W.REJECT, W.F_SEAL_A, 0)
        raise ValueError(f"src: the header of the {what} from rank {ch.peer} arrived damaged (its checksum "
                         f"differs); nothing was written")
    return got


def _answer(ch: Channel, status: int, field: int, value: int) -> None:
    ch.isend(torch.tensor([status, field, value], dtype=torch.int64, device=ch.work)).wait()


def _reject_first(got: list[int], expect: dict[int, int], ch: Channel, what: str) -> None:
    """Answer REJECT and raise ValueError at the first header field that differs from ``expect``."""
    for field, want in expect.items():
        if got[field] != want:
            _answer(ch, W.REJECT, field, want)
            raise ValueError(f"src: rank {ch.peer} sent {what} with {W.FIELD_NAMES[field]} "
                             f"{W.describe(field, got[field])}, expected {W.describe(field, want)}")


def _expect_layout(got: list[int], layout: W.Layout, ch: Channel, what: str) -> None:
    """REJECT a header whose layout fields are not the ones its own sizes give (an inconsistent sender), or
    whose chunks are larger than :data:`~kvcache.distributed.wire.MAX_CHUNK` plus a row."""
    if layout.chunks and layout.body_bytes(0) > W.MAX_CHUNK + layout.prefix + sum(layout.parts) + 64:
        _reject_first(got, {W.F_CHUNK_ROWS: max(1, W.MAX_CHUNK // max(1, sum(layout.parts)))}, ch, what)
    _reject_first(got, {W.F_PREFIX: layout.prefix, W.F_ROWS: layout.rows, W.F_CHUNKS: layout.chunks,
                        W.F_NBYTES: layout.nbytes}, ch, what)


def _damaged(what: str, src: int, bad: int, layout: W.Layout, after: str) -> ValueError:
    return ValueError(f"src: chunk {bad} of {layout.chunks} of the {what} from rank {src} arrived damaged (its "
                      f"checksum differs from the sender's); {after}")


# ------------------------------------------------------------------------------------------------ blocks


def send_blocks(
    cache: PagedKVCache,
    block_ids: Sequence[int] | torch.Tensor,
    dst: int,
    group: dist.ProcessGroup | None = None,
    *,
    checksum: bool = True,
    chunk_bytes: int | None = None,
) -> bool:
    """Send blocks of every layer of ``cache`` to rank ``dst``, which calls :func:`recv_blocks`.

    The blocks' bytes (data pool, int8 / int4 / k8v4 scale / zero or fp8k key scales, fp8 / fp8k K / V scales) are
    packed on the cache's device chunk by chunk (rows of one block of one layer, layer-major) and sent once the
    receiver has accepted the header; chunk ``i + 1`` is packed and checksummed while chunk ``i`` is on the wire.

    Parameters
    ----------
    cache : PagedKVCache
        The sending cache; the blocks are read, not freed (free them in your allocator once this returns: on
        CUDA the current stream then waits for the sends, so later writes to those blocks are ordered after).
    block_ids : sequence of int or torch.Tensor
        Block ids in ``[0, num_blocks)``, in the order the receiver's new ids will follow.
    dst : int
        Global rank of the receiver.
    group : ProcessGroup, optional
        Default: the world. NCCL for CUDA caches (messages stay on the GPU), gloo for CPU caches (and CUDA
        caches, through host memory).
    checksum : bool
        Send each chunk's checksum (computed on the device, one extra read of the payload on each side),
        checked on arrival before the chunk is written.
    chunk_bytes : int, optional
        Payload bytes per chunk, rounded down to whole rows (one block of one layer; one row at least), at
        most 1 GiB. Default: :func:`kvcache.distributed.wire.default_chunk_bytes` (an eighth of the payload,
        16-64 MiB).

    Returns
    -------
    bool
        True when sent; False when the receiver's allocator had no room (nothing was sent). A damaged chunk
        is reported by the receiver only (no answer comes back after the payload).

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
    chunk = _chunk_bytes(chunk_bytes)
    dst = check_peer("dst", dst, group)
    n = len(ids)
    layout = _block_layout(cache, n, chunk_bytes=chunk)
    pools = _pools(cache)
    rows = _rows_index(cache, ids) if n else None
    L = cache.num_layers

    def fill(c: int, prefix: torch.Tensor | None, parts: list[torch.Tensor]) -> None:
        if prefix is not None:
            prefix.view(torch.float32).view(L, 2).copy_(cache.kv_scales)
        r0, r1 = layout.rows_of(c)
        for pool, part in zip(pools, parts):
            torch.index_select(pool, 0, rows[r0:r1], out=part.view(pool.dtype).view(r1 - r0, pool.shape[1]))

    header = _block_header(cache, n, layout, checksum)
    return _send(header, layout, fill, checksum, dst, group, cache.device, "blocks") == W.ACCEPT


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

    Checked on arrival: the header's own checksum, and the sender's kv_dtype, layout, model dtype, layers, KV
    heads, head_dim and block size must be this cache's (else ValueError here and on the sender, no block
    taken, nothing written); each chunk's checksum, on the device, before that chunk is written (a damaged
    chunk is never written); for fp8, the sender's K / V scales must equal this cache's bit for bit, unless
    ``adopt_scales``.

    After a damaged chunk: ValueError naming the first damaged chunk, raised once every chunk has arrived (the
    ranks stay in step); the new blocks are given back to ``allocator``. The damaged chunks' rows are not
    written; the intact chunks' rows are, into those blocks (free before the call and after it); every block
    allocated before the call, and ``kv_scales``, are unchanged. After different fp8 scales: ValueError, nothing
    written (compared once chunk 0 has arrived: one host sync, fp8 without ``adopt_scales`` only).

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
        fp8 / fp8k only: set this cache's ``kv_scales`` to the sender's instead of requiring them equal (they decode
        every block of a layer: only for a cache whose other blocks do not matter, such as a fresh one). fp8k
        compares and takes ``v_scale`` alone (its keys carry their own scales).

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
    ch = Channel(group, check_peer("src", src, group), cache.device)
    got = _recv_header(ch, "blocks")
    mine = _block_header(cache, 0, _block_layout(cache, 0, chunk_rows=1), True)
    fields = (W.F_KIND, W.F_KV_DTYPE, W.F_LAYOUT, W.F_DTYPE, W.F_LAYERS, W.F_HEADS, W.F_HEAD_DIM, W.F_BLOCK_SIZE,
              W.F_DATA, W.F_PARAMS)
    _reject_first(got, {f: mine[f] for f in fields}, ch, "blocks")
    n = got[W.F_COUNT]
    if n < 0 or n > c.num_blocks:  # more than the whole pool: no room, whatever is free
        _answer(ch, W.NO_ROOM, W.F_COUNT, allocator.num_free_blocks)
        return None
    layout = _block_layout(cache, n, chunk_rows=got[W.F_CHUNK_ROWS])
    _expect_layout(got, layout, ch, "blocks")
    ids = allocator.allocate(n) if n else []
    if ids is None:
        _answer(ch, W.NO_ROOM, W.F_COUNT, allocator.num_free_blocks)
        return None
    try:
        _answer(ch, W.ACCEPT, 0, 0)
        if n:
            _receive_blocks(cache, ch, layout, ids, bool(got[W.F_HAS_SUM]), adopt_scales)
    except BaseException:
        allocator.free(ids)
        raise
    return ids


def _receive_blocks(cache: PagedKVCache, ch: Channel, layout: W.Layout, ids: list[int], checksum: bool,
                    adopt_scales: bool) -> None:
    """Every chunk of an accepted transfer, each scattered into blocks ``ids`` if intact; then the fp8 scales."""
    L = cache.num_layers
    pools = _pools(cache)
    rows = _rows_index(cache, ids)
    scales = torch.empty(L, 2, dtype=torch.float32, device=cache.device) if layout.prefix else None
    used = list(kv_format(cache.config.kv_dtype).layer_scales)  # the scales the blocks decode with
    # fp8 scales that differ from this cache's (compared once chunk 0 is here): nothing is written then
    other_scales: list[list[list[float]]] = []

    def sink(c: int, prefix: torch.Tensor | None, parts: list[torch.Tensor],
             check: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        if prefix is not None and scales is not None:
            scales.copy_(prefix.view(torch.float32).view(L, 2))
            if not adopt_scales and not torch.equal(scales[:, used].contiguous().view(torch.int32),
                                                    cache.kv_scales[:, used].contiguous().view(torch.int32)):
                other_scales.append(scales.tolist())
        if other_scales:
            return
        r0, r1 = layout.rows_of(c)
        for pool, part in zip(pools, parts):
            scatter_rows(part.view(pool.dtype).view(r1 - r0, pool.shape[1]), pool, rows[r0:r1], check)

    bad = receive_chunks(ch, layout, sink, checksum)
    if bad >= 0:
        raise _damaged("blocks", ch.peer, bad, layout, f"it was not written; the {len(ids)} new blocks were given "
                       f"back, blocks in use before this call are unchanged")
    if other_scales:
        raise ValueError(f"src: rank {ch.peer} sent fp8 blocks with K / V scales {other_scales[0]}, this cache "
                         f"has {cache.kv_scales.tolist()} (pass adopt_scales=True to take the sender's); nothing "
                         f"was written")
    if scales is not None and adopt_scales:
        cache.kv_scales[:, used] = scales[:, used]  # a list index: assigned in place (index_put_), not a view


# ------------------------------------------------------------------------------------------------ snapshots
