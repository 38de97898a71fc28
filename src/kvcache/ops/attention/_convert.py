"""int8 / int4 codes -> the attention dots' operand dtype, inside the attention kernel.

Two forms with the same results:

* :func:`codes_to` / :func:`codes_f32`: Triton ops (every target dtype; the interpreter's form, and the form of
  prefill tiles).
* :func:`u8_to` / :func:`u4_to`: inline PTX on whole 32-bit registers (four int8 or eight int4 codes at a
  time; int8 to float16, int4 to float16 or bfloat16), used by decode tiles: byte permutes (``prmt``) build
  two magic-number values at a time and one packed subtraction removes the magic. The asm is declared impure,
  so Triton keeps the conversion in the register layout of the load and the 16-bit operand reaches the tensor
  cores through shared memory with ``ldmatrix``; a pure conversion is moved after the shared-memory read into
  the MMA operand layout, which reads the 8-bit V operand one byte per instruction. On sm_90 this cuts a
  128-key int4 decode tile from ~1,700 to ~1,000 instructions per warp and its registers from ~240 to ~170;
  int8 decode at head_dim 64 runs 12% faster (BENCHMARKS.md).

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
def codes_to(c, DT: tl.constexpr, NBITS: tl.constexpr):
    """Exactly ``c.to(DT)`` for ``NBITS``-bit unsigned codes ``c`` (uint8 tensor; 8: int8, 4: int4) by Triton ops
    (the interpreter's form, and float32 targets)."""
    if DT == tl.float16:
        out = (c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
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

_U8_F16 = tl.constexpr("""{
.reg .b32 m, k;
mov.b32 m, 0x64646464;
mov.b32 k, 0x64006400;
prmt.b32 $0, $2, m, 0x5140;
prmt.b32 $1, $2, m, 0x5342;
sub.f16x2 $0, $0, k;
sub.f16x2 $1, $1, k;
}""")

# int4: byte i holds element i of the first half (low nibble) and of the second half (high nibble)
_U4_16 = """{
.reg .b32 t, u, m, k, one;
mov.b32 m, MAGIC4;
mov.b32 k, MAGIC2;
and.b32 t, $4, 0x0F0F0F0F;
shr.b32 u, $4, 4;
and.b32 u, u, 0x0F0F0F0F;
prmt.b32 $0, t, m, 0x5140;
prmt.b32 $1, t, m, 0x5342;
prmt.b32 $2, u, m, 0x5140;
prmt.b32 $3, u, m, 0x5342;
SUB2
}"""
_SUB_F16 = "sub.f16x2 $0, $0, k;\nsub.f16x2 $1, $1, k;\nsub.f16x2 $2, $2, k;\nsub.f16x2 $3, $3, k;"
_SUB_BF16 = ("mov.b32 one, 0x3F803F80;\nfma.rn.bf16x2 $0, $0, one, k;\nfma.rn.bf16x2 $1, $1, one, k;\n"
             "fma.rn.bf16x2 $2, $2, one, k;\nfma.rn.bf16x2 $3, $3, one, k;")
_U4_F16 = tl.constexpr(_U4_16.replace("MAGIC4", "0x64646464").replace("MAGIC2", "0x64006400").replace("SUB2", _SUB_F16))
# bf16: 0x43cc = 128 + c; then x * 1 + (-128) (0xC300), exact
_U4_BF16 = tl.constexpr(
    _U4_16.replace("MAGIC4", "0x43434343").replace("MAGIC2", "0xC300C300").replace("SUB2", _SUB_BF16))

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
