"""The append kernel: new K / V rows into paged blocks, RoPE on K and quantization fused."""

from __future__ import annotations

import triton
import triton.language as tl

from ...._backend import kernel
from .codes import Q_FP8, Q_FP8K, Q_NONE
from .lookup import _lookup, _spec_lookup, _spec_same
from .numerics import _rcp
from .quant import _encode, _store_row
from .rope import _rope_k

try:  # programmatic dependent launch (Hopper and later); triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _load_token(k, v, n, stride_kn, stride_vn, hh, i, m1, m2, HALF: tl.constexpr, STRIDE_KH: tl.constexpr,
                STRIDE_VH: tl.constexpr, VEC: tl.constexpr, LOAD_EV: tl.constexpr):
    # row n of k and v as two half tiles each (model dtype, not converted: fewer live registers). The row
    # strides come in units of VEC elements: the product with the constexpr proves to the compiler that rows
    # start on VEC-element boundaries (vector loads; an int argument carries no divisibility of its own).
    nn = n.to(tl.int64)
    krow = k + nn * (stride_kn * VEC) + hh * STRIDE_KH
    vrow = v + nn * (stride_vn * VEC) + hh * STRIDE_VH
    k1 = tl.load(krow + i, mask=m1, other=0.0, eviction_policy=LOAD_EV)
    k2 = tl.load(krow + HALF + i, mask=m2, other=0.0, eviction_policy=LOAD_EV)
    v1 = tl.load(vrow + i, mask=m1, other=0.0, eviction_policy=LOAD_EV)
    v2 = tl.load(vrow + HALF + i, mask=m2, other=0.0, eviction_policy=LOAD_EV)
    return k1, k2, v1, v2



@triton.jit
def _write_row(
    r1, r2, is_v, valid, blk, off, pos, k, n, stride_kn, pool, qparams, inv_freq, freqs, FMAX: tl.constexpr, fp8_scales,
    hh, i, m1, m2, RAW: tl.constexpr, QUANT: tl.constexpr, ROPE: tl.constexpr, ROT: tl.constexpr,
    INTERLEAVED: tl.constexpr, ATTN_SCALE: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, S_TOK: tl.constexpr, S_HEAD: tl.constexpr, P_TOK: tl.constexpr,
    P_HEAD: tl.constexpr, STRIDE_KH: tl.constexpr, BLOCK_H: tl.constexpr, LIBDEVICE: tl.constexpr,
    VEC: tl.constexpr, EARLY: tl.constexpr, STORE_CM: tl.constexpr, PAIR_ASM: tl.constexpr, SELECT: tl.constexpr,
    MASKED: tl.constexpr, cs_c, cs_s, CS_GIVEN: tl.constexpr,
):
    # Store row n's K (is_v == 0: RoPE applied) or V (is_v == 1), given as half tiles r1 / r2 in the model
    # dtype, at (blk, off) in the pool's format. is_v is a constant or a per-program value; RAW: store r1 / r2
    # as loaded (no RoPE, unquantized). RoPE and quantization do not depend on where the row goes: with EARLY
    # they run before the branch on `valid` (which waits for the block-table load) and overlap that load; only
    # the stores wait.
    if EARLY:
        c1, c2, scale, zero = _row_codes(r1, r2, is_v, pos, k, n, stride_kn, inv_freq, freqs, FMAX, fp8_scales, hh,
                                         i, m1, m2, RAW, QUANT, ROPE, ROT, INTERLEAVED, ATTN_SCALE, H, D, HALF,
                                         STRIDE_KH, BLOCK_H, LIBDEVICE, VEC, SELECT, cs_c, cs_s, CS_GIVEN)
    if EARLY and MASKED:
        # no branch on `valid`: the stores are predicated on it. Behind a branch, ptxas hoisted the branch (and
        # so the wait for the block table) above the per-head division and the codes, which then ran after the
        # block-table load returned instead of overlapping it
        _store_row(c1, c2, scale, zero, pool, qparams, blk, off, is_v, hh, i, m1, m2, valid, QUANT, H, HALF, DP,
                   BLOCK_SIZE, S_TOK, S_HEAD, P_TOK, P_HEAD, STORE_CM, PAIR_ASM, True, LIBDEVICE)
    elif valid:
        if not EARLY:
            c1, c2, scale, zero = _row_codes(r1, r2, is_v, pos, k, n, stride_kn, inv_freq, freqs, FMAX, fp8_scales,
                                             hh, i, m1, m2, RAW, QUANT, ROPE, ROT, INTERLEAVED, ATTN_SCALE, H, D,
                                             HALF, STRIDE_KH, BLOCK_H, LIBDEVICE, VEC, SELECT, cs_c, cs_s,
                                             CS_GIVEN)
        _store_row(c1, c2, scale, zero, pool, qparams, blk, off, is_v, hh, i, m1, m2, valid, QUANT, H, HALF, DP,
                   BLOCK_SIZE, S_TOK, S_HEAD, P_TOK, P_HEAD, STORE_CM, PAIR_ASM, False, LIBDEVICE)


@triton.jit
def _row_codes(
    r1, r2, is_v, pos, k, n, stride_kn, inv_freq, freqs, FMAX: tl.constexpr, fp8_scales, hh, i, m1, m2,
    RAW: tl.constexpr, QUANT: tl.constexpr, ROPE: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr,
    ATTN_SCALE: tl.constexpr, H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, STRIDE_KH: tl.constexpr,
    BLOCK_H: tl.constexpr, LIBDEVICE: tl.constexpr, VEC: tl.constexpr, SELECT: tl.constexpr, cs_c, cs_s,
    CS_GIVEN: tl.constexpr,
):
    # what _store_row stores for row n's K or V (see _write_row); SELECT: is_v is a per-program value, RoPE
    # computed by K and V programs and kept by K; CS_GIVEN: RoPE's cos / sin are cs_c / cs_s (see _rope_k)
    if RAW and (QUANT == Q_NONE):
        c1 = r1
        c2 = r2
        scale = tl.zeros([BLOCK_H, 1], tl.float32)  # unused
        zero = scale
    else:
        inv = 1.0
        if QUANT == Q_FP8:  # one IEEE reciprocal per row, then multiplies (as the reference)
            inv = _rcp(tl.load(fp8_scales + is_v), LIBDEVICE)
        elif QUANT == Q_FP8K:  # the values' (the keys have their own, per head: _encode)
            inv = _rcp(tl.load(fp8_scales + 1), LIBDEVICE)
        x1 = r1.to(tl.float32)
        x2 = r2.to(tl.float32)
        if ROPE:
            if SELECT:
                # is_v per program (split launches): V programs rotate too and keep x. Branching on is_v instead,
                # ptxas moves a slot mapping's position load into the branch, after the wait for K / V: two
                # memory latencies in a row (V programs are not the critical path). The policy selects it for
                # quantized slot-mapping launches, the ones it makes faster (docs/tuning-history.md)
                y1, y2 = _rope_k(x1, x2, pos, freqs, FMAX, k, n, stride_kn, hh, i, m1, m2, inv_freq, ROT,
                                 INTERLEAVED, ATTN_SCALE, D, HALF, STRIDE_KH, LIBDEVICE, VEC, cs_c, cs_s, CS_GIVEN)
                x1 = tl.where(is_v == 0, y1, x1)
                x2 = tl.where(is_v == 0, y2, x2)
            elif is_v == 0:
                x1, x2 = _rope_k(x1, x2, pos, freqs, FMAX, k, n, stride_kn, hh, i, m1, m2, inv_freq, ROT, INTERLEAVED,
                                 ATTN_SCALE, D, HALF, STRIDE_KH, LIBDEVICE, VEC, cs_c, cs_s, CS_GIVEN)
        c1, c2, scale, zero = _encode(x1, x2, inv, hh, m1, m2, is_v, QUANT, H, BLOCK_H, LIBDEVICE)
    return c1, c2, scale, zero


@kernel(ints=("stride_kn", "stride_vn", "bt_stride", "table_width", "n_seqs", "guess_mul"))
def _append_kernel(
    k, v,  # model dtype [N, H, D], head_dim contiguous; row strides stride_kn * VEC / stride_vn * VEC
    pool,  # storage dtype, one layer (see kvcache.paged.config)
    qparams,  # float32 (scale, zero) pool when QUANT >= Q_INT8 (fp8k: key scales), else unused (not `params`:
    # triton's binder uses that name for a local)
    block_tables,  # int32 [B, table_width] (MODE 0 / 1)
    cu_q,  # int32 [B + 1] (MODE 0 / 1)
    k_lens,  # int32 kv_lens [B] (MODE 0) or cu_k_lens [B + 1] (MODE 1)
    slots,  # int64 [N] (MODE 2)
    positions,  # int32 / int64 [N] (MODE 2 with ROPE)
    inv_freq,  # float32 [ROT // 2] (ROPE)
    fp8_scales,  # float32 [2]: k_scale, v_scale (QUANT == Q_FP8; Q_FP8K: v_scale alone)
    stride_kn, stride_vn, bt_stride, table_width, n_seqs,
    guess_mul,  # see _guess_mul
    MODE: tl.constexpr,  # 0: cu_q_lens + kv_lens, 1: cu_q_lens + cu_k_lens, 2: slot mapping
    QUANT: tl.constexpr,  # 0 none, 1 fp8, 2 int8, 3 int4, 4 k8v4, 5 fp8k (codes.py)
    ROPE: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr, ATTN_SCALE: tl.constexpr,
    H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,  # DP: stored elements per row of a plane (D or D // 2)
    BLOCK_SIZE: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    S_TOK: tl.constexpr, S_HEAD: tl.constexpr, P_TOK: tl.constexpr, P_HEAD: tl.constexpr,  # see _block_strides
    CP_RANK: tl.constexpr, CP_SIZE: tl.constexpr,
    SEARCH: tl.constexpr,  # > 0: find the sequence with one vector load of SEARCH entries; 0: binary search
    LOG_B: tl.constexpr,
    STRIDE_KH: tl.constexpr, STRIDE_VH: tl.constexpr,  # head strides of k / v (fixed per model)
    BLOCK_H: tl.constexpr, BLOCK_HF: tl.constexpr, LIBDEVICE: tl.constexpr,
    SPLIT: tl.constexpr,  # False: a program writes one row's K and V; True: two programs per row, one for K and
    # one for V (half the work on each program's critical path: short decode launches)
    PDL: tl.constexpr,  # launched with programmatic dependent launch: wait for the previous kernel before the
    # first read (after the lookup with INDEX_FIRST), release the next one after that wait
    FMAX: tl.constexpr,  # max(inv_freq) (ROPE), 0.0 when unknown: bounds a row's angles (see _sincos)
    VEC: tl.constexpr,  # stride_kn / stride_vn are in units of VEC elements (a power of two)
    EARLY: tl.constexpr,  # RoPE / quantization before the block-table load returns (see _write_row)
    LOAD_EV: tl.constexpr, STORE_CM: tl.constexpr,  # cache hints: eviction policy of k / v loads, pool stores
    HG: tl.constexpr,  # SPLIT: head groups of BLOCK_H heads, one program each
    PAIR_ASM: tl.constexpr,  # (scale, zero) stored by PTX inline assembly (see _store_pair); else tl.store
    ROPE_SELECT: tl.constexpr,  # SPLIT: K and V programs both rotate, V keeps its row (see _row_codes)
    MASKED: tl.constexpr,  # EARLY: stores predicated on the row's validity rather than behind a branch (_write_row)
    CS_FIRST: tl.constexpr,  # rotate-half over all of D: RoPE's cos / sin right after the lookup (_rope_cs)
    INDEX_FIRST: tl.constexpr,  # the lookup (and CS_FIRST's cos / sin) before the wait for the previous kernel
    # (PDL); only for index tensors and inv_freq that kernel does not write (see policy.plan_append)
    SPECULATE: tl.constexpr,  # INDEX_FIRST without that promise: the lookup's first guess before the wait, every
    # value it read checked after the wait (_spec_same); a row whose values changed, or whose guess missed, is
    # looked up and written again after that, behind one branch
    FREQS_LATE: tl.constexpr,  # inv_freq may be written by the previous kernel: read after the wait (SPECULATE)
):
    # grid: (N,), or (2 HG N,) when SPLIT: a program per row's K or V and group of BLOCK_H heads. A row (one
    # token, BLOCK_H heads) is handled as two half tiles, elements [0, HALF) and [HALF, D): rotate-half RoPE
    # pairs them directly, int4 packs them into one byte.
    HALF: tl.constexpr = (D + 1) // 2
    # a missed guess calls the search (see _find_seq_call): per-row launches, and split ones of raw rows
    SEARCH_CALL: tl.constexpr = (not SPLIT) or (QUANT == Q_NONE and not ROPE)
    CS_GIVEN: tl.constexpr = CS_FIRST and ROPE and (not INTERLEAVED) and (ROT == D)
    FAST_F: tl.constexpr = ROPE and (not INTERLEAVED) and (ROT == D)  # freqs loaded once, below
    if PDL and not INDEX_FIRST:
        gdc_wait()  # everything below may read what the previous kernel wrote
        gdc_launch_dependents()  # the next kernel may be scheduled now: it waits for this grid to finish
    pid = tl.program_id(0)
    hg = 0
    if SPLIT:
        hg = pid % HG
    hh = hg * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HF)[None, :]
    m1 = (hh < H) & (i < HALF)
    m2 = (hh < H) & (i + HALF < D)
    freqs = tl.zeros([BLOCK_HF], tl.float32)
    if FAST_F and not FREQS_LATE:  # rotate-half over all of D: frequencies j of pairs (j, HALF + j)
        freqs = tl.load(inv_freq + tl.arange(0, BLOCK_HF), mask=tl.arange(0, BLOCK_HF) < HALF, other=0.0)
    if SPLIT:
        n = pid // (2 * HG)
        is_v = (pid // HG) % 2  # 0: this program writes the row's K, 1: its V
        nn = n.to(tl.int64)
        row = tl.where(is_v == 1, v + nn * (stride_vn * VEC), k + nn * (stride_kn * VEC))
        hoff = tl.where(is_v == 1, hh * STRIDE_VH, hh * STRIDE_KH)
    else:
        n = pid
    if INDEX_FIRST and SPECULATE:  # the first guess and cos / sin before the wait, checked after it
        valid, blk, off, pos, cs_c, cs_s, hit, sa, sb, sc, bt_ptr, bt_mask, raw = _spec_lookup(
            n, block_tables, cu_q, k_lens, slots, positions, bt_stride, table_width, n_seqs, guess_mul, freqs, MODE,
            ROPE, BLOCK_SIZE, NUM_BLOCKS, CP_RANK, CP_SIZE, CS_GIVEN, FMAX, ATTN_SCALE, LIBDEVICE)
        if PDL:
            gdc_wait()  # K / V, and the index tensors, may come from the previous kernel
            gdc_launch_dependents()
        if FAST_F and FREQS_LATE:
            freqs = tl.load(inv_freq + tl.arange(0, BLOCK_HF), mask=tl.arange(0, BLOCK_HF) < HALF, other=0.0)
    elif INDEX_FIRST:  # the lookup (and cos / sin) before the wait: reads only index tensors and inv_freq
        valid, blk, off, pos, cs_c, cs_s = _lookup(
            n, block_tables, cu_q, k_lens, slots, positions, bt_stride, table_width, n_seqs, guess_mul, freqs, MODE,
            ROPE, BLOCK_SIZE, NUM_BLOCKS, CP_RANK, CP_SIZE, SEARCH, LOG_B, SEARCH_CALL, CS_GIVEN, FMAX, ATTN_SCALE,
            LIBDEVICE, "")
        if PDL:
            gdc_wait()  # K / V may come from the previous kernel
            gdc_launch_dependents()
    # otherwise the row's K and V first: they do not depend on where it goes, so their latency overlaps the
    # index loads
    if SPLIT:
        r1 = tl.load(row + hoff + i, mask=m1, other=0.0, eviction_policy=LOAD_EV)
        r2 = tl.load(row + hoff + HALF + i, mask=m2, other=0.0, eviction_policy=LOAD_EV)
        k1 = r1  # placeholders (_write_token)
        k2 = r2
        v1 = r1
        v2 = r2
    else:
        k1, k2, v1, v2 = _load_token(k, v, n, stride_kn, stride_vn, hh, i, m1, m2, HALF, STRIDE_KH, STRIDE_VH, VEC,
                                     LOAD_EV)
        r1 = k1  # placeholders (_write_token)
        r2 = k2
        is_v = 0
    if not INDEX_FIRST:
        valid, blk, off, pos, cs_c, cs_s = _lookup(
            n, block_tables, cu_q, k_lens, slots, positions, bt_stride, table_width, n_seqs, guess_mul, freqs, MODE,
            ROPE, BLOCK_SIZE, NUM_BLOCKS, CP_RANK, CP_SIZE, SEARCH, LOG_B, SEARCH_CALL, CS_GIVEN, FMAX, ATTN_SCALE,
            LIBDEVICE, "")
    same = n >= 0
    if INDEX_FIRST and SPECULATE:
        same = _spec_same(n, cu_q, k_lens, slots, positions, n_seqs, guess_mul, hit, sa, sb, sc, bt_ptr, bt_mask,
                          raw, MODE, ROPE)
        valid = valid & same
    _write_token(k1, k2, v1, v2, r1, r2, is_v, valid, blk, off, pos, k, n, stride_kn, pool, qparams, inv_freq, freqs,
                 FMAX, fp8_scales, hh, i, m1, m2, QUANT, ROPE, ROT, INTERLEAVED, ATTN_SCALE, H, D, DP, HALF,
                 BLOCK_SIZE, S_TOK, S_HEAD, P_TOK, P_HEAD, STRIDE_KH, BLOCK_H, LIBDEVICE, VEC, EARLY, STORE_CM,
                 PAIR_ASM, ROPE_SELECT, MASKED, cs_c, cs_s, CS_GIVEN, SPLIT)
    if INDEX_FIRST and SPECULATE:
        if not same:  # the guess missed (the launch speculates on batches of one row per sequence and by slot
            # mapping: rows of a sequence with 0 or 2+ rows, padding rows), or the previous kernel changed what
            # was read
            valid, blk, off, pos, cs_c, cs_s = _lookup(
                n, block_tables, cu_q, k_lens, slots, positions, bt_stride, table_width, n_seqs, guess_mul,
                freqs, MODE, ROPE, BLOCK_SIZE, NUM_BLOCKS, CP_RANK, CP_SIZE, SEARCH, LOG_B, True, CS_GIVEN, FMAX,
                ATTN_SCALE, LIBDEVICE, ".cg")
            _write_token(k1, k2, v1, v2, r1, r2, is_v, valid, blk, off, pos, k, n, stride_kn, pool, qparams, inv_freq,
                         freqs, FMAX, fp8_scales, hh, i, m1, m2, QUANT, ROPE, ROT, INTERLEAVED, ATTN_SCALE, H, D,
                         DP, HALF, BLOCK_SIZE, S_TOK, S_HEAD, P_TOK, P_HEAD, STRIDE_KH, BLOCK_H, LIBDEVICE, VEC, EARLY,
                         STORE_CM, PAIR_ASM, ROPE_SELECT, MASKED, cs_c, cs_s, CS_GIVEN, SPLIT)


@triton.jit
def _write_token(
    k1, k2, v1, v2, r1, r2, is_v, valid, blk, off, pos, k, n, stride_kn, pool, qparams, inv_freq, freqs,
    FMAX: tl.constexpr, fp8_scales, hh, i, m1, m2, QUANT: tl.constexpr, ROPE: tl.constexpr, ROT: tl.constexpr,
    INTERLEAVED: tl.constexpr, ATTN_SCALE: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, S_TOK: tl.constexpr, S_HEAD: tl.constexpr, P_TOK: tl.constexpr,
    P_HEAD: tl.constexpr, STRIDE_KH: tl.constexpr, BLOCK_H: tl.constexpr, LIBDEVICE: tl.constexpr,
    VEC: tl.constexpr, EARLY: tl.constexpr, STORE_CM: tl.constexpr, PAIR_ASM: tl.constexpr,
    ROPE_SELECT: tl.constexpr, MASKED: tl.constexpr, cs_c, cs_s, CS_GIVEN: tl.constexpr, SPLIT: tl.constexpr,
):
    # the append kernel's stores of row n: SPLIT, this program's K or V (r1 / r2, is_v); else the row's K (k1 /
    # k2) and V (v1 / v2); the arguments of the other kind are placeholders
    if SPLIT:
        # with RoPE, V goes through float32 too: an exact round trip for every model dtype
        _write_row(r1, r2, is_v, valid, blk, off, pos, k, n, stride_kn, pool, qparams, inv_freq, freqs, FMAX,
                   fp8_scales, hh, i, m1, m2, not ROPE, QUANT, ROPE, ROT, INTERLEAVED, ATTN_SCALE, H, D, DP, HALF,
                   BLOCK_SIZE, S_TOK, S_HEAD, P_TOK, P_HEAD, STRIDE_KH, BLOCK_H, LIBDEVICE, VEC, EARLY,
                   STORE_CM, PAIR_ASM, ROPE_SELECT, MASKED, cs_c, cs_s, CS_GIVEN)
    else:
        for kv in tl.static_range(2):  # K, then V (never rotated: stored as loaded when unquantized)
            _write_row(k1 if kv == 0 else v1, k2 if kv == 0 else v2, kv, valid, blk, off, pos, k, n,
                       stride_kn, pool, qparams, inv_freq, freqs, FMAX, fp8_scales, hh, i, m1, m2,
                       (not ROPE) or (kv == 1), QUANT, ROPE, ROT, INTERLEAVED, ATTN_SCALE, H, D, DP, HALF,
                       BLOCK_SIZE, S_TOK, S_HEAD, P_TOK, P_HEAD, STRIDE_KH, BLOCK_H, LIBDEVICE, VEC, EARLY,
                       STORE_CM, PAIR_ASM, False, MASKED, cs_c, cs_s, CS_GIVEN)

