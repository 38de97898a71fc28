"""One KV tile of the attention kernel's online softmax, one warp's state (:mod:`._kernel` gives the rules it follows:
the formats' dequantization, the V fold of int8 / int4 decode tiles, the masks)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._block_keys import block_key_tile
from ._convert import dequant
from ._loads import PV_RANGE, _key_rows, _load_kv, _load_params, _softcapped


@triton.jit
def _tile(
    t, m_i, l_i, acc_lo, acc_hi, zacc, pvs, a_sc, q_lo, q_hi, q_sum, q_inv, q_pos, ok_m, qk_scale, pool, qparams,
    bt_row, b, kvh, j_hi, n_blocks, full_end, table_width, cp_rank, cp_size, window, offs_n, dd, ok_lo, ok_hi,
    qdt: tl.constexpr,
    SOFTCAP: tl.constexpr, H1: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, S_BLK: tl.constexpr,
    K_HI: tl.constexpr, V_AT: tl.constexpr, S_TOK: tl.constexpr, S_HEAD: tl.constexpr, P_BLK: tl.constexpr,
    P_KV: tl.constexpr, P_TOK: tl.constexpr, P_HEAD: tl.constexpr, QK: tl.constexpr, QV: tl.constexpr, WK: tl.constexpr,
    LINEAR: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, MASK: tl.constexpr, V_FOLD: tl.constexpr, Q_RESCALE: tl.constexpr,
    INTERP: tl.constexpr, Q_DT: tl.constexpr, V_MAGIC: tl.constexpr,
):
    """One KV tile ``t`` of the online softmax: returns the updated (m_i, l_i, acc_lo, acc_hi, zacc, pvs, a_sc).
    Decode tiles of int8 / int4 (``V_FOLD``) update the rest: ``zacc`` (the rows' sums of ``p * zero_v``), ``a_sc``
    (the accumulators' unit: they hold the output times ``R / a_sc``) and, with ``V_MAGIC``, ``pvs`` (``[M, 16]``,
    the magic offset's weight per row in the accumulators' units, in 16 equal columns); other tiles return them
    unchanged.

    ``MASK=False`` for tiles whose every key every row may see (inside the causal bound of the tile's first row
    and the window of its last): no score mask. Loads stay masked by the length and the block ids' range, so no
    input reads outside the pool. ``qdt``: the dots' operand dtype; ``Q_DT``: the query's own dtype (they differ
    for bfloat16 queries under the interpreter, whose dots run in float32), the rounding target of the
    prefill tiles' 16-bit dequantization.
    """
    j = t * BLOCK_N + offs_n
    ok_n, blk, tok, base = _key_rows(j, j_hi, b, bt_row, n_blocks, kvh, BS, S_BLK, S_TOK, S_HEAD, LINEAR)
    k_off = base[None, :] + dd[:, None]
    k_lo, k_hi = _load_kv(pool, k_off, ok_n[None, :] & ok_lo[:, None], ok_n[None, :] & ok_hi[:, None], K_HI,
                          3 if QK == 6 else QK, q_lo.dtype, not V_FOLD or QK == 6, INTERP, False)
    if QK == 6:  # int4b: int4 codes per channel over full blocks, int8 rows in the partial one
        k_lo, k_hi, ok_n = block_key_tile(k_lo, t, j, ok_n, blk, tok, kvh, bt_row, j_hi, n_blocks, full_end,
                                          table_width, pool, qparams, dd, ok_lo, ok_hi, H1, BLOCK_N, BS, S_BLK, S_TOK,
                                          S_HEAD, P_BLK, P_TOK, P_HEAD, WK, qdt)
    pbase = blk * P_BLK + tok * P_TOK + kvh * P_HEAD
    if QK >= 2 and QK <= 4 and not V_FOLD:
        # prefill tiles: dequantize K per element (many rows share it), no per-score affine
        ks, kz = _load_params(qparams, pbase, ok_n)
        k_lo, k_hi = dequant(k_lo, k_hi, ks, kz, qdt, Q_DT, 4 if QK == 3 else 8, True, INTERP)
    s = tl.dot(q_lo, k_lo.to(q_lo.dtype), input_precision=PRECISION)
    s = tl.dot(q_hi, k_hi.to(q_lo.dtype), acc=s, input_precision=PRECISION)
    if QK == 5:  # fp8k: each key's scale, one multiply per score (0 past the length: scores masked or 0)
        s = s * tl.load(qparams + pbase, mask=ok_n, other=0.0)[None, :]
    # without softcap (every format but fp8, whose scale is data): the rows' maxima of unscaled scores times the
    # score scale (> 0) are the maxima of the scaled ones, and the scale enters exp2's argument, one multiply-add per
    # score; rescaled bfloat16 queries (Q_RESCALE) fold their rows' 1 / r into that scale
    LATE: tl.constexpr = QK != 1 and SOFTCAP == 0
    qk_row = q_inv * qk_scale  # q_inv is 1 without Q_RESCALE
    if QK >= 2 and QK <= 4 and V_FOLD:
        ks, kz = _load_params(qparams, pbase, ok_n)
        s = s * ks[None, :] + q_sum[:, None] * kz[None, :]
        if Q_RESCALE and not LATE:
            s = s * q_inv[:, None]  # the rows' 1 / r (rescaled bfloat16 queries)
    if SOFTCAP > 0:
        s = _softcapped(s, qk_scale, SOFTCAP)
    elif not LATE:
        s = s * qk_scale
    if MASK:
        k_pos = j * cp_size + cp_rank
        allowed = ok_m[:, None] & ok_n[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
    if LATE:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_row)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    if LATE:
        p = tl.exp2(s * qk_row[:, None] - m_safe[:, None])
    else:
        p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    m_i = m_new
    vbase = base + V_AT
    # int8 / int4 decode tiles: V in float16 for 16-bit queries (codes exact; P's operand sits in float16's normal
    # range), float32 for float32 queries
    if qdt == tl.float32:
        vdt: tl.constexpr = tl.float32
    else:
        vdt: tl.constexpr = tl.float16
    v_off = vbase[:, None] + dd[None, :]
    v_lo, v_hi = _load_kv(pool, v_off, ok_n[:, None] & ok_lo[None, :], ok_n[:, None] & ok_hi[None, :], H1, QV, vdt,
                          not V_FOLD, INTERP, V_MAGIC)
    if QV >= 2 and QV <= 4:  # (scale, zero) of V; fp8k's values are fp8's
        vp = blk * P_BLK + P_KV + tok * P_TOK + kvh * P_HEAD
        vs, vz = _load_params(qparams, vp, ok_n)
        if V_FOLD:
            # sum_j p_j (s_j c_j + z_j) = (s_max / R) * sum_j (R p_j s_j / s_max) c_j + sum_j p_j z_j (module
            # docstring); tokens past the length or the table load scale and zero 0, masked scores have p = 0
            vs_max = tl.max(vs, 0)
            # a tile without a positive finite scale (masked, all-zero or NaN) keeps the accumulators' unit
            vs_max = tl.where((vs_max > 0.0) & (vs_max < float("inf")), vs_max, a_sc)
            # one reciprocal per tile, finite: maxima below 2^-64 (subnormal bfloat16 scales) are first scaled by 2^64
            # with their scales (exact)
            up = tl.where(vs_max < 5.421010862427522e-20, 1.8446744073709552e19, 1.0)
            rcp = 1.0 / (vs_max * up)
            pv = (p * ((vs * up) * (PV_RANGE * rcp))[None, :]).to(vdt)  # <= R (1 + 2^-22); NaN stays NaN
            # the accumulators hold the output times R / a_sc (a_sc: the last tile's s_max), so the dots accumulate in
            # place, rescaled by alpha * a_sc / s_max first: no multiply of the dot's result. a_sc * rcp before the
            # 2^64 (1 / s_max alone overflows below 2^-128); the ratio is capped finite so that alpha = 0 gives 0
            f = alpha * tl.minimum((a_sc * rcp) * up, 3.0e38)
            acc_lo = tl.dot(pv, v_lo, acc=acc_lo * f[:, None], input_precision=PRECISION)
            acc_hi = tl.dot(pv, v_hi, acc=acc_hi * f[:, None], input_precision=PRECISION)
            a_sc = vs_max
            zacc = zacc * alpha + tl.sum(p * vz[None, :], 1)
            if V_MAGIC:
                # the operand carried 1024 + c: the offset's weight (in the accumulators' units) is the row sum of
                # the dot's own float16 P operand, taken out after the loop
                pvs = tl.dot(pv, tl.full([BLOCK_N, 16], 1.0, vdt), acc=pvs * f[:, None], input_precision=PRECISION)
        else:
            # prefill tiles (many rows per key): dequantize V per element, the rows share it
            v_lo, v_hi = dequant(v_lo, v_hi, vs, vz, qdt, Q_DT, 4 if QV == 3 else 8, False, INTERP)
            pc = p.to(qdt)
            acc_lo = tl.dot(pc, v_lo, acc=acc_lo * alpha[:, None], input_precision=PRECISION)
            acc_hi = tl.dot(pc, v_hi, acc=acc_hi * alpha[:, None], input_precision=PRECISION)
    else:
        pc = p.to(qdt)
        acc_lo = tl.dot(pc, v_lo.to(qdt), acc=acc_lo * alpha[:, None], input_precision=PRECISION)
        acc_hi = tl.dot(pc, v_hi.to(qdt), acc=acc_hi * alpha[:, None], input_precision=PRECISION)
    return m_i, l_i, acc_lo, acc_hi, zacc, pvs, a_sc
