"""One layer's append and gather under a step plan: the one path of the cache and of the loose keyword ops.

Per layer only the layer's own tensors are checked (shape, dtype, device, strides: a few int compares); the
plan's index tensors were validated when it was built, and its launch description is derived by the first
append and reused by every later one. On CUDA, the first append of each kind of layer (pointer alignment, k / v
strides) compiles and binds the launch; the others repeat it with raw pointers (:class:`~.launch.AppendPlan`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..._backend import _current_device, _current_stream, _hooks_active, pdl_enabled
from ..._validate import MODEL_DTYPES, check_dtype_in, fmt_shape
from ...rope import RopeKernelParams
from .checks import check_arg_tensor, check_kv_rows, check_rope, host_check_fp8_scales
from .launch import (
    AppendPlan,
    append_index,
    append_paged_kv_launch,
    default_append_launch,
    gather_paged_kv_launch,
    rope_constants,
)
from .layer import PagedLayer
from .policy import AppendLaunch
from .step import StepPlan

__all__ = ["append_rows", "gather_rows", "check_rows"]


@dataclasses.dataclass(slots=True)
class _AppendMemo:
    """A plan's appends of ``n_rows`` rows: their launch description, the index pointers a prepared launch
    passes, and the prepared launches by kind of layer."""

    n_rows: int
    launch: AppendLaunch
    index_ptrs: tuple
    prepared: dict[tuple, AppendPlan]


def check_rows(k: object, v: object, layer: PagedLayer) -> None:
    """``k`` / ``v`` ``[N, H, D]`` for ``layer``: its heads and head_dim, one model dtype (the layer's when it has
    one, else the format's rule), its device, head_dim contiguous; ValueError / TypeError naming the argument
    otherwise. A few int compares on the common path; the detailed checks only to name what is wrong."""
    if type(k) is torch.Tensor and type(v) is torch.Tensor:
        ks, dt = k.shape, k.dtype
        _, _, h, d, _, _ = layer.geometry
        did = layer.dev_id
        if (len(ks) == 3 and ks[1] == h and ks[2] == d and v.shape == ks and dt is v.dtype
                and dt is layer.dtype
                and k.stride(2) == 1 and v.stride(2) == 1 and k.get_device() == did and v.get_device() == did
                and ((k.is_cuda and v.is_cuda) if did >= 0 else (k.is_cpu and v.is_cpu))):
            return  # (an index alone is ambiguous: -1 is the CPU and also "meta", 0 is cuda:0 and other devices')
    if layer.dtype is not None:
        for name, t in (("k", k), ("v", v)):
            if isinstance(t, torch.Tensor) and t.dtype != layer.dtype:
                raise ValueError(f"{name}: expected dtype {layer.dtype} (the cache's model dtype), got {t.dtype}")
    _, _, h, _, kv_dtype, _ = layer.geometry
    check_kv_rows(k, v, layer.pool, kv_dtype, h, layer.pool.shape[-1])


def append_rows(k: torch.Tensor, v: torch.Tensor, layer: PagedLayer, plan: StepPlan) -> bool:
    """Write ``k`` / ``v`` ``[N, H, D]`` into ``layer`` where ``plan`` says (RoPE on K and quantization fused).
    ``plan`` must be built for the layer's geometry (the caller checks). Returns True when the launch repeated a
    prepared one (a diagnostic)."""
    check_rows(k, v, layer)
    plan.require("append", ragged=False, rows=True, writes=True)
    n = k.shape[0]
    if plan.check:
        plan.host_check(n)
        if layer.scales is not None:
            host_check_fp8_scales(layer.scales, layer.kv_dtype)
    memo = plan.append_memo
    if memo is None or memo.n_rows != n:
        memo = plan.append_memo = _derive(plan, layer, n)
    if n == 0:
        return False
    did = layer.dev_id
    key = None
    if did >= 0 and not _hooks_active() and _current_device() == did:
        # everything that selects the compiled kernel besides the plan: dtype, alignment and strides of the
        # layer's tensors (the Kernel's own key, read from the values that may vary between layers; a plan may
        # serve caches of one geometry and different model dtypes)
        kp, vp = k.data_ptr(), v.data_ptr()
        key = (layer.align, k.dtype, k.stride(), v.stride(), kp & 15 == 0, vp & 15 == 0)
        prepared = memo.prepared.get(key)
        if prepared is not None:
            prepared.launch(_current_stream(did), n, kp, vp, key[2][0], key[3][0], layer.ptrs, memo.index_ptrs)
            return True
    prepared = append_paged_kv_launch(k, v, layer, plan, memo.launch)
    if key is not None and prepared is not None:
        memo.prepared[key] = prepared
    return False


def _derive(plan: StepPlan, layer: PagedLayer, n: int) -> _AppendMemo:
    """The first append of ``n`` rows under ``plan``: its launch description and index pointers, and the prepared
    launches it shares with earlier plans of the same kind (``plan.launch_store``). Besides each layer's own
    tensors (the key of ``prepared``), a compiled append is selected by the rows, the sequences, the index
    tensors' kinds (kv_lens or cu_k_lens), dtypes and 16-byte alignment, the RoPE constants, context parallelism
    and the launch promises: equal keys, equal kernels; the pointers themselves are passed at every launch."""
    sm = plan.slot_mapping
    if sm is not None and sm.shape[0] != n:
        raise ValueError(f"slot_mapping: expected shape [{n}] (one slot per row of k), got [{sm.shape[0]}]")
    index = append_index(plan)
    ptrs = tuple(t.data_ptr() if isinstance(t, torch.Tensor) else t for t in index)
    store = plan.launch_store
    if store is None:
        return _AppendMemo(n, default_append_launch(n, layer, plan), ptrs, {})
    key = (n, plan.num_seqs, plan.kv_lens is not None, plan.cp_rank, plan.cp_size, plan.metadata_ready,
           plan.rope_ready, pdl_enabled(),
           tuple(None if t is None else (t.dtype, p & 15 == 0) for t, p in zip(index[:6], ptrs[:6])),
           rope_constants(plan.rope))
    shared = store.get(key)
    if shared is None:
        if len(store) >= _STORE_SIZE:
            store.clear()
        shared = store[key] = (default_append_launch(n, layer, plan), {})
    return _AppendMemo(n, shared[0], ptrs, shared[1])


_STORE_SIZE = 64  # kinds of steps a cache keeps the launches of (a serving loop sees a handful)


def gather_rows(layer: PagedLayer, plan: StepPlan, k_out: torch.Tensor | None, v_out: torch.Tensor | None,
                max_len: int | None, dtype: torch.dtype | None, rope: RopeKernelParams | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer``'s blocks of ``plan``'s sequences (as they stand after the step) into ``k_out`` / ``v_out``
    ``[B, H, S_out, D]`` (allocated when None: ``S_out = max_len``, default the longest sequence, one sync), in
    ``dtype``, dequantized, zero-padded; ``rope`` rotates the keys. See :func:`kvcache.ops.gather_paged_kv`."""
    plan.require("gather", ragged=True, rows=False)
    _, _, h, d, kv_dtype, _ = layer.geometry
    rope = check_rope(rope, d, layer.device)
    b = plan.num_seqs
    if (k_out is None) != (v_out is None):
        raise ValueError(f"k_out: expected both k_out and v_out, or neither, got only "
                         f"{'k_out' if k_out is not None else 'v_out'}")
    if k_out is None:
        if dtype is None:
            if kv_dtype != "auto":
                raise ValueError(f"dtype: expected the model dtype for a {kv_dtype!r} pool, got None")
            dtype = layer.pool.dtype
        check_dtype_in("dtype", dtype, MODEL_DTYPES)
        if max_len is None:
            max_len = int(plan.seq_lens.max().item()) if b else 0
            max_len = max(max_len - plan.cp_rank + plan.cp_size - 1, 0) // plan.cp_size
        if isinstance(max_len, bool) or not isinstance(max_len, int):
            raise TypeError(f"max_len: expected an int, got {type(max_len).__name__}")
        if max_len < 0:
            raise ValueError(f"max_len: expected an int >= 0, got {max_len!r}")
        k_out = torch.empty((b, h, max_len, d), dtype=dtype, device=layer.device)
        v_out = torch.empty((b, h, max_len, d), dtype=dtype, device=layer.device)
    else:
        _check_outputs(k_out, v_out, layer, b, max_len)
    gather_paged_kv_launch(k_out, v_out, layer, plan, rope)  # type: ignore[arg-type]
    return k_out, v_out  # type: ignore[return-value]


def _check_outputs(k_out: object, v_out: object, layer: PagedLayer, b: int, max_len: object) -> None:
    _, _, h, d, kv_dtype, _ = layer.geometry
    check_arg_tensor("k_out", k_out, dtypes=MODEL_DTYPES, ndim=4, device=layer.device)
    check_arg_tensor("v_out", v_out, dtypes=MODEL_DTYPES, ndim=4, device=layer.device)
    for name, t in (("k_out", k_out), ("v_out", v_out)):
        if t.shape[0] != b or t.shape[1] != h or t.shape[3] != d or t.stride(3) != 1:  # type: ignore[union-attr]
            raise ValueError(f"{name}: expected [{b}, {h}, S_out, {d}] with head_dim contiguous, got "
                             f"{fmt_shape(t.shape)} strides {tuple(t.stride())}")  # type: ignore[union-attr]
    if v_out.shape != k_out.shape or v_out.dtype != k_out.dtype:  # type: ignore[union-attr]
        raise ValueError(f"v_out: expected {k_out.dtype} {fmt_shape(k_out.shape)} (as k_out), got "  # type: ignore[union-attr]
                         f"{v_out.dtype} {fmt_shape(v_out.shape)}")  # type: ignore[union-attr]
    if kv_dtype == "auto" and k_out.dtype != layer.pool.dtype:  # type: ignore[union-attr]
        raise ValueError(f"k_out: expected dtype {layer.pool.dtype} (the pool's), got {k_out.dtype}")  # type: ignore[union-attr]
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int)):
        raise TypeError(f"max_len: expected an int or None, got {type(max_len).__name__}")
    if max_len is not None and max_len != k_out.shape[2]:  # type: ignore[union-attr]
        raise ValueError(f"max_len: expected None or {k_out.shape[2]} (S_out of k_out / v_out), got {max_len}")  # type: ignore[union-attr]

