"""Swapping blocks to page-locked host memory and back (preemption by swap): :class:`SwappedBlocks` and the
copies behind ``PagedKVCache.swap_out`` / ``swap_in``."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .cache import PagedKVCache

__all__ = ["SwappedBlocks", "swap_out", "swap_in"]


@dataclasses.dataclass
class SwappedBlocks:
    """Blocks copied to page-locked host memory by :meth:`PagedKVCache.swap_out`.

    ``data`` ``[n, L, *block]`` (and ``params`` for int8 / int4 / k8v4 / fp8k) hold the blocks in the order given;
    ``event`` completes when the copy has (wait on it, or pass the object to ``swap_in``, which orders itself
    after it on the device).
    """

    data: torch.Tensor
    params: torch.Tensor | None
    event: torch.cuda.Event | None
    # (kv_dtype, layout, num_kv_heads, head_dim, block_size, num_layers) of the cache the blocks came from: swap_in
    # takes them only into a cache of the same format (None: not recorded, checked by shape and dtype alone)
    layout_key: tuple | None = None

    @property
    def num_blocks(self) -> int:
        """Number of blocks held (``data.shape[0]``)."""
        return self.data.shape[0]

    def synchronize(self) -> None:
        """Block the host until the copy to host memory has completed (no-op on the CPU)."""
        if self.event is not None:
            self.event.synchronize()


def swap_out(cache: PagedKVCache, ids: torch.Tensor, *, stream: torch.cuda.Stream | None = None,
             pin_memory: bool = True) -> SwappedBlocks:
    """Copy blocks of every layer to page-locked host memory, asynchronously on ``stream``.

    The blocks are gathered on the device (``index_select``) and copied with one non-blocking transfer;
    the returned :class:`SwappedBlocks` records an event when done. The device blocks may be reused
    once ``stream`` has passed that point (the caller orders later writes after it).

    Returns :class:`SwappedBlocks`: ``data`` ``[n, L, *block]`` in the storage dtype (a block of
    ``pool(layer)`` per layer), ``params`` float32 ``[n, L, *param_block]`` for int8 / int4 / k8v4 / fp8k (else None),
    in the order of ``ids`` (int64 ``[n]``, validated block ids).
    """
    ids = ids.to(cache.device)
    cuda = cache.device.type == "cuda"
    ctx = torch.cuda.stream(stream) if (cuda and stream is not None) else contextlib.nullcontext()
    with ctx:
        if cuda and stream is not None:
            stream.wait_stream(torch.cuda.current_stream(cache.device))
        data = cache.buffer.index_select(1, ids).transpose(0, 1).contiguous()
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=pin_memory and cuda)
        host.copy_(data, non_blocking=cuda)
        hparams = None
        if cache.params_buffer is not None:
            p = cache.params_buffer.index_select(1, ids).transpose(0, 1).contiguous()
            hparams = torch.empty(p.shape, dtype=p.dtype, pin_memory=pin_memory and cuda)
            hparams.copy_(p, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
            data.record_stream(torch.cuda.current_stream(cache.device))
    return SwappedBlocks(host, hparams, event, cache.swap_key())

def swap_in(cache: PagedKVCache, swapped: SwappedBlocks, ids: torch.Tensor, *,
            stream: torch.cuda.Stream | None = None) -> None:
    """Copy swapped-out blocks back into blocks ``block_ids`` of every layer, asynchronously on
    ``stream`` (after the swap-out's event).

    ``swapped``: from :meth:`swap_out` of a cache of the same format (kv_dtype, layout, heads, head_dim,
    block size, layers): ``data`` ``[n, L, *block]`` in the storage dtype, ``params`` float32 ``[n, L,
    *param_block]`` for int8 / int4 / k8v4 / fp8k (else None). ``ids``: int64 ``[n]`` block ids in ``[0,
    num_blocks)`` (validated by the cache), distinct.
    Anything else raises ValueError before a byte is copied."""
    if ids.shape[0] != swapped.num_blocks:
        raise ValueError(f"block_ids: expected {swapped.num_blocks} ids (the swapped blocks), got {ids.shape[0]}")
    if len(set(ids.tolist())) != ids.shape[0]:
        raise ValueError(f"block_ids: expected distinct block ids, got {ids.tolist()[:8]}")
    if swapped.layout_key is not None and swapped.layout_key != cache.swap_key():
        raise ValueError(f"swapped: blocks of another cache format (kv_dtype, layout, num_kv_heads, head_dim, "
                         f"block_size, num_layers) {swapped.layout_key}, expected {cache.swap_key()}")
    shape = (cache.buffer.shape[0], *cache.buffer.shape[2:])
    if not isinstance(swapped.data, torch.Tensor) or swapped.data.dtype != cache.buffer.dtype or tuple(
            swapped.data.shape[1:]) != shape:
        got = (f"{swapped.data.dtype} {list(swapped.data.shape)}" if isinstance(swapped.data, torch.Tensor)
               else type(swapped.data).__name__)
        raise ValueError(f"swapped: expected data {cache.buffer.dtype} [n, {', '.join(map(str, shape))}] (blocks "
                         f"of this cache's shape), got {got}")
    if cache.params_buffer is not None:
        pshape = (cache.params_buffer.shape[0], *cache.params_buffer.shape[2:])
        p = swapped.params
        if not isinstance(p, torch.Tensor) or p.dtype != torch.float32 or tuple(p.shape) != (ids.shape[0],
                                                                                          *pshape):
            got = f"{p.dtype} {list(p.shape)}" if isinstance(p, torch.Tensor) else repr(p)
            raise ValueError(f"swapped: expected params float32 [{ids.shape[0]}, {', '.join(map(str, pshape))}] "
                             f"(the blocks' scale / zero), got {got}")
    elif swapped.params is not None:
        raise ValueError("swapped: expected params None (this cache stores no scale / zero)")
    ids = ids.to(cache.device)
    cuda = cache.device.type == "cuda"
    ctx = torch.cuda.stream(stream) if (cuda and stream is not None) else contextlib.nullcontext()
    with ctx:
        if swapped.event is not None:
            torch.cuda.current_stream(cache.device).wait_event(swapped.event)
        data = swapped.data.to(cache.device, non_blocking=cuda).transpose(0, 1)
        if cache.buffer.element_size() == 1 and cache.buffer.is_floating_point():
            # fp8 pools as bytes: index_copy_ has no float8 kernel (CPU or CUDA, torch 2.11)
            cache.buffer.view(torch.uint8).index_copy_(1, ids, data.view(torch.uint8))
        else:
            cache.buffer.index_copy_(1, ids, data)
        if cache.params_buffer is not None:
            p = swapped.params.to(cache.device, non_blocking=cuda).transpose(0, 1)
            cache.params_buffer.index_copy_(1, ids, p)
