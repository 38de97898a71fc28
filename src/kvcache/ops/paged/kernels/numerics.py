"""Float32 helpers shared by the paged kernels: IEEE rounding, quantization codes, the fp8 grid, sin / cos."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _round_even(y, LIBDEVICE: tl.constexpr):
    # round half to even (0 <= y < 2**22): cvt.rni on the GPU, the same result by formula elsewhere
    if LIBDEVICE:
        return libdevice.rint(y)
    else:
        r = tl.floor(y + 0.5)
        tie = (r - y) == 0.5
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _codes(y, LIBDEVICE: tl.constexpr):
    # int32 whose low byte is the code round-half-to-even(y), for float32 0 <= y < qmax + 1/2 (qmax <= 255): adding
    # 2**23 leaves an ulp of 1, so the IEEE addition rounds y half to even into the low mantissa bits (two float
    # ops instead of the quarter-rate cvt.rni and cvt.rzi). The callers keep the low byte (int4: the low
    # nibbles). No clamp is needed: y = RN(RN(x - min) * RN(1 / RN((max - min) / qmax))) with min <= x <= max
    # is >= 0, and at most qmax * (1 + 2**-24)**3 < qmax + 1/2. The addition must round on its own: fused with
    # the product that makes y (the compiler's default) it rounds once, and codes at ties move by one.
    if LIBDEVICE:
        r = libdevice.add_rn(y, 8388608.0)  # add.rn: never contracted into a multiply-add
    else:
        r = y + 8388608.0  # the interpreter does not fuse
    return r.to(tl.int32, bitcast=True)


@triton.jit
def _div(a, b, LIBDEVICE: tl.constexpr):
    # IEEE round-to-nearest division (triton's `/` on float32 is an approximation on the GPU)
    if LIBDEVICE:
        return libdevice.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _rcp(x, LIBDEVICE: tl.constexpr):
    # IEEE round-to-nearest 1 / x (the same value as _div(1, x); one rcp.rn on the GPU)
    if LIBDEVICE:
        return libdevice.rcp_rn(x)
    else:
        return 1.0 / x


@triton.jit
def _fp8_grid(y, LIBDEVICE: tl.constexpr):
    # y (float32, |y| <= 448) rounded half-to-even onto the float8 e4m3 grid, in float32 arithmetic. Used
    # under the CPU interpreter, whose float32 -> fp8 conversion drops the carry into the next binade
    # (-0.49 -> -0.25); converting an exactly representable value is exact there.
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 |y|) for normal floats
    qe = tl.maximum(e, -6) - 3  # e4m3: 3 mantissa bits, smallest normal exponent -6
    quantum = ((qe + 127) << 23).to(tl.float32, bitcast=True)
    r = _round_even(a / quantum, LIBDEVICE) * quantum  # division by a power of two: exact
    return tl.where(y.to(tl.int32, bitcast=True) < 0, -r, r)  # the sign bit: -0.0 stays -0.0


_SINCOS_MAX = tl.constexpr(1.0e5)  # _sincos's range (radians)


@triton.jit
def _sincos(x):
    # (cos x, sin x) of float32 x, 0 <= |x| <= 1e5, in ~25 branch-free float32 operations (libdevice's cosf and
    # sinf each reduce the argument separately and branch). x = q * pi/2 + r with |r| <= pi/4 (Cody-Waite: pi/2
    # as 1.5703125 + 4.8446655e-4 - 6.4074993e-7 + 9.9209363e-10, the first three with <= 8 significant bits,
    # so q * part is exact for q < 2**16 and the first subtraction is exact: the reduction does not rely on
    # fused multiply-adds, which the interpreter does not fuse), Cephes' minimax polynomials on r (degree 7
    # for sin, 8 for cos), and the quadrant q mod 4 selecting sign and function. Error <= 2**-22 absolute,
    # compiled (the compiler may fuse the polynomial's multiply-adds) and interpreted
    # (tests/paged/test_sincos.py), well inside the RoPE slack the tests allow.
    t = x * 0.6366197723675814 + 12582912.0  # 1.5 * 2**23: the sum holds round(x * 2 / pi) in its low bits
    quad = t.to(tl.int32, bitcast=True) & 3
    q = t - 12582912.0
    r = x - q * 1.5703125
    r = r - q * 0.000484466552734375
    r = r + q * 6.407499313354492e-07
    r = r - q * 9.92093629470503e-10
    r2 = r * r
    s = r + r * r2 * (-1.6666654611e-1 + r2 * (8.3321608736e-3 + r2 * -1.9515295891e-4))
    c = 1.0 - 0.5 * r2 + r2 * r2 * (4.166664568298827e-2 + r2 * (-1.388731625493765e-3 + r2 * 2.443315711809948e-5))
    odd = (quad & 1) != 0
    sin_x = tl.where(odd, c, s)
    cos_x = tl.where(odd, s, c)
    sin_x = tl.where((quad & 2) != 0, -sin_x, sin_x)
    cos_x = tl.where(((quad + 1) & 2) != 0, -cos_x, cos_x)
    return cos_x, sin_x


@triton.jit
def _sincos_full(x, LIBDEVICE: tl.constexpr):
    # (cos x, sin x) for any float32 x: libdevice on the GPU (full range reduction), numpy's under the interpreter
    if LIBDEVICE:
        return libdevice.cos(x), libdevice.sin(x)
    else:
        return tl.cos(x), tl.sin(x)

