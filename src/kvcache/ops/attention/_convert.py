"""int8 / int4 codes -> the attention dots' operand dtype, inside the attention kernel.

Exact conversions, two forms with the same results (and one offset form, below):

* :func:`codes_to` / :func:`codes_f32`: Triton ops (every target dtype; the interpreter's form).
* :func:`u8_to` / :func:`u4_to`: inline PTX on whole 32-bit registers (four int8 or eight int4 codes at a
  time; int8 to float16, int4 to float16 or bfloat16), used by decode tiles: byte permutes (``prmt``) build
  two magic-number values at a time and one packed subtraction removes the magic. The asm is declared impure,
  so Triton keeps the conversion in the register layout of the load and the 16-bit operand reaches the tensor
  cores through shared memory with ``ldmatrix``; a pure conversion is moved after the shared-memory read into
  the MMA operand layout, which reads the 8-bit V operand one byte per instruction. On sm_90 this cuts a
  128-key int4 decode tile from ~1,700 to ~1,000 instructions per warp and its registers from ~240 to ~170;
  int8 decode at head_dim 64 runs 12% faster (H100, docs/tuning-history.md).

* :func:`u8_magic`: not exact but offset, the magic numbers themselves, ``1024 + c`` in float16, for the decode
  tiles' int8 V operand, whose offset the attention kernel removes after the dots (two permutes per four codes).

Prefill tiles dequantize instead, :func:`dequant` (``codes * scale + zero`` of K and V): inline PTX on the same
registers, the magic-number rule then packed 16-bit ``fma`` with the token's (scale, zero): 1.5 instructions per
float16 int8 element against ~4.5 for float32 math and ~2.5 for Triton's own 16-bit ops (a byte extraction and a
merge per pair). It is declared pure; the impure form compiles to the same SASS (the codes are read from shared
memory either way).

Magic-number rule: ORed into the low mantissa bits of a power of two ``M`` whose ulp is 1, a code ``c`` gives
exactly ``M + c``, and subtracting ``M`` is exact. fp16: bits ``0x6400 | c`` = 1024 + c (any 8-bit code);
bf16: ``0x4300 | c`` = 128 + c (4-bit codes); fp32: ``0x4B000000 | c`` = 2^23 + c. bf16 of an 8-bit code (up to
255, past the bf16 rule) is the fp32 value rounded to bf16, exact (8 significant bits at most).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def codes_f32(c):
    """Exact float32 value of unsigned integer codes ``c`` (``c < 2^23``) by the magic-number rule."""
    return (c.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _f16_magic(c):
    """float16 ``1024 + c`` of unsigned 8-bit codes ``c``, exact: the code ORed into the mantissa of 1024."""
    return (c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)


@triton.jit
def codes_to(c, DT: tl.constexpr, NBITS: tl.constexpr):
    """Exactly ``c.to(DT)`` for ``NBITS``-bit unsigned codes ``c`` (uint8 tensor; 8: int8, 4: int4) by Triton ops
    (the interpreter's form, and float32 targets)."""
    if DT == tl.float16:
        out = _f16_magic(c) - 1024.0
    elif DT == tl.bfloat16:
        if NBITS <= 7:
            out = (c.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True) - 128.0
        else:
            f = codes_f32(c).to(tl.uint32, bitcast=True)
            out = (f >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        tl.static_assert(DT == tl.float32, "codes_to: float16, bfloat16 or float32 targets only")
        out = codes_f32(c)
    return out


# ---- compiled forms: one 32-bit input register = four bytes b0..b3; outputs are packed pairs (low half first) ----

def _u8_f16(k: str) -> str:
    """int8: the four codes in ``$2`` -> float16 pairs ``$0`` (b0, b1) and ``$1`` (b2, b3) of ``1024 + c - k``:
    ``prmt`` builds the magic-number halves, one packed subtraction removes ``k``."""
    return (f"mov.b32 m, 0x64646464;\nmov.b32 k, {k};\nprmt.b32 $0, $2, m, 0x5140;\nprmt.b32 $1, $2, m, 0x5342;\n"
            "sub.f16x2 $0, $0, k;\nsub.f16x2 $1, $1, k;\n")


def _u4_pairs(magic4: str, magic2: str, sub: str) -> str:
    """int4: the byte rows in ``$4`` (byte i: element i of the first half in its low nibble, of the second half in
    its high nibble) -> low-nibble pairs ``$0``, ``$1`` and high-nibble pairs ``$2``, ``$3``: the nibbles ORed into
    the magic ``magic4`` by ``prmt``, then ``sub`` (which removes ``k = magic2``)."""
    return (f"mov.b32 m, {magic4};\nmov.b32 k, {magic2};\nand.b32 t, $4, 0x0F0F0F0F;\nshr.b32 u, $4, 4;\n"
            "and.b32 u, u, 0x0F0F0F0F;\nprmt.b32 $0, t, m, 0x5140;\nprmt.b32 $1, t, m, 0x5342;\n"
            "prmt.b32 $2, u, m, 0x5140;\nprmt.b32 $3, u, m, 0x5342;\n" + sub)


_SUB_F16 = "sub.f16x2 $0, $0, k;\nsub.f16x2 $1, $1, k;\nsub.f16x2 $2, $2, k;\nsub.f16x2 $3, $3, k;\n"
# bfloat16: x * 1 + k
_SUB_BF16 = ("mov.b32 one, 0x3F803F80;\nfma.rn.bf16x2 $0, $0, one, k;\nfma.rn.bf16x2 $1, $1, one, k;\n"
             "fma.rn.bf16x2 $2, $2, one, k;\nfma.rn.bf16x2 $3, $3, one, k;\n")
_U8_F16 = tl.constexpr("{\n.reg .b32 m, k;\n" + _u8_f16("0x64006400") + "}")
_U4_F16 = tl.constexpr("{\n.reg .b32 t, u, m, k, one;\n" + _u4_pairs("0x64646464", "0x64006400", _SUB_F16) + "}")
# bf16: 0x43cc = 128 + c; then x * 1 + (-128) (0xC300), exact
_U4_BF16 = tl.constexpr("{\n.reg .b32 t, u, m, k, one;\n" + _u4_pairs("0x43434343", "0xC300C300", _SUB_BF16) + "}")


@triton.jit
def u8_to(raw, DT: tl.constexpr):
    """int8 codes (uint8 tensor) -> exact float16 values, compiled form (decode tiles run int8 dots in float16:
    bfloat16 queries are rescaled to float16, see the attention kernel)."""
    tl.static_assert(DT == tl.float16, "u8_to: float16 only")
    return tl.inline_asm_elementwise(_U8_F16, "=r,=r,r", [raw], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def u4_to(raw, DT: tl.constexpr):
    """int4 byte rows (uint8 tensor) -> (low nibbles, high nibbles) as exact ``DT`` values, compiled form."""
    if DT == tl.float16:
        lo, hi = tl.inline_asm_elementwise(_U4_F16, "=r,=r,=r,=r,r", [raw], dtype=(tl.float16, tl.float16),
                                           is_pure=False, pack=4)
    else:
        tl.static_assert(DT == tl.bfloat16, "u4_to: float16 or bfloat16")
        lo, hi = tl.inline_asm_elementwise(_U4_BF16, "=r,=r,=r,=r,r", [raw], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=False, pack=4)
    return lo, hi


# int4b decode tiles: exact codes (as u4_to), then ``c * s + z`` per pair with each channel's float16 (scale, zero),
# one packed fma (one rounding); operands after the byte rows: low-half scale pairs, high-half scale pairs, then zeros
_U4_FMA_F16 = tl.constexpr("""{
.reg .b32 t, u, m, k, a0, a1, a2, a3;
mov.b32 m, 0x64646464;
mov.b32 k, 0x64006400;
and.b32 t, $4, 0x0F0F0F0F;
shr.b32 u, $4, 4;
and.b32 u, u, 0x0F0F0F0F;
prmt.b32 a0, t, m, 0x5140;
prmt.b32 a1, t, m, 0x5342;
prmt.b32 a2, u, m, 0x5140;
prmt.b32 a3, u, m, 0x5342;
sub.f16x2 a0, a0, k;
sub.f16x2 a1, a1, k;
sub.f16x2 a2, a2, k;
sub.f16x2 a3, a3, k;
fma.rn.f16x2 $0, a0, $5, $9;
fma.rn.f16x2 $1, a1, $6, $10;
fma.rn.f16x2 $2, a2, $7, $11;
fma.rn.f16x2 $3, a3, $8, $12;
}""")


@triton.jit
def u4_fma(raw, s_lo, s_hi, z_lo, z_hi):
    """int4 byte rows (uint8 tensor) and float16 (scale, zero) of the same shape for the low and the high nibbles ->
    float16 (``lo * s_lo + z_lo``, ``hi * s_hi + z_hi``), one rounding each, compiled form (declared impure, as
    :func:`u4_to`, so that it runs in the load's register layout)."""
    lo, hi = tl.inline_asm_elementwise(_U4_FMA_F16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [raw, s_lo, s_hi, z_lo, z_hi],
                                       dtype=(tl.float16, tl.float16), is_pure=False, pack=4)
    return lo, hi


# ---- decode tiles: int8 codes as float16 magic numbers, the offset left in (the kernel removes it after the dots) ----
MAGIC = tl.constexpr(1024.0)
_U8_F16_MAGIC = tl.constexpr("{\n.reg .b32 m;\nmov.b32 m, 0x64646464;\nprmt.b32 $0, $2, m, 0x5140;\n"
                             "prmt.b32 $1, $2, m, 0x5342;\n}")


@triton.jit
def u8_magic(raw, INTERP: tl.constexpr):
    """int8 codes ``c`` (uint8 tensor) -> float16 ``1024 + c``, exact: two byte permutes per four codes when
    compiled (declared impure, as :func:`u8_to`), Triton ops under the interpreter (the same bits)."""
    if INTERP:
        out = _f16_magic(raw)
    else:
        out = tl.inline_asm_elementwise(_U8_F16_MAGIC, "=r,=r,r", [raw], dtype=tl.float16, is_pure=False, pack=4)
    return out


# ---- prefill K / V tiles: codes * scale + zero per token in packed 16-bit math ----
# The codes are centred (c - 128, c - 8: exact) and the caller passes zero + 128 scale (+ 8 scale), so the zero's
# rounding is that of the token's mid-range and the scale's weighs at most 128 (8) steps. (scale, zero) arrive as
# 16-bit tensors broadcast over the token's elements: each packed pair holds those of its own two elements, whatever
# the layout (a pair is one token's in practice).
_UNPACK8_F16 = _u8_f16("0x64806480")  # centred: c - 128
# int8, bfloat16 (no bfloat16 magic number holds 8-bit codes): (1024 + c) - 1023 = c + 1 in float16, 1..256 with at
# most 8 significant bits, so its low 3 mantissa bits are 0; its bits >> 3 are the bfloat16 bits of (c + 1) * 2^-112
# (the high lane's zero low bits shift into the low lane's top), + 112 in both exponents gives c + 1, and
# (c + 1) * 1 - 129 = c - 128
_UNPACK8_BF16 = """mov.b32 m, 0x64646464;
mov.b32 k, 0x63FE63FE;
mov.b32 f, 0x38003800;
mov.b32 one, 0x3F803F80;
mov.b32 g, 0xC301C301;
prmt.b32 $0, $2, m, 0x5140;
prmt.b32 $1, $2, m, 0x5342;
sub.f16x2 $0, $0, k;
sub.f16x2 $1, $1, k;
shr.b32 $0, $0, 3;
shr.b32 $1, $1, 3;
add.u32 $0, $0, f;
add.u32 $1, $1, f;
fma.rn.bf16x2 $0, $0, one, g;
fma.rn.bf16x2 $1, $1, one, g;
"""
# int4, float16: prmt makes 0x64bb pairs (b: both nibbles of a byte); masking keeps 1024 + lo or 1024 + 16 hi, then
# (1024 + lo) - 1032 = lo - 8 and (1024 + 16 hi) / 16 - 72 = hi - 8
_UNPACK4_F16 = """mov.b32 m, 0x64646464;
mov.b32 k, 0x64086408;
mov.b32 f, 0x2C002C00;
mov.b32 g, 0xD480D480;
prmt.b32 a, $4, m, 0x5140;
prmt.b32 b, $4, m, 0x5342;
and.b32 $0, a, 0xFF0FFF0F;
and.b32 $1, b, 0xFF0FFF0F;
and.b32 $2, a, 0xFFF0FFF0;
and.b32 $3, b, 0xFFF0FFF0;
sub.f16x2 $0, $0, k;
sub.f16x2 $1, $1, k;
fma.rn.f16x2 $2, $2, f, g;
fma.rn.f16x2 $3, $3, f, g;
"""
# int4, bfloat16: the u4 unpacking into 128 + c, then (128 + c) * 1 - 136 = c - 8
_UNPACK4_BF16 = _u4_pairs("0x43434343", "0xC308C308", _SUB_BF16)


def _dequant_asm(unpack: str, n_out: int, ty: str, split: bool) -> tl.constexpr:
    """``unpack`` (centred codes into $0 .. $n_out-1, from the codes in $n_out), then per output pair ``c * s + z``
    (operands after the codes: scale pairs, with ``split`` the scale's low parts, then zero pairs), as
    ``fma.rn.{ty}``. ``split``: ``c * s_hi + (c * s_lo + z)``, the scale's rounding error carried by its low part."""
    sh, nxt = n_out + 1, n_out + 3
    sl = nxt if split else -1
    z = nxt + 2 if split else nxt
    body = ""
    for i in range(n_out):
        p = i % 2
        if split:
            body += f"fma.rn.{ty} t{i}, ${i}, ${sl + p}, ${z + p};\nfma.rn.{ty} ${i}, ${i}, ${sh + p}, t{i};\n"
        else:
            body += f"fma.rn.{ty} ${i}, ${i}, ${sh + p}, ${z + p};\n"
    regs = ".reg .b32 m, k, f, g, a, b, t, u, one, t0, t1, t2, t3;\n"
    return tl.constexpr("{\n" + regs + unpack + body + "}")


_DQ8_F16 = _dequant_asm(_UNPACK8_F16, 2, "f16x2", False)
_DQ8_F16_SPLIT = _dequant_asm(_UNPACK8_F16, 2, "f16x2", True)
_DQ8_BF16 = _dequant_asm(_UNPACK8_BF16, 2, "bf16x2", False)
_DQ8_BF16_SPLIT = _dequant_asm(_UNPACK8_BF16, 2, "bf16x2", True)
_DQ4_F16 = _dequant_asm(_UNPACK4_F16, 4, "f16x2", False)
_DQ4_F16_SPLIT = _dequant_asm(_UNPACK4_F16, 4, "f16x2", True)
_DQ4_BF16 = _dequant_asm(_UNPACK4_BF16, 4, "bf16x2", False)
_DQ4_BF16_SPLIT = _dequant_asm(_UNPACK4_BF16, 4, "bf16x2", True)


@triton.jit
def _round_to(x, VDT: tl.constexpr):
    """float32 ``x`` rounded to the nearest ``VDT`` value (ties to even), as float32: the interpreter's form of a
    compiled rounding (its own float32 -> bfloat16 cast truncates and loses subnormals)."""
    if VDT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        out = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        out = x.to(VDT).to(tl.float32)
    return out


@triton.jit
def _asm8(asm: tl.constexpr, constraints: tl.constexpr, args, VDT: tl.constexpr):
    """int8 codes -> ``VDT`` values by ``asm`` (four codes per call)."""
    if VDT == tl.float16:
        out = tl.inline_asm_elementwise(asm, constraints, args, dtype=tl.float16, is_pure=True, pack=4)
    else:
        out = tl.inline_asm_elementwise(asm, constraints, args, dtype=tl.bfloat16, is_pure=True, pack=4)
    return out


@triton.jit
def _asm4(asm: tl.constexpr, constraints: tl.constexpr, args, VDT: tl.constexpr):
    """int4 byte rows -> (low, high) nibble halves as ``VDT`` by ``asm`` (four bytes per call)."""
    if VDT == tl.float16:
        lo, hi = tl.inline_asm_elementwise(asm, constraints, args, dtype=(tl.float16, tl.float16), is_pure=True,
                                           pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(asm, constraints, args, dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                           pack=4)
    return lo, hi


@triton.jit
def _dequant16(lo8, hi8, sc, ze, VDT: tl.constexpr, NBITS: tl.constexpr, KT: tl.constexpr):
    """The compiled 16-bit forms of :func:`dequant`: (scale, centred zero) rounded to ``VDT``, K tiles with the
    scale's low part."""
    s_hi = sc.to(VDT)
    z16 = ze.to(VDT)
    s_lo = (sc - s_hi.to(tl.float32)).to(VDT)
    if NBITS == 8:
        if VDT == tl.float16:
            asm: tl.constexpr = _DQ8_F16_SPLIT if KT else _DQ8_F16
        else:
            asm: tl.constexpr = _DQ8_BF16_SPLIT if KT else _DQ8_BF16
        if KT:
            lo = _asm8(asm, "=r,=r,r,r,r,r,r,r,r", [lo8, s_hi, s_lo, z16], VDT)
            hi = _asm8(asm, "=r,=r,r,r,r,r,r,r,r", [hi8, s_hi, s_lo, z16], VDT)
        else:
            lo = _asm8(asm, "=r,=r,r,r,r,r,r", [lo8, s_hi, z16], VDT)
            hi = _asm8(asm, "=r,=r,r,r,r,r,r", [hi8, s_hi, z16], VDT)
    else:
        if VDT == tl.float16:
            asm: tl.constexpr = _DQ4_F16_SPLIT if KT else _DQ4_F16
        else:
            asm: tl.constexpr = _DQ4_BF16_SPLIT if KT else _DQ4_BF16
        if KT:
            lo, hi = _asm4(asm, "=r,=r,=r,=r,r,r,r,r,r,r,r", [lo8, s_hi, s_lo, z16], VDT)
        else:
            lo, hi = _asm4(asm, "=r,=r,=r,=r,r,r,r,r,r", [lo8, s_hi, z16], VDT)
    return lo, hi


@triton.jit
def dequant(c_lo, c_hi, scale, zero, DT: tl.constexpr, VDT: tl.constexpr, NBITS: tl.constexpr, KT: tl.constexpr,
            INTERP: tl.constexpr):
    """K or V halves of a prefill tile, ``codes * scale + zero`` with per-token float32 ``scale`` / ``zero``
    (``[BLOCK_N]``), as ``DT``, the dot's operand dtype. ``c_lo`` / ``c_hi``: the halves' int8 codes, or (int4) the
    byte rows twice; ``KT``: K tiles (``[HALF_P, BLOCK_N]``), else V (``[BLOCK_N, HALF_P]``); ``VDT``: the query
    dtype.

    Compiled, one asm call per four codes: the codes, centred exactly (``c' = c - 128``, int4 ``c - 8``), times the
    scale plus the centred zero ``z' = zero + 128 scale`` (int4 ``+ 8 scale``: the token's mid-range), both rounded
    to ``VDT``, in packed ``fma.rn.f16x2`` / ``fma.rn.bf16x2``: 1.5 instructions per element (float16 int8) up to
    2.5 (bfloat16 int8), against ~4.5 for float32 math. K tiles carry the scale's rounding error in a second
    16-bit term, ``c' s_hi + (c' s_lo + z')`` (+0.5 per element): a token's scale error would scale its scores, an
    error growing with the score, where V's only perturbs a weighted average.

    Precision (``s`` the quantization step; ``u`` = 2^-11 float16, 2^-9 bfloat16): every form rounds the result
    once to ``VDT``, as float32 math does; the packed forms add the rounding of ``z'`` (``u |mid|``) and, for V, of
    the scale (``|c'| u s``: float16 int8 at most ``s / 16``, bfloat16 int8 ``s / 4``, int4 ``s / 256`` and
    ``s / 64``). So bfloat16 int8 V is off by up to about one bfloat16 ulp of the token's values more than float32
    math would be, below the int8 rounding itself (``s / 2``): rms 0.15 s against 0.10 s on Gaussian tokens.
    bfloat16 runs in bfloat16, not in float16 then converted: float16 is the more accurate (11 significant bits
    against 8) but holds only values within +-65504 and scales above 2^-14 (below: subnormal, below 2^-25: zero),
    and bfloat16 caches hold values far outside both (bfloat16 has float32's range). float16 queries assume
    float16-range values (scales below 2^-14 lose relative precision, at most 2^-18 absolute per value). The
    interpreter computes the same roundings with Triton ops (products exact in float32, sums rounded there then to
    ``VDT``); float32 queries: float32 math.
    """
    if NBITS == 4:
        if INTERP or VDT == tl.float32:
            lo8 = c_lo & 15
            hi8 = c_lo >> 4
        else:
            lo8 = c_lo
            hi8 = c_lo
    else:
        lo8 = c_lo
        hi8 = c_hi
    if KT:
        sc = scale[None, :]
        ze = zero[None, :]
    else:
        sc = scale[:, None]
        ze = zero[:, None]
    if VDT == tl.float32:
        lo = codes_f32(lo8) * sc + ze
        hi = codes_f32(hi8) * sc + ze
    else:
        if NBITS == 4:
            MID: tl.constexpr = 8.0
        else:
            MID: tl.constexpr = 128.0
        if INTERP:
            # the compiled roundings: products exact in float32, the sums rounded there then to VDT
            lo = codes_f32(lo8) - MID
            hi = codes_f32(hi8) - MID
            s32 = _round_to(sc, VDT)
            z32 = _round_to(ze + MID * sc, VDT)
            if KT:
                sl32 = _round_to(sc - s32, VDT)
                lo = lo * s32 + _round_to(lo * sl32 + z32, VDT)
                hi = hi * s32 + _round_to(hi * sl32 + z32, VDT)
            else:
                lo = lo * s32 + z32
                hi = hi * s32 + z32
            lo = _round_to(lo, VDT)
            hi = _round_to(hi, VDT)
        else:
            lo, hi = _dequant16(lo8, hi8, sc, ze + MID * sc, VDT, NBITS, KT)
    return lo.to(DT), hi.to(DT)
