"""LayerStore: the memory of a slot cache's layers and the slot moves on it (save, restore, compaction).

Uniform layers are one tensor ``[L, B, 2, H, S, D]`` addressed by strides; layers that differ in heads or head
size are views of one flat buffer addressed through a static per-layer table built once here, so every
multi-layer op is one launch with no per-call host-to-device work (CUDA-graph capturable). Used by
:class:`kvcache.linear._slots.SlotCache`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import ops
from .._backend import use_triton
from .._validate import next_pow2, vec_elems
from ..ops._layers import build_layer_table
from ..ops.compact import compact_slots_strided, compact_slots_table
from ..ops.copy import _copy_strided_kernel, copy_slot_strided, copy_slot_table
from .snapshot import KVSnapshot

__all__ = ["LayerStore"]


class LayerStore:
    """Memory of ``L`` layers ``[B, 2, H_i, S, D_i]`` in one allocation, zero-initialised."""

    def __init__(
        self,
        specs: Sequence[tuple[int, int]],
        max_batch: int,
        max_seq: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.specs = tuple((int(h), int(d)) for h, d in specs)
        self.max_batch = max_batch
        self.max_seq = max_seq
        self.dtype = dtype
        self.device = device
        self.uniform = len(set(self.specs)) == 1
        if self.uniform:
            h, d = self.specs[0]
            self.buffer: torch.Tensor | None = torch.zeros(
                (len(self.specs), max_batch, 2, h, max_seq, d), dtype=dtype, device=device
            )
            self.layers: tuple[torch.Tensor, ...] = tuple(self.buffer.unbind(0))
            self.table = None
            self._vec = vec_elems(self.buffer.element_size(), [d])
        else:
            sizes = [max_batch * 2 * h * max_seq * d for h, d in self.specs]
            flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
            layers, off = [], 0
            for (h, d), n in zip(self.specs, sizes):
                layers.append(flat[off : off + n].view(max_batch, 2, h, max_seq, d))
                off += n
            self.buffer = None
            self.flat = flat
            self.layers = tuple(layers)
            # Packed snapshots put layer i at seq_len * sum_{j<i} 2 * H_j * D_j elements.
            per_token, acc = [], 0
            for h, d in self.specs:
                per_token.append(acc)
                acc += 2 * h * d
            self.table = build_layer_table(self.layers, snap_packed_per_token=per_token)

    # ------------------------------------------------------------------------------------------ slots

    def save(self, snap: KVSnapshot, batch_idx: int) -> None:
        s = snap.seq_len
        if snap.flat is None:
            ops.save_kv_layers(list(self.layers), list(snap.layers), batch_idx, s)
        elif self.uniform:
            h, d = self.specs[0]
            S = self.max_seq
            self._copy_uniform(self.buffer, snap.flat, s, batch_idx * 2 * h * S * d, 0,  # type: ignore[arg-type]
                               self.max_batch * 2 * h * S * d, S * d, 2 * h * s * d, s * d)
        else:
            copy_slot_table(self.layers[0], snap.flat, self.table, batch_idx, s, save=True,  # type: ignore[arg-type]
                            cache_layers=self.layers, snap_layers=snap.layers)

    def restore(self, snap: KVSnapshot, batch_idx: int) -> None:
        s = snap.seq_len
        if snap.flat is None:
            ops.restore_kv_layers(list(snap.layers), list(self.layers), batch_idx, s)
        elif self.uniform:
            h, d = self.specs[0]
            S = self.max_seq
            self._copy_uniform(snap.flat, self.buffer, s, 0, batch_idx * 2 * h * S * d,  # type: ignore[arg-type]
                               2 * h * s * d, s * d, self.max_batch * 2 * h * S * d, S * d)
        else:
            copy_slot_table(self.layers[0], snap.flat, self.table, batch_idx, s, save=False,  # type: ignore[arg-type]
                            cache_layers=self.layers, snap_layers=snap.layers)

    def _copy_uniform(
        self, src: torch.Tensor, dst: torch.Tensor, s: int, src_off: int, dst_off: int,
        src_layer_stride: int, src_row_stride: int, dst_layer_stride: int, dst_row_stride: int,
    ) -> None:
        """Row-prefix copy between the uniform buffer and a packed snapshot (the per-call hot path: the
        vector width is fixed at construction, every offset and stride being a multiple of head_dim)."""
        h, d = self.specs[0]
        n = s * d
        if n == 0:
            return
        if not use_triton(self.device):
            copy_slot_strided(
                src, dst, num_layers=len(self.specs), rows=2 * h, n=n, src_off=src_off, dst_off=dst_off,
                src_layer_stride=src_layer_stride, src_row_stride=src_row_stride,
                dst_layer_stride=dst_layer_stride, dst_row_stride=dst_row_stride,
            )
            return
        vec = self._vec
        block = min(4096, max(128, next_pow2(n)))
        _copy_strided_kernel.launch(
            self.device, (-(-n // block), 2 * h, len(self.specs)), src, dst, src_off, dst_off,
            src_layer_stride, src_row_stride, dst_layer_stride, dst_row_stride, n // vec, BLOCK=block, VEC=vec,
        )

    def compact(self, mapping: torch.Tensor, lengths: torch.Tensor, old_active: int, new_active: int) -> None:
        if self.uniform:
            h, d = self.specs[0]
            S, B = self.max_seq, self.max_batch
            strides = (B * 2 * h * S * d, S * d, 2 * h * S * d)
            compact_slots_strided(
                self.buffer, self.buffer, mapping, lengths, old_active, new_active,  # type: ignore[arg-type]
                num_layers=len(self.specs), rows=2 * h, row_capacity=S * d,
                src_strides=strides, dst_strides=strides, token_elems=d,
            )
        else:
            compact_slots_table(self.layers, self.table, mapping, lengths, old_active, new_active)
