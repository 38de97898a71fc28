"""int4b key tiles of the attention kernel: a full block's int4 codes with its channels' fp16 (scale, zero), the
partial last block's int8 rows (halves in its own and in the next block's key plane, a float32 (scale, zero) per
row); the byte format of :mod:`kvcache.ops.paged.block_keys`.

Two forms: :func:`block_key_tile` dequantizes any tile's keys (full blocks, the partial one, prefill tiles);
:func:`block_group_tile` runs decode tiles over full blocks only, ``BLOCK_GROUP`` blocks per online-softmax step
(each block's own QK^T dot, one running maximum, one accumulator rescale and one V unit for the group), with the
block's id, addresses, scales and zeros per block rather than per key and, for float16 queries, codes times
scale plus zero in one packed asm per four bytes in the load's register layout (:func:`._convert.u4_fma`, its
operands two channels' scales or zeros a word, loaded as the key area stores them). The
attention kernel takes the group form for the full blocks of a decode tile's unmasked range at one block per tile
index and the one-block form for the rest (the last full blocks and the partial one).

Compiled, that asm is declared impure (so that it stays in the load's layout) and its scale and zero operands are
loaded in the loop: Triton 3.6's pipeliner cannot predicate it inside a tile that also holds the partial block's
branch, so :func:`block_key_tile` keeps Triton's own math.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..paged.kernels.block_keys import channel_scale_zero, row_scale_zero
from ._convert import u4_fma
from ._loads import PV_RANGE, _load_kv, _load_params, _softcapped

# Full blocks per online-softmax step of int4b's one-block decode tiles (block_group_tile). H200, 32 / 8 heads x 128,
# HND, 16-key tiles of two stages, fp16 / bf16 queries, one run: 64 x 16k 1,003 / 859 us in pairs, 990 / 1,035 in
# fours; 256 x 2k 500 / 480 in pairs, 560 / 652 in fours (a group of four holds 31 KB of shared memory a program, a
# pair 18 KB). One block a step measured 1,239 / 1,261 at 64 x 16k (BENCHMARKS.md has the current figures). With the
# key area's scales and zeros apart, int4b / int4 with fp16 queries (both timed in one process; fours in one, pairs
# in four of the same hour): 256 x 2k 1.42-1.43x in fours against 1.18-1.29x in pairs, 64 x 16k 1.36-1.39x against
# 1.31-1.35x, 96 x 768 1.48-1.59x against 1.13-1.36x.
BLOCK_GROUP = tl.constexpr(2)


@triton.jit
def _dequant(raw, s_lo, z_lo, s_hi, z_hi, DT: tl.constexpr):
    # int4 byte rows times their channels' scale plus zero, in DT by Triton's ops: float16 operands in float16 (the
    # codes and the stored fp16 scales exact), bfloat16 in float32 with one rounding to the operand (bfloat16 would
    # round the scale and then the product)
    if DT == tl.float16:
        MATH: tl.constexpr = tl.float16
    else:
        MATH: tl.constexpr = tl.float32
    k_lo = ((raw & 15).to(MATH) * s_lo.to(MATH) + z_lo.to(MATH)).to(DT)
    k_hi = ((raw >> 4).to(MATH) * s_hi.to(MATH) + z_hi.to(MATH)).to(DT)
    return k_lo, k_hi


@triton.jit
def _spread(x, HALF_P: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr):
    # [HALF_P, NB] per block -> [HALF_P, NB * BS] per key (the block's BS keys side by side)
    if NB == 1:
        out = tl.broadcast_to(x, (HALF_P, BS))
    else:
        out = tl.reshape(tl.broadcast_to(x[:, :, None], (HALF_P, NB, BS)), (HALF_P, NB * BS))
    return out


@triton.jit
def block_key_tile(raw, t, j, ok_n, blk, tok, kvh, bt_row, j_hi, n_blocks, full_end, table_width, pool, qparams, dd,
                   ok_lo, ok_hi,
                   H1: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, S_BLK: tl.constexpr,
                   S_TOK: tl.constexpr, S_HEAD: tl.constexpr, P_BLK: tl.constexpr, P_TOK: tl.constexpr,
                   P_HEAD: tl.constexpr, WK: tl.constexpr, DT: tl.constexpr):
    """Key halves ``[HALF_P, BLOCK_N]`` (channels down, keys across) of tile ``t`` of an int4b pool in ``DT`` (the
    dots' operand dtype; full blocks dequantized in it, the partial block's int8 rows in float32): ``raw`` the int4
    byte rows (uint8, as loaded for int4), keys ``j`` below ``full_end`` in full blocks, the rest in the partial
    one. A tile of whole blocks loads each block's scales and zeros once and spreads them over its keys. Returns
    (k_lo, k_hi, ok_n): a partial block's key whose next block is past the table or the pool is dropped from
    ``ok_n`` (not read), as the torch path drops it."""
    HALF_P: tl.constexpr = dd.shape[0]
    if BLOCK_N % BS == 0:
        NB: tl.constexpr = BLOCK_N // BS
        jb = t * BLOCK_N + tl.arange(0, NB) * BS
        ok_b = jb < j_hi
        bb = tl.load(bt_row + jb // BS, mask=ok_b, other=0)
        ok_b = ok_b & (bb >= 0) & (bb < n_blocks)
        pbase = bb.to(tl.int64)[None, :] * P_BLK + kvh * P_HEAD  # [1, NB]
        s_lo, z_lo = channel_scale_zero(qparams, pbase, dd[:, None], 2 * H1, WK, P_TOK,
                                        ok_b[None, :] & ok_lo[:, None])
        s_hi, z_hi = channel_scale_zero(qparams, pbase, H1 + dd[:, None], 2 * H1, WK, P_TOK,
                                        ok_b[None, :] & ok_hi[:, None])
        s_lo = _spread(s_lo, HALF_P, NB, BS)
        z_lo = _spread(z_lo, HALF_P, NB, BS)
        s_hi = _spread(s_hi, HALF_P, NB, BS)
        z_hi = _spread(z_hi, HALF_P, NB, BS)
    else:
        pbase = blk[None, :] * P_BLK + kvh * P_HEAD  # [1, N]
        s_lo, z_lo = channel_scale_zero(qparams, pbase, dd[:, None], 2 * H1, WK, P_TOK,
                                        ok_n[None, :] & ok_lo[:, None])
        s_hi, z_hi = channel_scale_zero(qparams, pbase, H1 + dd[:, None], 2 * H1, WK, P_TOK,
                                        ok_n[None, :] & ok_hi[:, None])
    k_lo, k_hi = _dequant(raw, s_lo, z_lo, s_hi, z_hi, DT)
    part = ok_n & (j >= full_end)
    if tl.max(part.to(tl.int32), 0) > 0:  # the tile reaches the partial block: its int8 rows
        has = part & (j // BS + 1 < table_width)
        nxt = tl.load(bt_row + j // BS + 1, mask=has, other=-1)
        ok8 = has & (nxt >= 0) & (nxt < n_blocks)
        ok_n = ok_n & (~part | ok8)
        nxt = tl.where(ok8, nxt, 0).to(tl.int64)
        row = tok * S_TOK + kvh * S_HEAD
        q_lo = tl.load(pool + (blk * S_BLK + row)[None, :] + dd[:, None], mask=ok8[None, :] & ok_lo[:, None],
                       other=0).to(tl.float32)
        q_hi = tl.load(pool + (nxt * S_BLK + row)[None, :] + dd[:, None], mask=ok8[None, :] & ok_hi[:, None],
                       other=0).to(tl.float32)
        pb = blk * P_BLK + kvh * P_HEAD
        rs, rz = row_scale_zero(qparams, pb, tok, WK, P_TOK, ok8)
        k_lo = tl.where(part[None, :], (q_lo * rs[None, :] + rz[None, :]).to(DT), k_lo)
        k_hi = tl.where(part[None, :], (q_hi * rs[None, :] + rz[None, :]).to(DT), k_hi)
    return k_lo, k_hi, ok_n


@triton.jit
def _full_block(i, t, q_lo, q_hi, offs_n, j_hi, bt_row, n_blocks, kvh, pool, qparams, dd, ok_lo, ok_hi,
                H1: tl.constexpr, BS: tl.constexpr, S_BLK: tl.constexpr, S_KV: tl.constexpr, S_TOK: tl.constexpr,
                S_HEAD: tl.constexpr, P_BLK: tl.constexpr, P_TOK: tl.constexpr, P_HEAD: tl.constexpr,
                WK: tl.constexpr, PRECISION: tl.constexpr, PACKED: tl.constexpr, INTERP: tl.constexpr,
                VDT: tl.constexpr):
    # block t + i of a group (a full block): its raw scores [M, BS], V halves as exact codes in VDT, its tokens' V
    # (scale, zero) and whether its keys exist (a block id outside the pool reads zeros: the caller drops its keys)
    HALF_P: tl.constexpr = dd.shape[0]
    bb = tl.load(bt_row + t + i)
    ok_b = ((t + i) * BS < j_hi) & (bb >= 0) & (bb < n_blocks)
    bb = tl.where(ok_b, bb, 0).to(tl.int64)
    base = bb * S_BLK + offs_n * S_TOK + kvh * S_HEAD  # [BS]
    ok_n = tl.where(ok_b, offs_n, BS) < BS  # [BS]: every key of a valid block
    raw = tl.load(pool + base[None, :] + dd[:, None], mask=ok_n[None, :] & ok_lo[:, None], other=0)
    pb = bb * P_BLK + kvh * P_HEAD
    ok_d = (dd * 0 + ok_b.to(tl.int32)) != 0  # [HALF_P], constant along the channels (vector loads)
    s_lo, z_lo = channel_scale_zero(qparams, pb, dd, 2 * H1, WK, P_TOK, ok_d & ok_lo)
    s_hi, z_hi = channel_scale_zero(qparams, pb, H1 + dd, 2 * H1, WK, P_TOK, ok_d & ok_hi)
    s_lo = tl.broadcast_to(s_lo[:, None], (HALF_P, BS))
    z_lo = tl.broadcast_to(z_lo[:, None], (HALF_P, BS))
    s_hi = tl.broadcast_to(s_hi[:, None], (HALF_P, BS))
    z_hi = tl.broadcast_to(z_hi[:, None], (HALF_P, BS))
    if PACKED:
        k_lo, k_hi = u4_fma(raw, s_lo, s_hi, z_lo, z_hi)
    else:
        k_lo, k_hi = _dequant(raw, s_lo, z_lo, s_hi, z_hi, q_lo.dtype)
    s = tl.dot(q_lo, k_lo, input_precision=PRECISION)
    s = tl.dot(q_hi, k_hi, acc=s, input_precision=PRECISION)
    v_off = (base + S_KV)[:, None] + dd[None, :]
    v_lo, v_hi = _load_kv(pool, v_off, ok_n[:, None] & ok_lo[None, :], ok_n[:, None] & ok_hi[None, :], H1, 3, VDT,
                          False, INTERP, False)
    vs, vz = _load_params(qparams, pb + offs_n * P_TOK, ok_n)
    return s, v_lo, v_hi, vs, vz, ok_n


@triton.jit
def block_group_tile(
    t, m_i, l_i, acc_lo, acc_hi, zacc, a_sc, q_lo, q_hi, qk_scale, pool, qparams, bt_row, kvh, j_hi, n_blocks,
    offs_n, dd, ok_lo, ok_hi,
    SOFTCAP: tl.constexpr, H1: tl.constexpr, BS: tl.constexpr, S_BLK: tl.constexpr, S_KV: tl.constexpr,
    S_TOK: tl.constexpr, S_HEAD: tl.constexpr, P_BLK: tl.constexpr, P_TOK: tl.constexpr, P_HEAD: tl.constexpr,
    WK: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr, PACKED: tl.constexpr, INTERP: tl.constexpr,
):
    """``GROUP`` (2 or 4) full blocks ``t .. t + GROUP - 1`` of an int4b decode tile (one block per tile index, every
    key visible to every row: the unmasked range below the sequence's last full block) in one online-softmax step:
    each block's keys dequantized with its channels' (scale, zero), its own QK^T dot, then one running maximum,
    one rescale of the accumulators and one V unit (the group's largest V scale) for the group, as ``_tile`` does
    for one tile of V folded per token. Returns (m_i, l_i, acc_lo, acc_hi, zacc, a_sc)."""
    tl.static_assert(GROUP == 2 or GROUP == 4, "block_group_tile: groups of 2 or 4 blocks")
    if q_lo.dtype == tl.float32:
        VDT: tl.constexpr = tl.float32
    else:
        VDT: tl.constexpr = tl.float16
    s0, v0_lo, v0_hi, vs0, vz0, ok0 = _full_block(
        0, t, q_lo, q_hi, offs_n, j_hi, bt_row, n_blocks, kvh, pool, qparams, dd, ok_lo, ok_hi, H1, BS, S_BLK, S_KV,
        S_TOK, S_HEAD, P_BLK, P_TOK, P_HEAD, WK, PRECISION, PACKED, INTERP, VDT)
    s1, v1_lo, v1_hi, vs1, vz1, ok1 = _full_block(
        1, t, q_lo, q_hi, offs_n, j_hi, bt_row, n_blocks, kvh, pool, qparams, dd, ok_lo, ok_hi, H1, BS, S_BLK, S_KV,
        S_TOK, S_HEAD, P_BLK, P_TOK, P_HEAD, WK, PRECISION, PACKED, INTERP, VDT)
    if SOFTCAP > 0:
        s0 = _softcapped(s0, qk_scale, SOFTCAP)
        s1 = _softcapped(s1, qk_scale, SOFTCAP)
        row = tl.full([], 1.0, tl.float32)
    else:
        row = qk_scale
    # keys of a block id outside the pool take no weight, as the torch path drops them
    s0 = tl.where(ok0[None, :], s0, float("-inf"))
    s1 = tl.where(ok1[None, :], s1, float("-inf"))
    mx = tl.maximum(tl.max(s0, 1), tl.max(s1, 1))
    vs_max = tl.maximum(tl.max(vs0, 0), tl.max(vs1, 0))
    if GROUP == 4:
        s2, v2_lo, v2_hi, vs2, vz2, ok2 = _full_block(
            2, t, q_lo, q_hi, offs_n, j_hi, bt_row, n_blocks, kvh, pool, qparams, dd, ok_lo, ok_hi, H1, BS, S_BLK,
            S_KV, S_TOK, S_HEAD, P_BLK, P_TOK, P_HEAD, WK, PRECISION, PACKED, INTERP, VDT)
        s3, v3_lo, v3_hi, vs3, vz3, ok3 = _full_block(
            3, t, q_lo, q_hi, offs_n, j_hi, bt_row, n_blocks, kvh, pool, qparams, dd, ok_lo, ok_hi, H1, BS, S_BLK,
            S_KV, S_TOK, S_HEAD, P_BLK, P_TOK, P_HEAD, WK, PRECISION, PACKED, INTERP, VDT)
        if SOFTCAP > 0:
            s2 = _softcapped(s2, qk_scale, SOFTCAP)
            s3 = _softcapped(s3, qk_scale, SOFTCAP)
        s2 = tl.where(ok2[None, :], s2, float("-inf"))
        s3 = tl.where(ok3[None, :], s3, float("-inf"))
        mx = tl.maximum(mx, tl.maximum(tl.max(s2, 1), tl.max(s3, 1)))
        vs_max = tl.maximum(vs_max, tl.maximum(tl.max(vs2, 0), tl.max(vs3, 0)))
    # the scores' maxima times the score scale (> 0) are the scaled scores' maxima (as _tile's LATE form)
    m_new = tl.maximum(m_i, mx * row)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p0 = tl.exp2(s0 * row - m_safe[:, None])
    p1 = tl.exp2(s1 * row - m_safe[:, None])
    l_sum = tl.sum(p0, 1) + tl.sum(p1, 1)
    z_sum = tl.sum(p0 * vz0[None, :], 1) + tl.sum(p1 * vz1[None, :], 1)
    if GROUP == 4:
        p2 = tl.exp2(s2 * row - m_safe[:, None])
        p3 = tl.exp2(s3 * row - m_safe[:, None])
        l_sum += tl.sum(p2, 1) + tl.sum(p3, 1)
        z_sum += tl.sum(p2 * vz2[None, :], 1) + tl.sum(p3 * vz3[None, :], 1)
    l_i = l_i * alpha + l_sum
    # V folded per token with the group's largest scale as the unit (_tile's V_FOLD form)
    vs_max = tl.where((vs_max > 0.0) & (vs_max < float("inf")), vs_max, a_sc)
    up = tl.where(vs_max < 5.421010862427522e-20, 1.8446744073709552e19, 1.0)
    rcp = 1.0 / (vs_max * up)
    unit = PV_RANGE * rcp  # the P operand (vs * up) * unit stays <= R: R / vs_max alone overflows below 2^-113
    f = alpha * tl.minimum((a_sc * rcp) * up, 3.0e38)
    pv = (p0 * ((vs0 * up) * unit)[None, :]).to(VDT)
    acc_lo = tl.dot(pv, v0_lo, acc=acc_lo * f[:, None], input_precision=PRECISION)
    acc_hi = tl.dot(pv, v0_hi, acc=acc_hi * f[:, None], input_precision=PRECISION)
    pv = (p1 * ((vs1 * up) * unit)[None, :]).to(VDT)
    acc_lo = tl.dot(pv, v1_lo, acc=acc_lo, input_precision=PRECISION)
    acc_hi = tl.dot(pv, v1_hi, acc=acc_hi, input_precision=PRECISION)
    if GROUP == 4:
        pv = (p2 * ((vs2 * up) * unit)[None, :]).to(VDT)
        acc_lo = tl.dot(pv, v2_lo, acc=acc_lo, input_precision=PRECISION)
        acc_hi = tl.dot(pv, v2_hi, acc=acc_hi, input_precision=PRECISION)
        pv = (p3 * ((vs3 * up) * unit)[None, :]).to(VDT)
        acc_lo = tl.dot(pv, v3_lo, acc=acc_lo, input_precision=PRECISION)
        acc_hi = tl.dot(pv, v3_hi, acc=acc_hi, input_precision=PRECISION)
    zacc = zacc * alpha + z_sum
    return m_new, l_i, acc_lo, acc_hi, zacc, vs_max
