"""Per-layer metadata tables for one-launch multi-layer kernels.

A table is an int64 device tensor ``[num_layers, TABLE_COLS]``; offsets are in elements relative to a base
tensor passed to the kernel (the first layer), so the kernel keeps the base pointer's alignment and the
layers may live in separate allocations. Columns:

=====  ==================  ===========================================================================
col    name                meaning
=====  ==================  ===========================================================================
0      cache_off           element offset of the layer ``[B, 2, H_i, S_i, D_i]`` from the cache base
1      cache_bstride       ``2 * H_i * S_i * D_i``: elements between batch slots
2      cache_rstride       ``S_i * D_i``: elements between (kv, head) rows of one slot
3      rows                ``2 * H_i``
4      head_dim            ``D_i``
5      snap_off            element offset of the saved layer ``[2, H_i, s, D_i]`` from the snapshot base
6      snap_off_per_token  added ``seq_len`` times to ``snap_off`` (packed snapshots of all layers)
7      (unused, 0)
=====  ==================  ===========================================================================
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

import torch

from .._validate import (
    KV_DTYPES,
    check_contiguous,
    check_device,
    check_dtype,
    check_ndim,
    check_same_dtype,
    check_tensor,
    fmt_shape,
    vec_elems,
)

TABLE_COLS = 8


@dataclasses.dataclass(frozen=True)
class LayerTable:
    """A device table plus what the launchers need on the host."""

    table: torch.Tensor  # int64 [L, TABLE_COLS] on the layers' device
    num_layers: int
    max_rows: int  # max 2 * H_i
    max_head_dim: int
    vec: int  # elements every offset, stride and head_dim is a multiple of (<= 16 bytes)


def build_layer_table(
    cache_layers: Sequence[torch.Tensor],
    snap_layers: Sequence[torch.Tensor] | None = None,
    *,
    snap_packed_per_token: Sequence[int] | None = None,
) -> LayerTable:
    """Build the table of ``cache_layers`` (and their snapshot tensors, if any). Host work + one H2D copy."""
    base = cache_layers[0]
    elt = base.element_size()
    rows: list[list[int]] = []
    divisors: list[int] = []
    for i, layer in enumerate(cache_layers):
        b, _, h, s, d = layer.shape
        off = (layer.data_ptr() - base.data_ptr()) // elt
        snap_off = 0
        if snap_layers is not None:
            snap_off = (snap_layers[i].data_ptr() - snap_layers[0].data_ptr()) // elt
        per_tok = 0 if snap_packed_per_token is None else int(snap_packed_per_token[i])
        rows.append([off, 2 * h * s * d, s * d, 2 * h, d, snap_off, per_tok, 0])
        divisors += [off, s * d, d, snap_off, per_tok]
    table = torch.tensor(rows, dtype=torch.int64).to(base.device)
    return LayerTable(
        table=table,
        num_layers=len(rows),
        max_rows=max(r[3] for r in rows),
        max_head_dim=max(r[4] for r in rows),
        vec=vec_elems(elt, divisors),
    )


class TableMemo:
    """Small LRU of layer tables keyed by the tensors' addresses and shapes.

    The first call with a set of tensors builds the table (a host-to-device copy, not capturable in a CUDA
    graph); later calls with the same tensors reuse it.
    """

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._items: OrderedDict[tuple, LayerTable] = OrderedDict()

    def get(
        self, cache_layers: Sequence[torch.Tensor], snap_layers: Sequence[torch.Tensor] | None = None
    ) -> LayerTable:
        # offsets are in elements: the same addresses viewed as another dtype need another table
        key = (cache_layers[0].dtype, cache_layers[0].device) + tuple((t.data_ptr(), t.shape) for t in cache_layers)
        if snap_layers is not None:
            key = key + tuple((t.data_ptr(), t.shape) for t in snap_layers)
        hit = self._items.get(key)
        if hit is not None:
            self._items.move_to_end(key)
            return hit
        table = build_layer_table(cache_layers, snap_layers)
        self._items[key] = table
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return table


def check_kv_layers(name: str, layers: object, *, allow_any_dtype: bool = False) -> list[torch.Tensor]:
    """Validate a list of KV layers ``[B, 2, H_i, S_i, D_i]``: same B, dtype and device, contiguous."""
    if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence):
        raise TypeError(f"{name}: expected a list of tensors [B, 2, H_i, S_i, D_i], got {type(layers).__name__}")
    if len(layers) == 0:
        raise ValueError(f"{name}: expected at least one layer, got an empty list")
    out: list[torch.Tensor] = []
    first: torch.Tensor | None = None
    for i, t in enumerate(layers):
        lname = f"{name}[{i}]"
        check_kv_layer(lname, t, allow_any_dtype=allow_any_dtype)
        if first is None:
            first = t
        else:
            check_same_dtype(lname, t, f"{name}[0]", first)
            check_device(lname, t, first.device, f"{name}[0]")
            if t.shape[0] != first.shape[0]:
                raise ValueError(
                    f"{lname}: expected max batch {first.shape[0]} (dim 0 of {name}[0]), got shape "
                    f"{fmt_shape(t.shape)}"
                )
        out.append(t)
    return out


def check_kv_layer(name: str, t: object, *, allow_any_dtype: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        check_tensor(name, t)
    shape = t.shape  # type: ignore[union-attr]
    if len(shape) != 5:
        check_ndim(name, t, 5, "[max_batch, 2, num_kv_heads, max_seq_len, head_dim]")  # type: ignore[arg-type]
    if shape[1] != 2:
        raise ValueError(f"{name}: expected shape [B, 2, H, S, D] (dim 1 = K and V), got {fmt_shape(shape)}")
    if not allow_any_dtype and t.dtype not in KV_DTYPES:  # type: ignore[union-attr]
        check_dtype(name, t, KV_DTYPES)  # type: ignore[arg-type]
    if not t.is_contiguous():  # type: ignore[union-attr]
        check_contiguous(name, t)  # type: ignore[arg-type]
    return t  # type: ignore[return-value]
