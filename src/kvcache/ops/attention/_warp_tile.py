"""Warp-split decode tiles of the attention kernel: each of ``W`` warps takes its own ``BLOCK_N / W`` keys of a KV
tile and keeps its own online-softmax state, so a tile needs no exchange between warps (no shared-memory row
reductions, no barrier, and P reaches the PV dot in the registers of the warp that computed it). The ``W``
states are merged once, after the KV loop, by log-sum-exp (:func:`_merge_warps`).

Tensors carry a leading warp dimension: scores ``[W, M, BLOCK_N / W]``, accumulators ``[W, M, HALF_P]``, row
state ``[W, M]``; the dots are batched over it (the batch dimension of a 3-D ``tl.dot`` is spread over the warps).
int8 / int4 caches only: numerics are those of the decode tiles of :func:`._tile._tile` (codes in the dots,
the same scores and masks, the V fold over each warp's keys).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._loads import PV_RANGE, _key_rows, _load_kv, _load_params, _softcapped


@triton.jit
def _tile_w(
    t, m_i, l_i, acc_lo, acc_hi, zacc, q_lo, q_hi, q_sum, q_inv, q_pos, ok_m, qk_scale, pool, qparams, bt_row, b, kvh,
    j_hi, n_blocks, cp_rank, cp_size, window, offs_w, dd, ok_lo, ok_hi, qdt: tl.constexpr, SOFTCAP: tl.constexpr,
    H1: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, S_BLK: tl.constexpr, K_HI: tl.constexpr,
    V_AT: tl.constexpr, S_TOK: tl.constexpr, S_HEAD: tl.constexpr, P_BLK: tl.constexpr, P_KV: tl.constexpr,
    P_TOK: tl.constexpr, P_HEAD: tl.constexpr, QK: tl.constexpr, QV: tl.constexpr, LINEAR: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, MASK: tl.constexpr, Q_RESCALE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """KV tile ``t`` split over the warps: ``offs_w`` ``[W, BLOCK_N / W]`` are the tile's key offsets of each
    warp; q ``[W, M, HALF_P]`` (the query tile broadcast), state ``[W, M]`` / ``[W, M, HALF_P]``. Returns the
    updated (m_i, l_i, acc_lo, acc_hi, zacc)."""
    tl.static_assert(QK >= 2 and QK <= 4, "warp-split tiles: int8 / int4 / k8v4 caches")
    j = t * BLOCK_N + offs_w
    ok_n, blk, tok, base = _key_rows(j, j_hi, b, bt_row, n_blocks, kvh, BS, S_BLK, S_TOK, S_HEAD, LINEAR)
    k_off = base[:, None, :] + dd[None, :, None]
    k_lo, k_hi = _load_kv(pool, k_off, ok_n[:, None, :] & ok_lo[None, :, None], ok_n[:, None, :] & ok_hi[None, :, None],
                          K_HI, QK, q_lo.dtype, False, INTERP, False)
    s = tl.dot(q_lo, k_lo.to(q_lo.dtype), input_precision=PRECISION)
    s = tl.dot(q_hi, k_hi.to(q_lo.dtype), acc=s, input_precision=PRECISION)
    pbase = blk * P_BLK + tok * P_TOK + kvh * P_HEAD
    ks, kz = _load_params(qparams, pbase, ok_n)
    s = s * ks[:, None, :] + q_sum[None, :, None] * kz[:, None, :]
    if Q_RESCALE:
        s = s * q_inv[None, :, None]  # the rows' 1 / r (rescaled bfloat16 queries)
    if SOFTCAP > 0:
        s = _softcapped(s, qk_scale, SOFTCAP)
    else:
        s = s * qk_scale
    if MASK:
        k_pos = j * cp_size + cp_rank
        allowed = ok_m[None, :, None] & ok_n[:, None, :] & (k_pos[:, None, :] <= q_pos[None, :, None])
        if HAS_WINDOW:
            allowed = allowed & (k_pos[:, None, :] > q_pos[None, :, None] - window)
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 2))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, :, None])
    l_i = l_i * alpha + tl.sum(p, 2)
    m_i = m_new
    if qdt == tl.float32:
        vdt: tl.constexpr = tl.float32
    else:
        vdt: tl.constexpr = tl.float16
    v_off = (base + V_AT)[:, :, None] + dd[None, None, :]
    v_lo, v_hi = _load_kv(pool, v_off, ok_n[:, :, None] & ok_lo[None, None, :], ok_n[:, :, None] & ok_hi[None, None, :],
                          H1, QV, vdt, False, INTERP, False)
    vp = blk * P_BLK + P_KV + tok * P_TOK + kvh * P_HEAD
    vs, vz = _load_params(qparams, vp, ok_n)
    # the V fold of _kernel's docstring, over each warp's keys: (s_max / R) sum_j (R p_j s_j / s_max) c_j
    vs_max = tl.max(vs, 1)
    vs_max = tl.where((vs_max > 0.0) & (vs_max < float("inf")), vs_max, 1.0)
    pv = (p * ((vs / vs_max[:, None]) * PV_RANGE)[:, None, :]).to(vdt)
    dot_scale = (vs_max * (1.0 / PV_RANGE))[:, None, None]
    acc_lo = acc_lo * alpha[:, :, None] + dot_scale * tl.dot(pv, v_lo, input_precision=PRECISION)
    acc_hi = acc_hi * alpha[:, :, None] + dot_scale * tl.dot(pv, v_hi, input_precision=PRECISION)
    zacc = zacc * alpha + tl.sum(p * vz[:, None, :], 2)
    return m_i, l_i, acc_lo, acc_hi, zacc


@triton.jit
def _merge_warps(m_w, l_w, acc_lo_w, acc_hi_w, zacc_w):
    """Merge the ``W`` warps' states (``[W, M]``, ``[W, M, HALF_P]``) into one row state by log-sum-exp: returns
    (m_i, l_i, acc_lo, acc_hi, zacc) as the single-state tile loop leaves them."""
    m_i = tl.max(m_w, 0)
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    w = tl.exp2(m_w - m_safe[None, :])
    l_i = tl.sum(l_w * w, 0)
    acc_lo = tl.sum(acc_lo_w * w[:, :, None], 0)
    acc_hi = tl.sum(acc_hi_w * w[:, :, None], 0)
    zacc = tl.sum(zacc_w * w, 0)
    return m_i, l_i, acc_lo, acc_hi, zacc
