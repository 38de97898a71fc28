"""Save / restore of one batch slot's prefix (TensorRT Edge-LLM ``saveKVCache*`` / ``instantiateKVCache*``).

A layer ``[B, 2, H, S, D]`` holds, for slot ``b``, ``2 * H`` rows of ``S * D`` contiguous elements; the first
``s`` tokens of a row are ``s * D`` contiguous elements. Saving copies those row prefixes into a snapshot
``[2, H, s, D]`` (``2 * H`` rows of ``s * D`` elements); restoring copies them back. The kernels therefore
copy flat row prefixes: any head_dim, any head count, any dtype (bits are moved, never values), and one
launch for any number of layers even when head counts, max lengths and head sizes differ.

Kernels
-------
``_copy_strided_kernel``: layers that are equally shaped slices of one tensor (one layer, or
``LinearKVCache.buffer``), addressed by strides. ``_copy_table_kernel``: layers of any shapes, addressed by
a per-layer table (:mod:`kvcache.ops._layers`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton.language as tl

from .._backend import kernel, use_triton
from .._validate import (
    cdiv,
    check_contiguous,
    check_device,
    check_int,
    check_same_dtype,
    check_shape,
    check_tensor,
    fmt_shape,
    next_pow2,
    vec_elems,
)
from ._layers import LayerTable, TableMemo, check_kv_layer, check_kv_layers

__all__ = [
    "save_kv_layer",
    "restore_kv_layer",
    "save_kv_layers",
    "restore_kv_layers",
    "save_kv_layer_reference",
    "restore_kv_layer_reference",
    "copy_slot_strided",
    "copy_slot_table",
]

_MAX_BLOCK = 4096  # elements per program: 8 KiB of fp16


def _block(n: int) -> int:
    return min(_MAX_BLOCK, max(128, next_pow2(n)))


@kernel(ints=("src_off", "dst_off", "src_layer_stride", "src_row_stride", "dst_layer_stride",
              "dst_row_stride", "n_vecs"))
def _copy_strided_kernel(
    src,  # source tensor (any dtype: values are moved by load/store, never converted)
    dst,  # destination tensor, same dtype
    src_off,  # element offset of (layer 0, row 0) of the source slot (batch offset included)
    dst_off,
    src_layer_stride,
    src_row_stride,
    dst_layer_stride,
    dst_row_stride,
    n_vecs,  # elements to copy per row (seq_len * head_dim) divided by VEC
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
):
    # grid: (cdiv(n, BLOCK), rows per layer = 2 * H, layers)
    # row (l, r) of src starts at src_off + l * src_layer_stride + r * src_row_stride; n contiguous elements.
    chunk = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)
    # n is passed divided by VEC: a product with the constexpr proves the divisibility to the compiler
    # (tl.multiple_of on a kernel argument is dropped), so masked loads and stores stay 16 bytes wide.
    n = n_vecs * VEC
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.multiple_of(src_off + layer * src_layer_stride + r * src_row_stride, VEC)
    d = tl.multiple_of(dst_off + layer * dst_layer_stride + r * dst_row_stride, VEC)
    x = tl.load(src + s + offs, mask=mask)
    tl.store(dst + d + offs, x, mask=mask)


@kernel(ints=("batch_idx", "seq_len"))
def _copy_table_kernel(
    cache,  # first cache layer (table offsets are relative to it)
    snap,  # first snapshot layer
    table,  # int64 [L, 8], see kvcache.ops._layers
    batch_idx,
    seq_len,
    SAVE: tl.constexpr,  # True: cache -> snapshot; False: snapshot -> cache
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
):
    # grid: (cdiv(seq_len * max head_dim, BLOCK), max 2 * H_i, L)
    chunk = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)
    row = table + layer * 8
    rows = tl.load(row + 3)
    head_dim = tl.load(row + 4)
    n = tl.multiple_of(seq_len * head_dim, VEC)
    start = chunk * BLOCK
    if (r < rows) & (start < n):
        c = tl.load(row + 0) + batch_idx * tl.load(row + 1) + r * tl.load(row + 2)
        c = tl.multiple_of(c, VEC)
        s = tl.multiple_of(tl.load(row + 5) + seq_len * tl.load(row + 6) + r * n, VEC)
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        if SAVE:
            x = tl.load(cache + c + offs, mask=mask)
            tl.store(snap + s + offs, x, mask=mask)
        else:
            x = tl.load(snap + s + offs, mask=mask)
            tl.store(cache + c + offs, x, mask=mask)


def copy_slot_strided(
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    num_layers: int,
    rows: int,
    n: int,
    src_off: int,
    dst_off: int,
    src_layer_stride: int,
    src_row_stride: int,
    dst_layer_stride: int,
    dst_row_stride: int,
) -> None:
    """Launcher of the strided row-prefix copy (no validation: callers validated). Bits are copied."""
    if n == 0 or num_layers == 0 or rows == 0:
        return
    sb, db = src, dst
    if not use_triton(src.device):
        s = sb.reshape(-1)
        d = db.reshape(-1)
        for layer in range(num_layers):
            for r in range(rows):
                a = src_off + layer * src_layer_stride + r * src_row_stride
                b = dst_off + layer * dst_layer_stride + r * dst_row_stride
                d[b : b + n].copy_(s[a : a + n])
        return
    vec = vec_elems(
        src.element_size(),
        [n, src_off, dst_off, src_layer_stride, src_row_stride, dst_layer_stride, dst_row_stride],
    )
    block = _block(n)
    _copy_strided_kernel.launch(
        src.device,
        (cdiv(n, block), rows, num_layers),
        sb,
        db,
        src_off,
        dst_off,
        src_layer_stride,
        src_row_stride,
        dst_layer_stride,
        dst_row_stride,
        n // vec,
        BLOCK=block,
        VEC=vec,
    )


def copy_slot_table(
    cache_base: torch.Tensor,
    snap_base: torch.Tensor,
    table: LayerTable,
    batch_idx: int,
    seq_len: int,
    *,
    save: bool,
    cache_layers: Sequence[torch.Tensor],
    snap_layers: Sequence[torch.Tensor],
) -> None:
    """Launcher of the table-driven row-prefix copy (no validation: callers validated)."""
    if seq_len == 0:
        return
    if not use_triton(cache_base.device):
        for c, s in zip(cache_layers, snap_layers):
            if save:
                s.copy_(c[batch_idx, :, :, :seq_len])
            else:
                c[batch_idx, :, :, :seq_len].copy_(s)
        return
    n_max = seq_len * table.max_head_dim
    block = _block(n_max)
    _copy_table_kernel.launch(
        cache_base.device,
        (cdiv(n_max, block), table.max_rows, table.num_layers),
        cache_base,
        snap_base,
        table.table,
        batch_idx,
        seq_len,
        SAVE=save,
        BLOCK=block,
        VEC=table.vec,
    )


def save_kv_layer_reference(src: torch.Tensor, dst: torch.Tensor, batch_idx: int) -> None:
    """Pure-torch reference of :func:`save_kv_layer`."""
    dst.copy_(src[batch_idx, :, :, : dst.shape[2]])


def restore_kv_layer_reference(src: torch.Tensor, dst: torch.Tensor, batch_idx: int) -> None:
    """Pure-torch reference of :func:`restore_kv_layer`."""
    dst[batch_idx, :, :, : src.shape[2]].copy_(src)


def _check_slot_pair(layer_name: str, layer: torch.Tensor, snap_name: str, snap: torch.Tensor) -> int:
    """Validate a layer ``[B, 2, H, S, D]`` against its saved prefix ``[2, H, s, D]``; returns ``s``."""
    if not isinstance(snap, torch.Tensor):
        check_tensor(snap_name, snap)
    shape = snap.shape
    _, _, h, s_max, d = layer.shape
    if len(shape) != 4 or shape[0] != 2 or shape[1] != h or shape[3] != d or shape[2] > s_max:
        raise ValueError(
            f"{snap_name}: expected shape [2, {h}, s, {d}] with s <= {s_max} (from {layer_name} "
            f"{fmt_shape(layer.shape)}), got {fmt_shape(shape)}"
        )
    if snap.dtype != layer.dtype:
        check_same_dtype(snap_name, snap, layer_name, layer)
    if snap.device != layer.device:
        check_device(snap_name, snap, layer.device, layer_name)
    if not snap.is_contiguous():
        check_contiguous(snap_name, snap)
    a0, b0 = layer.data_ptr(), snap.data_ptr()
    elt = layer.element_size()
    if a0 < b0 + snap.numel() * elt and b0 < a0 + layer.numel() * elt and snap.numel():
        raise ValueError(f"{snap_name}: must not overlap {layer_name} in memory")
    return shape[2]


def save_kv_layer(src: torch.Tensor, dst: torch.Tensor, batch_idx: int) -> None:
    """Copy the first ``s`` tokens of slot ``batch_idx`` of one layer into ``dst``.

    Parameters
    ----------
    src : torch.Tensor
        shape ``[B, 2, H, S, D]``, dtype float16 / bfloat16 / float8_e4m3fn, contiguous.
    dst : torch.Tensor
        shape ``[2, H, s, D]`` with ``s <= S``, same dtype and device, contiguous. Written.
    batch_idx : int
        ``0 <= batch_idx < B``.

    Note
    ----
    One launch, no allocation, no host sync (CUDA-graph capturable). Bits are copied exactly.
    """
    check_kv_layer("src", src)
    s = _check_slot_pair("src", src, "dst", dst)
    check_int("batch_idx", batch_idx, 0, src.shape[0] - 1)
    b, _, h, s_max, d = src.shape
    copy_slot_strided(
        src, dst, num_layers=1, rows=2 * h, n=s * d, src_off=batch_idx * 2 * h * s_max * d, dst_off=0,
        src_layer_stride=0, src_row_stride=s_max * d, dst_layer_stride=0, dst_row_stride=s * d,
    )


def restore_kv_layer(src: torch.Tensor, dst: torch.Tensor, batch_idx: int) -> None:
    """Copy a saved prefix ``src`` into the first ``s`` tokens of slot ``batch_idx`` of one layer.

    Parameters
    ----------
    src : torch.Tensor
        shape ``[2, H, s, D]``, dtype float16 / bfloat16 / float8_e4m3fn, contiguous.
    dst : torch.Tensor
        shape ``[B, 2, H, S, D]`` with ``S >= s``, same dtype and device, contiguous. Tokens ``>= s`` of the
        slot and every other slot are left untouched.
    batch_idx : int
        ``0 <= batch_idx < B``.

    Note
    ----
    Lengths are not changed: after restoring ``N`` tokens, call
    ``cache.reset_for_new_sequences([N - 1, ...])`` and prefill from token ``N - 1`` so that the last prompt
    token's logits are recomputed. One launch, no allocation, no host sync.
    """
    check_kv_layer("dst", dst)
    s = _check_slot_pair("dst", dst, "src", src)
    check_int("batch_idx", batch_idx, 0, dst.shape[0] - 1)
    b, _, h, s_max, d = dst.shape
    copy_slot_strided(
        src, dst, num_layers=1, rows=2 * h, n=s * d, src_off=0, dst_off=batch_idx * 2 * h * s_max * d,
        src_layer_stride=0, src_row_stride=s * d, dst_layer_stride=0, dst_row_stride=s_max * d,
    )


_TABLES = TableMemo()


def _check_layer_lists(
    cache_name: str, cache: object, snap_name: str, snap: object, batch_idx: object, seq_len: object
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    layers = check_kv_layers(cache_name, cache)
    if isinstance(snap, torch.Tensor) or not isinstance(snap, Sequence):
        raise TypeError(f"{snap_name}: expected a list of tensors [2, H_i, seq_len, D_i], got {type(snap).__name__}")
    if len(snap) != len(layers):
        raise ValueError(
            f"{snap_name}: expected {len(layers)} tensors (one per layer of {cache_name}), got {len(snap)}"
        )
    check_int("batch_idx", batch_idx, 0, layers[0].shape[0] - 1)
    max_s = min(t.shape[3] for t in layers)
    check_int("seq_len", seq_len, 0, max_s)
    snaps = list(snap)
    for i, (layer, t) in enumerate(zip(layers, snaps)):
        check_tensor(f"{snap_name}[{i}]", t)
        check_shape(f"{snap_name}[{i}]", t, (2, layer.shape[2], seq_len, layer.shape[4]))
        check_same_dtype(f"{snap_name}[{i}]", t, f"{cache_name}[{i}]", layer)
        check_device(f"{snap_name}[{i}]", t, layer.device, f"{cache_name}[{i}]")
        check_contiguous(f"{snap_name}[{i}]", t)
    _check_no_overlap(cache_name, layers, snap_name, snaps)
    return layers, snaps


def _check_no_overlap(
    cache_name: str, layers: Sequence[torch.Tensor], snap_name: str, snaps: Sequence[torch.Tensor]
) -> None:
    """No snapshot tensor may overlap a cache layer or another snapshot tensor (as in :func:`save_kv_layer`).

    A sweep over the byte ranges sorted by start: a range overlaps an earlier one exactly when it starts before
    the largest end seen so far; the largest end is kept per kind, since cache layers may touch each other.
    """
    spans = []
    for kind, name, ts in ((0, cache_name, layers), (1, snap_name, snaps)):
        for i, t in enumerate(ts):
            if t.numel():
                a = t.data_ptr()
                spans.append((a, a + t.numel() * t.element_size(), kind, f"{name}[{i}]"))
    spans.sort(key=lambda x: (x[0], x[2]))
    reach = [(0, ""), (0, "")]  # per kind: (largest end so far, its tensor's name)
    for a, b, kind, name in spans:
        for other in ((0, 1) if kind == 1 else (1,)):
            end, owner = reach[other]
            if a < end:
                first, second = (owner, name) if owner.startswith(snap_name) else (name, owner)
                raise ValueError(f"{first}: must not overlap {second} in memory")
        if b > reach[kind][0]:
            reach[kind] = (b, name)


def save_kv_layers(
    src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], batch_idx: int, seq_len: int
) -> None:
    """Save the first ``seq_len`` tokens of slot ``batch_idx`` of every layer, in one launch.

    Parameters
    ----------
    src : list of torch.Tensor
        Layer ``i``: shape ``[B, 2, H_i, S_i, D_i]`` (heads, max length and head size may differ per
        layer), one dtype (float16 / bfloat16 / float8_e4m3fn), one device, contiguous.
    dst : list of torch.Tensor
        Layer ``i``: shape ``[2, H_i, seq_len, D_i]``, same dtype and device, contiguous. Written.
    batch_idx : int
        ``0 <= batch_idx < B``.
    seq_len : int
        ``0 <= seq_len <= min(S_i)``.

    Note
    ----
    One kernel launch for all layers. The per-layer address table is built on the first call with a given
    set of tensors and reused after (capturable in a CUDA graph from the second call on); the caches keep
    their tables from construction.
    """
    layers, snaps = _check_layer_lists("src", src, "dst", dst, batch_idx, seq_len)
    table = _TABLES.get(layers, snaps) if use_triton(layers[0].device) else None
    copy_slot_table(layers[0], snaps[0], table, batch_idx, seq_len, save=True,  # type: ignore[arg-type]
                    cache_layers=layers, snap_layers=snaps)


def restore_kv_layers(
    src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], batch_idx: int, seq_len: int
) -> None:
    """Restore saved prefixes ``src`` into the first ``seq_len`` tokens of slot ``batch_idx``, one launch.

    Parameters
    ----------
    src : list of torch.Tensor
        Layer ``i``: shape ``[2, H_i, seq_len, D_i]``, contiguous.
    dst : list of torch.Tensor
        Layer ``i``: shape ``[B, 2, H_i, S_i, D_i]``, one dtype and device, contiguous. Only the first
        ``seq_len`` tokens of slot ``batch_idx`` are written.
    batch_idx, seq_len : int
        As in :func:`save_kv_layers`.
    """
    layers, snaps = _check_layer_lists("dst", dst, "src", src, batch_idx, seq_len)
    table = _TABLES.get(layers, snaps) if use_triton(layers[0].device) else None
    copy_slot_table(layers[0], snaps[0], table, batch_idx, seq_len, save=False,  # type: ignore[arg-type]
                    cache_layers=layers, snap_layers=snaps)
