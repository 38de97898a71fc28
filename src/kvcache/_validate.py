"""Argument validation shared by every public entry point.

Errors name the argument, the expected and the actual value, and are raised before any byte of a cache is
written. ``TypeError`` for a wrong type, ``ValueError`` for a wrong value (shape, dtype, device, range,
layout). Never ``assert``: it is gone under ``python -O``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Storage dtypes of the linear caches. fp8 is stored bytes: scales belong to attention. float32 is the CPU
# models' default dtype (copies move 4-byte words like any other width).
KV_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float32)
MODEL_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)  # paged caches' K / V

# Same-width integer dtypes used to move bytes without touching their values (no NaN canonicalisation).
_BITS_DTYPES: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fmt_shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def check_ndim(name: str, t: torch.Tensor, ndim: int, what: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor {what}, got shape {fmt_shape(t.shape)}")


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {fmt_shape(shape)}, got {fmt_shape(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, dtypes: torch.dtype | Sequence[torch.dtype]) -> None:
    allowed = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
    if t.dtype not in allowed:
        want = " or ".join(str(d) for d in allowed)
        raise ValueError(f"{name}: expected dtype {want}, got {t.dtype}")


def check_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name}: expected dtype {ref.dtype} (the dtype of {ref_name}), got {t.dtype}")


def check_device(name: str, t: torch.Tensor, device: torch.device, ref_name: str) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of {ref_name}), got {t.device}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())} for shape "
            f"{fmt_shape(t.shape)}"
        )


def check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    """Check an integer in ``[lo, hi]`` (inclusive bounds; None = unbounded)."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected a Python int, got a tensor (pass int(x) explicitly)")
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}: expected an int <= {hi}, got {value}")
    return value


def check_dtype_in(name: str, dtype: object, allowed: tuple[torch.dtype, ...]) -> torch.dtype:
    """``dtype`` if it is one of ``allowed``; TypeError for a non-dtype, ValueError for another dtype."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name}: expected a torch.dtype, got {type(dtype).__name__}")
    if dtype not in allowed:
        raise ValueError(f"{name}: expected one of {', '.join(str(d) for d in allowed)}, got {dtype}")
    return dtype


def check_kv_dtype(name: str, dtype: object) -> torch.dtype:
    """A dtype of the linear caches' storage: one of :data:`KV_DTYPES`."""
    return check_dtype_in(name, dtype, KV_DTYPES)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same memory viewed as the integer dtype of the same width (copies move bits, not values)."""
    target = _BITS_DTYPES.get(t.element_size())
    if target is None:
        raise TypeError(f"unsupported element size {t.element_size()} bytes for dtype {t.dtype}")
    if t.dtype == target:
        return t
    return t.view(target)


def check_bits_dtype(name: str, t: torch.Tensor) -> None:
    if t.element_size() not in _BITS_DTYPES or t.is_complex():
        raise TypeError(f"{name}: dtype {t.dtype} is not supported (element size must be 1, 2, 4 or 8 bytes)")


def vec_elems(element_size: int, values: Sequence[int]) -> int:
    """Largest power-of-two number of elements, at most 16 bytes, that divides every value in ``values``.

    The kernels take strides and lengths in units of this many elements (and multiply by it as a constexpr),
    which proves to the compiler that rows start on 16-byte boundaries whenever they really do: vector loads
    and stores. It is only ever as large as what the values prove.
    """
    vec = max(1, 16 // element_size)
    g = 0
    for v in values:
        g |= v  # the lowest set bit of the OR is the largest power of two dividing every value
    return vec if g == 0 else min(vec, g & -g)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints (plain Python: ``triton.cdiv`` is slow to call from the host)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()


def check_tensor_arg(name: str, t: object, *, dtypes: tuple[torch.dtype, ...], ndim: int, device: torch.device,
                     ref: str) -> torch.Tensor:
    """``t`` as a tensor of one of ``dtypes`` with ``ndim`` dims on ``device`` (the device of the argument
    ``ref``); TypeError / ValueError naming ``name``, the expected and the actual value otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor, got shape {fmt_shape(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of {ref}), got {t.device}")
    return t


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of the strings ``choices``; TypeError / ValueError naming ``name`` otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected one of {choices}, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
    return value


def check_index_vector(name: str, t: object, n: int | None, device: torch.device, *,
                       dtypes: tuple[torch.dtype, ...] = (torch.int32,), ref: str = "pool") -> torch.Tensor:
    """``t`` as a contiguous 1-d tensor of one of ``dtypes`` (``n`` entries unless None) on ``device`` (the device
    of the argument ``ref``): the index vectors of a batch (lengths, cumulative lengths, slots, positions)."""
    check_tensor_arg(name, t, dtypes=dtypes, ndim=1, device=device, ref=ref)
    if n is not None and t.shape[0] != n:  # type: ignore[union-attr]
        raise ValueError(f"{name}: expected shape [{n}], got {fmt_shape(t.shape)}")  # type: ignore[union-attr]
    if t.shape[0] > 1 and t.stride(0) != 1:  # type: ignore[union-attr]
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")  # type: ignore[union-attr]
    return t  # type: ignore[return-value]


def check_cp(cp_rank: object, cp_size: object) -> tuple[int, int]:
    """Context-parallel rank and size: ints with ``cp_size >= 1`` and ``0 <= cp_rank < cp_size``."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, int):
        raise TypeError(f"cp_size: expected an int, got {type(cp_size).__name__}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int):
        raise TypeError(f"cp_rank: expected an int, got {type(cp_rank).__name__}")
    if cp_size < 1:
        raise ValueError(f"cp_size: expected an int >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank: expected 0 <= cp_rank < cp_size={cp_size}, got {cp_rank}")
    return cp_rank, cp_size
