"""Batch eviction: mapping construction and in-place compaction (TensorRT Edge-LLM ``compact*``).

After some sequences of a running batch finish, the kept ones are moved down so that they occupy slots
``0 .. new_active - 1`` in their original order. ``build_batch_mapping`` makes the mapping
(``mapping[i]`` = new slot of old slot ``i``, or ``-1``); the compaction kernels move the data.

Why in-place compaction is race-free
------------------------------------
Every mapping that :func:`build_batch_mapping` makes is *order-preserving*: kept slots are numbered in
order, so ``mapping[i] <= i`` and ``mapping`` is strictly increasing over kept slots. A program of the
compaction kernels owns one block of element positions (one chunk of one (layer, kv, head) row) and walks
the old slots ``i = 0, 1, ..., old_active - 1`` in ascending order, copying that block of slot ``i`` to slot
``mapping[i]``. Different programs touch disjoint positions, so they never conflict. Inside a program, slot
``j`` is written only at step ``i`` with ``mapping[i] = j``, and ``j = mapping[i] <= i``; if ``j`` is itself a
kept slot that moves, it was read at step ``j < i``, before that write (program order; a compiler may move
a load earlier, never a store earlier than a load it follows). If ``j`` was evicted or never read, nothing
is lost. Loads issued ahead of time only read slots ``> i``, which no step ``<= i`` writes. The same thread
handles the same element positions at every step, so no barrier is needed.

Inputs read from device memory are bounded in the kernels and the references alike, so no input writes
outside the target tensor:

* Entry ``i`` is applied only when ``0 <= j = mapping[i] < new_active`` and, in place, ``j <= i`` and ``j`` is
  larger than every earlier applied ``mapping[i']`` (:func:`~kvcache.ops.lengths.compaction_moves`). A malformed
  mapping passed with ``check=False`` thus moves a well-defined subset (never racing, never writing one slot
  twice), and :func:`~kvcache.ops.compact_lengths` applies the same subset, so lengths describe the data.
  ``check=True`` (syncs) rejects such a mapping with an error instead.
* A length is clamped to ``[0, S]`` (the row's capacity) before it sizes a copy.

The lengths are compacted by a second, single-program launch after the data kernel, because the data
kernel reads ``lengths[i]`` while it runs (compacting them in the same launch is a race).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._backend import use_triton
from .._validate import (
    bits,
    check_bits_dtype,
    check_contiguous,
    check_device,
    check_dtype,
    check_int,
    check_ndim,
    check_same_dtype,
    check_tensor,
    fmt_shape,
)
from ._compact_kernels import (
    compact_batch_reference,
    compact_kv_layer_reference,
    compact_slots_strided,
    compact_slots_table,
)
from ._layers import TableMemo, check_kv_layer, check_kv_layers
from .lengths import _check_lengths_args, compact_lengths
from .mapping import build_batch_mapping, build_batch_mapping_reference, check_batch_mapping

__all__ = [
    "build_batch_mapping",
    "build_batch_mapping_reference",
    "compact_kv_layer",
    "compact_kv_layers",
    "compact_batch",
    "compact_batch_reference",
    "compact_kv_layer_reference",
    "check_batch_mapping",
    "compact_slots_strided",
    "compact_slots_table",
]

# The kernels, their launchers (compact_slots_*) and the references live in kvcache.ops._compact_kernels and
# are re-exported here.


def compact_kv_layer(
    layer: torch.Tensor,
    batch_mapping: torch.Tensor,
    lengths: torch.Tensor,
    old_active: int,
    new_active: int,
    dst_lengths: torch.Tensor | None = None,
    *,
    check: bool = False,
) -> None:
    """Compact one layer in place: slot ``batch_mapping[i]`` receives the first ``lengths[i]`` tokens of
    slot ``i`` for every kept ``i < old_active``.

    Parameters
    ----------
    layer : torch.Tensor
        shape ``[B, 2, H, S, D]``, dtype float16 / bfloat16 / float8_e4m3fn, contiguous. In/out.
    batch_mapping : torch.Tensor
        shape ``[>= old_active]``, dtype int32, same device: new slot of each old slot, ``-1`` = evicted.
    lengths : torch.Tensor
        shape ``[>= old_active]``, dtype int32, same device: tokens held by each old slot (``<= S``).
    old_active, new_active : int
        ``0 <= new_active <= old_active <= B``.
    dst_lengths : torch.Tensor, optional
        shape ``[>= new_active]``, int32. When given, the compacted lengths are written there by a second
        launch after the data kernel; it may be ``lengths`` itself. With a per-layer loop, pass it on the
        **last** layer only (earlier layers must still read the old lengths), or use
        :func:`compact_kv_layers`.
    check : bool
        Debug mode: verify the mapping (syncs) and raise ValueError before writing if it is not
        order-preserving.

    Note
    ----
    Precondition: the mapping is order-preserving, as :func:`build_batch_mapping` makes it; the module
    docstring explains why that makes the in-place walk race-free. Only the valid prefix of each moved slot
    is copied; slots past a length and evicted slots keep stale data. No allocation, no host sync.
    """
    check_kv_layer("layer", layer)
    _check_compaction_args("layer", (layer,), batch_mapping, lengths, old_active, new_active, dst_lengths, check)
    b, _, h, s, d = layer.shape
    compact_slots_strided(
        layer, layer, batch_mapping, lengths, old_active, new_active,
        num_layers=1, rows=2 * h, row_capacity=s * d,
        src_strides=(0, s * d, 2 * h * s * d), dst_strides=(0, s * d, 2 * h * s * d), token_elems=d,
    )
    if dst_lengths is not None:
        compact_lengths(lengths, batch_mapping, old_active, new_active, dst_lengths)


_TABLES = TableMemo()


def compact_kv_layers(
    layers: Sequence[torch.Tensor],
    batch_mapping: torch.Tensor,
    lengths: torch.Tensor,
    old_active: int,
    new_active: int,
    dst_lengths: torch.Tensor | None = None,
    *,
    check: bool = False,
) -> None:
    """Compact every layer in one launch, then the lengths (a second, one-program launch).

    Parameters
    ----------
    layers : list of torch.Tensor
        Layer ``i``: shape ``[B, 2, H_i, S_i, D_i]`` (heads, max length, head size may differ), one dtype
        and device, contiguous. In/out.
    batch_mapping, lengths, old_active, new_active, check
        As in :func:`compact_kv_layer`; ``lengths[i] <= min(S_i)``.
    dst_lengths : torch.Tensor, optional
        Where the compacted lengths go (may be ``lengths``); ``None`` leaves the lengths alone.

    Note
    ----
    The lengths are compacted only after every layer was read (stream order). The layer address table is
    built on the first call with a set of layers and reused after; the caches build theirs at construction.
    """
    layers = check_kv_layers("layers", layers)
    _check_compaction_args("layers[0]", layers, batch_mapping, lengths, old_active, new_active, dst_lengths, check)
    table = _TABLES.get(layers) if use_triton(layers[0].device) else None
    compact_slots_table(layers, table, batch_mapping, lengths, old_active, new_active)
    if dst_lengths is not None:
        compact_lengths(lengths, batch_mapping, old_active, new_active, dst_lengths)


def compact_batch(
    src: torch.Tensor,
    batch_mapping: torch.Tensor,
    dst: torch.Tensor,
    old_active: int,
    new_active: int,
    *,
    check: bool = False,
) -> None:
    """Compact any tensor along dim 0: ``dst[batch_mapping[i]] = src[i]`` for every kept ``i < old_active``.

    Parameters
    ----------
    src : torch.Tensor
        shape ``[B, ...]``, any dtype of 1, 2, 4 or 8 bytes; each ``src[i]`` must be contiguous (dim 0 may
        have any stride).
    batch_mapping : torch.Tensor
        shape ``[>= old_active]``, int32, same device.
    dst : torch.Tensor
        shape ``[B', ...]`` with ``B' >= new_active`` and the same trailing shape, dtype and device,
        contiguous; or ``src`` itself (in place: rows that stay where they are are not copied).
    old_active, new_active : int
        ``0 <= new_active <= old_active <= B``.
    check : bool
        Debug mode: verify the mapping (syncs).
    """
    check_tensor("src", src)
    check_tensor("dst", dst)
    check_tensor("batch_mapping", batch_mapping)
    if src.dim() < 1:
        raise ValueError(f"src: expected at least 1 dimension (the batch), got shape {fmt_shape(src.shape)}")
    check_bits_dtype("src", src)
    check_same_dtype("dst", dst, "src", src)
    check_device("dst", dst, src.device, "src")
    check_device("batch_mapping", batch_mapping, src.device, "src")
    check_ndim("batch_mapping", batch_mapping, 1, "of int32")
    check_dtype("batch_mapping", batch_mapping, torch.int32)
    if batch_mapping.stride(0) != 1:
        raise ValueError(f"batch_mapping: expected a contiguous tensor, got stride {batch_mapping.stride(0)}")
    check_int("old_active", old_active, 0, src.shape[0])
    check_int("new_active", new_active, 0, old_active)
    if batch_mapping.shape[0] < old_active:
        raise ValueError(f"batch_mapping: expected at least {old_active} entries, got shape [{batch_mapping.shape[0]}]")
    if dst.dim() != src.dim() or dst.shape[1:] != src.shape[1:] or dst.shape[0] < new_active:
        raise ValueError(
            f"dst: expected shape [>= {new_active}, {', '.join(str(s) for s in src.shape[1:])}], got "
            f"{fmt_shape(dst.shape)}"
        )
    row_shape = src.shape[1:]
    n = 1
    for size in row_shape:
        n *= size
    if src.dim() > 1 and n > 1 and not _rows_contiguous(src):
        raise ValueError(f"src: each src[i] must be contiguous, got strides {tuple(src.stride())}")
    in_place = dst.data_ptr() == src.data_ptr() and dst.stride() == src.stride() and dst.shape == src.shape
    if not in_place:
        check_contiguous("dst", dst)
        s0, s1 = src.data_ptr(), src.data_ptr() + ((src.shape[0] - 1) * src.stride(0) + n) * src.element_size()
        d0, d1 = dst.data_ptr(), dst.data_ptr() + dst.numel() * dst.element_size()
        if src.numel() and dst.numel() and s0 < d1 and d0 < s1:
            raise ValueError("dst: must be src itself (in place) or not overlap src in memory")
    if check:
        check_batch_mapping(batch_mapping, old_active, new_active)
    if src.shape[0] == 0:
        n = 0
    if not use_triton(src.device):
        if old_active:
            compact_batch_reference(src, batch_mapping, dst, old_active, new_active)
        return
    if src.dtype not in _NATIVE_DTYPES:  # Triton moves these as they are; others as same-width integers
        src, dst = bits(src), bits(dst)
    compact_slots_strided(
        src, dst, batch_mapping, None, old_active, new_active,
        num_layers=1, rows=1, row_capacity=n,
        src_strides=(0, 0, src.stride(0)), dst_strides=(0, 0, dst.stride(0) if dst.dim() else 1),
    )


_NATIVE_DTYPES = frozenset({
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2,
})


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether every ``t[i]`` is contiguous (dim 0 may have any stride)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _check_compaction_args(
    ref_name: str,
    layers: Sequence[torch.Tensor],
    batch_mapping: torch.Tensor,
    lengths: torch.Tensor,
    old_active: int,
    new_active: int,
    dst_lengths: torch.Tensor | None,
    check: bool,
) -> None:
    """Argument checks shared by compact_kv_layer and compact_kv_layers (validated layers, ``layers[0]`` named
    ``ref_name`` in errors)."""
    ref = layers[0]
    check_tensor("batch_mapping", batch_mapping)
    check_tensor("lengths", lengths)
    dst = lengths if dst_lengths is None else check_tensor("dst_lengths", dst_lengths)
    _check_lengths_args(lengths, batch_mapping, old_active, new_active, dst, max_batch=ref.shape[0],
                        ref=(ref_name, ref.device))
    if check:
        check_batch_mapping(batch_mapping, old_active, new_active)
        _check_length_values(lengths, old_active, min(t.shape[3] for t in layers))


def _check_length_values(lengths: torch.Tensor, old_active: int, max_len: int) -> None:
    vals = lengths[:old_active].cpu()
    if old_active and (int(vals.min()) < 0 or int(vals.max()) > max_len):
        raise ValueError(f"lengths: expected values in [0, {max_len}], got {vals.tolist()}")
