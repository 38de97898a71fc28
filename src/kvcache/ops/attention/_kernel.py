"""Triton kernel of attention over a paged pool or a linear cache layer, every stored format.

One program per (query tile of one sequence, KV head, KV split); tiles of at most 16 rows (decode) put the KV heads
of a query tile next to each other in the launch order, larger tiles the query tiles of a KV head. Its M dimension
is ``BLOCK_Q`` query tokens times the padded GQA group ``G_P``: row ``m`` is token ``m // G_P`` and q head ``kv_head
* G + m % G_P``, so every q head of a KV head shares each K / V tile it loads (decode: one token's whole group,
padded to 16 rows for the tensor cores). QK^T and PV are ``tl.dot`` with float32 accumulators; the online softmax
runs in base 2 with ``log2(e)`` folded into the scale. Without softcap (every format but fp8, whose scale is data),
the rows' maxima are taken on unscaled scores (the scale is > 0) and the scale enters exp2's argument: one
multiply-add per score.

Rows of head_dim are handled as two halves, elements ``[0, H1)`` and ``[H1, D)`` (``H1 = ceil(D / 2)``), each a
power-of-two tile of ``HALF_P`` lanes: int4 stores exactly these halves in the low and high nibbles of one
byte row (planar halves, see :mod:`kvcache.paged.config`), so its codes are unpacked by a mask and a shift
with no shuffles, and the other formats use the same code with two plain loads per row.

Dequantization happens in registers right after the load:

* fp8: the tile converts to the query dtype; ``k_scale`` is folded into the score scale and ``v_scale`` into
  the final normalisation.
* fp8k: as fp8, and each key's float32 scale (per token and head) multiplies its scores after the dot, one
  multiply per score (``k_scale`` is not used).
* int8 / int4 decode tiles (``V_FOLD``: 16 rows, each K / V element used by few rows, so per-element work would
  dominate): both dots run on the codes (exact in fp16 / bf16), and the (scale, zero) pairs act per token. QK^T:
  ``q . k = scale_k * (q . codes) + zero_k * sum(q)``, one multiply-add per score. PV:
  ``sum_j p_j (s_j c_j + z_j) = (s_max / R) * sum_j (R p_j s_j / s_max) c_j + sum_j p_j z_j`` per tile, with ``s_max``
  the tile's largest V scale (the previous tile's where it is not a positive finite number: masked, all-zero or NaN
  tiles) and ``R = PV_RANGE = 2^15``. The dot's P operand (float16) ``R p s / s_max`` is at most ``R`` (``p <= 1``,
  ``s <= s_max``: no fp16 overflow) and leaves fp16's normal range only below ``p s / s_max = 2^-29``, so no weight of
  a token whose scale is small (absolutely, or next to the tile's largest) sinks into fp16's subnormals, as ``p * s``
  in fp16 would (scales ~1e-4). The float32 accumulators hold the output in units of ``a / R``, ``a`` the last tile's
  ``s_max``: each tile rescales them by ``alpha * a / s_max`` and its dot accumulates in place (no multiply of the
  dot's result; they overflow only if a sequence's V scales span about 2^(103 - log2 of the softmax sum), 2^85 for
  long contexts). The zero terms ``sum_j p_j z_j`` go to a per-row float32 accumulator in output units, rescaled by
  ``alpha``, and are added after the accumulators return to output units, before the normalisation. Codes become
  floats with no integer -> float conversion instruction (magic numbers, :mod:`._convert`): K's in the query dtype,
  V's in float16 (float32 for float32 queries), whatever the query dtype, since P's operand is scaled into float16's
  normal range. int8 V rows over 64 elements (``V_MAGIC``, where it measured faster) keep the magic number's offset in
  the operand, ``1024 + c``, and the offset leaves after the loop: a second dot of the tile's float16 P operand with a
  ones tile keeps its row sums ``pvs`` (exact products, in the accumulators' units and rescaled with them), and
  ``1024 * pvs`` is taken from the accumulators at the end. The dot then accumulates products of ``1024 + c`` (at most
  1279) in float32: an error of about 2^-13 of the tile's largest V scale (one int8 step) per unit of softmax weight,
  against the half step of the int8 rounding itself. K keeps exact codes: its offset, ``1024 sum(q)`` in every score,
  measured 100-200x the exact form's log-sum-exp error for queries with a non-zero mean (2e-2 at mean 32).
* int8 / int4 prefill tiles (many rows share each element): K and V are dequantized per element into the dot's
  dtype, ``codes * scale + zero`` in packed 16-bit fma (:func:`._convert.dequant`: its docstring gives the
  precision), so the scores need no per-score affine.
* int4b (keys per channel over each full block): keys are dequantized per element with their block's channel
  pairs (:mod:`._block_keys`), values fold as int4's. Decode tiles of one block per tile index take the full blocks
  of their unmasked range ``BLOCK_GROUP`` at a time, one online-softmax step per group (``block_group_tile``), and
  the rest (the last full blocks, the partial block's int8 rows) one by one.
* A NaN scale or zero (a non-finite (token, head) of the cache) makes every output row that loads it NaN.

Decode tiles may split their keys over the warps (``WARPS_K > 1``, :mod:`._warp_tile`): each warp keeps its own
softmax state over its quarter of every tile's keys, merged once after the KV loop. They exist for int8 / int4
(the V fold above, ``V_FOLD`` set for them whatever the rows) and are chosen by the policy for int4 at
head_dim 65..128 over long contexts.

Shape contract (strides in elements, head_dim contiguous):

* q / out: row of (sequence ``b``, token ``i``, q head ``h``) at ``b * s_qb + (row0_b + i) * s_qt + h * s_qh``
  (paged: ``row0_b = cu_q[b]``, ``s_qb = 0``; linear: ``row0_b = 0``); lse likewise with its own strides.
* pool: element (block, k/v, token, kv head, r) at ``block * S_BLK + kv * S_KV + tok * S_TOK + head * S_HEAD +
  r``; params the same with ``P_*`` strides, r in {0: scale, 1: zero} (fp8k: one plane, r = 0). A linear layer
  ``[B, 2, H, S, D]`` is a pool of ``B`` blocks of ``S`` tokens, block ``b`` holding sequence ``b`` (``LINEAR``).
* workspace (``num_splits > 1``): partial outputs ``[num_splits, n_rows, HQ, D]`` and lse ``[num_splits,
  n_rows, HQ]`` float32, row index ``row0_b + i`` (linear: ``b * q_len + i``).
"""

from __future__ import annotations

import triton.language as tl

from ..._backend import kernel
from ._block_keys import BLOCK_GROUP, block_group_tile
from ._convert import MAGIC
from ._epilogue import _add_sink, _store_rows
from ._loads import LN2, LOG2E, PV_RANGE, _find_tile
from ._tile import _tile
from ._warp_tile import _merge_warps, _tile_w

try:  # programmatic dependent launch (Hopper and later); triton >= 3.4
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover
    gdc_wait = None


@kernel(ints=("s_qt", "s_qh", "s_qb", "s_ot", "s_oh", "s_ob", "s_lt", "s_lh", "s_lb", "bt_stride", "table_width",
              "n_blocks", "q_len_u", "n_seqs", "n_rows", "cp_rank", "cp_size", "window", "num_splits", "n_tiles",
              "rope_len"))
def _attention_kernel(
    # qparams, not `params`: triton 3.6's argument binder has a local of that name
    q, out, lse, ws_out, ws_lse, pool, qparams, kv_scales, sinks, block_tables, cu_q, kv_lens, rope_cos, rope_sin,
    s_qt, s_qh, s_qb, s_ot, s_oh, s_ob, s_lt, s_lh, s_lb, bt_stride, table_width, n_blocks, q_len_u, n_seqs,
    n_rows, cp_rank, cp_size, window, num_splits, n_tiles, rope_len,
    SM_SCALE: tl.constexpr, SOFTCAP: tl.constexpr, D: tl.constexpr, H1: tl.constexpr, HALF_P: tl.constexpr,
    HQ: tl.constexpr, G: tl.constexpr, G_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BS: tl.constexpr, S_BLK: tl.constexpr, S_KV: tl.constexpr, S_TOK: tl.constexpr, S_HEAD: tl.constexpr,
    P_BLK: tl.constexpr, P_KV: tl.constexpr, P_TOK: tl.constexpr, P_HEAD: tl.constexpr, QUANT: tl.constexpr,
    WK: tl.constexpr, FP8_SCALED: tl.constexpr, LINEAR: tl.constexpr, LOG_B: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr, PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr, V_FOLD: tl.constexpr, Q_RESCALE: tl.constexpr, WARPS_K: tl.constexpr,
    HEADS_INNER: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr,
    Q_ROPE: tl.constexpr,
):
    # QUANT: 0 model dtype, 1 fp8, 2 int8, 3 int4, 4 k8v4 (int8 keys, int4 values), 5 fp8k (fp8, a scale per key),
    # 6 int4b (keys per channel over each full block, ``WK`` key-area words per slot; int4 values)
    if PDL:
        # launched as a programmatic dependent: the grid may be resident before the previous kernel (the append,
        # which releases its dependents early) ends; nothing is read before that kernel has finished
        gdc_wait()
    NUM_KV: tl.constexpr = HQ // G
    if HEADS_INNER:
        # decode tiles: the KV heads of one query tile are neighbours in the launch order, so programs that run at
        # the same time read neighbouring rows of the same blocks (whole token rows of the pool and of the (scale,
        # zero) pairs)
        pid = tl.program_id(0) // NUM_KV
        kvh = tl.program_id(0) % NUM_KV
        if not LINEAR:
            # launch order, a permutation of the tiles: those a batch of one row per sequence uses first, its spare
            # tiles (every (BLOCK_Q + 1)-th, which return at once) last, so none holds a slot a working tile waits for
            n_main = n_tiles - n_tiles // (BLOCK_Q + 1)
            pid = tl.where(pid < n_main, pid + pid // BLOCK_Q, (pid - n_main) * (BLOCK_Q + 1) + BLOCK_Q)
    else:
        # prefill tiles: the query tiles of one KV head are neighbours, sharing its K / V in L2
        pid = tl.program_id(0) % n_tiles
        kvh = tl.program_id(0) // n_tiles
    split = tl.program_id(1)
    if LINEAR:
        tiles = tl.cdiv(q_len_u, BLOCK_Q)
        b = pid // tiles
        lt = pid - b * tiles
        q_len = q_len_u + pid * 0
        row0 = pid * 0
        ws_row0 = b * q_len_u
        kv_len = tl.load(kv_lens + b) + q_len_u
        bt_row = block_tables  # unused
    else:
        # decode tiles take their sequence by a checked guess first; fp8 tiles keep the search: Triton 3.6 compiles
        # its head_dim-64 decode tile 32-43% slower with the guess's branch (fp8k, fp8's tiles, keeps it too)
        b, row0, q_len = _find_tile(pid, cu_q, n_seqs, BLOCK_Q, LOG_B, HEADS_INNER and QUANT != 1 and QUANT != 5)
        lt = pid - (row0 // BLOCK_Q + b)
        ws_row0 = row0
        kv_len = tl.load(kv_lens + b)
        bt_row = block_tables + b.to(tl.int64) * bt_stride
    if (lt < 0) | (lt * BLOCK_Q >= q_len):
        # lt < 0: a launch over sequences whose rows start past row 0 (a batch split into decode and prefill
        # launches) has no sequence for its first tiles
        return
    # operand dtype of the tensor-core dots: the query's (float32 where the interpreter cannot dot bf16)
    if DOT_F32:
        qdt = tl.float32
    else:
        qdt = q.dtype.element_ty

    # ---- query tile: BLOCK_Q tokens x G_P heads -------------------------------------------------------
    offs_m = tl.arange(0, BLOCK_Q * G_P)
    qi = lt * BLOCK_Q + offs_m // G_P
    g = offs_m % G_P
    hq = kvh * G + g
    ok_m = (qi < q_len) & (g < G) & (row0 + qi < n_rows)
    q_pos = kv_len - q_len + qi
    dd = tl.arange(0, HALF_P)
    # lane masks of the two halves; all-true constants where a half fills its tile (D = 64, 128, 256), so that the
    # compiler can prove whole 16-byte groups unmasked and vectorize the loads and stores
    if H1 == HALF_P:
        ok_lo = tl.full([HALF_P], 1, tl.int1)
    else:
        ok_lo = dd < H1
    if D - H1 == HALF_P:
        ok_hi = tl.full([HALF_P], 1, tl.int1)
    else:
        ok_hi = dd < D - H1
    q_rows = b.to(tl.int64) * s_qb + (row0 + qi).to(tl.int64) * s_qt + hq * s_qh
    q_lo = tl.load(q + q_rows[:, None] + dd[None, :], mask=ok_m[:, None] & ok_lo[None, :], other=0.0)
    q_hi = tl.load(q + q_rows[:, None] + H1 + dd[None, :], mask=ok_m[:, None] & ok_hi[None, :], other=0.0)
    if Q_ROPE:
        # rotate-half RoPE of each query row at its position, the halves being the rotation's pairs: [a, b] ->
        # [a cos - b sin, b cos + a sin] in float32, one rounding (cos / sin rows [rope_len, D] hold each frequency
        # twice; a position outside the tables rotates to zero)
        ok_c = ok_m[:, None] & ok_lo[None, :] & (q_pos >= 0)[:, None] & (q_pos < rope_len)[:, None]
        cs_rows = q_pos.to(tl.int64)[:, None] * D + dd[None, :]
        cos_q = tl.load(rope_cos + cs_rows, mask=ok_c, other=0.0).to(tl.float32)
        sin_q = tl.load(rope_sin + cs_rows, mask=ok_c, other=0.0).to(tl.float32)
        qa = q_lo.to(tl.float32)
        qb = q_hi.to(tl.float32)
        q_lo = (qa * cos_q - qb * sin_q).to(q.dtype.element_ty)
        q_hi = (qb * cos_q + qa * sin_q).to(q.dtype.element_ty)
    if QUANT >= 2 and QUANT <= 4:
        q_sum = tl.sum(q_lo.to(tl.float32), 1) + tl.sum(q_hi.to(tl.float32), 1)
    else:
        q_sum = tl.zeros([BLOCK_Q * G_P], tl.float32)  # unused
    q_inv = tl.full([BLOCK_Q * G_P], 1.0, tl.float32)
    if Q_RESCALE:
        # bfloat16 queries over int8 codes (decode tiles): QK^T runs in float16, whose code conversion is 2.5x
        # cheaper than bfloat16's. Each row is scaled by a power of two r that brings its largest |q| into
        # [2^14, 2^15), exact (bfloat16's 8 significant bits fit float16's 11) for every element above 2^-28 of
        # the row's largest; scores are multiplied by 1 / r and sum(q) by r (the zero term)
        amax = tl.maximum(tl.max(tl.abs(q_lo.to(tl.float32)), 1), tl.max(tl.abs(q_hi.to(tl.float32)), 1))
        e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        k = tl.minimum(tl.maximum(268 - e, 1), 253)
        r = (k << 23).to(tl.float32, bitcast=True)
        q_inv = ((254 - k) << 23).to(tl.float32, bitcast=True)
        q_lo = (q_lo.to(tl.float32) * r[:, None]).to(tl.float16)
        q_hi = (q_hi.to(tl.float32) * r[:, None]).to(tl.float16)
        q_sum = q_sum * r
        if not DOT_F32:
            qdt_k: tl.constexpr = tl.float16
        else:
            qdt_k: tl.constexpr = qdt
    else:
        qdt_k: tl.constexpr = qdt
    q_lo = q_lo.to(qdt_k)
    q_hi = q_hi.to(qdt_k)
    # decode tiles without a warp split take int8 V rows over 64 elements as float16 magic numbers with the offset
    # left in (module docstring); every other operand converts exactly
    V_MAGIC: tl.constexpr = V_FOLD and WARPS_K == 1 and QUANT == 2 and HALF_P >= 64 and qdt != tl.float32
    # the keys' and the values' formats and where they live: k8v4 stores int8 keys in planes 0 / 1 (the second half
    # S_KV after the first) and int4 values in plane 2; the other formats a key row's halves H1 apart, values at S_KV
    if QUANT == 4:
        QK: tl.constexpr = 2
        QV: tl.constexpr = 3
        K_HI: tl.constexpr = S_KV
        V_AT: tl.constexpr = 2 * S_KV
    elif QUANT == 6:
        QK: tl.constexpr = 6
        QV: tl.constexpr = 3
        K_HI: tl.constexpr = H1
        V_AT: tl.constexpr = S_KV
    else:
        QK: tl.constexpr = QUANT
        QV: tl.constexpr = QUANT
        K_HI: tl.constexpr = H1
        V_AT: tl.constexpr = S_KV

    k_scale = 1.0
    v_scale = 1.0
    if FP8_SCALED:
        if QUANT == 1:  # fp8k's keys carry their own scales
            k_scale = tl.load(kv_scales)
        v_scale = tl.load(kv_scales + 1)
    if SOFTCAP > 0:
        qk_scale = k_scale * (SM_SCALE / SOFTCAP)
    else:
        qk_scale = k_scale * (SM_SCALE * LOG2E)

    full_end = kv_len // BS * BS  # int4b: keys below it are in full blocks
    # ---- local KV range of this tile and split ------------------------------------------------------------
    x = kv_len - cp_rank
    n_local = tl.where(x > 0, (x + cp_size - 1) // cp_size, 0)
    n_local = tl.minimum(n_local, table_width * BS)
    last_pos = kv_len - q_len + tl.minimum(lt * BLOCK_Q + BLOCK_Q, q_len) - 1
    y = last_pos - cp_rank
    j_hi = tl.minimum(tl.where(y >= 0, y // cp_size + 1, 0), n_local)
    j_lo = j_hi * 0
    if HAS_WINDOW:
        z = kv_len - q_len + lt * BLOCK_Q - window + 1 - cp_rank
        j_lo = tl.where(z > 0, (z + cp_size - 1) // cp_size, 0)
    t_lo = j_lo // BLOCK_N
    n_t = tl.maximum(tl.cdiv(j_hi, BLOCK_N) - t_lo, 0)
    # at least MIN_SPLIT_TILES tiles per split: the plan sized the split for the block table's capacity, and the
    # splits past a shorter sequence's tiles return empty (log-sum-exp -inf, ignored by the merge)
    per = tl.maximum(tl.cdiv(n_t, num_splits), MIN_SPLIT_TILES)
    t_begin = t_lo + split * per
    t_end = tl.minimum(t_begin + per, t_lo + n_t)

    # tiles every row sees whole (keys inside the first row's causal bound and the last row's window) run
    # without the score mask: [tf_lo, tf_hi); the tiles before and after it are masked
    y0 = kv_len - q_len + lt * BLOCK_Q - cp_rank
    jf_hi = tl.minimum(tl.where(y0 >= 0, y0 // cp_size + 1, 0), j_hi)
    tf_lo = t_lo
    if HAS_WINDOW:
        zf = last_pos - window + 1 - cp_rank
        tf_lo = tl.cdiv(tl.where(zf > 0, (zf + cp_size - 1) // cp_size, 0), BLOCK_N)
    tf_hi = tl.maximum(jf_hi // BLOCK_N, tf_lo)

    if WARPS_K > 1:
        # decode tiles split over the warps (``_warp_tile``): W states of [W, M], merged after the loop
        W: tl.constexpr = WARPS_K
        M: tl.constexpr = BLOCK_Q * G_P
        offs_w = tl.arange(0, W)[:, None] * (BLOCK_N // W) + tl.arange(0, BLOCK_N // W)[None, :]
        q_lo_w = tl.broadcast_to(q_lo[None, :, :], (W, M, HALF_P))
        q_hi_w = tl.broadcast_to(q_hi[None, :, :], (W, M, HALF_P))
        m_w = tl.full([W, M], float("-inf"), tl.float32)
        l_w = tl.zeros([W, M], tl.float32)
        acc_lo_w = tl.zeros([W, M, HALF_P], tl.float32)
        acc_hi_w = tl.zeros([W, M, HALF_P], tl.float32)
        zacc_w = tl.zeros([W, M], tl.float32)
        if HAS_WINDOW:
            for t in range(t_begin, tl.minimum(t_end, tf_lo)):
                m_w, l_w, acc_lo_w, acc_hi_w, zacc_w = _tile_w(
                    t, m_w, l_w, acc_lo_w, acc_hi_w, zacc_w, q_lo_w, q_hi_w, q_sum, q_inv, q_pos, ok_m, qk_scale, pool,
                    qparams, bt_row, b, kvh, j_hi, n_blocks, cp_rank, cp_size, window, offs_w, dd, ok_lo, ok_hi, qdt,
                    SOFTCAP, H1, BLOCK_N, BS, S_BLK, K_HI, V_AT, S_TOK, S_HEAD, P_BLK, P_KV, P_TOK, P_HEAD, QK, QV,
                    LINEAR, HAS_WINDOW, PRECISION, True, Q_RESCALE, INTERP)
        for t in range(tl.maximum(t_begin, tf_lo), tl.minimum(t_end, tf_hi)):
            m_w, l_w, acc_lo_w, acc_hi_w, zacc_w = _tile_w(
                t, m_w, l_w, acc_lo_w, acc_hi_w, zacc_w, q_lo_w, q_hi_w, q_sum, q_inv, q_pos, ok_m, qk_scale, pool,
                qparams, bt_row, b, kvh, j_hi, n_blocks, cp_rank, cp_size, window, offs_w, dd, ok_lo, ok_hi, qdt,
                SOFTCAP, H1, BLOCK_N, BS, S_BLK, K_HI, V_AT, S_TOK, S_HEAD, P_BLK, P_KV, P_TOK, P_HEAD, QK, QV,
                LINEAR, HAS_WINDOW, PRECISION, False, Q_RESCALE, INTERP)
        for t in range(tl.maximum(t_begin, tf_hi), t_end):
            m_w, l_w, acc_lo_w, acc_hi_w, zacc_w = _tile_w(
                t, m_w, l_w, acc_lo_w, acc_hi_w, zacc_w, q_lo_w, q_hi_w, q_sum, q_inv, q_pos, ok_m, qk_scale, pool,
                qparams, bt_row, b, kvh, j_hi, n_blocks, cp_rank, cp_size, window, offs_w, dd, ok_lo, ok_hi, qdt,
                SOFTCAP, H1, BLOCK_N, BS, S_BLK, K_HI, V_AT, S_TOK, S_HEAD, P_BLK, P_KV, P_TOK, P_HEAD, QK, QV,
                LINEAR, HAS_WINDOW, PRECISION, True, Q_RESCALE, INTERP)
        m_i, l_i, acc_lo, acc_hi, zacc = _merge_warps(m_w, l_w, acc_lo_w, acc_hi_w, zacc_w)
        pvs = tl.zeros([M], tl.float32)  # unused: V_MAGIC takes one-warp tiles
    else:
        m_i = tl.full([BLOCK_Q * G_P], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * G_P], tl.float32)
        acc_lo = tl.zeros([BLOCK_Q * G_P, HALF_P], tl.float32)
        acc_hi = tl.zeros([BLOCK_Q * G_P, HALF_P], tl.float32)
        zacc = tl.zeros([BLOCK_Q * G_P], tl.float32)  # V_FOLD: sum of p * zero_v per row (else unused)
        if V_MAGIC:
            # the magic offset's weight per row, in each of 16 equal columns (summed by a dot)
            pvs = tl.zeros([BLOCK_Q * G_P, 16], tl.float32)
        else:
            pvs = tl.zeros([BLOCK_Q * G_P], tl.float32)  # unused
        a_sc = tl.full([], 1.0, tl.float32)  # V_FOLD: the accumulators hold the output times R / a_sc
        offs_n = tl.arange(0, BLOCK_N)
        if HAS_WINDOW:  # without a window, tf_lo == t_lo: nothing before the unmasked tiles
            for t in range(t_begin, tl.minimum(t_end, tf_lo)):
                m_i, l_i, acc_lo, acc_hi, zacc, pvs, a_sc = _tile(
                    t, m_i, l_i, acc_lo, acc_hi, zacc, pvs, a_sc, q_lo, q_hi, q_sum, q_inv, q_pos, ok_m, qk_scale,
                    pool, qparams, bt_row, b, kvh, j_hi, n_blocks, full_end, table_width, cp_rank, cp_size, window,
                    offs_n, dd, ok_lo, ok_hi, qdt, SOFTCAP, H1, BLOCK_N, BS, S_BLK, K_HI, V_AT, S_TOK, S_HEAD, P_BLK,
                    P_KV, P_TOK, P_HEAD, QK, QV, WK, LINEAR, HAS_WINDOW, PRECISION, True, V_FOLD, Q_RESCALE, INTERP,
                    q.dtype.element_ty, V_MAGIC)
        u_lo = tl.maximum(t_begin, tf_lo)
        u_hi = tl.minimum(t_end, tf_hi)
        if QUANT == 6 and V_FOLD and not LINEAR and BLOCK_N == BS and BLOCK_GROUP > 1:
            # int4b decode tiles: the full blocks of the unmasked range in groups of BLOCK_GROUP blocks, one softmax
            # step each; the rest (the last full blocks and the partial one) one block per tile below
            n_grp = tl.maximum(tl.minimum(u_hi, full_end // BS) - u_lo, 0) // BLOCK_GROUP
            for i in range(0, n_grp):
                m_i, l_i, acc_lo, acc_hi, zacc, a_sc = block_group_tile(
                    u_lo + i * BLOCK_GROUP, m_i, l_i, acc_lo, acc_hi, zacc, a_sc, q_lo, q_hi, qk_scale, pool,
                    qparams, bt_row, kvh, j_hi, n_blocks, offs_n, dd, ok_lo, ok_hi, SOFTCAP, H1, BS, S_BLK, S_KV,
                    S_TOK, S_HEAD, P_BLK, P_TOK, P_HEAD, WK, BLOCK_GROUP, PRECISION,
                    not INTERP and q_lo.dtype == tl.float16, INTERP)
            u_lo = u_lo + n_grp * BLOCK_GROUP
        for t in range(u_lo, u_hi):
            m_i, l_i, acc_lo, acc_hi, zacc, pvs, a_sc = _tile(
                t, m_i, l_i, acc_lo, acc_hi, zacc, pvs, a_sc, q_lo, q_hi, q_sum, q_inv, q_pos, ok_m, qk_scale, pool,
                qparams, bt_row, b, kvh, j_hi, n_blocks, full_end, table_width, cp_rank, cp_size, window, offs_n,
                dd, ok_lo, ok_hi, qdt, SOFTCAP, H1, BLOCK_N, BS, S_BLK, K_HI, V_AT, S_TOK, S_HEAD, P_BLK, P_KV, P_TOK,
                P_HEAD, QK, QV, WK, LINEAR, HAS_WINDOW, PRECISION, False, V_FOLD, Q_RESCALE, INTERP,
                q.dtype.element_ty, V_MAGIC)
        for t in range(tl.maximum(t_begin, tf_hi), t_end):
            m_i, l_i, acc_lo, acc_hi, zacc, pvs, a_sc = _tile(
                t, m_i, l_i, acc_lo, acc_hi, zacc, pvs, a_sc, q_lo, q_hi, q_sum, q_inv, q_pos, ok_m, qk_scale, pool,
                qparams, bt_row, b, kvh, j_hi, n_blocks, full_end, table_width, cp_rank, cp_size, window, offs_n,
                dd, ok_lo, ok_hi, qdt, SOFTCAP, H1, BLOCK_N, BS, S_BLK, K_HI, V_AT, S_TOK, S_HEAD, P_BLK, P_KV, P_TOK,
                P_HEAD, QK, QV, WK, LINEAR, HAS_WINDOW, PRECISION, True, V_FOLD, Q_RESCALE, INTERP,
                q.dtype.element_ty, V_MAGIC)

    if HAS_SINKS:
        m_i, l_i, acc_lo, acc_hi, zacc, pvs = _add_sink(sinks, hq, ok_m, split, cp_rank, m_i, l_i, acc_lo, acc_hi,
                                                        zacc, pvs, V_FOLD, V_MAGIC)

    has = l_i > 0
    inv = tl.where(has, v_scale / tl.where(has, l_i, 1.0), 0.0)
    if V_FOLD:
        # less the magic offset (V_MAGIC, in the accumulators' units), back to output units, plus the zero terms
        if V_MAGIC:
            pv_sum = tl.max(pvs, 1)
            acc_lo = acc_lo - MAGIC * pv_sum[:, None]
            acc_hi = acc_hi - MAGIC * pv_sum[:, None]
        if WARPS_K == 1:
            acc_lo = (acc_lo * (1.0 / PV_RANGE)) * a_sc
            acc_hi = (acc_hi * (1.0 / PV_RANGE)) * a_sc
        acc_lo = acc_lo + zacc[:, None]
        acc_hi = acc_hi + zacc[:, None]
    o_lo = acc_lo * inv[:, None]
    o_hi = acc_hi * inv[:, None]
    row_lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    if num_splits == 1:
        o_rows = b.to(tl.int64) * s_ob + (row0 + qi).to(tl.int64) * s_ot + hq * s_oh
        _store_rows(out, o_rows, dd, ok_m, ok_lo, o_lo.to(out.dtype.element_ty))
        _store_rows(out + H1, o_rows, dd, ok_m, ok_hi, o_hi.to(out.dtype.element_ty))
        if HAS_LSE:
            l_rows = b.to(tl.int64) * s_lb + (row0 + qi).to(tl.int64) * s_lt + hq * s_lh
            tl.store(lse + l_rows, row_lse, mask=ok_m)
    else:
        w_rows = (split * n_rows + ws_row0 + qi).to(tl.int64) * HQ + hq
        _store_rows(ws_out, w_rows * D, dd, ok_m, ok_lo, o_lo)
        _store_rows(ws_out + H1, w_rows * D, dd, ok_m, ok_hi, o_hi)
        tl.store(ws_lse + w_rows, row_lse, mask=ok_m)
