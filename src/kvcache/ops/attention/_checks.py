"""Argument validation of the attention ops: shapes, dtypes, devices and options, checked on the host from
tensor metadata only (never reading a tensor's values: no sync), before anything is launched.
"""

from __future__ import annotations

import math

import torch

from ..._validate import check_choice, check_index_vector, check_tensor_arg, fmt_shape
from ..paged.checks import check_attention_options
from ..paged.format import LAYOUTS, kv_format

Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_options(scale: object, window: object, softcap: object, sinks: object, hq: int, d: int,
                  device: torch.device) -> tuple[float, int | None, float | None]:
    """Validated (scale, window, softcap); ``scale`` defaults to ``1 / sqrt(head_dim)``."""
    scale, window, softcap = check_attention_options(scale, window, softcap)
    if sinks is not None:
        check_sinks(sinks, hq, device)
    return (1.0 / math.sqrt(d) if scale is None else scale), window, softcap


def check_sinks(sinks: object, hq: int, device: torch.device) -> torch.Tensor:
    """``sinks``: a contiguous float32 ``[Hq]`` on q's device (one logit per q head)."""
    check_tensor_arg("sinks", sinks, dtypes=(torch.float32,), ndim=1, device=device, ref="q")
    if sinks.shape[0] != hq or (hq > 1 and sinks.stride(0) != 1):  # type: ignore[union-attr]
        raise ValueError(f"sinks: expected a contiguous float32 [{hq}] (one logit per q head), got "
                         f"{fmt_shape(sinks.shape)} strides {tuple(sinks.stride())}")  # type: ignore[union-attr]
    return sinks  # type: ignore[return-value]


def check_q(q: object, ndim: int, what: str) -> torch.Tensor:
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in Q_DTYPES:
        raise ValueError(f"q: expected dtype float16 or bfloat16 or float32, got {q.dtype}")
    if q.dim() != ndim:
        raise ValueError(f"q: expected a {ndim}-d tensor {what}, got shape {fmt_shape(q.shape)}")
    if q.stride(-1) != 1 and q.shape[-1] > 1:
        raise ValueError(f"q: expected head_dim to be contiguous (stride 1), got strides {tuple(q.stride())}")
    return q


def check_out(out: object, q: torch.Tensor, name: str = "out") -> torch.Tensor:
    """``out``: q's shape, dtype and device, head_dim contiguous (other strides free)."""
    check_tensor_arg(name, out, dtypes=(q.dtype,), ndim=q.dim(), device=q.device, ref="q")
    if tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"{name}: expected shape {fmt_shape(q.shape)} (as q), got {fmt_shape(out.shape)}")
    if out.stride(-1) != 1 and out.shape[-1] > 1:
        raise ValueError(f"{name}: expected head_dim to be contiguous (stride 1), got strides {tuple(out.stride())}")
    return out


def check_lse(lse: object, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    check_tensor_arg("lse", lse, dtypes=(torch.float32,), ndim=len(shape), device=device, ref="q")
    if tuple(lse.shape) != tuple(shape):
        raise ValueError(f"lse: expected shape {fmt_shape(shape)}, got {fmt_shape(lse.shape)}")
    return lse


def check_gqa(hq: int, h: int) -> int:
    if h < 1 or hq % h:
        raise ValueError(f"q: expected num_q_heads to be a multiple of num_kv_heads {h}, got {hq}")
    return hq // h


def check_pool(pool: object, params: object, kv_scales: object, kv_dtype: str, layout: str,
               q: torch.Tensor) -> tuple[int, int, int]:
    """Validate one layer's paged pool against q; returns (num_blocks, block_size, num_kv_heads)."""
    fmt = kv_format(kv_dtype)
    check_choice("layout", layout, LAYOUTS)
    dev = q.device
    stored = (q.dtype,) if fmt.storage is None else (fmt.storage,)
    check_tensor_arg("pool", pool, dtypes=stored, ndim=5, device=dev, ref="q")
    p = fmt.planes
    want = f"[num_blocks, {p}, block_size, H, R]" if layout == "NHD" else f"[num_blocks, {p}, H, block_size, R]"
    if pool.shape[1] != p:
        raise ValueError(f"pool: expected shape {want} ({layout}), got {fmt_shape(pool.shape)}")
    if not pool.is_contiguous():
        raise ValueError(f"pool: expected a contiguous tensor, got strides {tuple(pool.stride())}")
    nb = pool.shape[0]
    bs, h = (pool.shape[2], pool.shape[3]) if layout == "NHD" else (pool.shape[3], pool.shape[2])
    d = q.shape[-1]
    r = fmt.row_elems(d)
    if pool.shape[4] != r or (fmt.needs_even_head_dim and d % 2):
        raise ValueError(f"pool: expected rows of {r} elements for head_dim {d} and kv_dtype {kv_dtype!r}, got "
                         f"shape {fmt_shape(pool.shape)}")
    if fmt.block_keys and 2 * bs > d:
        raise ValueError(f"block_size: expected at most head_dim / 2 = {d // 2} for kv_dtype {kv_dtype!r}, got {bs}")
    if fmt.has_params:
        if params is None:
            what = "(scale, zero)" if fmt.row_params or fmt.block_keys else "key scale"
            raise ValueError(f"params: expected the float32 {what} pool for kv_dtype {kv_dtype!r}, got None")
        check_tensor_arg("params", params, dtypes=(torch.float32,), ndim=5, device=dev, ref="q")
        pp, pw = fmt.param_planes, fmt.params_width(d, bs)
        pshape = (nb, pp, bs, h, pw) if layout == "NHD" else (nb, pp, h, bs, pw)
        if tuple(params.shape) != pshape or not params.is_contiguous():
            raise ValueError(f"params: expected a contiguous float32 {fmt_shape(pshape)}, got "
                             f"{fmt_shape(params.shape)} strides {tuple(params.stride())}")
    elif params is not None:
        raise ValueError(f"params: expected None for kv_dtype {kv_dtype!r}, got a tensor")
    if fmt.per_layer_scale:  # the others ignore kv_scales (as the append does): PagedKVCache.kv_scales[layer] fits all
        check_kv_scales(kv_scales, dev, required=True, kv_dtype=kv_dtype)
    return nb, bs, h


def check_kv_scales(kv_scales: object, device: torch.device, required: bool, kv_dtype: str = "fp8") -> None:
    if kv_scales is None and not required:
        return
    if kv_scales is None:
        raise ValueError(f"kv_scales: expected float32 [2] (k_scale, v_scale) for kv_dtype {kv_dtype!r}, got None")
    check_tensor_arg("kv_scales", kv_scales, dtypes=(torch.float32,), ndim=1, device=device, ref="q")
    if kv_scales.shape[0] != 2 or kv_scales.stride(0) != 1:
        raise ValueError(f"kv_scales: expected a contiguous float32 [2] (k_scale, v_scale), got "
                         f"{fmt_shape(kv_scales.shape)} strides {tuple(kv_scales.stride())}")


def check_int_vec(name: str, t: object, n: int, device: torch.device) -> torch.Tensor:
    """An int32 index vector of ``n`` entries on q's device."""
    return check_index_vector(name, t, n, device, ref="q")


def check_workspace(workspace: object, size: int, device: torch.device) -> torch.Tensor:
    check_tensor_arg("workspace", workspace, dtypes=(torch.float32,), ndim=1, device=device, ref="q")
    if workspace.numel() < size or (workspace.numel() > 1 and workspace.stride(0) != 1):
        raise ValueError(f"workspace: expected a contiguous float32 tensor of at least {size} elements, got "
                         f"{workspace.numel()} with strides {tuple(workspace.stride())}")
    return workspace
