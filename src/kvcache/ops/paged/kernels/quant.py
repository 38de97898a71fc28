"""Encoding a row in the pool's format (fp8 / fp8k / int8 / int4 with (scale, zero)), storing it, and reading it
back."""

from __future__ import annotations

import triton
import triton.language as tl

from .codes import Q_FP8, Q_FP8K, Q_INT4, Q_INT8, Q_K8V4, Q_NONE
from .numerics import _codes, _div, _fp8_grid, _rcp


@triton.jit
def _encode(x1, x2, inv_fp8, hh, m1, m2, is_v, QUANT: tl.constexpr, H: tl.constexpr, BLOCK_H: tl.constexpr,
            LIBDEVICE: tl.constexpr):
    # One token's rows, given as float32 half tiles [BLOCK_H, BLOCK_HF] of elements i (x1) and HALF + i (x2)
    # (m1 / m2: the elements that exist),
    # encoded in the pool's format: (codes of the first half, codes of the second half (int4 and k8v4 values:
    # unused, both halves are packed in the first), per-head scale, per-head zero (unused unless QUANT >=
    # Q_INT8; fp8k: the key's scale)). is_v (k8v4: keys int8, values int4; fp8k: keys scaled per row) is a
    # constant or a per-program value. Pure
    # arithmetic: the caller runs it before it knows where the row goes (the block-table load), so that the
    # two overlap.
    c1 = x1
    c2 = x2
    scale = tl.zeros([BLOCK_H, 1], tl.float32)  # unused unless QUANT >= Q_INT8
    zero = scale
    if QUANT == Q_FP8 or QUANT == Q_FP8K:
        if QUANT == Q_FP8K:
            # keys: scale = amax / 448 per head (the largest element stored as +-448, exactly), one IEEE division
            # and one reciprocal per head, as the reference; values: the layer's scale as fp8. A head holding a NaN
            # or an infinity gets scale NaN (bad, as the integer formats below) and reciprocal 0
            amax = tl.max(tl.maximum(tl.where(m1, tl.abs(x1), 0.0), tl.where(m2, tl.abs(x2), 0.0)), axis=1,
                          keep_dims=True)
            bad = tl.sum(tl.where(m1, x1 * 0.0, 0.0) + tl.where(m2, x2 * 0.0, 0.0), axis=1, keep_dims=True)
            amax = tl.where(hh < H, amax, 0.0)
            # at least float32's smallest normal (2^-126) for a non-zero row: a subnormal scale would be flushed to
            # 0 on the GPU and its reciprocal overflow on the CPU; x * (1 / scale) stays within +-448 either way
            scale = tl.where(amax > 0.0, tl.maximum(_div(amax, tl.zeros_like(amax) + 448.0, LIBDEVICE),
                                                    1.1754943508222875e-38), 0.0) + bad
            k_inv = tl.where(scale > 0.0, _rcp(tl.where(scale > 0.0, scale, 1.0), LIBDEVICE), 0.0)
            inv_row = tl.where(is_v == 0, k_inv, inv_fp8)
        else:
            inv_row = inv_fp8
        # finite values saturate at +-448; NaN and +-inf are stored as NaN (e4m3fn has no infinity): visible,
        # never a finite value
        y1 = x1 * inv_row
        y2 = x2 * inv_row
        if LIBDEVICE:
            # y * 0 is a zero of y's sign for finite y and NaN for +-inf and NaN: added to the clamp (which drops
            # NaN), it makes every non-finite value NaN and leaves the others as they are, -0.0 included
            c1 = tl.minimum(tl.maximum(y1, -448.0), 448.0) + y1 * 0.0
            c2 = tl.minimum(tl.maximum(y2, -448.0), 448.0) + y2 * 0.0
        else:  # the interpreter's conversion neither saturates nor rounds into the next binade (see _fp8_grid)
            c1 = _fp8_grid(tl.where(y1 * 0.0 == 0.0, tl.minimum(tl.maximum(y1, -448.0), 448.0), float("nan")),
                           LIBDEVICE)
            c2 = _fp8_grid(tl.where(y2 * 0.0 == 0.0, tl.minimum(tl.maximum(y2, -448.0), 448.0), float("nan")),
                           LIBDEVICE)
    elif QUANT >= Q_INT8:
        # per (token, head) asymmetric: masked lanes never take part in min / max
        if QUANT == Q_INT4:
            qmax = 15.0
        elif QUANT == Q_K8V4:
            qmax = tl.where(is_v == 0, 255.0, 15.0)
        else:
            qmax = 255.0
        # the two halves combined element-wise first: one cross-thread reduction each for min and max. Kept
        # [BLOCK_H, 1] (keep_dims) in the tile's own layout: no layout conversion through shared memory for
        # the per-head arithmetic and the scale / zero stores
        mn = tl.min(tl.minimum(tl.where(m1, x1, float("inf")), tl.where(m2, x2, float("inf"))), axis=1,
                    keep_dims=True)
        mx = tl.max(tl.maximum(tl.where(m1, x1, float("-inf")), tl.where(m2, x2, float("-inf"))), axis=1,
                    keep_dims=True)
        # NaN where the head holds a NaN or an infinity (x * 0 is 0 exactly for finite x), else 0: such a head
        # stores codes 0 with scale and zero NaN, and reads back as NaN (visible, never a finite value)
        bad = tl.sum(tl.where(m1, x1 * 0.0, 0.0) + tl.where(m2, x2 * 0.0, 0.0), axis=1, keep_dims=True)
        zero = tl.where(hh < H, mn, 0.0)
        mx = tl.where(hh < H, mx, 0.0)
        scale = _div(mx - zero, tl.zeros_like(zero) + qmax, LIBDEVICE) + bad  # per head: IEEE, as the reference
        # scale == 0: every code 0, a constant row round-trips exactly
        inv = tl.where(scale > 0.0, _rcp(tl.where(scale > 0.0, scale, 1.0), LIBDEVICE), 0.0)
        fin = scale == scale
        q1 = _codes(tl.where(fin, (x1 - zero) * inv, 0.0), LIBDEVICE)  # low byte: the code (above: 2**23's exponent)
        q2 = _codes(tl.where(fin, (x2 - zero) * inv, 0.0), LIBDEVICE)
        zero = zero + bad
        # planar nibbles: byte i = element i | element HALF + i << 4 (q1, q2 < 16 in their low bits)
        if QUANT == Q_INT4:
            c1 = (q1 | (q2 << 4)).to(tl.uint8)
            c2 = c1  # unused
        elif QUANT == Q_K8V4:  # keys: two int8 halves (two planes); values: int4 nibbles (one plane)
            c1 = tl.where(is_v == 0, q1, q1 | (q2 << 4)).to(tl.uint8)
            c2 = q2.to(tl.uint8)
        else:
            c1 = q1.to(tl.uint8)  # the low byte
            c2 = q2.to(tl.uint8)
    return c1, c2, scale, zero


@triton.jit
def _store_row(c1, c2, scale, zero, pool, qparams, blk, off, is_v, hh, i, m1, m2, ok, QUANT: tl.constexpr,
               H: tl.constexpr, HALF: tl.constexpr, DP: tl.constexpr, BLOCK_SIZE: tl.constexpr, S_TOK: tl.constexpr,
               S_HEAD: tl.constexpr, P_TOK: tl.constexpr, P_HEAD: tl.constexpr, STORE_CM: tl.constexpr,
               PAIR_ASM: tl.constexpr, MASKED: tl.constexpr, LIBDEVICE: tl.constexpr):
    # Store what _encode returned (or, unquantized, the values to store in any float dtype) as the K (is_v == 0)
    # or V row at (blk, off) of the data pool and of the (scale, zero) pool; m1 / m2: the elements that exist;
    # MASKED: ok (a scalar) masks every store too. k8v4: a block has 3 planes, keys in the first two (elements
    # [0, HALF) and [HALF, D)), values in the third
    s_kv: tl.constexpr = BLOCK_SIZE * H * DP  # one block's plane, data and params
    p_kv: tl.constexpr = BLOCK_SIZE * H * 2
    if QUANT == Q_K8V4:
        PLANES: tl.constexpr = 3
        V_PLANE: tl.constexpr = 2
    else:
        PLANES: tl.constexpr = 2
        V_PLANE: tl.constexpr = 1
    dst = pool + (blk * (PLANES * s_kv) + off * S_TOK + is_v * (V_PLANE * s_kv))
    if QUANT == Q_FP8K:  # one plane of one float per (token, head): the keys' scales
        par = qparams + (blk * (BLOCK_SIZE * H) + off * P_TOK)
    else:
        par = qparams + (blk * (2 * p_kv) + off * P_TOK + is_v * p_kv)
    hm = hh < H
    if MASKED:  # tl.where: `tile & scalar` is an int32 tile under triton 3.9's interpreter, not a mask
        m1 = tl.where(ok, m1, False)
        m2 = tl.where(ok, m2, False)
        hm = tl.where(ok, hm, False)
    p1 = dst + hh * S_HEAD + i
    if (QUANT == Q_FP8 or QUANT == Q_FP8K) and not LIBDEVICE:
        # the interpreter converts float32 NaN to 384.0 in fp8: NaN lanes are written as the NaN byte 0x7F
        b1 = tl.where(c1 == c1, c1.to(tl.float8e4nv).to(tl.uint8, bitcast=True), 0x7F).to(tl.uint8)
        b2 = tl.where(c2 == c2, c2.to(tl.float8e4nv).to(tl.uint8, bitcast=True), 0x7F).to(tl.uint8)
        p8 = p1.to(tl.pointer_type(tl.uint8))
        tl.store(p8, b1, mask=m1)
        tl.store(p8 + HALF, b2, mask=m2)
    else:
        tl.store(p1, c1.to(dst.dtype.element_ty), mask=m1, cache_modifier=STORE_CM)
        if QUANT == Q_K8V4:  # a key's second half in the next plane
            tl.store(p1 + s_kv, c2, mask=tl.where(is_v == 0, m2, False), cache_modifier=STORE_CM)
        elif QUANT != Q_INT4:
            tl.store(p1 + HALF, c2.to(dst.dtype.element_ty), mask=m2, cache_modifier=STORE_CM)
    if QUANT == Q_FP8K:  # the key's scale [BLOCK_H, 1]
        tl.store(par + hh * P_HEAD, scale, mask=tl.where(is_v == 0, hm, False), cache_modifier=STORE_CM)
    elif QUANT >= Q_INT8:  # scale / zero [BLOCK_H, 1]
        if PAIR_ASM:
            _store_pair(par + hh * P_HEAD, scale, zero, hm, STORE_CM)
        else:
            tl.store(par + hh * P_HEAD, scale, mask=hm, cache_modifier=STORE_CM)
            tl.store(par + hh * P_HEAD + 1, zero, mask=hm, cache_modifier=STORE_CM)


@triton.jit
def _store_pair(ptr, a, b, mask, STORE_CM: tl.constexpr):
    # float32 (a, b) as one 8-byte store at ptr (8-byte aligned) where mask, by every thread that holds them
    # (PTX). tl.store would first move the per-head values through shared memory (two barriers per store) into
    # a layout with one owner per value; a value held by several threads of a warp is written by each of
    # them here, to one address: one transaction.
    args = [ptr.to(tl.int64), a.to(tl.int32, bitcast=True), b.to(tl.int32, bitcast=True), mask.to(tl.int32)]
    if STORE_CM == ".cs":
        tl.inline_asm_elementwise(
            "{ .reg .pred %p; setp.ne.s32 %p, $4, 0; @%p st.global.cs.v2.b32 [$1], {$2, $3}; mov.u32 $0, 0; }",
            "=r,l,r,r,r", args, dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred %p; setp.ne.s32 %p, $4, 0; @%p st.global.v2.b32 [$1], {$2, $3}; mov.u32 $0, 0; }",
            "=r,l,r,r,r", args, dtype=tl.int32, is_pure=False, pack=1)



@triton.jit
def _split_elem(e, HALF: tl.constexpr, HI: tl.constexpr):
    # where element e of an int8 row lives: HI == 0, in one row; else (k8v4 keys) elements [HALF, D) start HI
    # elements after the row (the next plane)
    if HI == 0:
        return e
    return tl.where(e < HALF, e, e + (HI - HALF))


@triton.jit
def _load_dequantized(row, par, e, mask, fp8_scale, QUANT: tl.constexpr, S_TOK: tl.constexpr, S_HEAD: tl.constexpr,
                      P_TOK: tl.constexpr, P_HEAD: tl.constexpr, tt, hh, HALF: tl.constexpr, LIBDEVICE: tl.constexpr,
                      HI: tl.constexpr):
    # float32 values of elements e of tokens tt, heads hh of one block's K or V region (dequantized); HI: see
    # _split_elem (int8 rows)
    if QUANT == Q_NONE:
        x = tl.load(row + tt * S_TOK + hh * S_HEAD + e, mask=mask, other=0.0).to(tl.float32)
    elif QUANT == Q_FP8 or QUANT == Q_FP8K:
        raw = tl.load(row + tt * S_TOK + hh * S_HEAD + e, mask=mask, other=0.0)
        if QUANT == Q_FP8K:  # the key's own scale
            pm = (tt >= 0) & (hh >= 0) & mask
            x = raw.to(tl.float32) * tl.load(par + tt * P_TOK + hh * P_HEAD, mask=pm, other=0.0)
        else:
            x = raw.to(tl.float32) * fp8_scale
        if not LIBDEVICE:  # the interpreter reads the NaN bytes 0x7F / 0xFF as +-480
            x = tl.where((raw.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F, float("nan"), x)
    else:
        if QUANT == Q_INT4:  # planar nibbles: element e < HALF low nibble of byte e, else high nibble of e - HALF
            low = e < HALF
            byte = tl.load(row + tt * S_TOK + hh * S_HEAD + tl.where(low, e, e - HALF), mask=mask, other=0)
            byte = byte.to(tl.int32)
            q = tl.where(low, byte & 15, (byte >> 4) & 15).to(tl.float32)
        else:
            q = tl.load(row + tt * S_TOK + hh * S_HEAD + _split_elem(e, HALF, HI), mask=mask, other=0).to(tl.float32)
        pm = (tt >= 0) & (hh >= 0) & mask  # only for the per-element path with RoPE partners
        scale = tl.load(par + tt * P_TOK + hh * P_HEAD, mask=pm, other=0.0)
        zero = tl.load(par + tt * P_TOK + hh * P_HEAD + 1, mask=pm, other=0.0)
        x = q * scale + zero
    return x


@triton.jit
def _tile_params(par, tt, hh, hm, P_TOK: tl.constexpr, P_HEAD: tl.constexpr, TOK: tl.constexpr,
                 BLOCK_H: tl.constexpr):
    # float32 (scale, zero) of tokens tt x heads hh as [TOK, BLOCK_H, 1]: loaded once per (token, head) as a
    # 2-d tile and broadcast over head_dim (a [TOK, BLOCK_H, 1] load would repeat per element)
    off = tl.reshape(tt * P_TOK + hh * P_HEAD, (TOK, BLOCK_H))
    m = tl.reshape(hm, (TOK, BLOCK_H))
    scale = tl.load(par + off, mask=m, other=0.0)
    zero = tl.load(par + off + 1, mask=m, other=0.0)
    return scale[:, :, None], zero[:, :, None]

