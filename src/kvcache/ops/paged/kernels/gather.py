"""The gather kernel: paged blocks back to contiguous K / V, dequantized, optionally rotating keys."""

from __future__ import annotations

import triton
import triton.language as tl

from ...._backend import kernel
from .codes import BY_KV_LENS, Q_FP8, Q_FP8K, Q_INT4, Q_INT8, Q_K8V4, Q_NONE
from .quant import _load_dequantized, _split_elem, _tile_params
from .rope import _rope_pairs, _rotate


@triton.jit
def _read_tile(
    row, par, dst, tvalid, pos_f, inv_freq, attn_scale, fp8_scale, tt, hh, dd,
    QUANT: tl.constexpr, ROPE: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr,
    H: tl.constexpr, D: tl.constexpr, TOK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    S_TOK: tl.constexpr, S_HEAD: tl.constexpr, P_TOK: tl.constexpr, P_HEAD: tl.constexpr,
    OUT_S, OUT_H, LIBDEVICE: tl.constexpr, HI: tl.constexpr,
):
    # TOK tokens x H heads x D of one of K / V from one block into dst[h, t, d] (model dtype); tokens that
    # are not valid (past the sequence) are written as zeros. HI: where an int8 row's second half starts
    # (_split_elem; k8v4 keys)
    m = (hh < H) & (dd < D) & (tt >= 0)
    lm = m & tvalid
    out_ptr = dst + tt * OUT_S + hh * OUT_H + dd
    if (QUANT == Q_NONE) and (not ROPE):
        x = tl.load(row + tt * S_TOK + hh * S_HEAD + dd, mask=lm, other=0.0)
        tl.store(out_ptr, x.to(dst.dtype.element_ty), mask=m)
    elif (QUANT == Q_INT4) and (not ROPE):
        # bytes [TOK, H, D/2]: low nibbles are elements [0, D/2), high nibbles [D/2, D): two contiguous stores
        d2 = tl.arange(0, BLOCK_D // 2)[None, None, :]
        hm = (hh < H) & tvalid & (tt >= 0)
        byte = tl.load(row + tt * S_TOK + hh * S_HEAD + d2, mask=hm & (d2 < D // 2), other=0).to(tl.int32)
        scale, zero = _tile_params(par, tt, hh, hm, P_TOK, P_HEAD, TOK, BLOCK_H)
        lo = tl.where(tvalid, (byte & 15).to(tl.float32) * scale + zero, 0.0)
        hi = tl.where(tvalid, ((byte >> 4) & 15).to(tl.float32) * scale + zero, 0.0)
        sm = (hh < H) & (d2 < D // 2) & (tt >= 0)
        tl.store(dst + tt * OUT_S + hh * OUT_H + d2, lo.to(dst.dtype.element_ty), mask=sm)
        tl.store(dst + tt * OUT_S + hh * OUT_H + D // 2 + d2, hi.to(dst.dtype.element_ty), mask=sm)
    else:
        if QUANT == Q_INT8:  # one scale / zero per (token, head), not per element
            hm = (hh < H) & tvalid & (tt >= 0)
            q = tl.load(row + tt * S_TOK + hh * S_HEAD + _split_elem(dd, D // 2, HI), mask=lm, other=0)
            q = q.to(tl.float32)
            scale, zero = _tile_params(par, tt, hh, hm, P_TOK, P_HEAD, TOK, BLOCK_H)
            x = q * scale + zero
        else:
            x = _load_dequantized(row, par, dd, lm, fp8_scale, QUANT, S_TOK, S_HEAD, P_TOK, P_HEAD, tt, hh, D // 2,
                                  LIBDEVICE, HI)
        if ROPE:
            partner, j, first, in_rot = _rope_pairs(dd, ROT, INTERLEAVED)
            xp = _load_dequantized(row, par, partner, lm & in_rot, fp8_scale, QUANT, S_TOK, S_HEAD, P_TOK, P_HEAD, tt,
                                   hh, D // 2, LIBDEVICE, HI)
            f = tl.load(inv_freq + j, mask=in_rot, other=0.0)
            x = _rotate(x, xp, f, first, in_rot, pos_f, attn_scale, LIBDEVICE)
        x = tl.where(tvalid, x, 0.0)
        tl.store(out_ptr, x.to(dst.dtype.element_ty), mask=m)


@kernel(ints=("sk_b", "sk_h", "sk_s", "sv_b", "sv_h", "sv_s", "bt_stride", "table_width", "s_out"))
def _gather_kernel(
    k_out, v_out,  # model dtype [B, H, S_out, D] (any strides in units of VEC, head_dim contiguous)
    pool, qparams, block_tables, k_lens, inv_freq, fp8_scales,
    sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, bt_stride, table_width, s_out,
    MODE: tl.constexpr,  # 0: kv_lens [B], 1: cu_k_lens [B + 1]
    QUANT: tl.constexpr, ROPE: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr, ATTN_SCALE: tl.constexpr,
    H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    S_TOK: tl.constexpr, S_HEAD: tl.constexpr, P_TOK: tl.constexpr, P_HEAD: tl.constexpr,  # see _block_strides
    CP_RANK: tl.constexpr, CP_SIZE: tl.constexpr,
    TOK: tl.constexpr,  # tokens per program: a power of two dividing BLOCK_SIZE (one block-table load)
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, LIBDEVICE: tl.constexpr,
    VEC: tl.constexpr,  # the output strides are in units of VEC elements (vector stores)
    WIDE: tl.constexpr,  # an output spans 2**31 elements or more: its offsets in 64-bit integers
):
    # grid: (cdiv(S_out, TOK), B): TOK consecutive output (local) tokens of one sequence, in one block.
    t0 = tl.program_id(0).to(tl.int64) * TOK
    b = tl.program_id(1).to(tl.int64)
    if MODE == BY_KV_LENS:
        total = tl.load(k_lens + b).to(tl.int64)
    else:
        total = (tl.load(k_lens + b + 1) - tl.load(k_lens + b)).to(tl.int64)
    local = tl.maximum(total - CP_RANK + CP_SIZE - 1, 0) // CP_SIZE  # tokens of this rank
    bi = t0 // BLOCK_SIZE
    has_block = (t0 < local) & (bi < table_width)
    blk = tl.load(block_tables + b * bt_stride + bi, mask=has_block, other=-1).to(tl.int64)
    has_block = has_block & (blk >= 0) & (blk < NUM_BLOCKS)
    blk = tl.where(has_block, blk, 0)
    tt = tl.arange(0, TOK)[:, None, None]
    hh = tl.arange(0, BLOCK_H)[None, :, None]
    dd = tl.arange(0, BLOCK_D)[None, None, :]
    t = t0 + tt
    # (t * 0 + ...) makes has_block a vector: triton 3.9's interpreter rejects vector & scalar masks
    tvalid = (t < local) & (t < s_out) & ((t * 0 + has_block.to(tl.int64)) != 0)
    tt = tl.where(t < s_out, tt, -1)  # rows past S_out: masked off everywhere (tt >= 0 in the masks)
    s_kv: tl.constexpr = BLOCK_SIZE * H * DP  # one plane of a block
    p_kv: tl.constexpr = BLOCK_SIZE * H * 2
    if QUANT == Q_K8V4:  # keys: int8 rows in planes 0 / 1 (second half s_kv after the first); values: int4, plane 2
        PLANES: tl.constexpr = 3
        QK: tl.constexpr = Q_INT8
        QV: tl.constexpr = Q_INT4
        K_HI: tl.constexpr = s_kv
    elif QUANT == Q_FP8K:  # keys: fp8 rows with their own scales; values: fp8 with the layer's
        PLANES: tl.constexpr = 2
        QK: tl.constexpr = Q_FP8K
        QV: tl.constexpr = Q_FP8
        K_HI: tl.constexpr = 0
    else:
        PLANES: tl.constexpr = 2
        QK: tl.constexpr = QUANT
        QV: tl.constexpr = QUANT
        K_HI: tl.constexpr = 0
    off0 = t0 % BLOCK_SIZE
    base = blk * (PLANES * s_kv) + off0 * S_TOK
    if QUANT == Q_FP8K:  # params: the keys' scales, one plane of one float per (token, head)
        pbase = blk * (BLOCK_SIZE * H) + off0 * P_TOK
    else:
        pbase = blk * (2 * p_kv) + off0 * P_TOK
    pos_f = (t * CP_SIZE + CP_RANK).to(tl.float32)
    k_scale = 1.0
    v_scale = 1.0
    if QUANT == Q_FP8:
        k_scale = tl.load(fp8_scales)
    if QUANT == Q_FP8 or QUANT == Q_FP8K:
        v_scale = tl.load(fp8_scales + 1)
    if WIDE:  # the strides times VEC, and a head's offset, may pass int32: 64-bit address arithmetic
        sk_b = sk_b.to(tl.int64)
        sk_h = sk_h.to(tl.int64)
        sk_s = sk_s.to(tl.int64)
        sv_b = sv_b.to(tl.int64)
        sv_h = sv_h.to(tl.int64)
        sv_s = sv_s.to(tl.int64)
    _read_tile(pool + base, qparams + pbase, k_out + b * (sk_b * VEC) + t0 * (sk_s * VEC), tvalid, pos_f, inv_freq,
               ATTN_SCALE, k_scale, tt, hh, dd, QK, ROPE, ROT, INTERLEAVED, H, D, TOK, BLOCK_H, BLOCK_D, S_TOK,
               S_HEAD, P_TOK, P_HEAD, sk_s * VEC, sk_h * VEC, LIBDEVICE, K_HI)
    _read_tile(pool + base + (PLANES - 1) * s_kv, qparams + pbase + p_kv, v_out + b * (sv_b * VEC) + t0 * (sv_s * VEC),
               tvalid, pos_f, inv_freq, ATTN_SCALE, v_scale, tt, hh, dd, QV, False, ROT, INTERLEAVED, H, D, TOK,
               BLOCK_H, BLOCK_D, S_TOK, S_HEAD, P_TOK, P_HEAD, sv_s * VEC, sv_h * VEC, LIBDEVICE, 0)
