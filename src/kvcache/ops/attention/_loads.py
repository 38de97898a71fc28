"""Loads of K / V tiles and of their (scale, zero) pairs, shared by the attention kernel's tiles (any rank: the
caller builds the offsets and masks of its own tile shape)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._convert import codes_to, u4_to, u8_to


@triton.jit
def _load_kv(pool, off, m_lo, m_hi, H1: tl.constexpr, QUANT: tl.constexpr, DT: tl.constexpr, RAW: tl.constexpr,
             INTERP: tl.constexpr):
    """The two halves of K or V rows: elements ``[0, H1)`` at ``pool + off`` (mask ``m_lo``) and ``[H1, D)`` at
    ``pool + off + H1`` (mask ``m_hi``; int4: the high nibbles of the same bytes).

    ``RAW``: as stored (16-bit values, fp8 values, int8 codes as uint8, int4 byte rows as uint8 twice); the caller
    converts at the dot (prefill tiles dequantize int8 / int4 there). Else (int8 / int4 decode tiles only) the
    codes as exact ``DT`` values, by the inline-PTX form of :mod:`._convert` when compiled.

    int4: one load of the byte row; the low nibbles are the first half, the high nibbles the second. fp8 pools
    arrive as their bytes (uint8), so masked lanes read as +0.0 (a masked load's ``other`` cannot be an fp8
    constant), then bitcast.
    """
    if QUANT == 3:
        raw = tl.load(pool + off, mask=m_lo, other=0)
        if RAW:
            lo = raw
            hi = raw
        elif INTERP or DT == tl.float32:
            lo = codes_to(raw & 15, DT, 4)
            hi = codes_to(raw >> 4, DT, 4)
        else:
            lo, hi = u4_to(raw, DT)
    else:
        lo = tl.load(pool + off, mask=m_lo, other=0)
        hi = tl.load(pool + off + H1, mask=m_hi, other=0)
        if QUANT == 1:
            b_lo = lo
            b_hi = hi
            lo = b_lo.to(tl.float8e4nv, bitcast=True)
            hi = b_hi.to(tl.float8e4nv, bitcast=True)
            if INTERP:  # the interpreter reads the NaN bytes 0x7F / 0xFF as +-480: decode them by hand
                lo = tl.where((b_lo & 0x7F) == 0x7F, float("nan"), lo.to(tl.float32))
                hi = tl.where((b_hi & 0x7F) == 0x7F, float("nan"), hi.to(tl.float32))
        elif QUANT == 2 and not RAW:
            if INTERP or DT == tl.float32:
                lo = codes_to(lo, DT, 8)
                hi = codes_to(hi, DT, 8)
            else:
                lo = u8_to(lo, DT)
                hi = u8_to(hi, DT)
    return lo, hi


@triton.jit
def _load_params(qparams, pbase, ok_n):
    """(scale, zero) of each token of a tile (``pbase`` ``[N]``): one 8-byte load per token, split in registers."""
    par = tl.load(qparams + pbase[:, None] + tl.arange(0, 2)[None, :], mask=ok_n[:, None], other=0.0)
    return tl.split(par)


@triton.jit
def _load_params2(qparams, pbase, ok_n):
    """:func:`_load_params` of a ``[W, N]`` tile of tokens (warp-split decode tiles)."""
    par = tl.load(qparams + pbase[:, :, None] + tl.arange(0, 2)[None, None, :], mask=ok_n[:, :, None], other=0.0)
    return tl.split(par)
