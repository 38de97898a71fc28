"""Validation of the paged ops' arguments (host side, before any byte is written): ValueError / TypeError
naming the argument, the expected and the actual value."""

from __future__ import annotations

import math

import torch

from ..._validate import MODEL_DTYPES, check_choice, check_int, check_tensor_arg, fmt_shape
from ..._validate import check_index_vector as _check_index_vector
from ...rope import RopeKernelParams
from .format import LAYOUTS, kv_format


def check_arg_tensor(name: str, t: object, *, dtypes: tuple[torch.dtype, ...], ndim: int,
                     device: torch.device) -> torch.Tensor:
    """:func:`kvcache._validate.check_tensor_arg` for an argument that must live on the pool's device."""
    return check_tensor_arg(name, t, dtypes=dtypes, ndim=ndim, device=device, ref="pool")


def pool_geometry(pool: object, params: object, kv_dtype: str, layout: str) -> tuple[int, int, int, int]:
    """Validate a layer pool (and params); returns (num_blocks, block_size, num_kv_heads, stored row elems)."""
    fmt = kv_format(kv_dtype)
    check_choice("layout", layout, LAYOUTS)
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"pool: expected a torch.Tensor, got {type(pool).__name__}")
    if pool.dim() != 5 or pool.shape[1] != fmt.planes:
        p = fmt.planes
        want = f"[num_blocks, {p}, block_size, H, D]" if layout == "NHD" else f"[num_blocks, {p}, H, block_size, D]"
        raise ValueError(f"pool: expected shape {want} ({layout}), got {fmt_shape(pool.shape)}")
    if not pool.is_contiguous():
        raise ValueError(f"pool: expected a contiguous tensor, got strides {tuple(pool.stride())}")
    want_dtype = MODEL_DTYPES if fmt.storage is None else (fmt.storage,)
    if pool.dtype not in want_dtype:
        raise ValueError(f"pool: expected dtype {' or '.join(str(d) for d in want_dtype)} for kv_dtype "
                         f"{kv_dtype!r}, got {pool.dtype}")
    nb = pool.shape[0]
    bs, h = (pool.shape[2], pool.shape[3]) if layout == "NHD" else (pool.shape[3], pool.shape[2])
    if fmt.block_keys and bs > pool.shape[4]:  # int4b: rows of head_dim / 2 bytes
        raise ValueError(f"block_size: expected at most head_dim / 2 = {pool.shape[4]} for kv_dtype {kv_dtype!r}, got "
                         f"{bs} (pool shape {fmt_shape(pool.shape)})")
    if fmt.has_params:
        what = "scales and zeros" if fmt.row_params or fmt.block_keys else "key scales"
        if not isinstance(params, torch.Tensor):
            raise TypeError(f"params: expected a float32 tensor of {what} for kv_dtype {kv_dtype!r}, "
                            f"got {type(params).__name__}")
        # (scale, zero) of K and of V; fp8k: the scale of K
        d = 2 * pool.shape[4] if fmt.value_bits == 4 else pool.shape[4]
        want = (pool.shape[0], fmt.param_planes, *pool.shape[2:4], fmt.params_width(d, bs))
        if tuple(params.shape) != want or params.dtype != torch.float32 or not params.is_contiguous():
            raise ValueError(f"params: expected a contiguous float32 tensor of shape {fmt_shape(want)}, got "
                             f"{params.dtype} {fmt_shape(params.shape)}")
        if params.device != pool.device:
            raise ValueError(f"params: expected device {pool.device} (the device of pool), got {params.device}")
    elif params is not None:
        raise ValueError(f"params: expected None for kv_dtype {kv_dtype!r}")
    return nb, bs, h, pool.shape[4]


def check_kv_rows(k: object, v: object, pool: torch.Tensor, kv_dtype: str, h: int, dp: int, names=("k", "v")):  # type: ignore[no-untyped-def]
    check_arg_tensor(names[0], k, dtypes=MODEL_DTYPES, ndim=3, device=pool.device)
    check_arg_tensor(names[1], v, dtypes=MODEL_DTYPES, ndim=3, device=pool.device)
    d = k.shape[2]  # type: ignore[union-attr]
    if tuple(v.shape) != tuple(k.shape) or v.dtype != k.dtype:  # type: ignore[union-attr]
        raise ValueError(f"{names[1]}: expected {k.dtype} {fmt_shape(k.shape)} (as {names[0]}), got "  # type: ignore[union-attr]
                         f"{v.dtype} {fmt_shape(v.shape)}")  # type: ignore[union-attr]
    fmt = kv_format(kv_dtype)
    if k.shape[1] != h or dp != fmt.row_elems(d) or (fmt.needs_even_head_dim and d % 2):  # type: ignore[union-attr]
        raise ValueError(f"{names[0]}: expected [n, {h}, D] matching pool {fmt_shape(pool.shape)} "
                         f"(kv_dtype {kv_dtype!r}), got {fmt_shape(k.shape)}")  # type: ignore[union-attr]
    if kv_dtype == "auto" and pool.dtype != k.dtype:  # type: ignore[union-attr]
        raise ValueError(f"{names[0]}: expected dtype {pool.dtype} (the pool's, kv_dtype 'auto'), got {k.dtype}")  # type: ignore[union-attr]
    for name, t in zip(names, (k, v)):
        if t.stride(2) != 1:  # type: ignore[union-attr]
            raise ValueError(f"{name}: expected head_dim to be contiguous (stride 1), got strides {tuple(t.stride())}")  # type: ignore[union-attr]
    return d


def check_rope(rope, d: int, device: torch.device):  # type: ignore[no-untyped-def]
    if rope is None:
        return None
    if not isinstance(rope, RopeKernelParams):
        raise TypeError(
            f"rope: expected RopeKernelParams (RopeConfig.kernel_params(device=...)), got {type(rope).__name__}"
        )
    for attr in ("inv_freq", "attention_scaling", "rotary_dim", "interleaved"):
        if not hasattr(rope, attr):
            raise TypeError(
                f"rope: expected RopeKernelParams (RopeConfig.kernel_params(...)), got {type(rope).__name__}"
            )
    rot = rope.rotary_dim
    if not isinstance(rot, int) or rot < 2 or rot % 2 or rot > d:
        raise ValueError(f"rope: expected an even rotary_dim in [2, {d}], got {rot}")
    inv = rope.inv_freq
    if not isinstance(inv, torch.Tensor) or inv.dtype != torch.float32 or tuple(inv.shape) != (rot // 2,):
        raise ValueError(f"rope: expected inv_freq float32 [{rot // 2}], got {getattr(inv, 'dtype', None)} "
                         f"{fmt_shape(getattr(inv, 'shape', ()))}")
    if inv.device != device:
        raise ValueError(f"rope: expected inv_freq on {device} (the device of pool), got {inv.device}")
    if not inv.is_contiguous():
        raise ValueError("rope: expected a contiguous inv_freq")
    top = getattr(rope, "max_inv_freq", 0.0)
    if isinstance(top, bool) or not isinstance(top, (int, float)) or not math.isfinite(top) or top < 0:
        raise ValueError(f"rope: expected max_inv_freq a finite float >= 0 (0.0: unknown), got {top!r}")
    return rope


def check_attention_options(scale: object, window: object, softcap: object
                            ) -> tuple[float | None, int | None, float | None]:
    """Attention's ``scale`` (None: ``1 / sqrt(head_dim)``, resolved by the launch), sliding ``window`` and
    ``softcap``, validated; TypeError / ValueError naming the argument."""
    if window is not None:
        check_int("window", window, 1, 2**31 - 1)
    return _positive_float("scale", scale, "a float"), window, _positive_float("softcap", softcap, "a float or None")


def _positive_float(name: str, value: object, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected {what}, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a finite float > 0{'' if name == 'scale' else ' or None'}, got {value!r}")
    return float(value)


def host_check_rope_bound(rope) -> None:  # type: ignore[no-untyped-def]
    # check=True: max_inv_freq must bound inv_freq (it selects the cos / sin evaluation by each row's largest angle)
    if rope is not None and rope.max_inv_freq and float(rope.inv_freq.abs().max()) > rope.max_inv_freq:
        raise ValueError(f"rope: max_inv_freq {rope.max_inv_freq} is below max |inv_freq| "
                         f"{float(rope.inv_freq.abs().max())}")


def check_index_vector(name: str, t: object, n: int | None, device: torch.device,
                       dtypes: tuple[torch.dtype, ...] = (torch.int32,)) -> torch.Tensor:
    """:func:`kvcache._validate.check_index_vector` for an index vector that must live on the pool's device."""
    return _check_index_vector(name, t, n, device, dtypes=dtypes, ref="pool")


def check_fp8_scales(fp8_scales: object, kv_dtype: str, device: torch.device) -> torch.Tensor | None:
    if not kv_format(kv_dtype).per_layer_scale:
        return None
    if fp8_scales is None:
        raise ValueError(f"fp8_scales: expected a float32 tensor [2] (k_scale, v_scale) for kv_dtype {kv_dtype!r}")
    t = check_arg_tensor("fp8_scales", fp8_scales, dtypes=(torch.float32,), ndim=1, device=device)
    if t.shape[0] != 2 or not t.is_contiguous():
        raise ValueError(f"fp8_scales: expected a contiguous float32 tensor [2], got {fmt_shape(t.shape)}")
    return t




def host_check_ragged(n, nb, bs, block_tables, cu_q_lens, kv_lens, cu_k_lens, cp_rank, cp_size,  # type: ignore[no-untyped-def]
                      spare: bool = False) -> None:
    # spare (int4b): a partial last block needs the block after it, and so does a block this call fills from a
    # partial one (its earlier key rows' second halves are there)
    cu = cu_q_lens.tolist()
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > n:
        raise ValueError(f"cu_q_lens: expected non-decreasing from 0 to at most {n} (rows of k), got {cu}")
    b = len(cu) - 1
    if kv_lens is not None:
        starts = kv_lens.tolist()
        if any(s < 0 for s in starts):
            raise ValueError(f"kv_lens: expected values >= 0, got {starts}")
        totals = [starts[i] + cu[i + 1] - cu[i] for i in range(b)]
    else:
        ck = cu_k_lens.tolist()
        totals = [ck[i + 1] - ck[i] for i in range(b)]
        if ck[0] != 0 or any(totals[i] < cu[i + 1] - cu[i] for i in range(b)):
            raise ValueError(f"cu_k_lens: expected from 0 with every total >= its new tokens, got {ck}")
    width = block_tables.shape[1]
    tables = block_tables.tolist()
    for i in range(b):
        local = max(totals[i] - cp_rank + cp_size - 1, 0) // cp_size  # positions p with p % cp_size == cp_rank
        need = -(-local // bs)
        if spare:
            start = totals[i] - (cu[i + 1] - cu[i])
            need = max(need + (local % bs > 0), start // bs + 2 if start % bs and local > start else 0)
        if need > width:
            raise ValueError(f"block_tables: sequence {i} needs {need} blocks for {totals[i]} tokens, the table holds "
                             f"{width}")
        bad = [x for x in tables[i][:need] if not 0 <= x < nb]
        if bad:
            raise ValueError(f"block_tables: sequence {i} uses block ids {bad} outside [0, {nb})")
    # two rows written to one slot (a block shared by sequences that both write into it): which one lands is
    # up to the device's scheduling, so the debug mode refuses it
    seen: dict[int, int] = {}
    for i in range(b):
        start = totals[i] - (cu[i + 1] - cu[i])
        for p in range(max(start, 0), totals[i]):
            if p % cp_size != cp_rank:
                continue
            lp = p // cp_size
            slot = tables[i][lp // bs] * bs + lp % bs
            if slot in seen:
                raise ValueError(f"block_tables: sequences {seen[slot]} and {i} both write slot {slot} (block "
                                 f"{slot // bs}, offset {slot % bs}) in one append")
            seen[slot] = i


def host_check_slots(slots: list[int], nb: int, bs: int) -> None:
    """Debug checks of a slot mapping: -1 or a slot of the pool, no slot written twice."""
    bad = [x for x in slots if x < -1 or x >= nb * bs]
    if bad:
        raise ValueError(f"slot_mapping: expected -1 or slots in [0, {nb * bs}), got {bad[:8]}")
    written = [x for x in slots if x >= 0]
    if len(set(written)) != len(written):
        dup = sorted({x for x in written if written.count(x) > 1})
        raise ValueError(f"slot_mapping: expected each slot at most once per append, got {dup[:8]} more than once")


def host_check_fp8_scales(fp8_scales: torch.Tensor, kv_dtype: str = "fp8") -> None:
    """Debug check of fp8 (k_scale, v_scale): finite and > 0 (a scale of 0 would store NaN / +-448); fp8k reads
    v_scale alone."""
    vals = fp8_scales.tolist()
    used = [vals[i] for i in kv_format(kv_dtype).layer_scales]
    if not all(math.isfinite(x) and x > 0 for x in used):
        raise ValueError(f"fp8_scales: expected finite scales > 0, got {vals}")


