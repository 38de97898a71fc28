"""Batch compaction machinery behind :mod:`kvcache.ops.compact`: the Triton kernels, their launchers (no
validation: callers validated) and the pure-torch references.

Why the in-place walk of the kernels is race-free, and how they bound the inputs they read from device memory,
is argued in the module docstring of :mod:`kvcache.ops.compact`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton.language as tl

from .._backend import kernel, use_triton
from .._validate import cdiv, next_pow2, vec_elems
from ._layers import LayerTable
from .lengths import compaction_moves

__all__ = [
    "compact_slots_strided",
    "compact_slots_table",
    "compact_kv_layer_reference",
    "compact_batch_reference",
]

_MAX_BLOCK = 4096


def _block(n: int) -> int:
    return min(_MAX_BLOCK, max(128, next_pow2(n)))


# --------------------------------------------------------------------------------------------------------
# kernels


@kernel(ints=("old_active", "new_active", "src_layer_stride", "src_row_stride", "src_batch_stride",
              "dst_layer_stride", "dst_row_stride", "dst_batch_stride", "token_elems", "max_tokens", "row_vecs"))
def _compact_strided_kernel(
    src,  # bits
    dst,  # bits (src itself when IN_PLACE)
    mapping,  # int32 [>= old_active]
    lengths,  # int32 [>= old_active] when HAS_LENGTHS
    old_active,
    new_active,
    src_layer_stride,
    src_row_stride,
    src_batch_stride,
    dst_layer_stride,
    dst_row_stride,
    dst_batch_stride,
    token_elems,  # elements per token (head_dim) when HAS_LENGTHS
    max_tokens,  # tokens a row holds (lengths are clamped to [0, max_tokens]) when HAS_LENGTHS
    row_vecs,  # elements per row divided by VEC, when not HAS_LENGTHS (a product proves divisibility)
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    IN_PLACE: tl.constexpr,
):
    # grid: (cdiv(max row elements, BLOCK), rows per layer, layers)
    # row (l, r) of slot b: l * layer_stride + r * row_stride + b * batch_stride; valid elements:
    # clamp(lengths[b], 0, max_tokens) * token_elems (HAS_LENGTHS) or row_vecs * VEC. Walks old slots in
    # ascending order; in place it applies only j <= i above every earlier applied j (module doc of
    # kvcache.ops.compact).
    chunk = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)
    start = chunk * BLOCK
    offs = start + tl.arange(0, BLOCK)
    src_row = layer * src_layer_stride + r * src_row_stride
    dst_row = layer * dst_layer_stride + r * dst_row_stride
    zero = layer * 0  # int64 zero: slot offsets are computed in 64 bits
    running = new_active * 0 - 1  # largest applied mapping value so far (int32)
    for i in range(0, old_active):
        j = tl.load(mapping + i)
        if HAS_LENGTHS:
            held = tl.minimum(tl.maximum(tl.load(lengths + i), 0), max_tokens)
            n = held.to(tl.int64) * token_elems
        else:
            n = row_vecs * VEC
        move = (j >= 0) & (j < new_active) & (start < n)
        if IN_PLACE:
            valid = (j >= 0) & (j < new_active) & (j <= i) & (j > running)
            running = tl.where(valid, j, running)
            move = move & valid & (j < i)
        if move:
            mask = offs < tl.multiple_of(n, VEC)
            s = tl.multiple_of(src_row + (zero + i) * src_batch_stride, VEC)
            d = tl.multiple_of(dst_row + j.to(tl.int64) * dst_batch_stride, VEC)
            x = tl.load(src + s + offs, mask=mask)
            tl.store(dst + d + offs, x, mask=mask)


@kernel(ints=("old_active", "new_active"))
def _compact_table_kernel(
    data,  # bits of the first layer (table offsets are relative to it)
    table,  # int64 [L, 8], see kvcache.ops._layers
    mapping,  # int32 [>= old_active]
    lengths,  # int32 [>= old_active]
    old_active,
    new_active,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
):
    # grid: (cdiv(max S_i * D_i, BLOCK), max 2 * H_i, L); in place, ascending old slots, j <= i above every
    # earlier applied j, lengths clamped to [0, S_i] (module doc of kvcache.ops.compact).
    chunk = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)
    row = table + layer * 8
    rows = tl.load(row + 3)
    if r < rows:
        layer_off = tl.load(row + 0)
        batch_stride = tl.load(row + 1)
        row_elems = tl.load(row + 2)  # S_i * D_i
        row_start = layer_off + r * row_elems
        head_dim = tl.load(row + 4)
        start = chunk * BLOCK
        offs = start + tl.arange(0, BLOCK)
        running = new_active * 0 - 1  # largest applied mapping value so far (int32)
        for i in range(0, old_active):
            j = tl.load(mapping + i)
            n = tl.minimum(tl.maximum(tl.load(lengths + i), 0).to(tl.int64) * head_dim, row_elems)
            valid = (j >= 0) & (j <= i) & (j < new_active) & (j > running)
            running = tl.where(valid, j, running)
            if valid & (j < i) & (start < n):
                mask = offs < tl.multiple_of(n, VEC)
                s = tl.multiple_of(row_start + (layer * 0 + i) * batch_stride, VEC)
                d = tl.multiple_of(row_start + j.to(tl.int64) * batch_stride, VEC)
                x = tl.load(data + s + offs, mask=mask)
                tl.store(data + d + offs, x, mask=mask)


# --------------------------------------------------------------------------------------------------------
# launchers (no validation: callers validated)


def compact_slots_strided(
    src: torch.Tensor,
    dst: torch.Tensor,
    batch_mapping: torch.Tensor,
    lengths: torch.Tensor | None,
    old_active: int,
    new_active: int,
    *,
    num_layers: int,
    rows: int,
    row_capacity: int,
    src_strides: tuple[int, int, int],
    dst_strides: tuple[int, int, int],
    token_elems: int = 1,
) -> None:
    """Launch the strided compaction. ``*_strides`` are (layer, row, batch) element strides; a row holds
    ``row_capacity`` elements, of which ``clamp(lengths[b], 0, row_capacity // token_elems) * token_elems``
    (or all, without lengths) are copied."""
    if old_active == 0 or row_capacity == 0:
        return
    in_place = src.data_ptr() == dst.data_ptr()
    sb, db = src, dst
    if not use_triton(src.device):
        s_flat, d_flat = sb.reshape(-1), db.reshape(-1)
        lens = lengths[:old_active].tolist() if lengths is not None else None
        max_tokens = row_capacity // token_elems
        for i, j in compaction_moves(batch_mapping, old_active, new_active, in_place):
            n = min(max(lens[i], 0), max_tokens) * token_elems if lens is not None else row_capacity
            if i == j:
                continue
            for layer in range(num_layers):
                for r in range(rows):
                    a = layer * src_strides[0] + r * src_strides[1] + i * src_strides[2]
                    b = layer * dst_strides[0] + r * dst_strides[1] + j * dst_strides[2]
                    d_flat[b : b + n].copy_(s_flat[a : a + n])
        return
    row_unit = token_elems if lengths is not None else row_capacity
    vec = vec_elems(src.element_size(), [*src_strides, *dst_strides, row_unit])
    block = _block(row_capacity)
    _compact_strided_kernel.launch(
        src.device,
        (cdiv(row_capacity, block), rows, num_layers),
        sb,
        db,
        batch_mapping,
        lengths if lengths is not None else batch_mapping,
        old_active,
        new_active,
        *src_strides,
        *dst_strides,
        token_elems,
        row_capacity // token_elems,
        row_capacity // vec,
        BLOCK=block,
        VEC=vec,
        HAS_LENGTHS=lengths is not None,
        IN_PLACE=in_place,
    )


def compact_slots_table(
    layers: Sequence[torch.Tensor],
    table: LayerTable | None,
    batch_mapping: torch.Tensor,
    lengths: torch.Tensor,
    old_active: int,
    new_active: int,
) -> None:
    """Launch the table-driven in-place compaction of KV layers ``[B, 2, H_i, S_i, D_i]``."""
    if old_active == 0:
        return
    if not use_triton(layers[0].device):
        for layer in layers:
            compact_kv_layer_reference(layer, batch_mapping, lengths, old_active, new_active)
        return
    assert table is not None
    row_capacity = max(int(t.shape[3]) * int(t.shape[4]) for t in layers)
    block = _block(row_capacity)
    _compact_table_kernel.launch(
        layers[0].device,
        (cdiv(row_capacity, block), table.max_rows, table.num_layers),
        layers[0],
        table.table,
        batch_mapping,
        lengths,
        old_active,
        new_active,
        BLOCK=block,
        VEC=table.vec,
    )


# --------------------------------------------------------------------------------------------------------
# references


def compact_kv_layer_reference(
    layer: torch.Tensor, batch_mapping: torch.Tensor, lengths: torch.Tensor, old_active: int, new_active: int
) -> None:
    """Pure-torch reference of the data part of :func:`~kvcache.ops.compact_kv_layer` (in place, ascending order)."""
    lens = lengths[:old_active].tolist()
    s = layer.shape[3]
    for i, j in compaction_moves(batch_mapping, old_active, new_active):
        n = min(max(lens[i], 0), s)  # never Python's negative indexing on a device value
        if i != j:
            layer[j, :, :, :n] = layer[i, :, :, :n]


def compact_batch_reference(
    src: torch.Tensor, batch_mapping: torch.Tensor, dst: torch.Tensor, old_active: int, new_active: int
) -> None:
    """Pure-torch reference of :func:`~kvcache.ops.compact_batch`."""
    in_place = src.data_ptr() == dst.data_ptr()
    for i, j in compaction_moves(batch_mapping, old_active, new_active, in_place):
        if i != j or not in_place:
            dst[j] = src[i]
