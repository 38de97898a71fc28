"""What LinearKVCache and KVCacheManager share: the layer storage and the per-sequence state.

``LayerStore`` (:mod:`kvcache.linear._store`) owns the memory of all layers (one allocation) and moves slots: save,
restore, compaction.

``SlotCache`` holds the lengths, the active batch size and the eviction / save / restore API. The lengths
live on the device; a host mirror of them is kept while it is exact (after ``reset_for_new_sequences`` and
integer commits), which lets most bound checks run on the host without a sync. The lengths, their host mirror
(and when it is trusted), the active batch size, ``reset_for_new_sequences`` and ``commit`` are in its base
class ``SlotLengths`` (:mod:`kvcache.linear._slot_lengths`); this module adds attention, eviction and snapshots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import ops
from .._validate import check_dtype, check_int, check_ndim, check_tensor, fmt_shape
from ..ops.lengths import compact_lengths
from ._slot_lengths import SlotLengths
from .snapshot import KVSnapshot


class SlotCache(SlotLengths):
    """Sequence state and slot operations shared by :class:`~kvcache.LinearKVCache` and
    :class:`~kvcache.KVCacheManager`."""

    # ------------------------------------------------------------------------------------------ attention

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        *,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        kv_scales: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of the active sequences' new rows over ``layer`` (no mask tensor): see
        :func:`kvcache.ops.linear_attention`.

        ``q`` ``[active_batch_size, Hq, q_len, D]``: the new tokens, whose K / V were written first (``append``)
        and are not yet committed: row ``i`` of sequence ``b`` sits at position ``lengths[b] + i`` and attends
        to the slot's valid prefix and the new rows up to its own. Returns ``out`` ``[active, Hq, q_len, D]``.

        Example
        -------
        >>> import torch
        >>> from kvcache import CacheConfig, LinearKVCache
        >>> cache = LinearKVCache(CacheConfig(1, 2, 16, 2, 8, dtype=torch.float32, device="cpu"))
        >>> cache.reset_for_new_sequences([0, 0])
        >>> k = torch.randn(2, 2, 3, 8)
        >>> cache.append(0, k, k)
        >>> cache.attention(0, torch.randn(2, 4, 3, 8)).shape
        torch.Size([2, 4, 3, 8])
        """
        i = self._check_layer_index(layer)
        return ops.linear_attention(q, self._store.layers[i], self.lengths, scale=scale, window=window,
                                    softcap=softcap, sinks=sinks, kv_scales=kv_scales, out=out, lse=lse)

    def _check_layer_index(self, i: int) -> int:
        return check_int("i", i, 0, len(self._store.specs) - 1)

    # ------------------------------------------------------------------------------------------ eviction

    def evict(self, finished: torch.Tensor | Sequence[bool], *, check: bool = False) -> torch.Tensor:
        """Drop finished sequences and compact every layer and the lengths in place.

        Parameters
        ----------
        finished : torch.Tensor | sequence of bool
            bool ``[active_batch_size]``, on the host or on the cache's device (then reading the new batch size
            syncs once).
        check : bool
            Debug mode: verify the mapping and lengths (syncs).

        Returns
        -------
        torch.Tensor
            The mapping, int32 ``[old active_batch_size]`` on the cache's device: new index of each old
            sequence or ``-1``. Use it with :func:`kvcache.ops.compact_batch` for the engine's own
            per-sequence tensors.
        """
        old = self._active
        host_finished: list[bool] | None = None
        if isinstance(finished, torch.Tensor):
            check_tensor("finished", finished)
            check_ndim("finished", finished, 1, "of bool [active_batch_size]")
            check_dtype("finished", finished, torch.bool)
            if finished.shape[0] != old:
                raise ValueError(
                    f"finished: expected shape [{old}] (active_batch_size), got {fmt_shape(finished.shape)}"
                )
            if finished.device.type == "cpu":
                host_finished = [bool(x) for x in finished.tolist()]
            elif finished.device != self.device:
                raise ValueError(f"finished: expected device {self._devices_allowed()}, got {finished.device}")
        else:
            if isinstance(finished, (str, bytes)) or not isinstance(finished, Sequence):
                raise TypeError(
                    f"finished: expected a bool tensor or a sequence of bool, got {type(finished).__name__}"
                )
            if len(finished) != old:
                raise ValueError(f"finished: expected {old} flags (active_batch_size), got {len(finished)}")
            for i, f in enumerate(finished):
                if not isinstance(f, bool):
                    raise TypeError(f"finished[{i}]: expected a bool, got {type(f).__name__}")
            host_finished = list(finished)
        mapping = self._mapping[:old]
        if host_finished is not None:
            kept = [i for i, f in enumerate(host_finished) if not f]
            new = len(kept)
            host_map = [-1] * old
            for j, i in enumerate(kept):
                host_map[i] = j
            if old:
                mapping.copy_(torch.tensor(host_map, dtype=torch.int32))
        else:
            _, new = ops.build_batch_mapping(finished, out=self._mapping)
            kept = None
        self._refresh()
        if check:
            ops.check_batch_mapping(mapping, old, new)  # type: ignore[arg-type]
            held = self._lengths_view.tolist()  # the device values: the mirror could only echo them
            if any(not 0 <= x <= self._store.max_seq for x in held):
                raise ValueError(f"lengths: expected values in [0, {self._store.max_seq}], got {held}")
        values = self._mirror_values()
        if old and new != old:
            self._store.compact(mapping, self._lengths, old, new)  # type: ignore[arg-type]
            compact_lengths(self._lengths, mapping, old, new)  # type: ignore[arg-type]
        self._known_ver = self._lengths._version
        if values is not None:
            self._set_mirror(None if kept is None else [values[i] for i in kept])
            if self._mirror is not None:
                self._all_empty = not any(self._mirror)
        self._set_active(new)  # type: ignore[arg-type]
        return mapping.clone()

    # ------------------------------------------------------------------------------------------ snapshots

    def save(self, batch_idx: int, seq_len: int, *, out: KVSnapshot | None = None) -> KVSnapshot:
        """Copy the first ``seq_len`` tokens of active sequence ``batch_idx`` of every layer (one launch).

        Parameters
        ----------
        batch_idx : int
            An active sequence, ``0 <= batch_idx < active_batch_size``.
        seq_len : int
            ``0 <= seq_len <=`` the sequence's length (read from the device when the host copy is unknown; only
            inside a CUDA-graph capture is the bound ``max_seq_len`` instead).
        out : KVSnapshot, optional
            A snapshot of this cache's layer shapes, dtype and device with ``out.seq_len == seq_len`` to
            write into (no allocation; capturable in a CUDA graph). Default: a new packed snapshot.

        Returns
        -------
        KVSnapshot
            ``out``, or a new packed snapshot on the cache's device, layer ``i`` ``[2, H_i, seq_len, D_i]``.
        """
        if self._active == 0:
            check_int("batch_idx", batch_idx)
            raise ValueError(f"batch_idx: no active sequence to save from (active_batch_size is 0), got {batch_idx}")
        check_int("batch_idx", batch_idx, 0, self._active - 1)
        check_int("seq_len", seq_len, 0)
        self._refresh()
        values = self._mirror_values()
        if values is None and not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            values = self.host_lengths()  # one sync; never inside a CUDA-graph capture
        held = self._store.max_seq if values is None else min(max(values[batch_idx], 0), self._store.max_seq)
        if seq_len > held:
            raise ValueError(
                f"seq_len: expected an int <= {held} (the tokens sequence {batch_idx} holds), got {seq_len}"
            )
        if out is None:
            out = KVSnapshot.empty(self._store.specs, seq_len, dtype=self._store.dtype, device=self.device)
        else:
            self._check_snapshot("out", out)
            if out.seq_len != seq_len:
                raise ValueError(f"out: expected seq_len {seq_len}, got {out.seq_len}")
        self._store.save(out, batch_idx)
        return out

    def _check_snapshot(self, name: str, snapshot: object) -> None:
        if not isinstance(snapshot, KVSnapshot):
            raise TypeError(f"{name}: expected a KVSnapshot, got {type(snapshot).__name__}")
        if snapshot.layer_specs is not self._store.specs and snapshot.layer_specs != self._store.specs:
            raise ValueError(
                f"{name}: expected layers of (num_kv_heads, head_dim) {list(self._store.specs)}, got "
                f"{list(snapshot.layer_specs)}"
            )
        if snapshot.dtype != self._store.dtype:
            raise ValueError(f"{name}: expected dtype {self._store.dtype}, got {snapshot.dtype}")
        if snapshot.device != self.device:
            raise ValueError(
                f"{name}: expected device {self.device}, got {snapshot.device} (use snapshot.to(cache.device))"
            )
        if snapshot.seq_len > self._store.max_seq:
            raise ValueError(f"{name}: expected seq_len <= {self._store.max_seq}, got {snapshot.seq_len}")

    def restore(self, snapshot: KVSnapshot, batch_idx: int) -> None:
        """Copy a saved prefix into the first ``snapshot.seq_len`` tokens of slot ``batch_idx`` of every layer.

        Lengths are not changed. The system-prompt recipe: restore ``N`` tokens into slot ``b``, then
        ``reset_for_new_sequences`` with ``N - 1`` for ``b`` and prefill from token ``N - 1``, so that the
        last prompt token's logits are recomputed.

        Parameters
        ----------
        snapshot : KVSnapshot
            From :meth:`save` of a cache with the same layer shapes and dtype, on this cache's device
            (``snapshot.to(cache.device)`` first if needed).
        batch_idx : int
            ``0 <= batch_idx < max_batch_size`` (active or not).
        """
        self._check_snapshot("snapshot", snapshot)
        check_int("batch_idx", batch_idx, 0, self._store.max_batch - 1)
        self._store.restore(snapshot, batch_idx)
