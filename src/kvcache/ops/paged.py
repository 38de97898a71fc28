"""Paged KV kernels: append new K/V into blocks (LMDeploy TurboMind ``ProcessKV``: RoPE on K and
quantization fused into the write), gather blocks back to contiguous K/V (``FlattenKV``), copy blocks
(copy-on-write).

The byte format (layouts, int8 / int4 / fp8 quantization, int4 nibble order) is documented in
:mod:`kvcache.paged.config`. Which tokens go where:

* ragged batch: sequence ``b`` owns rows ``cu_q_lens[b] .. cu_q_lens[b + 1]`` of ``k`` / ``v``; its first new
  token has position ``kv_lens[b]`` (tokens already cached), or ``total_b - q_len_b`` with
  ``total_b = cu_k_lens[b + 1] - cu_k_lens[b]`` (TurboMind's cumulative lengths after the append). Token at
  position ``p`` goes to block ``block_tables[b, p // block_size]``, offset ``p % block_size``.
* context parallel (``cp_size > 1``): token ``p`` lives on rank ``p % cp_size`` at local position
  ``p // cp_size``; a rank writes only its tokens, and RoPE uses the global position ``p``.
* slot mapping: row ``n`` goes to slot ``slot_mapping[n]`` (``block * block_size + offset``), ``-1`` = skip;
  RoPE positions come from ``positions``.

Rows whose block index falls outside the block table, whose block id is out of range, and padding rows
past ``cu_q_lens[-1]`` are skipped on the device (``check=True`` on the cache syncs and raises instead).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .._backend import PreparedLaunch, kernel, use_triton

try:  # programmatic dependent launch (Hopper and later); triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None
from .._validate import MODEL_DTYPES, cdiv, check_dtype_in, next_pow2, vec_elems
from ..rope import RopeKernelParams

__all__ = [
    "append_paged_kv",
    "gather_paged_kv",
    "copy_blocks",
    "QUANT_CODES",
    "append_paged_kv_launch",
    "gather_paged_kv_launch",
    "copy_blocks_launch",
    "append_paged_kv_reference",
    "gather_paged_kv_reference",
    "quantize_rows_reference",
    "dequantize_rows_reference",
]

QUANT_CODES = {"auto": 0, "fp8": 1, "int8": 2, "int4": 3}

# Cache hints of prefill-sized (not split) appends: new K / V rows are read once (evict first from L2), pool
# rows written once (streaming stores). Measured on an H100 (benchmarks/append_ab.py): int4 86 -> 96% of copy
# bandwidth, fp8 90 -> 93%, fp16 and int8 unchanged; decode-sized launches 0.1-0.2 us slower (not used there).
# KVCACHE_APPEND_HINTS=0 (read at import) turns them off.
_HINTS = os.environ.get("KVCACHE_APPEND_HINTS", "1") != "0"
_FP8_MAX = 448.0
# int8 / int4 (scale, zero) of per-row (prefill-sized) launches stored by inline PTX, one 8-byte store per head in
# the values' own layout (see _store_pair). Measured on an H100 (benchmarks/append_ab.py versions, 21:56-22:00
# UTC): int8 prefill with RoPE +0.0 to +3.0 points of copy bandwidth per interleaved pair (median +0.9), 4% fewer
# instructions (Nsight Compute); split (decode) launches no faster (int4 ragged +0.1 us), so they keep tl.store.
# KVCACHE_PAIR_ASM=0 (read at import) stores them with tl.store everywhere.
_PAIR_ASM = os.environ.get("KVCACHE_PAIR_ASM", "1") != "0"
# EARLY launches, except ROPE_SELECT ones, store with masks (the row's validity) instead of behind a branch on it
# (see _write_row and the launch's MASKED). KVCACHE_MASKED_STORES=0 (read at import) branches everywhere.
_MASKED_STORES = os.environ.get("KVCACHE_MASKED_STORES", "1") != "0"


def _ptx(device: torch.device) -> bool:
    """Whether kernels for ``device`` are compiled from PTX (an NVIDIA GPU: inline PTX may be used)."""
    return device.type == "cuda" and torch.version.hip is None


# ------------------------------------------------------------------------------------------------------------
# device helpers


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


@triton.jit
def _rope_pairs(e, ROT: tl.constexpr, INTERLEAVED: tl.constexpr):
    # For element indices e: the partner element, the frequency index, whether e is the first of its pair
    # and whether e is rotated. Rotate-half pairs (i, i + ROT/2); interleaved pairs (2i, 2i + 1).
    in_rot = e < ROT
    if INTERLEAVED:
        partner = e ^ 1
        j = e // 2
        first = (e % 2) == 0
    else:
        half: tl.constexpr = ROT // 2
        first = e < half
        partner = tl.where(first, e + half, e - half)
        j = tl.where(first, e, e - half)
    return partner, j, first, in_rot


_SINCOS_MAX = tl.constexpr(1.0e5)  # _sincos's range (radians)
_FAST_TRIG = os.environ.get("KVCACHE_FAST_TRIG", "1") != "0"  # KVCACHE_FAST_TRIG=0 (read at import): never _sincos


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


@triton.jit
def _rotate(x, xp, f, first, in_rot, pos_f, attn_scale, LIBDEVICE: tl.constexpr):
    # x * cos + rotate_half(x) * sin, as transformers: cos / sin of (position * inv_freq) in float32 (one
    # [1, BLOCK] row of them per token, shared by every head), scaled by attention_scaling
    c, sn = _sincos_full(pos_f * f, LIBDEVICE)  # accurate, full range reduction
    c = c * attn_scale
    sn = sn * attn_scale
    return tl.where(in_rot, x * c + xp * tl.where(first, -sn, sn), x)


@triton.jit
def _encode(x1, x2, inv_fp8, hh, m1, m2, QUANT: tl.constexpr, H: tl.constexpr, BLOCK_H: tl.constexpr,
            LIBDEVICE: tl.constexpr):
    # One token's rows, given as float32 half tiles [BLOCK_H, BLOCK_HF] of elements i (x1) and HALF + i (x2)
    # (m1 / m2: the elements that exist),
    # encoded in the pool's format: (codes of the first half, codes of the second half (QUANT 3: unused, both
    # halves are packed in the first), per-head scale, per-head zero (unused unless QUANT >= 2)). Pure
    # arithmetic: the caller runs it before it knows where the row goes (the block-table load), so that the
    # two overlap.
    c1 = x1
    c2 = x2
    scale = tl.zeros([BLOCK_H, 1], tl.float32)  # unused unless QUANT >= 2
    zero = scale
    if QUANT == 1:
        c1 = tl.minimum(tl.maximum(x1 * inv_fp8, -448.0), 448.0)
        c2 = tl.minimum(tl.maximum(x2 * inv_fp8, -448.0), 448.0)
        if not LIBDEVICE:
            c1 = _fp8_grid(c1, LIBDEVICE)
            c2 = _fp8_grid(c2, LIBDEVICE)
    elif QUANT >= 2:
        # per (token, head) asymmetric: masked lanes never take part in min / max
        if QUANT == 3:
            qmax = 15.0
        else:
            qmax = 255.0
        # the two halves combined element-wise first: one cross-thread reduction each for min and max. Kept
        # [BLOCK_H, 1] (keep_dims) in the tile's own layout: no layout conversion through shared memory for
        # the per-head arithmetic and the scale / zero stores
        mn = tl.min(tl.minimum(tl.where(m1, x1, float("inf")), tl.where(m2, x2, float("inf"))), axis=1,
                    keep_dims=True)
        mx = tl.max(tl.maximum(tl.where(m1, x1, float("-inf")), tl.where(m2, x2, float("-inf"))), axis=1,
                    keep_dims=True)
        zero = tl.where(hh < H, mn, 0.0)
        mx = tl.where(hh < H, mx, 0.0)
        scale = _div(mx - zero, tl.zeros_like(zero) + qmax, LIBDEVICE)  # per head: IEEE, as the reference
        # scale == 0: every code 0, a constant row round-trips exactly
        inv = tl.where(scale > 0.0, _rcp(tl.where(scale > 0.0, scale, 1.0), LIBDEVICE), 0.0)
        q1 = _codes((x1 - zero) * inv, LIBDEVICE)  # low byte: the code (bits above it: 2**23's exponent)
        q2 = _codes((x2 - zero) * inv, LIBDEVICE)
        if QUANT == 3:  # planar nibbles: byte i = element i | element HALF + i << 4 (q1, q2 < 16 in their low bits)
            c1 = (q1 | (q2 << 4)).to(tl.uint8)
            c2 = c1  # unused
        else:
            c1 = q1.to(tl.uint8)  # the low byte
            c2 = q2.to(tl.uint8)
    return c1, c2, scale, zero


@triton.jit
def _store_row(c1, c2, scale, zero, pool, qparams, blk, off, is_v, hh, i, m1, m2, ok, QUANT: tl.constexpr,
               H: tl.constexpr, HALF: tl.constexpr, DP: tl.constexpr, BLOCK_SIZE: tl.constexpr, S_TOK: tl.constexpr,
               S_HEAD: tl.constexpr, P_TOK: tl.constexpr, P_HEAD: tl.constexpr, STORE_CM: tl.constexpr,
               PAIR_ASM: tl.constexpr, MASKED: tl.constexpr):
    # Store what _encode returned (or, unquantized, the values to store in any float dtype) as the K (is_v == 0)
    # or V row at (blk, off) of the data pool and of the (scale, zero) pool; m1 / m2: the elements that exist;
    # MASKED: ok (a scalar) masks every store too
    s_kv: tl.constexpr = BLOCK_SIZE * H * DP  # one block's K (or V) region, data and params
    p_kv: tl.constexpr = BLOCK_SIZE * H * 2
    dst = pool + (blk * (2 * s_kv) + off * S_TOK + is_v * s_kv)
    par = qparams + (blk * (2 * p_kv) + off * P_TOK + is_v * p_kv)
    hm = hh < H
    if MASKED:  # tl.where: `tile & scalar` is an int32 tile under triton 3.9's interpreter, not a mask
        m1 = tl.where(ok, m1, False)
        m2 = tl.where(ok, m2, False)
        hm = tl.where(ok, hm, False)
    p1 = dst + hh * S_HEAD + i
    tl.store(p1, c1.to(dst.dtype.element_ty), mask=m1, cache_modifier=STORE_CM)
    if QUANT != 3:
        tl.store(p1 + HALF, c2.to(dst.dtype.element_ty), mask=m2, cache_modifier=STORE_CM)
    if QUANT >= 2:  # scale / zero [BLOCK_H, 1]
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
def _seq_rows(b, cu_q, kv_info, MODE: tl.constexpr, CM: tl.constexpr):
    # (cu_q[b], cu_q[b + 1], tokens sequence b held before the append: kv_lens[b], or its cu_k_lens length
    # minus its new rows); CM: the loads' cache modifier (".cg": from L2, past any line this SM's L1 holds)
    q0 = tl.load(cu_q + b, cache_modifier=CM)
    q1 = tl.load(cu_q + b + 1, cache_modifier=CM)
    if MODE == 0:
        start = tl.load(kv_info + b, cache_modifier=CM)
    else:
        start = (tl.load(kv_info + b + 1, cache_modifier=CM) - tl.load(kv_info + b, cache_modifier=CM)) - (q1 - q0)
    return q0, q1, start


@triton.jit
def _find_seq(n, cu_q, kv_info, n_seqs, MODE: tl.constexpr, SEARCH: tl.constexpr, LOG_B: tl.constexpr,
              CM: tl.constexpr):
    # (b, cu_q[b], cu_q[b + 1], tokens cached before the append) of the sequence that owns row n, the largest
    # b with cu_q[b] <= n. One vector load of SEARCH entries, or a binary search when SEARCH == 0.
    if SEARCH > 0:
        ib = tl.arange(0, SEARCH)
        ends = tl.load(cu_q + 1 + ib, mask=ib < n_seqs, other=2147483647, cache_modifier=CM)  # cu_q[1 .. B]
        b = tl.sum((ends <= n).to(tl.int32), axis=0)  # sequences that end at or before row n
        q0 = tl.max(tl.where(ends <= n, ends, 0), axis=0)  # cu_q[b]
        q1 = tl.min(tl.where(ends > n, ends, 2147483647), axis=0)  # cu_q[b + 1]
        if MODE == 0:
            kvl = tl.load(kv_info + ib, mask=ib < n_seqs, other=0, cache_modifier=CM)
            start = tl.sum(tl.where(ib == b, kvl, 0), axis=0)
        else:
            cks = tl.load(kv_info + 1 + ib, mask=ib < n_seqs, other=0, cache_modifier=CM)
            ck0 = tl.load(kv_info + ib, mask=ib < n_seqs, other=0, cache_modifier=CM)
            start = tl.sum(tl.where(ib == b, cks - ck0, 0), axis=0) - (q1 - q0)
    else:
        lo = n * 0
        hi = lo + n_seqs
        for _ in tl.static_range(LOG_B):
            mid = (lo + hi) // 2
            go = tl.load(cu_q + mid, cache_modifier=CM) <= n
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        b = lo
        q0, q1, start = _seq_rows(b, cu_q, kv_info, MODE, CM)
    return b.to(tl.int64), q0, q1, start


@triton.jit(noinline=True)
def _find_seq_call(n, cu_q, kv_info, n_seqs, MODE: tl.constexpr, SEARCH: tl.constexpr, LOG_B: tl.constexpr,
                   CM: tl.constexpr):
    # _find_seq as a call (see _target's CALL). It is taken only where the guess misses, and keeps the search's
    # code and registers out of the hot path. Measured on an H100 against the inlined search (append_ab.py
    # versions, 23:48 and 23:58 UTC): per-row (prefill) launches 0.5-2.5 points of copy bandwidth faster for
    # int4, the other formats within noise; split (decode) launches of unquantized rows without RoPE 0.1 us per
    # layer faster (1.57-1.63 against 1.66-1.73), while the other split launches were as fast or up to 0.1 us
    # faster inlined (fp8, int4), although ptxas then issues their K / V loads after the guess's check.
    return _find_seq(n, cu_q, kv_info, n_seqs, MODE, SEARCH, LOG_B, CM)


_GUESS_BITS = 30
_GUESS_SHIFT = tl.constexpr(_GUESS_BITS)
_GUESS_ONE = 1 << _GUESS_BITS  # _guess_mul(n, n): one row per sequence


def _guess_mul(n_seqs: int, n_rows: int) -> int:
    """The append kernel's ``guess_mul``: ceil(n_seqs * 2**30 / n_rows), at most 2**30 (an int32 argument).

    The kernel's first guess of row n's sequence, ``(n * guess_mul) >> 30``, is floor(n * n_seqs / n_rows) +
    floor(frac + n * d / 2**30) with ``d`` the ceiling's excess (< 1): exact for decode batches (n_seqs ==
    n_rows: guess_mul = 2**30, the guess is n) and for prefills of L rows each until n reaches 2**30 / L. A
    multiply and a shift where a 64-bit division took about 25 dependent instructions ahead of the first index
    loads. The guess is checked in the kernel; a wrong one costs a search, never a wrong row."""
    if n_rows <= 0:
        return 0
    return min(((n_seqs << _GUESS_BITS) + n_rows - 1) // n_rows, 1 << _GUESS_BITS)


@triton.jit
def _guess(n, guess_mul, n_seqs):
    # row n's first guess of its sequence: floor(n * n_seqs / n_rows) by a multiply and a shift (see _guess_mul)
    return tl.minimum((n.to(tl.int64) * guess_mul) >> _GUESS_SHIFT, n_seqs - 1)


@triton.jit
def _local_pos(pos, valid, CP_RANK: tl.constexpr, CP_SIZE: tl.constexpr):
    # context parallelism: (valid and token `pos` on this rank, its local position pos // CP_SIZE)
    if CP_SIZE > 1:
        return valid & ((pos % CP_SIZE) == CP_RANK), pos // CP_SIZE
    return valid, pos


@triton.jit
def _target(
    n, block_tables, cu_q, kv_info, slots, positions, bt_stride, table_width, n_seqs, guess_mul,
    MODE: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    CP_RANK: tl.constexpr, CP_SIZE: tl.constexpr, SEARCH: tl.constexpr, LOG_B: tl.constexpr, CALL: tl.constexpr,
    CM: tl.constexpr,
):
    # where row n goes: (valid, block id, offset in the block, global position); CALL: a guess that misses calls
    # the search (_find_seq_call) rather than inlining it; CM: the index loads' cache modifier (see _seq_rows)
    pos = n.to(tl.int64) * 0
    if MODE == 2:
        slot = tl.load(slots + n, cache_modifier=CM).to(tl.int64)
        valid = slot >= 0
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        if ROPE:
            pos = tl.load(positions + n, cache_modifier=CM).to(tl.int64)
    else:
        # first guess: rows spread evenly over the sequences, floor(n * n_seqs / n_rows) by a multiply and a shift
        # (see _guess_mul; exact for decode batches and equal-length prefills), checked with two loads;
        # otherwise search
        g = _guess(n, guess_mul, n_seqs)
        c0, c1, s0 = _seq_rows(g, cu_q, kv_info, MODE, CM)
        if (c0 <= n) & (n < c1):
            b = g
            q0 = c0
            q1 = c1
            start = s0
        else:
            if CALL:
                b, q0, q1, start = _find_seq_call(n, cu_q, kv_info, n_seqs, MODE, SEARCH, LOG_B, CM)
            else:
                b, q0, q1, start = _find_seq(n, cu_q, kv_info, n_seqs, MODE, SEARCH, LOG_B, CM)
        pos = (start + (n - q0)).to(tl.int64)
        valid, lpos = _local_pos(pos, (b < n_seqs) & (n < q1) & (pos >= 0), CP_RANK, CP_SIZE)
        bi = lpos // BLOCK_SIZE
        valid = valid & (bi < table_width)
        blk = tl.load(block_tables + b * bt_stride + bi, mask=valid, other=-1, cache_modifier=CM).to(tl.int64)
        off = lpos % BLOCK_SIZE
    valid = valid & (blk >= 0) & (blk < NUM_BLOCKS)
    return valid, blk, off, pos


@triton.jit
def _rope_cs(pos, freqs, FMAX: tl.constexpr, ATTN_SCALE: tl.constexpr, LIBDEVICE: tl.constexpr):
    # rotate-half RoPE over all of D: cos and sin of pos * freqs (freqs [BLOCK_HF]: the frequency of each pair
    # (j, HALF + j)) scaled by the attention scaling, as [1, BLOCK_HF] rows shared by every head
    pos_f = pos.to(tl.float32)
    angle = pos_f * freqs
    if FMAX > 0:  # max(inv_freq) known: one branch per program on its largest angle
        if tl.abs(pos_f) * FMAX <= _SINCOS_MAX:  # (slot mapping takes any position, negative ones too)
            c, sn = _sincos(angle)
        else:
            c, sn = _sincos_full(angle, LIBDEVICE)
    else:
        c, sn = _sincos_full(angle, LIBDEVICE)
    return (c * ATTN_SCALE)[None, :], (sn * ATTN_SCALE)[None, :]


@triton.jit
def _rope_k(x1, x2, pos, freqs, FMAX: tl.constexpr, k, n, stride_kn, hh, i, m1, m2, inv_freq, ROT: tl.constexpr,
            INTERLEAVED: tl.constexpr, ATTN_SCALE: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
            STRIDE_KH: tl.constexpr, LIBDEVICE: tl.constexpr, VEC: tl.constexpr, cs_c, cs_s, CS_GIVEN: tl.constexpr):
    # RoPE on one key row given as float32 half tiles x1 (elements i) and x2 (HALF + i), at position pos;
    # CS_GIVEN (rotate-half over all of D only): cos / sin are cs_c / cs_s (from _rope_cs)
    FAST_ROPE: tl.constexpr = (not INTERLEAVED) and (ROT == D)  # pairs (i, HALF + i): no partner loads
    if FAST_ROPE:  # one cos / sin per frequency, shared by every head
        if CS_GIVEN:
            c = cs_c
            sn = cs_s
        else:
            c, sn = _rope_cs(pos, freqs, FMAX, ATTN_SCALE, LIBDEVICE)
        y1 = x1 * c - x2 * sn
        y2 = x2 * c + x1 * sn
    else:  # partial rotary or interleaved pairs: partner elements re-read (L1 / L2 hits)
        pos_f = pos.to(tl.float32)
        krow = k + n.to(tl.int64) * (stride_kn * VEC) + hh * STRIDE_KH
        pa1, j1, fi1, r1 = _rope_pairs(i, ROT, INTERLEAVED)
        pa2, j2, fi2, r2 = _rope_pairs(i + HALF, ROT, INTERLEAVED)
        kp1 = tl.load(krow + pa1, mask=m1 & r1, other=0.0).to(tl.float32)
        kp2 = tl.load(krow + pa2, mask=m2 & r2, other=0.0).to(tl.float32)
        f1 = tl.load(inv_freq + j1, mask=r1, other=0.0)
        f2 = tl.load(inv_freq + j2, mask=r2, other=0.0)
        y1 = _rotate(x1, kp1, f1, fi1, r1, pos_f, ATTN_SCALE, LIBDEVICE)
        y2 = _rotate(x2, kp2, f2, fi2, r2, pos_f, ATTN_SCALE, LIBDEVICE)
    return y1, y2


@triton.jit
def _lookup(
    n, block_tables, cu_q, kv_info, slots, positions, bt_stride, table_width, n_seqs, guess_mul, freqs,
    MODE: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_BLOCKS: tl.constexpr, CP_RANK: tl.constexpr,
    CP_SIZE: tl.constexpr, SEARCH: tl.constexpr, LOG_B: tl.constexpr, CALL: tl.constexpr, CS_GIVEN: tl.constexpr,
    FMAX: tl.constexpr, ATTN_SCALE: tl.constexpr, LIBDEVICE: tl.constexpr, CM: tl.constexpr,
):
    # _target of row n, and with CS_GIVEN RoPE's cos / sin at its position (_rope_cs; else placeholders):
    # (valid, block id, offset, position, cos, sin). Reads only index tensors and freqs: with INDEX_FIRST it
    # runs before the wait for the previous kernel; a speculative launch's slow path runs it after the wait
    # (CM ".cg")
    valid, blk, off, pos = _target(n, block_tables, cu_q, kv_info, slots, positions, bt_stride, table_width, n_seqs,
                                   guess_mul, MODE, ROPE, BLOCK_SIZE, NUM_BLOCKS, CP_RANK, CP_SIZE, SEARCH, LOG_B, CALL,
                                   CM)
    cs_c, cs_s = _lookup_cs(pos, freqs, CS_GIVEN, FMAX, ATTN_SCALE, LIBDEVICE)
    return valid, blk, off, pos, cs_c, cs_s


@triton.jit
def _lookup_cs(pos, freqs, CS_GIVEN: tl.constexpr, FMAX: tl.constexpr, ATTN_SCALE: tl.constexpr,
               LIBDEVICE: tl.constexpr):
    # with CS_GIVEN, RoPE's cos / sin at a looked-up position (_rope_cs); else placeholders (unused)
    if CS_GIVEN:
        return _rope_cs(pos, freqs, FMAX, ATTN_SCALE, LIBDEVICE)
    return freqs[None, :], freqs[None, :]


@triton.jit
def _spec_lookup(
    n, block_tables, cu_q, kv_info, slots, positions, bt_stride, table_width, n_seqs, guess_mul, freqs,
    MODE: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_BLOCKS: tl.constexpr, CP_RANK: tl.constexpr,
    CP_SIZE: tl.constexpr, CS_GIVEN: tl.constexpr, FMAX: tl.constexpr, ATTN_SCALE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    # SPECULATE's lookup, before the wait for the previous kernel: _lookup with the first guess only (no search),
    # plus what _spec_same re-reads after the wait: (valid, block id, offset, position, cos, sin, hit, a, b, c,
    # bt_ptr, bt_mask, raw). a, b, c: (cu_q[g], cu_q[g + 1], cached tokens) of the guess g, or (slot, position,
    # 0) by slot mapping; raw: the block-table entry read at bt_ptr where bt_mask (ragged). hit: the guess is
    # row n's sequence (else valid is False and the row is looked up again after the wait).
    pos = n.to(tl.int64) * 0
    if MODE == 2:
        slot = tl.load(slots + n).to(tl.int64)
        if ROPE:
            pos = tl.load(positions + n).to(tl.int64)
        valid = slot >= 0
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        hit = n >= 0
        a = slot
        b = pos
        c = pos * 0
        bt_ptr = block_tables
        bt_mask = n < 0
        raw = (n * 0 - 1).to(tl.int32)
    else:
        g = _guess(n, guess_mul, n_seqs)
        a, b, c = _seq_rows(g, cu_q, kv_info, MODE, "")
        hit = (a <= n) & (n < b)
        pos = (c + (n - a)).to(tl.int64)
        valid, lpos = _local_pos(pos, hit & (pos >= 0), CP_RANK, CP_SIZE)
        bi = lpos // BLOCK_SIZE
        bt_mask = valid & (bi < table_width)
        bt_ptr = block_tables + g * bt_stride + bi
        raw = tl.load(bt_ptr, mask=bt_mask, other=-1)
        blk = raw.to(tl.int64)
        off = lpos % BLOCK_SIZE
        valid = bt_mask
    valid = valid & (blk >= 0) & (blk < NUM_BLOCKS)
    cs_c, cs_s = _lookup_cs(pos, freqs, CS_GIVEN, FMAX, ATTN_SCALE, LIBDEVICE)
    return valid, blk, off, pos, cs_c, cs_s, hit, a, b, c, bt_ptr, bt_mask, raw


@triton.jit
def _spec_same(
    n, cu_q, kv_info, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw, MODE: tl.constexpr,
    ROPE: tl.constexpr,
):
    # After the wait: did _spec_lookup read what the index tensors now hold? Every value it read is read again
    # from L2 (".cg": past a line this SM's L1 may still hold from before the wait) at the same address and
    # compared; the lookup is a function of those values alone.
    if MODE == 2:
        same = tl.load(slots + n, cache_modifier=".cg").to(tl.int64) == a
        if ROPE:
            same = same & (tl.load(positions + n, cache_modifier=".cg").to(tl.int64) == b)
    else:
        g = _guess(n, guess_mul, n_seqs)
        a2, b2, c2 = _seq_rows(g, cu_q, kv_info, MODE, ".cg")
        raw2 = tl.load(bt_ptr, mask=bt_mask, other=-1, cache_modifier=".cg")
        same = hit & (a2 == a) & (b2 == b) & (c2 == c) & (raw2 == raw)
    return same


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
                   BLOCK_SIZE, S_TOK, S_HEAD, P_TOK, P_HEAD, STORE_CM, PAIR_ASM, True)
    elif valid:
        if not EARLY:
            c1, c2, scale, zero = _row_codes(r1, r2, is_v, pos, k, n, stride_kn, inv_freq, freqs, FMAX, fp8_scales,
                                             hh, i, m1, m2, RAW, QUANT, ROPE, ROT, INTERLEAVED, ATTN_SCALE, H, D,
                                             HALF, STRIDE_KH, BLOCK_H, LIBDEVICE, VEC, SELECT, cs_c, cs_s,
                                             CS_GIVEN)
        _store_row(c1, c2, scale, zero, pool, qparams, blk, off, is_v, hh, i, m1, m2, valid, QUANT, H, HALF, DP,
                   BLOCK_SIZE, S_TOK, S_HEAD, P_TOK, P_HEAD, STORE_CM, PAIR_ASM, False)


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
    if RAW and (QUANT == 0):
        c1 = r1
        c2 = r2
        scale = tl.zeros([BLOCK_H, 1], tl.float32)  # unused
        zero = scale
    else:
        inv = 1.0
        if QUANT == 1:  # one IEEE reciprocal per row, then multiplies (as the reference)
            inv = _rcp(tl.load(fp8_scales + is_v), LIBDEVICE)
        x1 = r1.to(tl.float32)
        x2 = r2.to(tl.float32)
        if ROPE:
            if SELECT:
                # is_v per program (split launches): V programs rotate too and keep x. Branching on is_v instead,
                # ptxas moves a slot mapping's position load into the branch, after the wait for K / V: two
                # memory latencies in a row. V programs are not the critical path. Measured on an H100
                # (append_ab.py versions, 22:00 UTC): slot-mapping decode with RoPE, us per layer, fp8
                # 1.79-1.87 -> 1.47-1.52, int8 2.03-2.08 -> 1.91-1.96, int4 1.99-2.04 -> 1.83-1.89; fp16 and
                # ragged batches (their position loads are not in the branch) no faster, so the launch selects
                # it for quantized slot-mapping launches only
                y1, y2 = _rope_k(x1, x2, pos, freqs, FMAX, k, n, stride_kn, hh, i, m1, m2, inv_freq, ROT,
                                 INTERLEAVED, ATTN_SCALE, D, HALF, STRIDE_KH, LIBDEVICE, VEC, cs_c, cs_s, CS_GIVEN)
                x1 = tl.where(is_v == 0, y1, x1)
                x2 = tl.where(is_v == 0, y2, x2)
            elif is_v == 0:
                x1, x2 = _rope_k(x1, x2, pos, freqs, FMAX, k, n, stride_kn, hh, i, m1, m2, inv_freq, ROT, INTERLEAVED,
                                 ATTN_SCALE, D, HALF, STRIDE_KH, LIBDEVICE, VEC, cs_c, cs_s, CS_GIVEN)
        c1, c2, scale, zero = _encode(x1, x2, inv, hh, m1, m2, QUANT, H, BLOCK_H, LIBDEVICE)
    return c1, c2, scale, zero


@kernel(ints=("stride_kn", "stride_vn", "bt_stride", "table_width", "n_seqs", "guess_mul"))
def _append_kernel(
    k, v,  # model dtype [N, H, D], head_dim contiguous; row strides stride_kn * VEC / stride_vn * VEC
    pool,  # storage dtype, one layer (see kvcache.paged.config)
    qparams,  # float32 (scale, zero) pool when QUANT >= 2, else unused (not `params`: triton's binder
    # uses that name for a local)
    block_tables,  # int32 [B, table_width] (MODE 0 / 1)
    cu_q,  # int32 [B + 1] (MODE 0 / 1)
    kv_info,  # int32 kv_lens [B] (MODE 0) or cu_k_lens [B + 1] (MODE 1)
    slots,  # int64 [N] (MODE 2)
    positions,  # int32 / int64 [N] (MODE 2 with ROPE)
    inv_freq,  # float32 [ROT // 2] (ROPE)
    fp8_scales,  # float32 [2]: k_scale, v_scale (QUANT == 1)
    stride_kn, stride_vn, bt_stride, table_width, n_seqs,
    guess_mul,  # see _guess_mul
    MODE: tl.constexpr,  # 0: cu_q_lens + kv_lens, 1: cu_q_lens + cu_k_lens, 2: slot mapping
    QUANT: tl.constexpr,  # 0 none, 1 fp8, 2 int8, 3 int4
    ROPE: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr, ATTN_SCALE: tl.constexpr,
    H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,  # DP: stored elements per row (D or D // 2)
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
    # (PDL); only for index tensors and inv_freq that kernel does not write (see _ready_launch)
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
    SEARCH_CALL: tl.constexpr = (not SPLIT) or (QUANT == 0 and not ROPE)
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
            n, block_tables, cu_q, kv_info, slots, positions, bt_stride, table_width, n_seqs, guess_mul, freqs, MODE,
            ROPE, BLOCK_SIZE, NUM_BLOCKS, CP_RANK, CP_SIZE, CS_GIVEN, FMAX, ATTN_SCALE, LIBDEVICE)
        if PDL:
            gdc_wait()  # K / V, and the index tensors, may come from the previous kernel
            gdc_launch_dependents()
        if FAST_F and FREQS_LATE:
            freqs = tl.load(inv_freq + tl.arange(0, BLOCK_HF), mask=tl.arange(0, BLOCK_HF) < HALF, other=0.0)
    elif INDEX_FIRST:  # the lookup (and cos / sin) before the wait: reads only index tensors and inv_freq
        valid, blk, off, pos, cs_c, cs_s = _lookup(
            n, block_tables, cu_q, kv_info, slots, positions, bt_stride, table_width, n_seqs, guess_mul, freqs, MODE,
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
            n, block_tables, cu_q, kv_info, slots, positions, bt_stride, table_width, n_seqs, guess_mul, freqs, MODE,
            ROPE, BLOCK_SIZE, NUM_BLOCKS, CP_RANK, CP_SIZE, SEARCH, LOG_B, SEARCH_CALL, CS_GIVEN, FMAX, ATTN_SCALE,
            LIBDEVICE, "")
    same = n >= 0
    if INDEX_FIRST and SPECULATE:
        same = _spec_same(n, cu_q, kv_info, slots, positions, n_seqs, guess_mul, hit, sa, sb, sc, bt_ptr, bt_mask,
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
                n, block_tables, cu_q, kv_info, slots, positions, bt_stride, table_width, n_seqs, guess_mul,
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


@triton.jit
def _deq3(row, par, e, mask, fp8_scale, QUANT: tl.constexpr, S_TOK: tl.constexpr, S_HEAD: tl.constexpr,
          P_TOK: tl.constexpr, P_HEAD: tl.constexpr, tt, hh, HALF: tl.constexpr):
    # float32 values of elements e of tokens tt, heads hh of one block's K or V region (dequantized)
    if QUANT == 0:
        x = tl.load(row + tt * S_TOK + hh * S_HEAD + e, mask=mask, other=0.0).to(tl.float32)
    elif QUANT == 1:
        x = tl.load(row + tt * S_TOK + hh * S_HEAD + e, mask=mask, other=0.0).to(tl.float32) * fp8_scale
    else:
        if QUANT == 3:  # planar nibbles: element e < HALF low nibble of byte e, else high nibble of e - HALF
            low = e < HALF
            byte = tl.load(row + tt * S_TOK + hh * S_HEAD + tl.where(low, e, e - HALF), mask=mask, other=0)
            byte = byte.to(tl.int32)
            q = tl.where(low, byte & 15, (byte >> 4) & 15).to(tl.float32)
        else:
            q = tl.load(row + tt * S_TOK + hh * S_HEAD + e, mask=mask, other=0).to(tl.float32)
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


@triton.jit
def _read_tile(
    row, par, dst, tvalid, pos_f, inv_freq, attn_scale, fp8_scale, tt, hh, dd,
    QUANT: tl.constexpr, ROPE: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr,
    H: tl.constexpr, D: tl.constexpr, TOK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    S_TOK: tl.constexpr, S_HEAD: tl.constexpr, P_TOK: tl.constexpr, P_HEAD: tl.constexpr,
    OUT_S, OUT_H, LIBDEVICE: tl.constexpr,
):
    # TOK tokens x H heads x D of one of K / V from one block into dst[h, t, d] (model dtype); tokens that
    # are not valid (past the sequence) are written as zeros.
    m = (hh < H) & (dd < D) & (tt >= 0)
    lm = m & tvalid
    out_ptr = dst + tt * OUT_S + hh * OUT_H + dd
    if (QUANT == 0) and (not ROPE):
        x = tl.load(row + tt * S_TOK + hh * S_HEAD + dd, mask=lm, other=0.0)
        tl.store(out_ptr, x.to(dst.dtype.element_ty), mask=m)
    elif (QUANT == 3) and (not ROPE):
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
        if QUANT == 2:  # one scale / zero per (token, head), not per element
            hm = (hh < H) & tvalid & (tt >= 0)
            q = tl.load(row + tt * S_TOK + hh * S_HEAD + dd, mask=lm, other=0).to(tl.float32)
            scale, zero = _tile_params(par, tt, hh, hm, P_TOK, P_HEAD, TOK, BLOCK_H)
            x = q * scale + zero
        else:
            x = _deq3(row, par, dd, lm, fp8_scale, QUANT, S_TOK, S_HEAD, P_TOK, P_HEAD, tt, hh, D // 2)
        if ROPE:
            partner, j, first, in_rot = _rope_pairs(dd, ROT, INTERLEAVED)
            xp = _deq3(row, par, partner, lm & in_rot, fp8_scale, QUANT, S_TOK, S_HEAD, P_TOK, P_HEAD, tt, hh,
                       D // 2)
            f = tl.load(inv_freq + j, mask=in_rot, other=0.0)
            x = _rotate(x, xp, f, first, in_rot, pos_f, attn_scale, LIBDEVICE)
        x = tl.where(tvalid, x, 0.0)
        tl.store(out_ptr, x.to(dst.dtype.element_ty), mask=m)


@kernel(ints=("sk_b", "sk_h", "sk_s", "sv_b", "sv_h", "sv_s", "bt_stride", "table_width", "s_out"))
def _gather_kernel(
    k_out, v_out,  # model dtype [B, H, S_out, D] (any strides in units of VEC, head_dim contiguous)
    pool, qparams, block_tables, kv_info, inv_freq, fp8_scales,
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
    if MODE == 0:
        total = tl.load(kv_info + b).to(tl.int64)
    else:
        total = (tl.load(kv_info + b + 1) - tl.load(kv_info + b)).to(tl.int64)
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
    s_kv: tl.constexpr = BLOCK_SIZE * H * DP
    p_kv: tl.constexpr = BLOCK_SIZE * H * 2
    off0 = t0 % BLOCK_SIZE
    base = blk * (2 * s_kv) + off0 * S_TOK
    pbase = blk * (2 * p_kv) + off0 * P_TOK
    pos_f = (t * CP_SIZE + CP_RANK).to(tl.float32)
    k_scale = 1.0
    v_scale = 1.0
    if QUANT == 1:
        k_scale = tl.load(fp8_scales)
        v_scale = tl.load(fp8_scales + 1)
    if WIDE:  # the strides times VEC, and a head's offset, may pass int32: 64-bit address arithmetic
        sk_b = sk_b.to(tl.int64)
        sk_h = sk_h.to(tl.int64)
        sk_s = sk_s.to(tl.int64)
        sv_b = sv_b.to(tl.int64)
        sv_h = sv_h.to(tl.int64)
        sv_s = sv_s.to(tl.int64)
    _read_tile(pool + base, qparams + pbase, k_out + b * (sk_b * VEC) + t0 * (sk_s * VEC), tvalid, pos_f, inv_freq,
               ATTN_SCALE, k_scale, tt, hh, dd, QUANT, ROPE, ROT, INTERLEAVED, H, D, TOK, BLOCK_H, BLOCK_D, S_TOK,
               S_HEAD, P_TOK, P_HEAD, sk_s * VEC, sk_h * VEC, LIBDEVICE)
    _read_tile(pool + base + s_kv, qparams + pbase + p_kv, v_out + b * (sv_b * VEC) + t0 * (sv_s * VEC), tvalid,
               pos_f, inv_freq, ATTN_SCALE, v_scale, tt, hh, dd, QUANT, False, ROT, INTERLEAVED, H, D, TOK, BLOCK_H,
               BLOCK_D, S_TOK, S_HEAD, P_TOK, P_HEAD, sv_s * VEC, sv_h * VEC, LIBDEVICE)


@kernel(ints=("n_pairs", "layer_stride", "elems", "num_blocks"))
def _copy_blocks_kernel(
    buf,  # [L, num_blocks, elems] (any dtype)
    pairs,  # int64 [n_pairs, 2]: (src block, dst block)
    n_pairs, layer_stride, elems, num_blocks,
    BLOCK: tl.constexpr,
):
    # grid: (cdiv(elems, BLOCK), n_pairs, L); a pair with an id outside [0, num_blocks) is skipped
    c = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)
    src = tl.load(pairs + p * 2)
    dst = tl.load(pairs + p * 2 + 1)
    ok = (src >= 0) & (src < num_blocks) & (dst >= 0) & (dst < num_blocks)
    src = tl.where(ok, src, 0)
    dst = tl.where(ok, dst, 0)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    m = tl.where(ok, offs < elems, False)  # (tl.where: a scalar & tile mask is rejected by triton 3.9's interpreter)
    x = tl.load(buf + layer * layer_stride + src * elems + offs, mask=m)
    tl.store(buf + layer * layer_stride + dst * elems + offs, x, mask=m)


# ------------------------------------------------------------------------------------------------------------
# launchers (validated by the callers: kvcache.paged.PagedKVCache)


# Appends of fewer rows than this give K and V programs of their own (the kernel's SPLIT): measured on an H100
# (benchmarks/paged_tune.py), 256-row decode appends take 0.1-0.3 us less per layer split; 16384-row prefills
# are no faster.
_SPLIT_BELOW = 2048
# Split launches give each group of next_pow2(H) // _SPLIT_HEAD_GROUPS heads of a row's K (or V) a program.
# Measured (benchmarks/append_ab.py heads, 256-row decode, 8 x 128 heads): two groups are 0.1-0.2 us slower per
# layer, except slot-mapping int8 / int4 appends with RoPE (0.1 us faster, session 3, before ROPE_SELECT; with
# it, append_ab.py versions at 22:00 UTC: within 0.07 us); one group by default.
_SPLIT_HEAD_GROUPS = 1
# Decode-sized int8 / int4 appends by slot mapping with RoPE take one program per row of H * D / 256 warps (4 at
# 8 x 128 heads) rather than split programs (see append_paged_kv_launch); False: split like the others.
_SLOT_ROPE_ROWS = True
# Decode-sized launches with PDL and without the caller's metadata_ready promise look their rows up before the
# wait anyway and check what they read after it (the kernel's SPECULATE); False: they wait first.
_SPECULATE = os.environ.get("KVCACHE_SPECULATE", "1") != "0"


@functools.cache
def _pdl_supported(device: torch.device) -> bool:
    return device.type == "cuda" and gdc_wait is not None and torch.cuda.get_device_capability(device)[0] >= 9


_PDL_ENV = os.environ.get("KVCACHE_PDL", "1") != "0"  # read once, at import


def _pdl_default(device: torch.device) -> bool:
    """Programmatic dependent launch for the append: on where supported (compute capability >= 9.0);
    ``KVCACHE_PDL=0`` (read at import) turns it off. Safe with any neighbour: the kernel waits for the
    previous grid before its first read (before its first read of ``k`` / ``v`` when the caller promised
    ``metadata_ready``), releases the next one only after that wait, and a kernel launched after it without
    PDL starts as usual."""
    return _PDL_ENV and _pdl_supported(device)


def _block_strides(hnd: bool, H: int, DP: int, bs: int) -> dict[str, int]:
    """Element strides inside one K (or V) region of a block, [bs, H, DP] (NHD) or [H, bs, DP] (HND): of a
    token and of a head, in the data pool (S_*) and in the (scale, zero) params pool (P_*, 2 floats per row)."""
    if hnd:
        return dict(S_TOK=DP, S_HEAD=bs * DP, P_TOK=2, P_HEAD=bs * 2)
    return dict(S_TOK=H * DP, S_HEAD=DP, P_TOK=H * 2, P_HEAD=2)


def _rope_args(rope, device):  # type: ignore[no-untyped-def]
    if rope is None:
        return False, 2, False, 1.0, None
    return True, int(rope.rotary_dim), bool(rope.interleaved), float(rope.attention_scaling), rope.inv_freq


def _max_freq(rope) -> float:  # type: ignore[no-untyped-def]
    # the append's FMAX: max(inv_freq) when the params carry it (0.0: unknown, full-range cos / sin everywhere)
    top = getattr(rope, "max_inv_freq", 0.0) if rope is not None else 0.0
    return float(top) if _FAST_TRIG and top > 0 else 0.0  # (validated by the callers: a finite number >= 0)


def _ready_launch(metadata_ready: bool, pdl: bool, n_tokens: int, quant: int) -> tuple[bool, bool, bool]:
    """For an append whose caller promised ``metadata_ready`` (see :func:`append_paged_kv`), or that speculates
    (the check after the wait stands in for the promise; called with ``metadata_ready=True`` then):
    (INDEX_FIRST, split, whether the format takes CS_FIRST with it) of its default launch.

    Only decode-sized appends (fewer than ``_SPLIT_BELOW`` rows) with PDL look up their rows before the wait
    for the previous kernel: without PDL there is no wait to overlap, and prefills are not latency-bound.
    Those launches then take one program per row for fp16 / int8 / int4 (half the programs of a split launch,
    and the K and V chains side by side) and split programs for fp8; cos / sin go before the wait too except
    for fp8. Measured on an H100 (``benchmarks/append_ab.py versions``, session 6, 01:46 UTC; the variants
    behind the choice in BENCHMARKS.md), us per decode layer of a 32-layer graph, ragged / slot mapping, with
    RoPE, default -> metadata ready: fp16 1.57-1.59 -> 1.42-1.43 / 1.50-1.51 -> 1.30-1.31, fp8 1.82-1.85 ->
    1.41-1.46 / 1.48-1.68 -> 1.33-1.54, int8 1.86-1.89 -> 1.48-1.49 / 1.71-1.72 -> 1.53-1.54, int4 1.85-1.87
    -> 1.48-1.51 / 1.67-1.68 -> 1.51-1.52.
    """
    first = metadata_ready and pdl and n_tokens < _SPLIT_BELOW
    return first, first and quant == 1, quant != 1


def append_paged_kv_launch(
    k: torch.Tensor,
    v: torch.Tensor,
    pool: torch.Tensor,
    params: torch.Tensor | None,
    *,
    kv_dtype: str,
    layout: str,
    block_tables: torch.Tensor | None,
    cu_q_lens: torch.Tensor | None,
    kv_lens: torch.Tensor | None,
    cu_k_lens: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    positions: torch.Tensor | None,
    rope: RopeKernelParams | None,
    fp8_scales: torch.Tensor | None,
    cp_rank: int,
    cp_size: int,
    num_warps: int | None = None,
    split: bool | None = None,
    pdl: bool | None = None,
    early: bool | None = None,
    head_groups: int | None = None,
    max_registers: int | None = None,
    metadata_ready: bool = False,
    index_first: bool | None = None,
    cs_first: bool | None = None,
    speculate: bool | None = None,
    rope_ready: bool = False,
) -> AppendPlan | None:
    """Launch the append kernel; the arguments are those of :func:`append_paged_kv`, already validated
    (``k`` / ``v`` model dtype ``[N, H, D]``, ``pool`` / ``params`` one layer's pools, index tensors int32 /
    int64 on the pool's device, ``rope.inv_freq`` float32 on it, ``fp8_scales`` float32 ``[2]``).

    Tuning overrides (``None`` takes the defaults):

    * ``num_warps``;
    * ``split`` = one program for each row's K and one for its V (default: for fewer than ``_SPLIT_BELOW``
      rows, except int8 / int4 by slot mapping with RoPE (``_SLOT_ROPE_ROWS``: one program of ``H * D / 256``
      warps per row), and with ``metadata_ready`` there only for fp8, see :func:`_ready_launch`), else one
      program per row;
    * ``head_groups`` = split launches divide a row's heads among this many programs (a power of two; default
      ``_SPLIT_HEAD_GROUPS``; validated, and unused by launches that do not split);
    * ``pdl`` = launch with programmatic dependent launch (CUDA graphs on Hopper: the kernel is scheduled
      while the previous one drains, and waits for it before reading anything; with ``index_first`` or
      speculation, before reading ``k`` / ``v``, speculation checking its earlier reads after the wait);
    * ``early`` = RoPE and quantization before the wait for the block table rather than after it, the stores
      then predicated on the row's validity instead of behind a branch on it (except quantized slot-mapping
      launches with RoPE, and with ``KVCACHE_MASKED_STORES=0``) (default: for split launches, for those with
      ``index_first`` and for the per-row int8 / int4 slot-mapping decode launches with RoPE);
    * ``max_registers`` = a register cap per thread (none by default: caps of 40 and 32 measured no faster,
      see BENCHMARKS.md);
    * ``index_first`` = look up where each row goes (and compute RoPE's cos / sin) before waiting for the
      previous kernel (default: :func:`_ready_launch`, from ``metadata_ready``, the caller's promise that no
      kernel that may still be running writes the index tensors; see :func:`append_paged_kv`). Forced on
      without that promise it reads them unsynchronised;
    * ``cs_first`` = RoPE's cos / sin computed right after the lookup (with ``index_first``: before the wait
      too), not after the K / V rows arrive (rotate-half over the whole head only; default: with
      ``index_first``, per :func:`_ready_launch`);
    * ``speculate`` = without ``metadata_ready``, look up each row (first guess only) and compute cos / sin
      before the wait anyway, then re-read every value that used from L2 after the wait and redo the rows
      whose values changed or whose guess missed (default: decode-sized launches with PDL and no promise,
      of one row per sequence or by slot mapping, without RoPE or with rotate-half RoPE over the whole head;
      ``_SPECULATE``). It takes the launch shape of ``index_first`` (an explicit ``index_first=False`` with
      it is a ValueError);
    * ``rope_ready`` = no kernel that may still be running writes ``rope.inv_freq`` (the cache's own RoPE
      parameters, built once): speculation then reads the frequencies, and computes cos / sin, before the wait
      too; without it, after the wait.

    Returns an :class:`AppendPlan` for repeating this launch with new tensors of the same kind (compiled
    kernels on CUDA), else None.
    """
    if max_registers is not None and (type(max_registers) is not int or not 16 <= max_registers <= 255):
        raise ValueError(f"max_registers: expected an int in [16, 255] or None, got {max_registers!r}")
    if head_groups is not None and (type(head_groups) is not int or head_groups < 1
                                    or head_groups & (head_groups - 1) or head_groups > next_pow2(k.shape[1])):
        raise ValueError(f"head_groups: expected a power of two <= {next_pow2(k.shape[1])}, got {head_groups!r}")
    if pdl and not _pdl_supported(pool.device):
        raise ValueError("pdl: programmatic dependent launch needs a CUDA device of compute capability >= 9.0 "
                         "and triton >= 3.4")
    has_rope, rot, inter, attn_scale, inv_freq = _rope_args(rope, pool.device)
    fast_rope = has_rope and not inter and rot == k.shape[2]
    spec_ok = (not has_rope) or fast_rope  # speculation re-reads no partner elements of K nor inv_freq per element
    if speculate:
        if not spec_ok:
            raise ValueError(f"speculate: True needs no RoPE or rotate-half RoPE over the whole head_dim "
                             f"({k.shape[2]}), got rotary_dim {rot}, interleaved {inter}")
        if index_first is False:
            raise ValueError("speculate: True looks rows up before the wait; expected index_first None or True, "
                             "got False")
    n_tokens = k.shape[0]
    if n_tokens == 0:
        return None
    if not use_triton(pool.device):
        append_paged_kv_reference(
            k, v, pool, params, kv_dtype=kv_dtype, layout=layout, block_tables=block_tables, cu_q_lens=cu_q_lens,
            kv_lens=kv_lens, cu_k_lens=cu_k_lens, slot_mapping=slot_mapping, positions=positions, rope=rope,
            fp8_scales=fp8_scales, cp_rank=cp_rank, cp_size=cp_size,
        )
        return None
    if slot_mapping is None and cu_q_lens.shape[0] == 1:  # type: ignore[union-attr]
        return None  # no sequence: every row is padding
    if pdl is None:
        pdl = _pdl_default(pool.device)
    H, D = k.shape[1], k.shape[2]
    quant = QUANT_CODES[kv_dtype]
    if speculate is None:
        # only where the first guess is exact for every row: one row per sequence (a decode batch), or a slot
        # mapping. A mixed batch (prefill chunks beside decode rows) misses for most rows, which then do the work
        # twice: 2-4x slower (H100, 1280-1500 rows)
        exact = slot_mapping is not None or cu_q_lens.shape[0] - 1 == n_tokens  # type: ignore[union-attr]
        speculate = (_SPECULATE and spec_ok and exact and not metadata_ready and bool(pdl)
                     and n_tokens < _SPLIT_BELOW and index_first is None)
    speculate = bool(speculate)
    # speculation takes the launch shape of the promise's (lookup first)
    ready_first, ready_split, cs_format = _ready_launch(bool(metadata_ready) or speculate, bool(pdl), n_tokens,
                                                        quant)
    # int8 / int4 decode by slot mapping with RoPE: one program per row of H * D / 256 warps (4 for 8 x 128
    # heads), with the per-row launch's cache hints and (scale, zero) store (_SLOT_ROPE_ROWS). Measured on an
    # H100 (append_ab.py versions, session 6, 01:37 UTC, us per layer of a 32-layer graph, 8 x 128 heads,
    # against split launches with ROPE_SELECT): int8 1.93-1.96 -> 1.74-1.76 (2 warps: 1.78-1.80), int4
    # 1.83-1.92 -> 1.74-1.77 (2 warps: 1.83-1.84); ragged, fp8 and fp16 were slower that way
    slot_rope_rows = (_SLOT_ROPE_ROWS and not ready_first and slot_mapping is not None and has_rope and quant >= 2
                      and n_tokens < _SPLIT_BELOW and split is None)
    if split is None:
        split = ready_split if ready_first else (n_tokens < _SPLIT_BELOW and not slot_rope_rows)
    index_first = bool(ready_first if index_first is None else index_first) or speculate
    # speculation re-reads the index tensors after the wait, not inv_freq: unless no running kernel writes the
    # frequencies (rope_ready), they are read after the wait and cos / sin computed there (cs_first overridden).
    # Re-reading them instead cost up to 0.5 us per layer (a reduction over the row; H100, 04:21 UTC)
    freqs_late = speculate and fast_rope and not rope_ready
    if freqs_late:
        if cs_first:
            raise ValueError("cs_first: True needs inv_freq before the wait; a speculative launch reads it after "
                             "the wait unless rope_ready=True, got rope_ready False")
        cs_first = False
    cs_first = (cs_format and index_first if cs_first is None else bool(cs_first)) and fast_rope
    hints = _HINTS and not split
    if not split:
        hg = 1
    elif head_groups is None:
        hg = min(_SPLIT_HEAD_GROUPS, next_pow2(H))
    else:
        hg = head_groups
    if early is None:
        # measured on an H100 (benchmarks/append_ab.py): 0.03-0.1 us less per decode layer in every format; on
        # prefills (with the cache hints) no gain, and -1 to -4 points for fp8 and int4 with RoPE
        early = split or index_first or slot_rope_rows
    hnd = layout == "HND"
    bs = pool.shape[3] if hnd else pool.shape[2]
    n_seqs = 0 if slot_mapping is not None else cu_q_lens.shape[0] - 1  # type: ignore[union-attr]
    rope_select = bool(split) and has_rope and quant >= 1 and slot_mapping is not None
    # vector loads of k / v rows: the row strides (runtime ints) are passed in units of VEC elements (up to 16
    # bytes); the head strides and the half-row offset are constexprs, whose divisibility the compiler sees
    vec = vec_elems(k.element_size(), (k.stride(0), v.stride(0)))
    args = _append_args(
        k=k, v=v, pool=pool, params=params, block_tables=block_tables, cu_q=cu_q_lens,
        kv_info=kv_lens if kv_lens is not None else cu_k_lens, slots=slot_mapping, positions=positions,
        inv_freq=inv_freq, fp8_scales=fp8_scales, stride_kn=k.stride(0) // vec, stride_vn=v.stride(0) // vec,
        bt_stride=block_tables.stride(0) if block_tables is not None else 0,
        table_width=block_tables.shape[1] if block_tables is not None else 0, n_seqs=n_seqs, n_rows=n_tokens,
    )
    consts = dict(
        MODE=2 if slot_mapping is not None else (0 if kv_lens is not None else 1), QUANT=quant, ROPE=has_rope,
        ROT=rot, INTERLEAVED=inter, ATTN_SCALE=attn_scale, FMAX=_max_freq(rope), H=H, D=D, DP=pool.shape[-1],
        BLOCK_SIZE=bs, NUM_BLOCKS=pool.shape[0], **_block_strides(hnd, H, pool.shape[-1], bs), CP_RANK=cp_rank,
        CP_SIZE=cp_size,
        SEARCH=next_pow2(n_seqs) if 0 < n_seqs <= 1024 else 0, LOG_B=max(n_seqs - 1, 0).bit_length(),
        STRIDE_KH=k.stride(1), STRIDE_VH=v.stride(1), BLOCK_H=next_pow2(H) // hg, HG=hg,
        BLOCK_HF=next_pow2((D + 1) // 2),
        LIBDEVICE=pool.device.type == "cuda", SPLIT=bool(split), PDL=bool(pdl), VEC=vec, EARLY=bool(early),
        LOAD_EV="evict_first" if hints else "", STORE_CM=".cs" if hints else "",
        ROPE_SELECT=rope_select,
        # measured on an H100 (append_ab.py versions, 23:48 UTC), us per decode layer, branch -> masked: without
        # RoPE fp8 1.84-1.88 -> 1.60-1.61, int8 1.75-1.95 -> 1.61-1.64, int4 1.61-1.66 -> 1.57-1.58 (ragged; fp8
        # by slot mapping 1.53-1.54 -> 1.39-1.41); ragged with RoPE up to 0.1 faster; quantized slot mapping with
        # RoPE (ROPE_SELECT) int8 1.91-1.97 -> 2.02-2.03, int4 1.92-1.94 -> 1.94-2.03, fp8 1.55 -> 1.51-1.52, so
        # those keep the branch
        MASKED=bool(early) and _MASKED_STORES and not rope_select,
        INDEX_FIRST=index_first, CS_FIRST=cs_first, SPECULATE=speculate,
        FREQS_LATE=freqs_late,
        PAIR_ASM=_PAIR_ASM and not split and quant >= 2 and _ptx(pool.device) and params.data_ptr() % 8 == 0,  # type: ignore[union-attr]
        # measured on an H100 (benchmarks/paged_tune.py, append_ab.py; 8 x 128 heads): 2 warps (1 KB of fp16 per
        # warp and row); 4 for unquantized rows (append_ab.py, 00:08 UTC: +0.5-1.5 points of copy bandwidth on the
        # fp16 prefill, fp8 within noise, int8 / int4 with RoPE -3 / -10 points); 1 warp for split (decode-sized)
        # launches (as fast or up to 0.1 us faster per layer)
        num_warps=num_warps or max(1, min(8, H * D // (1024 if split else
                                                         (256 if quant == 0 or slot_rope_rows else 512)))),
    )
    if pdl:
        consts["launch_pdl"] = True
    if max_registers:  # ptxas register cap (occupancy experiments; no default)
        consts["maxnreg"] = max_registers
    per_row = 2 * hg if split else 1
    prepared = _append_kernel.launch(pool.device, (per_row * n_tokens,), *args, **consts)
    if prepared is None:
        return None
    return AppendPlan(prepared, vec, per_row)


def _append_args(k, v, pool, params, block_tables, cu_q, kv_info, slots, positions, inv_freq, fp8_scales,  # type: ignore[no-untyped-def]
                 stride_kn, stride_vn, bt_stride, table_width, n_seqs, n_rows) -> tuple:
    """The append kernel's runtime arguments in its order (tensors, or their ``data_ptr()`` ints). A pointer
    the launch does not use (None) is passed as ``pool``: never read, and a valid address."""
    return (
        k, v, pool, pool if params is None else params, pool if block_tables is None else block_tables,
        pool if cu_q is None else cu_q, pool if kv_info is None else kv_info, pool if slots is None else slots,
        pool if positions is None else positions, pool if inv_freq is None else inv_freq,
        pool if fp8_scales is None else fp8_scales, stride_kn, stride_vn, bt_stride, table_width, n_seqs,
        _GUESS_ONE if n_seqs == n_rows else _guess_mul(n_seqs, n_rows),  # a decode batch: no call (host time)
    )


class AppendPlan:
    """A compiled append launch, repeated with raw pointers for new tensors of the same kind.

    "The same kind": the same dtypes, 16-byte alignment of every pointer (and 8-byte alignment of ``params``,
    which selects the inline-PTX (scale, zero) store), k / v strides, mode, RoPE, format, number of sequences,
    K/V split, PDL setting, ``metadata_ready``, speculation (``_SPECULATE``, and for ragged batches whether
    they hold one row per sequence); the caller keys plans by those (see
    ``PagedKVCache.append``). :meth:`launch` skips argument binding and the launcher's per-tensor pointer
    checks, which are most of an eager call's host time.
    """

    __slots__ = ("prepared", "vec", "per_row")

    def __init__(self, prepared: PreparedLaunch, vec: int, per_row: int) -> None:
        self.prepared = prepared
        self.vec = vec  # k / v row strides (elements) are passed divided by vec
        self.per_row = per_row  # programs per row: 1, or 2 x head groups (split: K and V separately)

    def launch(
        self, stream: int, n: int, k: int, v: int, stride_kn: int, stride_vn: int, pool: int, params: int | None,
        inv_freq: int | None, fp8_scales: int, block_tables: int | None, cu_q: int | None, kv_lens: int | None,
        slots: int | None, positions: int | None, bt_stride: int, table_width: int, n_seqs: int,
    ) -> None:
        """Launch on ``stream`` for ``n`` rows. Pointers are ``data_ptr()`` ints (None: unused); ``k`` / ``v``
        rows ``stride_kn`` / ``stride_vn`` elements apart; ``block_tables`` int32 ``[n_seqs, table_width]``
        with rows ``bt_stride`` apart, ``cu_q`` int32 ``[n_seqs + 1]``, ``kv_lens`` int32 ``[n_seqs]``
        (ragged), or ``slots`` / ``positions`` int32 or int64 ``[n]`` (slot mapping)."""
        pl = self.prepared
        args = _append_args(k, v, pool, params, block_tables, cu_q, kv_lens, slots, positions, inv_freq, fp8_scales,
                            stride_kn // self.vec, stride_vn // self.vec, bt_stride, table_width, n_seqs, n)
        pl.run(self.per_row * n, 1, 1, stream, *pl.head, *args, *pl.consts)


# Output spans (elements from an output's first to its last, + 1) from which the gather computes its output
# addresses in 64-bit integers: int32 products of the strides overflow past 2**31 (tests lower it to reach that
# code path with small tensors).
_GATHER_WIDE_FROM = 1 << 31


def gather_paged_kv_launch(
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    pool: torch.Tensor,
    params: torch.Tensor | None,
    *,
    kv_dtype: str,
    layout: str,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor | None,
    cu_k_lens: torch.Tensor | None,
    rope: RopeKernelParams | None,
    fp8_scales: torch.Tensor | None,
    cp_rank: int,
    cp_size: int,
    num_warps: int | None = None,
    tok: int | None = None,
) -> None:
    """Launch the gather kernel (arguments already validated). ``k_out`` / ``v_out``: ``[B, H, S_out, D]``.
    ``num_warps`` and ``tok`` (tokens per program) override the defaults, for tuning."""
    B, H, s_out, D = k_out.shape
    if B == 0 or s_out == 0:
        return
    if not use_triton(pool.device):
        gather_paged_kv_reference(
            k_out, v_out, pool, params, kv_dtype=kv_dtype, layout=layout, block_tables=block_tables,
            kv_lens=kv_lens, cu_k_lens=cu_k_lens, rope=rope, fp8_scales=fp8_scales, cp_rank=cp_rank,
            cp_size=cp_size,
        )
        return
    quant = QUANT_CODES[kv_dtype]
    hnd = layout == "HND"
    bs = pool.shape[3] if hnd else pool.shape[2]
    has_rope, rot, inter, attn_scale, inv_freq = _rope_args(rope, pool.device)
    dummy = pool
    if tok is None:  # 1 token x 2 warps per program (8 x 128 heads): 92-97% of copy bandwidth on an H100
        tok = 1  # in graphs, every format (paged_tune.py)
    elif tok < 1 or bs % tok or tok & (tok - 1):
        raise ValueError(f"tok: expected a power of two dividing block_size {bs}, got {tok}")
    out_strides = (k_out.stride(0), k_out.stride(1), k_out.stride(2), v_out.stride(0), v_out.stride(1),
                   v_out.stride(2))
    vec = vec_elems(k_out.element_size(), out_strides)  # vector stores of output rows
    # the largest element offset of either output (its strides are non-negative): int32 address arithmetic below
    # 2**31, 64-bit from there (the common case keeps the narrower code)
    span = max(sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1 for t in (k_out, v_out))
    _gather_kernel.launch(
        pool.device, (cdiv(s_out, tok), B),
        k_out, v_out, pool, params if params is not None else dummy, block_tables,
        kv_lens if kv_lens is not None else cu_k_lens,
        inv_freq if inv_freq is not None else dummy,
        fp8_scales if fp8_scales is not None else dummy,
        *[st // vec for st in out_strides],
        block_tables.stride(0), block_tables.shape[1], s_out,
        MODE=0 if kv_lens is not None else 1, QUANT=quant, ROPE=has_rope, ROT=rot, INTERLEAVED=inter,
        ATTN_SCALE=attn_scale, H=H, D=D, DP=pool.shape[-1], BLOCK_SIZE=bs, NUM_BLOCKS=pool.shape[0],
        **_block_strides(hnd, H, pool.shape[-1], bs),
        CP_RANK=cp_rank, CP_SIZE=cp_size, TOK=tok, BLOCK_H=next_pow2(H), BLOCK_D=max(2, next_pow2(D)),
        LIBDEVICE=pool.device.type == "cuda", VEC=vec, WIDE=span >= _GATHER_WIDE_FROM,
        num_warps=num_warps or max(1, min(8, tok * H * D // 512)),
    )


def copy_blocks_launch(buf: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy whole blocks ``pairs[i, 0] -> pairs[i, 1]`` in every layer of ``buf`` ``[L, num_blocks, ...]``."""
    n_pairs = pairs.shape[0]
    if n_pairs == 0:
        return
    L, nb = buf.shape[0], buf.shape[1]
    elems = buf[0, 0].numel()
    if not use_triton(buf.device):
        for src, dst in pairs.tolist():
            if 0 <= src < nb and 0 <= dst < nb:  # (the kernel skips such pairs too)
                buf[:, dst] = buf[:, src]
        return
    block = min(4096, max(128, next_pow2(elems)))
    _copy_blocks_kernel.launch(buf.device, (cdiv(elems, block), n_pairs, L), buf, pairs, n_pairs, nb * elems,
                               elems, nb, BLOCK=block)


# ------------------------------------------------------------------------------------------------------------
# pure-torch references (the CPU backend)


def quantize_rows_reference(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization of the last dim: returns (codes uint8 [..., D], scale f32 [...], zero f32 [...])."""
    x = x.float()
    qmax = float(2**bits - 1)
    mn = x.amin(dim=-1)
    mx = x.amax(dim=-1)
    scale = (mx - mn) / qmax
    inv = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(scale))
    q = torch.round((x - mn[..., None]) * inv[..., None]).clamp(0, qmax)  # round half to even
    return q.to(torch.uint8), scale, mn


def dequantize_rows_reference(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``q * scale + zero`` in float32."""
    return q.float() * scale[..., None] + zero[..., None]


def _rope_rows(x: torch.Tensor, pos: torch.Tensor, rope, inverse: bool = False) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Rotate float32 rows x [n, H, D] at positions [n] the way the kernels do (float32)."""
    rot, inter, scale = int(rope.rotary_dim), bool(rope.interleaved), float(rope.attention_scaling)
    inv = rope.inv_freq.to(device=x.device, dtype=torch.float32)
    ang = pos.to(torch.float32)[:, None] * inv[None, :]  # [n, rot / 2]
    c = torch.cos(ang) * scale
    s = torch.sin(ang) * scale
    if inverse:
        s = -s
    out = x.clone()
    if inter:
        x1, x2 = x[..., 0:rot:2], x[..., 1:rot:2]
        out[..., 0:rot:2] = x1 * c[:, None] - x2 * s[:, None]
        out[..., 1:rot:2] = x2 * c[:, None] + x1 * s[:, None]
    else:
        half = rot // 2
        x1, x2 = x[..., :half], x[..., half:rot]
        out[..., :half] = x1 * c[:, None] - x2 * s[:, None]
        out[..., half:rot] = x2 * c[:, None] + x1 * s[:, None]
    return out


def _token_targets(
    n_tokens: int, block_tables, cu_q_lens, kv_lens, cu_k_lens, slot_mapping, positions, block_size: int,
    num_blocks: int, cp_rank: int, cp_size: int,
) -> list[tuple[int, int, int, int]]:  # type: ignore[no-untyped-def]
    """(row, block, offset, global position) of every row that is written."""
    out = []
    if slot_mapping is not None:
        slots = slot_mapping.tolist()
        pos = positions.tolist() if positions is not None else [0] * n_tokens
        for n, slot in enumerate(slots):
            if slot >= 0 and slot // block_size < num_blocks:
                out.append((n, slot // block_size, slot % block_size, int(pos[n])))
        return out
    cu = cu_q_lens.tolist()
    tables = block_tables.tolist()
    width = block_tables.shape[1]
    if kv_lens is not None:
        starts = kv_lens.tolist()
    else:
        ck = cu_k_lens.tolist()
        starts = [(ck[b + 1] - ck[b]) - (cu[b + 1] - cu[b]) for b in range(len(cu) - 1)]
    for b in range(len(cu) - 1):
        for n in range(cu[b], min(cu[b + 1], n_tokens)):
            p = starts[b] + (n - cu[b])
            if p < 0 or p % cp_size != cp_rank:
                continue
            lp = p // cp_size
            bi = lp // block_size
            if bi >= width:
                continue
            blk = tables[b][bi]
            if 0 <= blk < num_blocks:
                out.append((n, blk, lp % block_size, p))
    return out


def append_paged_kv_reference(
    k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor, params: torch.Tensor | None, *, kv_dtype: str, layout: str,
    block_tables: torch.Tensor | None, cu_q_lens: torch.Tensor | None, kv_lens: torch.Tensor | None,
    cu_k_lens: torch.Tensor | None, slot_mapping: torch.Tensor | None, positions: torch.Tensor | None,
    rope: RopeKernelParams | None, fp8_scales: torch.Tensor | None, cp_rank: int, cp_size: int,
) -> None:
    """Pure-torch reference of the append kernel (same arguments as :func:`append_paged_kv_launch`, already
    validated: ``k`` / ``v`` ``[N, H, D]`` model dtype, ``pool`` / ``params`` one layer's pools, index tensors
    int32 / int64 on the pool's device)."""
    hnd = layout == "HND"
    bs = pool.shape[3] if hnd else pool.shape[2]
    targets = _token_targets(k.shape[0], block_tables, cu_q_lens, kv_lens, cu_k_lens, slot_mapping, positions, bs,
                             pool.shape[0], cp_rank, cp_size)
    if not targets:
        return
    rows = torch.tensor([t[0] for t in targets], dtype=torch.long, device=k.device)
    blks = torch.tensor([t[1] for t in targets], dtype=torch.long, device=k.device)
    offs = torch.tensor([t[2] for t in targets], dtype=torch.long, device=k.device)
    pos = torch.tensor([t[3] for t in targets], dtype=torch.long, device=k.device)
    for kv, src in ((0, k), (1, v)):
        x = src[rows]  # [n, H, D]
        if kv == 0 and rope is not None:
            x = _rope_rows(x.float(), pos, rope)
        if kv_dtype == "auto":
            data = x.to(pool.dtype)
        elif kv_dtype == "fp8":
            inv = 1.0 / fp8_scales[kv].float()
            data = (x.float() * inv).clamp(-_FP8_MAX, _FP8_MAX).to(pool.dtype)
        else:
            q, scale, zero = quantize_rows_reference(x, 8 if kv_dtype == "int8" else 4)
            if kv_dtype == "int4":  # planar nibbles: byte i = q[i] | q[D/2 + i] << 4
                half = q.shape[-1] // 2
                q = (q[..., :half] | (q[..., half:] << 4)).to(torch.uint8)
            data = q
            par = torch.stack([scale, zero], dim=-1)  # [n, H, 2]
            if hnd:
                params[blks, kv, :, offs] = par
            else:
                params[blks, kv, offs] = par
        if hnd:
            pool[blks, kv, :, offs] = data
        else:
            pool[blks, kv, offs] = data


def gather_paged_kv_reference(
    k_out: torch.Tensor, v_out: torch.Tensor, pool: torch.Tensor, params: torch.Tensor | None, *, kv_dtype: str,
    layout: str, block_tables: torch.Tensor, kv_lens: torch.Tensor | None, cu_k_lens: torch.Tensor | None,
    rope: RopeKernelParams | None, fp8_scales: torch.Tensor | None, cp_rank: int, cp_size: int,
) -> None:
    """Pure-torch reference of the gather kernel (arguments as :func:`gather_paged_kv_launch`, validated):
    fills ``k_out`` / ``v_out`` ``[B, H, S_out, D]``."""
    hnd = layout == "HND"
    bs = pool.shape[3] if hnd else pool.shape[2]
    B, H, s_out, D = k_out.shape
    totals = kv_lens.tolist() if kv_lens is not None else [
        b - a for a, b in zip(cu_k_lens.tolist()[:-1], cu_k_lens.tolist()[1:])
    ]
    tables = block_tables.tolist()
    width = block_tables.shape[1]
    k_out.zero_()
    v_out.zero_()
    for b in range(B):
        local = max(totals[b] - cp_rank + cp_size - 1, 0) // cp_size
        ts = [t for t in range(min(local, s_out)) if t // bs < width and 0 <= tables[b][t // bs] < pool.shape[0]]
        if not ts:
            continue
        t_idx = torch.tensor(ts, dtype=torch.long, device=pool.device)
        blks = torch.tensor([tables[b][t // bs] for t in ts], dtype=torch.long, device=pool.device)
        offs = t_idx % bs
        for kv, out in ((0, k_out), (1, v_out)):
            data = pool[blks, kv, :, offs] if hnd else pool[blks, kv, offs]  # [n, H, DP]
            if kv_dtype == "auto":
                x = data.float()
            elif kv_dtype == "fp8":
                x = data.float() * fp8_scales[kv].float()
            else:
                par = params[blks, kv, :, offs] if hnd else params[blks, kv, offs]  # [n, H, 2]
                if kv_dtype == "int4":
                    q = torch.cat([data & 15, (data >> 4) & 15], dim=-1)
                else:
                    q = data
                x = dequantize_rows_reference(q, par[..., 0], par[..., 1])
            if kv == 0 and rope is not None:
                x = _rope_rows(x, t_idx * cp_size + cp_rank, rope)
            if kv_dtype == "auto" and not (kv == 0 and rope is not None):
                x = data  # exact copy
            out[b].index_copy_(1, t_idx, x.to(out.dtype).transpose(0, 1))


# ------------------------------------------------------------------------------------------------------------
# public ops (validate, then launch)



def _fmt(shape) -> str:  # type: ignore[no-untyped-def]
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _need(name: str, t: object, *, dtypes: tuple[torch.dtype, ...], ndim: int, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor, got shape {_fmt(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of pool), got {t.device}")
    return t


def _pool_geometry(pool: object, params: object, kv_dtype: str, layout: str) -> tuple[int, int, int, int]:
    """Validate a layer pool (and params); returns (num_blocks, block_size, num_kv_heads, stored row elems)."""
    if not isinstance(kv_dtype, str):
        raise TypeError(f"kv_dtype: expected one of {tuple(QUANT_CODES)}, got {type(kv_dtype).__name__}")
    if kv_dtype not in QUANT_CODES:
        raise ValueError(f"kv_dtype: expected one of {tuple(QUANT_CODES)}, got {kv_dtype!r}")
    if not isinstance(layout, str):
        raise TypeError(f"layout: expected 'NHD' or 'HND', got {type(layout).__name__}")
    if layout not in ("NHD", "HND"):
        raise ValueError(f"layout: expected 'NHD' or 'HND', got {layout!r}")
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"pool: expected a torch.Tensor, got {type(pool).__name__}")
    if pool.dim() != 5 or pool.shape[1] != 2:
        want = "[num_blocks, 2, block_size, H, D]" if layout == "NHD" else "[num_blocks, 2, H, block_size, D]"
        raise ValueError(f"pool: expected shape {want} ({layout}), got {_fmt(pool.shape)}")
    if not pool.is_contiguous():
        raise ValueError(f"pool: expected a contiguous tensor, got strides {tuple(pool.stride())}")
    want_dtype = {"fp8": (torch.float8_e4m3fn,), "int8": (torch.uint8,), "int4": (torch.uint8,)}.get(
        kv_dtype, MODEL_DTYPES)
    if pool.dtype not in want_dtype:
        raise ValueError(f"pool: expected dtype {' or '.join(str(d) for d in want_dtype)} for kv_dtype "
                         f"{kv_dtype!r}, got {pool.dtype}")
    nb = pool.shape[0]
    bs, h = (pool.shape[2], pool.shape[3]) if layout == "NHD" else (pool.shape[3], pool.shape[2])
    if kv_dtype in ("int8", "int4"):
        if not isinstance(params, torch.Tensor):
            raise TypeError(f"params: expected a float32 tensor of scales and zeros for kv_dtype {kv_dtype!r}, "
                            f"got {type(params).__name__}")
        want = (*pool.shape[:4], 2)
        if tuple(params.shape) != want or params.dtype != torch.float32 or not params.is_contiguous():
            raise ValueError(f"params: expected a contiguous float32 tensor of shape {_fmt(want)}, got "
                             f"{params.dtype} {_fmt(params.shape)}")
        if params.device != pool.device:
            raise ValueError(f"params: expected device {pool.device} (the device of pool), got {params.device}")
    elif params is not None:
        raise ValueError(f"params: expected None for kv_dtype {kv_dtype!r}")
    return nb, bs, h, pool.shape[4]


def _check_kv_rows(k: object, v: object, pool: torch.Tensor, kv_dtype: str, h: int, dp: int, names=("k", "v")):  # type: ignore[no-untyped-def]
    _need(names[0], k, dtypes=MODEL_DTYPES, ndim=3, device=pool.device)
    _need(names[1], v, dtypes=MODEL_DTYPES, ndim=3, device=pool.device)
    d = k.shape[2]  # type: ignore[union-attr]
    if tuple(v.shape) != tuple(k.shape) or v.dtype != k.dtype:  # type: ignore[union-attr]
        raise ValueError(f"{names[1]}: expected {k.dtype} {_fmt(k.shape)} (as {names[0]}), got "  # type: ignore[union-attr]
                         f"{v.dtype} {_fmt(v.shape)}")  # type: ignore[union-attr]
    want_dp = d // 2 if kv_dtype == "int4" else d
    if k.shape[1] != h or dp != want_dp or (kv_dtype == "int4" and d % 2):  # type: ignore[union-attr]
        raise ValueError(f"{names[0]}: expected [n, {h}, D] matching pool {_fmt(pool.shape)} "
                         f"(kv_dtype {kv_dtype!r}), got {_fmt(k.shape)}")  # type: ignore[union-attr]
    if kv_dtype == "auto" and pool.dtype != k.dtype:  # type: ignore[union-attr]
        raise ValueError(f"{names[0]}: expected dtype {pool.dtype} (the pool's, kv_dtype 'auto'), got {k.dtype}")  # type: ignore[union-attr]
    for name, t in zip(names, (k, v)):
        if t.stride(2) != 1:  # type: ignore[union-attr]
            raise ValueError(f"{name}: expected head_dim to be contiguous (stride 1), got strides {tuple(t.stride())}")  # type: ignore[union-attr]
    return d


def _check_rope(rope, d: int, device: torch.device):  # type: ignore[no-untyped-def]
    if rope is None:
        return None
    if not isinstance(rope, RopeKernelParams):
        raise TypeError(
            f"rope: expected RopeKernelParams (RopeConfig.kernel_params(device=...)), got {type(rope).__name__}"
        )
    for attr in ("inv_freq", "attention_scaling", "rotary_dim", "interleaved"):
        if not hasattr(rope, attr):
            raise TypeError(
                f"rope: expected RopeKernelParams (RopeConfig.kernel_params(...)), got {type(rope).__name__}"
            )
    rot = rope.rotary_dim
    if not isinstance(rot, int) or rot < 2 or rot % 2 or rot > d:
        raise ValueError(f"rope: expected an even rotary_dim in [2, {d}], got {rot}")
    inv = rope.inv_freq
    if not isinstance(inv, torch.Tensor) or inv.dtype != torch.float32 or tuple(inv.shape) != (rot // 2,):
        raise ValueError(f"rope: expected inv_freq float32 [{rot // 2}], got {getattr(inv, 'dtype', None)} "
                         f"{_fmt(getattr(inv, 'shape', ()))}")
    if inv.device != device:
        raise ValueError(f"rope: expected inv_freq on {device} (the device of pool), got {inv.device}")
    if not inv.is_contiguous():
        raise ValueError("rope: expected a contiguous inv_freq")
    top = getattr(rope, "max_inv_freq", 0.0)
    if isinstance(top, bool) or not isinstance(top, (int, float)) or not math.isfinite(top) or top < 0:
        raise ValueError(f"rope: expected max_inv_freq a finite float >= 0 (0.0: unknown), got {top!r}")
    return rope


def _host_check_rope_bound(rope) -> None:  # type: ignore[no-untyped-def]
    # check=True: max_inv_freq must bound inv_freq (it selects the cos / sin evaluation by each row's largest angle)
    if rope is not None and rope.max_inv_freq and float(rope.inv_freq.abs().max()) > rope.max_inv_freq:
        raise ValueError(f"rope: max_inv_freq {rope.max_inv_freq} is below max |inv_freq| "
                         f"{float(rope.inv_freq.abs().max())}")


def _check_int_vec(name: str, t: object, n: int | None, device: torch.device, dtypes=(torch.int32,)) -> torch.Tensor:  # type: ignore[no-untyped-def]
    _need(name, t, dtypes=dtypes, ndim=1, device=device)
    if n is not None and t.shape[0] != n:  # type: ignore[union-attr]
        raise ValueError(f"{name}: expected shape [{n}], got {_fmt(t.shape)}")  # type: ignore[union-attr]
    if t.stride(0) != 1 and t.shape[0] > 1:  # type: ignore[union-attr]
        raise ValueError(f"{name}: expected a contiguous tensor")
    return t  # type: ignore[return-value]


def _check_cp(cp_rank: object, cp_size: object) -> tuple[int, int]:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int):
        raise TypeError(f"cp_size: expected an int, got {type(cp_size).__name__}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int):
        raise TypeError(f"cp_rank: expected an int, got {type(cp_rank).__name__}")
    if cp_size < 1:
        raise ValueError(f"cp_size: expected an int >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank: expected 0 <= cp_rank < cp_size={cp_size}, got {cp_rank}")
    return cp_rank, cp_size


def _check_fp8_scales(fp8_scales: object, kv_dtype: str, device: torch.device) -> torch.Tensor | None:
    if kv_dtype != "fp8":
        return None
    if fp8_scales is None:
        raise ValueError("fp8_scales: expected a float32 tensor [2] (k_scale, v_scale) for kv_dtype 'fp8'")
    t = _need("fp8_scales", fp8_scales, dtypes=(torch.float32,), ndim=1, device=device)
    if t.shape[0] != 2 or not t.is_contiguous():
        raise ValueError(f"fp8_scales: expected a contiguous float32 tensor [2], got {_fmt(t.shape)}")
    return t


def append_paged_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    pool: torch.Tensor,
    params: torch.Tensor | None = None,
    *,
    kv_dtype: str = "auto",
    layout: str = "NHD",
    block_tables: torch.Tensor | None = None,
    cu_q_lens: torch.Tensor | None = None,
    kv_lens: torch.Tensor | None = None,
    cu_k_lens: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    rope=None,  # RopeKernelParams | None
    fp8_scales: torch.Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    check: bool = False,
    metadata_ready: bool = False,
) -> None:
    """Write new keys and values into paged blocks in one pass: RoPE on K and quantization fused.

    Parameters
    ----------
    k, v : torch.Tensor
        shape ``[num_tokens, H, D]``, float16 / bfloat16 / float32, head_dim contiguous (token and head
        strides free: e.g. views into a fused QKV projection). Keys are un-rotated when ``rope`` is given.
    pool : torch.Tensor
        One layer's data pool (layout and dtype in :mod:`kvcache.paged.config`), written in place.
    params : torch.Tensor, optional
        float32 scale / zero pool, required for ``kv_dtype`` int8 / int4.
    kv_dtype, layout : str
        The pool's format: ``"auto" | "fp8" | "int8" | "int4"`` and ``"NHD" | "HND"``.
    block_tables : torch.Tensor
        int32 ``[B, max_blocks]``: block ids of each sequence, in order (ragged mode).
    cu_q_lens : torch.Tensor
        int32 ``[B + 1]``, ``cu_q_lens[0] == 0``: rows of ``k`` / ``v`` per sequence (ragged mode; prefill
        chunks and decode tokens mixed). Rows past ``cu_q_lens[B]`` are padding and skipped.
    kv_lens : torch.Tensor
        int32 ``[B]``: tokens each sequence already holds (position of its first new token). Or:
    cu_k_lens : torch.Tensor
        int32 ``[B + 1]``: cumulative total lengths *after* this append (TurboMind).
    slot_mapping : torch.Tensor
        int64 or int32 ``[num_tokens]``: instead of the ragged description, the pool slot
        ``block * block_size + offset`` of every row; ``-1`` skips the row.
    positions : torch.Tensor
        int32 / int64 ``[num_tokens]``: RoPE positions in slot-mapping mode (required there with ``rope``).
    rope : RopeKernelParams, optional
        ``RopeConfig.kernel_params(...)`` with ``inv_freq`` on the pool's device: rotate keys before storing.
    fp8_scales : torch.Tensor
        float32 ``[2]`` (k_scale, v_scale), required for ``kv_dtype="fp8"``.
    cp_rank, cp_size : int
        Context parallelism: token ``p`` is stored only by rank ``p % cp_size``, at local position
        ``p // cp_size`` of the rank's block table; RoPE uses the global position.
    check : bool
        Debug mode (syncs): verify lengths, block-table capacity and block ids on the host and raise
        ValueError before writing. Without it, such rows are skipped on the device.
    metadata_ready : bool
        The caller's promise that no kernel that may still be running when this append starts writes the index
        tensors (``block_tables``, ``cu_q_lens``, ``kv_lens`` / ``cu_k_lens``, ``slot_mapping``,
        ``positions``) or ``rope.inv_freq``. That is: not the kernel just before this append on the stream,
        and not any kernel that one may overlap. A kernel launched without programmatic dependent launch (PDL)
        starts only after its predecessor has finished; a kernel launched with PDL may overlap its
        predecessor, and passes the guarantee on only if it waits for it before releasing its own dependents
        (kvcache's kernels do). Typically true of metadata copied in or computed at the start of a step and
        read by every layer's append. Decode-sized appends (fewer than 2048 rows) launched with PDL (Hopper)
        then find where each row goes, and compute RoPE's cos / sin (rotate-half over the whole head; not for
        fp8), before waiting for the previous kernel, which they wait for only to read ``k`` / ``v``; see
        :func:`_ready_launch`. The launch shape changes with it, and with it the compiler's contraction of the
        RoPE arithmetic: rotated keys may differ from the launch that waits in the last bit (within the same
        bounds). A broken promise reads stale indices: rows written to the wrong slots.

        Default False. Without the promise, decode-sized appends with PDL *speculate* (batches of one row per
        sequence, or by slot mapping; without RoPE, or with rotate-half RoPE over the whole head): they do the
        same lookup before the wait, then read every index value it used again from L2 after the wait
        (``ld.global.cg``) and compare; a row whose values changed (or whose sequence the first guess missed) is
        looked up and written again after the wait. ``rope.inv_freq`` is read after the wait there (the
        cache's own frequencies, built once, before it, with cos / sin: rotated keys may then differ from a
        launch that waits first in the last bit, as with the promise). Other appends wait before every read.
        ``KVCACHE_SPECULATE=0`` (read at import) turns speculation off.

    Note
    ----
    One kernel launch, no allocation, no host sync: capturable in a CUDA graph.
    """
    if type(metadata_ready) is not bool:
        raise TypeError(f"metadata_ready: expected a bool, got {metadata_ready!r} ({type(metadata_ready).__name__})")
    if type(check) is not bool:
        raise TypeError(f"check: expected a bool, got {check!r} ({type(check).__name__})")
    nb, bs, h, dp = _pool_geometry(pool, params, kv_dtype, layout)
    d = _check_kv_rows(k, v, pool, kv_dtype, h, dp)
    n = k.shape[0]
    dev = pool.device
    cp_rank, cp_size = _check_cp(cp_rank, cp_size)
    rope = _check_rope(rope, d, dev)
    if check:
        _host_check_rope_bound(rope)
    fp8_scales = _check_fp8_scales(fp8_scales, kv_dtype, dev)
    if slot_mapping is not None:
        if any(x is not None for x in (block_tables, cu_q_lens, kv_lens, cu_k_lens)):
            raise ValueError("slot_mapping: expected alone, without block_tables / cu_q_lens / kv_lens / cu_k_lens")
        _check_int_vec("slot_mapping", slot_mapping, n, dev, (torch.int64, torch.int32))
        if cp_size != 1:
            raise ValueError(f"cp_size: slot mapping addresses local slots directly; expected 1, got {cp_size}")
        if rope is not None:
            if positions is None:
                raise ValueError("positions: expected int32/int64 [num_tokens] with rope in slot-mapping mode")
            _check_int_vec("positions", positions, n, dev, (torch.int64, torch.int32))
        if check:
            s = slot_mapping.tolist()
            bad = [x for x in s if x < -1 or x >= nb * bs]
            if bad:
                raise ValueError(f"slot_mapping: expected -1 or slots in [0, {nb * bs}), got {bad[:8]}")
    else:
        if cu_q_lens is None or block_tables is None or (kv_lens is None) == (cu_k_lens is None):
            raise ValueError("cu_q_lens: expected block_tables, cu_q_lens and exactly one of kv_lens / cu_k_lens "
                             "(or slot_mapping alone)")
        if positions is not None:
            raise ValueError("positions: expected None in ragged mode (positions follow from kv_lens / cu_k_lens)")
        _check_int_vec("cu_q_lens", cu_q_lens, None, dev)
        b = cu_q_lens.shape[0] - 1
        if b < 0:
            raise ValueError("cu_q_lens: expected B + 1 >= 1 entries, got 0")
        _need("block_tables", block_tables, dtypes=(torch.int32,), ndim=2, device=dev)
        if block_tables.shape[0] != b or (block_tables.stride(1) != 1 and block_tables.shape[1] > 1):
            raise ValueError(f"block_tables: expected int32 [{b}, max_blocks] with contiguous rows, got "
                             f"{_fmt(block_tables.shape)} strides {tuple(block_tables.stride())}")
        if kv_lens is not None:
            _check_int_vec("kv_lens", kv_lens, b, dev)
        else:
            _check_int_vec("cu_k_lens", cu_k_lens, b + 1, dev)
        if check:
            _host_check_ragged(n, nb, bs, block_tables, cu_q_lens, kv_lens, cu_k_lens, cp_rank, cp_size)
    append_paged_kv_launch(
        k, v, pool, params, kv_dtype=kv_dtype, layout=layout, block_tables=block_tables, cu_q_lens=cu_q_lens,
        kv_lens=kv_lens, cu_k_lens=cu_k_lens, slot_mapping=slot_mapping, positions=positions, rope=rope,
        fp8_scales=fp8_scales, cp_rank=cp_rank, cp_size=cp_size, metadata_ready=metadata_ready,
    )


def _host_check_ragged(n, nb, bs, block_tables, cu_q_lens, kv_lens, cu_k_lens, cp_rank, cp_size) -> None:  # type: ignore[no-untyped-def]
    cu = cu_q_lens.tolist()
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > n:
        raise ValueError(f"cu_q_lens: expected non-decreasing from 0 to at most {n} (rows of k), got {cu}")
    b = len(cu) - 1
    if kv_lens is not None:
        starts = kv_lens.tolist()
        if any(s < 0 for s in starts):
            raise ValueError(f"kv_lens: expected values >= 0, got {starts}")
        totals = [starts[i] + cu[i + 1] - cu[i] for i in range(b)]
    else:
        ck = cu_k_lens.tolist()
        totals = [ck[i + 1] - ck[i] for i in range(b)]
        if ck[0] != 0 or any(totals[i] < cu[i + 1] - cu[i] for i in range(b)):
            raise ValueError(f"cu_k_lens: expected from 0 with every total >= its new tokens, got {ck}")
    width = block_tables.shape[1]
    tables = block_tables.tolist()
    for i in range(b):
        local = max(totals[i] - cp_rank + cp_size - 1, 0) // cp_size  # positions p with p % cp_size == cp_rank
        need = -(-local // bs)
        if need > width:
            raise ValueError(f"block_tables: sequence {i} needs {need} blocks for {totals[i]} tokens, the table holds "
                             f"{width}")
        bad = [x for x in tables[i][:need] if not 0 <= x < nb]
        if bad:
            raise ValueError(f"block_tables: sequence {i} uses block ids {bad} outside [0, {nb})")


def gather_paged_kv(
    pool: torch.Tensor,
    params: torch.Tensor | None = None,
    *,
    kv_dtype: str = "auto",
    layout: str = "NHD",
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor | None = None,
    cu_k_lens: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    max_len: int | None = None,
    dtype: torch.dtype | None = None,
    rope: RopeKernelParams | None = None,
    fp8_scales: torch.Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read sequences' blocks back into contiguous, dequantized K and V (TurboMind ``FlattenKV``).

    Parameters
    ----------
    pool, params, kv_dtype, layout
        One layer's pool, as in :func:`append_paged_kv`.
    block_tables : torch.Tensor
        int32 ``[B, max_blocks]`` of the requested sequences.
    kv_lens : torch.Tensor
        int32 ``[B]``: tokens each sequence holds (global count; with context parallelism the rank holds
        ``ceil((kv_lens - cp_rank) / cp_size)`` of them). Or ``cu_k_lens`` int32 ``[B + 1]``.
    k_out, v_out : torch.Tensor, optional
        shape ``[B, H, S_out, D]`` (any strides, head_dim contiguous) of the model dtype: filled, token ``t``
        at index ``t``, zeros past each sequence's (local) length. Default: new contiguous tensors with
        ``S_out = max_len``.
    max_len : int, optional
        ``S_out`` when the outputs are allocated here; default: the longest sequence (reads ``kv_lens``:
        one sync). With ``k_out`` / ``v_out`` given: None, or their ``S_out``.
    dtype : torch.dtype, optional
        Output dtype when allocating (default: the pool's model dtype; required for quantized pools).
    rope : RopeKernelParams, optional
        Apply RoPE to the keys while reading (for caches that store keys un-rotated); position of local
        token ``t`` is ``t * cp_size + cp_rank``.
    fp8_scales : torch.Tensor
        float32 ``[2]`` for ``kv_dtype="fp8"``.

    Returns
    -------
    (k, v) : ``[B, H, S_out, D]`` each.
    """
    nb, bs, h, dp = _pool_geometry(pool, params, kv_dtype, layout)
    dev = pool.device
    cp_rank, cp_size = _check_cp(cp_rank, cp_size)
    fp8_scales = _check_fp8_scales(fp8_scales, kv_dtype, dev)
    _need("block_tables", block_tables, dtypes=(torch.int32,), ndim=2, device=dev)
    b = block_tables.shape[0]
    if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:
        raise ValueError("block_tables: expected contiguous rows")
    if (kv_lens is None) == (cu_k_lens is None):
        raise ValueError("kv_lens: expected exactly one of kv_lens / cu_k_lens")
    if kv_lens is not None:
        _check_int_vec("kv_lens", kv_lens, b, dev)
    else:
        _check_int_vec("cu_k_lens", cu_k_lens, b + 1, dev)
    d = dp * 2 if kv_dtype == "int4" else dp
    rope = _check_rope(rope, d, dev)
    if (k_out is None) != (v_out is None):
        raise ValueError("k_out: expected both k_out and v_out, or neither")
    if k_out is None:
        if dtype is None:
            if kv_dtype != "auto":
                raise ValueError(f"dtype: expected the model dtype for a {kv_dtype!r} pool")
            dtype = pool.dtype
        check_dtype_in("dtype", dtype, MODEL_DTYPES)
        if max_len is None:
            lens = kv_lens if kv_lens is not None else cu_k_lens[1:] - cu_k_lens[:-1]  # type: ignore[index]
            max_len = int(lens.max().item()) if b else 0
            max_len = max(max_len - cp_rank + cp_size - 1, 0) // cp_size
        if isinstance(max_len, bool) or not isinstance(max_len, int):
            raise TypeError(f"max_len: expected an int, got {type(max_len).__name__}")
        if max_len < 0:
            raise ValueError(f"max_len: expected an int >= 0, got {max_len!r}")
        k_out = torch.empty((b, h, max_len, d), dtype=dtype, device=dev)
        v_out = torch.empty((b, h, max_len, d), dtype=dtype, device=dev)
    else:
        _need("k_out", k_out, dtypes=MODEL_DTYPES, ndim=4, device=dev)
        _need("v_out", v_out, dtypes=MODEL_DTYPES, ndim=4, device=dev)
        for name, t in (("k_out", k_out), ("v_out", v_out)):
            if t.shape[0] != b or t.shape[1] != h or t.shape[3] != d or t.stride(3) != 1:
                raise ValueError(f"{name}: expected [{b}, {h}, S_out, {d}] with head_dim contiguous, got "
                                 f"{_fmt(t.shape)} strides {tuple(t.stride())}")
        if v_out.shape != k_out.shape or v_out.dtype != k_out.dtype:
            raise ValueError(f"v_out: expected {k_out.dtype} {_fmt(k_out.shape)} (as k_out), got {v_out.dtype} "
                             f"{_fmt(v_out.shape)}")
        if kv_dtype == "auto" and k_out.dtype != pool.dtype:
            raise ValueError(f"k_out: expected dtype {pool.dtype} (the pool's), got {k_out.dtype}")
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int)):
            raise TypeError(f"max_len: expected an int or None, got {type(max_len).__name__}")
        if max_len is not None and max_len != k_out.shape[2]:
            raise ValueError(f"max_len: expected None or {k_out.shape[2]} (S_out of k_out / v_out), got {max_len}")
    gather_paged_kv_launch(
        k_out, v_out, pool, params, kv_dtype=kv_dtype, layout=layout, block_tables=block_tables, kv_lens=kv_lens,
        cu_k_lens=cu_k_lens, rope=rope, fp8_scales=fp8_scales, cp_rank=cp_rank, cp_size=cp_size,
    )
    return k_out, v_out


def copy_blocks(buffers: list[torch.Tensor], pairs: torch.Tensor, *, check: bool = True) -> None:
    """Copy whole blocks ``pairs[i, 0] -> pairs[i, 1]`` in every layer (copy-on-write of shared blocks).

    Parameters
    ----------
    buffers : list of torch.Tensor
        Each ``[L, num_blocks, ...]`` contiguous (the data pool of all layers, and the params pool if any),
        with the same ``num_blocks``.
    pairs : torch.Tensor
        int64 ``[n, 2]`` on the buffers' device: (source block, destination block), ids in
        ``[0, num_blocks)``. Destinations must be distinct and not sources of other pairs.
    check : bool
        Validate the ids before copying (reads ``pairs``: one device sync on a GPU). With ``check=False``
        the caller vouches for them; a pair with an id out of range is then skipped, never written out of
        bounds.
    """
    if not isinstance(pairs, torch.Tensor):
        raise TypeError(f"pairs: expected an int64 tensor [n, 2], got {type(pairs).__name__}")
    if type(check) is not bool:
        raise TypeError(f"check: expected a bool, got {type(check).__name__}")
    if isinstance(buffers, torch.Tensor) or not isinstance(buffers, (list, tuple)) or not buffers:
        raise TypeError(f"buffers: expected a non-empty list of tensors, got {type(buffers).__name__}")
    for i, buf in enumerate(buffers):
        if not isinstance(buf, torch.Tensor) or buf.dim() < 3 or not buf.is_contiguous():
            raise ValueError(f"buffers[{i}]: expected a contiguous tensor [L, num_blocks, ...]")
        if pairs.device != buf.device:
            raise ValueError(f"pairs: expected device {buf.device} (of buffers[{i}]), got {pairs.device}")
        if buf.shape[1] != buffers[0].shape[1]:
            raise ValueError(f"buffers[{i}]: expected {buffers[0].shape[1]} blocks (as buffers[0]), got "
                             f"{buf.shape[1]}")
    if pairs.dtype != torch.int64 or pairs.dim() != 2 or pairs.shape[1] != 2 or not pairs.is_contiguous():
        raise ValueError(f"pairs: expected a contiguous int64 tensor [n, 2], got {pairs.dtype} {_fmt(pairs.shape)}")
    if check and pairs.shape[0]:
        nb = buffers[0].shape[1]
        vals = pairs.tolist()
        bad = [x for pair in vals for x in pair if not 0 <= x < nb]
        if bad:
            raise ValueError(f"pairs: expected block ids in [0, {nb}), got {bad[:8]}")
        dst = [d for _, d in vals]
        if len(set(dst)) != len(dst) or set(dst) & {s for s, _ in vals}:
            raise ValueError("pairs: expected distinct destinations that are not also sources")
    for buf in buffers:
        copy_blocks_launch(buf, pairs)
