"""Greedy argmax over logits rows: ``torch.argmax(logits, dim=-1)`` as two Triton kernels, bit for bit.

``torch.argmax`` reduces each row in one thread block, so a decode step's ``[64, 128256]`` logits keep only 64
of an H100's SMs busy. Here each row is split into ``S`` contiguous chunks (grid ``(M, S)``): a program reduces
its chunk to a (key, index) pair and writes it to a small buffer, and a second kernel (grid ``(M,)``) reduces the
``S`` pairs of a row. When one chunk covers the row, the first kernel writes the result itself.

Order. Each value is compared through an int32 key computed from its bit pattern (read as the integer of the
same width; no float conversion, so subnormals are never flushed): ``key = +mag`` for a non-negative value and
``-mag`` for a negative one (``mag`` the pattern without its sign bit), which orders like the values, with
``-0.0`` and ``+0.0`` both at key 0 and ``-inf`` an ordinary value; every NaN (``mag`` above that of ``+inf``)
gets the largest key, ``0x7FFFFFFF``. Between equal keys the smaller index wins. That is ``torch.argmax``'s rule:
the first maximum, NaN above everything (the first NaN), signed zeros equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._backend import kernel, use_triton
from ..._validate import (
    cdiv,
    check_contiguous,
    check_device,
    check_dtype,
    check_ndim,
    check_shape,
    check_tensor,
    next_pow2,
)
from ...ops._pdl import pdl_enter, pdl_options

__all__ = ["argmax"]

# dtype -> (same-width integer dtype of its bit patterns, magnitude mask, +inf's pattern)
_BITS = {
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
}
_BLOCK = 2048  # elements a program loads per loop iteration (a tile)
_MIN_CHUNK = 2 * _BLOCK  # fewest elements of a row one program reduces when the row is split
_TARGET_PROGRAMS = 4 * 132  # stage-1 programs aimed at: 4 per SM of an H100
_STAGE1_WARPS = 8  # 8 elements a thread a tile: one 16-byte load in bf16 / fp16, two in float32
# Row lengths up to this keep every column index, and a chunk's end, inside int32; longer rows go to torch.
_MAX_COLS = 2**30

_KEY_NAN = tl.constexpr(0x7FFFFFFF)  # every NaN: above +inf (float32's key 0x7F800000)
_KEY_NONE = tl.constexpr(-(2**31))  # a masked-out lane: below -inf (-0x7F800000), so it never wins
_IDX_NONE = tl.constexpr(0x7FFFFFFF)  # index of "no candidate": loses every tie


@triton.jit
def _key(bits, MAG: tl.constexpr, INF: tl.constexpr):
    """int32 key of floats given as their bit patterns (int16 / int32) that orders like the values: sign and
    magnitude to two's complement (-0.0 and +0.0 -> 0), every NaN (magnitude above INF's) -> the largest key."""
    b = bits.to(tl.int32)  # sign-extends int16
    mag = b & MAG
    key = tl.where(b < 0, -mag, mag)
    return tl.where(mag > INF, _KEY_NAN, key)


@kernel(ints=("n_cols", "s_row_v", "tiles"))
def _argmax_chunk_kernel(x, part, out, n_cols, s_row_v, tiles, MAG: tl.constexpr, INF: tl.constexpr,
                         VEC: tl.constexpr, BLOCK: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr):
    """Program (row, c): the best (key, first index) of columns ``[c * tiles * BLOCK, ...)`` of ``row``, clipped
    to ``n_cols``. ``x`` holds the floats' bit patterns (int16 / int32; MAG, INF: the magnitude mask and +inf's
    pattern). DIRECT: the index goes to ``out[row]``; else the packed pair to ``part[row, c]``."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    # the row stride comes divided by VEC: the product proves 16-byte alignment of the row to the compiler
    base = x + row * s_row_v * VEC
    lo = c * tiles * BLOCK
    n = tl.minimum(n_cols - lo, tiles * BLOCK)
    n_full = n // BLOCK
    lanes = tl.arange(0, BLOCK)
    # per lane: the largest key seen and its first column (a later tile replaces it only with a larger key)
    best_k = tl.full([BLOCK], _KEY_NONE, tl.int32)
    best_i = tl.full([BLOCK], _IDX_NONE, tl.int32)
    for t in range(n_full):
        cols = lo + t * BLOCK + lanes
        k = _key(tl.load(base + cols), MAG, INF)
        better = k > best_k
        best_k = tl.where(better, k, best_k)
        best_i = tl.where(better, cols, best_i)
    if n_full * BLOCK < n:  # the row's last, partial tile
        cols = lo + n_full * BLOCK + lanes
        ok = cols < n_cols
        k = tl.where(ok, _key(tl.load(base + cols, mask=ok, other=0), MAG, INF), _KEY_NONE)
        better = k > best_k
        best_k = tl.where(better, k, best_k)
        best_i = tl.where(better, cols, best_i)
    k_max = tl.max(best_k, 0)
    i_first = tl.min(tl.where(best_k == k_max, best_i, _IDX_NONE), 0)
    if DIRECT:
        tl.store(out + row, i_first.to(tl.int64))
    else:
        # key in the high word, (IDX_NONE - index) in the low one: the larger int64 is the better pair
        packed = (k_max.to(tl.int64) << 32) | (-i_first.to(tl.int64) + _IDX_NONE)
        tl.store(part + row * tl.num_programs(1) + c, packed)


@kernel(ints=("n_chunks",))
def _argmax_combine_kernel(part, out, n_chunks, S_P: tl.constexpr, PDL: tl.constexpr):
    """Program row: the best of the ``n_chunks`` packed pairs ``part[row, :]``; its index to ``out[row]``."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, S_P)
    p = tl.load(part + row * n_chunks + offs, mask=offs < n_chunks, other=-9223372036854775808)
    best = tl.max(p, 0)
    tl.store(out + row, -(best & 0xFFFFFFFF) + _IDX_NONE)


def _plan(n_rows: int, n_cols: int, block: int = _BLOCK, min_chunk: int = _MIN_CHUNK,
          target: int = _TARGET_PROGRAMS) -> tuple[int, int]:
    """``(S, chunk)``: each row is split into ``S`` chunks of ``chunk`` columns (a multiple of ``block``; the
    last chunk is shorter), so that ``n_rows * S`` is about ``target`` and a chunk holds at least about
    ``min_chunk`` columns. Every chunk is non-empty. ``n_rows >= 1``, ``n_cols >= 1``."""
    s = max(1, min(cdiv(n_cols, min_chunk), cdiv(target, n_rows)))
    chunk = cdiv(cdiv(n_cols, s), block) * block
    return cdiv(n_cols, chunk), chunk


def _check(logits: object, out: object) -> torch.Tensor:
    logits = check_tensor("logits", logits)
    if logits.dtype not in _BITS:
        raise ValueError(f"logits: expected a float16 / bfloat16 / float32 tensor, got {logits.dtype}")
    check_ndim("logits", logits, 2, "[M, V]")
    n_rows, n_cols = logits.shape
    if n_cols == 0:
        raise ValueError(f"logits: expected at least one column (V >= 1), got shape [{n_rows}, 0]")
    if n_cols > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits: expected contiguous rows (stride(1) == 1), got strides {tuple(logits.stride())}")
    if out is not None:
        out = check_tensor("out", out)
        check_dtype("out", out, torch.int64)
        check_shape("out", out, (n_rows,))
        check_device("out", out, logits.device, "logits")
        check_contiguous("out", out)
    return logits


def argmax(logits: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Index of the maximum of each row: ``torch.argmax(logits, dim=-1)``, bit for bit.

    Ties go to the first (smallest) index; NaN counts as larger than every number (a row holding NaN gives its
    first NaN); ``-0.0`` equals ``+0.0``; ``-inf`` and ``+inf`` are ordinary values (a row of ``-inf`` gives 0).
    On CUDA (or under ``KVCACHE_TRITON_INTERPRET=1``) two Triton kernels split every row over several programs;
    elsewhere ``torch.argmax`` runs. No host sync; capturable in a CUDA graph. On compute capability >= 9.0 the
    kernels use programmatic dependent launch (unless ``KVCACHE_PDL=0``).

    Parameters
    ----------
    logits : torch.Tensor
        ``[M, V]``, float16 / bfloat16 / float32, ``M >= 0``, ``V >= 1``, ``stride(1) == 1`` (any row stride:
        a row slice of a larger tensor works).
    out : torch.Tensor, optional
        ``[M]`` int64, contiguous, on ``logits``' device: written in place and returned. Checked before anything
        is written.

    Returns
    -------
    torch.Tensor
        ``[M]`` int64: ``out`` when given, else a new tensor.

    Raises
    ------
    TypeError
        ``logits`` or ``out`` is not a tensor.
    ValueError
        A wrong dtype, shape, layout or device of ``logits`` or ``out``.

    Example
    -------
    >>> argmax(torch.tensor([[1.0, 3.0, 3.0], [float("nan"), 2.0, float("nan")]]))
    tensor([1, 0])
    """
    logits = _check(logits, out)
    n_rows, n_cols = logits.shape
    device = logits.device
    if not use_triton(device) or n_cols > _MAX_COLS:
        if out is None:
            return torch.argmax(logits, dim=-1)
        return torch.argmax(logits, dim=-1, out=out)
    if out is None:
        out = torch.empty(n_rows, dtype=torch.int64, device=device)
    if n_rows == 0:
        return out
    n_chunks, chunk = _plan(n_rows, n_cols)
    vec = 16 // logits.element_size()
    s_row = logits.stride(0)
    if s_row % vec:
        vec = 1
    int_dtype, mag, inf = _BITS[logits.dtype]
    pdl = pdl_options(device)
    direct = n_chunks == 1
    part = out if direct else torch.empty((n_rows, n_chunks), dtype=torch.int64, device=device)
    _argmax_chunk_kernel.launch(device, (n_rows, n_chunks), logits.view(int_dtype), part, out, n_cols,
                                s_row // vec, chunk // _BLOCK, MAG=mag, INF=inf, VEC=vec, BLOCK=_BLOCK, DIRECT=direct,
                                num_warps=_STAGE1_WARPS, **pdl)
    if not direct:
        s_p = next_pow2(n_chunks)
        _argmax_combine_kernel.launch(device, (n_rows,), part, out, n_chunks, S_P=s_p,
                                      num_warps=min(4, max(1, s_p // 64)), **pdl)
    return out
