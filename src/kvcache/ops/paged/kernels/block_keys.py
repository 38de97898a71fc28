"""int4b's append and gather kernels (the byte format of :mod:`kvcache.ops.paged.block_keys`). The append: programs
per (sequence, chunk, head), each writing its share of the blocks the call reaches (none, one or more), one block at
a time.

A block that stays partial gets its new key rows as int8 rows (halves in its own and in the next block's key plane,
(scale, zero) in its key area); a block that fills reads its earlier int8 rows back, adds the new rows and is
written as int4 codes per channel with fp16 (scale, zero). Values are int4 rows with float32 (scale, zero), as
``int4``'s. Rounding as the torch reference: IEEE division and reciprocal, round half to even, the int8 rows read
back with a separate multiply and add.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ...._backend import kernel
from .codes import BY_KV_LENS
from .numerics import _codes, _div, _rcp
from .rope import _rope_pairs, _rotate


@triton.jit
def _mul_add(q, s, z, LIBDEVICE: tl.constexpr):
    # q * s + z rounded twice (the reference's), never contracted into one fma
    if LIBDEVICE:
        return libdevice.add_rn(libdevice.mul_rn(q, s), z)
    else:
        return q * s + z


@triton.jit
def _rows(src, row0, stride_n, tt, hh, e, ok, pos_f, inv_freq, ATTN_SCALE: tl.constexpr, ROPE: tl.constexpr,
          ROT: tl.constexpr, INTERLEAVED: tl.constexpr, STRIDE_H: tl.constexpr, LIBDEVICE: tl.constexpr):
    # float32 elements e of rows row0 + tt (heads hh) of k / v [N, H, D], rotated when ROPE; 0 where not ok
    ptr = src + (row0 + tt) * stride_n + hh * STRIDE_H
    x = tl.load(ptr + e, mask=ok, other=0.0).to(tl.float32)
    if ROPE:
        partner, j, first, in_rot = _rope_pairs(e, ROT, INTERLEAVED)
        xp = tl.load(ptr + partner, mask=ok & in_rot, other=0.0).to(tl.float32)
        f = tl.load(inv_freq + j, mask=in_rot, other=0.0)
        x = _rotate(x, xp, f, first, in_rot, pos_f, ATTN_SCALE, LIBDEVICE)
    return x


@triton.jit
def _row_codes(lo, hi, ok, QMAX: tl.constexpr, LIBDEVICE: tl.constexpr):
    # asymmetric codes per row (dim 2 of [T, H, D/2] halves): (c_lo, c_hi int32, scale, zero [T, H, 1]); a row with a
    # NaN or an infinity: codes 0, scale and zero NaN (int8's rule)
    fin = (lo == lo) & (tl.abs(lo) < float("inf")) & (hi == hi) & (tl.abs(hi) < float("inf"))
    bad = (tl.sum((ok & ~fin).to(tl.int32), 2) > 0)[:, :, None]
    lo = tl.where(bad, 0.0, lo)
    hi = tl.where(bad, 0.0, hi)
    mn = tl.minimum(tl.min(tl.where(ok, lo, float("inf")), 2), tl.min(tl.where(ok, hi, float("inf")), 2))[:, :, None]
    mx = tl.maximum(tl.max(tl.where(ok, lo, -float("inf")), 2), tl.max(tl.where(ok, hi, -float("inf")), 2))[:, :, None]
    scale = _div(mx - mn, QMAX, LIBDEVICE)
    inv = tl.where(scale > 0, _rcp(tl.where(scale > 0, scale, 1.0), LIBDEVICE), 0.0)
    c_lo = _codes((lo - mn) * inv, LIBDEVICE) & 255
    c_hi = _codes((hi - mn) * inv, LIBDEVICE) & 255
    return c_lo, c_hi, tl.where(bad, float("nan"), scale), tl.where(bad, float("nan"), mn)


@triton.jit
def _channel_codes(lo, ok, LIBDEVICE: tl.constexpr):
    # int4 codes per channel over the block's rows (dim 0 of [BS, H, D/2]): (codes int32, scale16, zero16 [1, H, D/2])
    fin = (lo == lo) & (tl.abs(lo) < float("inf"))
    bad = (tl.sum((ok & ~fin).to(tl.int32), 0) > 0)[None, :, :]
    xf = tl.where(fin, lo, 0.0)
    mn = tl.min(tl.where(ok, xf, float("inf")), 0)[None, :, :]
    mx = tl.max(tl.where(ok, xf, -float("inf")), 0)[None, :, :]
    scale16 = _div(mx - mn, 15.0, LIBDEVICE).to(tl.float16)
    zero16 = mn.to(tl.float16)
    scale = scale16.to(tl.float32)
    zero = zero16.to(tl.float32)
    good = (scale > 0) & (tl.abs(scale) < float("inf")) & (tl.abs(zero) < float("inf")) & ~bad
    inv = tl.where(good, _rcp(tl.where(good, scale, 1.0), LIBDEVICE), 0.0)
    y = tl.minimum(tl.maximum((xf - tl.where(good, zero, 0.0)) * inv, 0.0), 15.0)
    codes = _codes(y, LIBDEVICE) & 15
    nan16 = tl.full(scale16.shape, float("nan"), tl.float16)
    return codes, tl.where(bad, nan16, scale16), tl.where(bad, nan16, zero16)


@triton.jit
def key_area_word(w, WK: tl.constexpr, P_TOK: tl.constexpr):
    """Offset of key-area word ``w`` (int tensor) from its block's and head's first params word: slot ``w // WK``,
    word ``2 + w % WK`` (words 0 and 1 of a slot hold its value row's (scale, zero)); the append, the gather and the
    attention kernels all address the key area by it."""
    return (w // WK) * P_TOK + 2 + w % WK


@triton.jit
def key_area_half(c, WK: tl.constexpr, P_TOK: tl.constexpr):
    """Offset, in float16 values, of key-area value ``c`` (int tensor) from the block's and head's first params word
    (``2 * key_area_word(c // 2) + c % 2``): a full block's channel ``c`` has its fp16 scale at ``c`` and its fp16
    zero at ``D + c``, so a word holds two channels' scales (or zeros), as a packed ``fma.f16x2`` takes them."""
    return (c // (2 * WK)) * (2 * P_TOK) + 4 + c % (2 * WK)


@triton.jit
def row_scale_zero(qparams, pbase, r, WK: tl.constexpr, P_TOK: tl.constexpr, mask):
    """float32 (scale, zero) of int8 rows ``r`` (int tensor) of the partial blocks whose head's params start at word
    ``pbase``: key-area words ``2 r`` and ``2 r + 1``; 0 where not ``mask``. The gather and the attention kernels
    read a partial block's rows by it."""
    s = tl.load(qparams + pbase + key_area_word(2 * r, WK, P_TOK), mask=mask, other=0.0)
    z = tl.load(qparams + pbase + key_area_word(2 * r + 1, WK, P_TOK), mask=mask, other=0.0)
    return s, z


@triton.jit
def _halves(qparams, pbase):
    # the float32 params pool as float16 values, from word pbase (a block's and head's first)
    return qparams.to(tl.pointer_type(tl.float16)) + 2 * pbase


@triton.jit
def channel_scale_zero(qparams, pbase, c, D: tl.constexpr, WK: tl.constexpr, P_TOK: tl.constexpr, mask):
    """float16 (scale, zero) of channels ``c`` (int tensor) of the full blocks whose head's params start at word
    ``pbase``: two channels' scales (or zeros) a word, loaded as a packed fma takes them; 0 where not ``mask``. The
    gather and the attention kernels read a full block's key area by it."""
    ph = _halves(qparams, pbase)
    s = tl.load(ph + key_area_half(c, WK, P_TOK), mask=mask, other=0.0)
    z = tl.load(ph + key_area_half(D + c, WK, P_TOK), mask=mask, other=0.0)
    return s, z


@triton.jit
def _int8_rows(k_lo, k_hi, ok, row_ok, kplane, nplane, kw, kz_w, LIBDEVICE: tl.constexpr):
    # key rows of a block that stays partial: int8 codes per row, halves in its own and the next block's key plane,
    # the row's (scale, zero) in its key-area words
    c_lo, c_hi, ks, kz = _row_codes(k_lo, k_hi, ok, 255.0, LIBDEVICE)
    tl.store(kplane, c_lo.to(tl.uint8), mask=ok)
    tl.store(nplane, c_hi.to(tl.uint8), mask=ok)
    tl.store(kw, ks, mask=row_ok)
    tl.store(kz_w, kz, mask=row_ok)


@triton.jit
def _fill_half(x, plane, old, os, oz, rows, scales, zeros, ok, LIBDEVICE: tl.constexpr):
    # one half (x: its new rows, float32) of a block that fills: the rows before the call read back from their int8
    # codes in plane, then int4 codes per channel (returned, int32) with the channels' fp16 scales and zeros stored
    # at the float16 pointers scales and zeros
    q = tl.load(plane, mask=old & ok, other=0).to(tl.float32)
    x = tl.where(old, _mul_add(q, os, oz, LIBDEVICE), x)
    c, s, z = _channel_codes(x, rows, LIBDEVICE)
    tl.store(scales, s, mask=ok)
    tl.store(zeros, z, mask=ok)
    return c


@triton.jit
def _write_block(k, v, pool, qparams, block_tables, inv_freq, b, bi, q0, start, n, g, stride_kn, stride_vn,
                 bt_stride, table_width, ROPE: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr,
                 ATTN_SCALE: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                 NUM_BLOCKS: tl.constexpr, WK: tl.constexpr, S_TOK: tl.constexpr, S_HEAD: tl.constexpr,
                 P_TOK: tl.constexpr, P_HEAD: tl.constexpr, STRIDE_KH: tl.constexpr, STRIDE_VH: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr, LIBDEVICE: tl.constexpr, ROWS: tl.constexpr):
    # the rows of sequence b (n rows from position start, input rows q0 ..) that fall in its table's block bi,
    # heads g * BLOCK_H ..: nothing for an out-of-range block, or a partial block without the next one. ROWS: BS
    # (the block's slots as one tile), or 1 for a call that writes one row and leaves its block partial (slot o0)
    o0 = tl.maximum(start - bi * BS, 0)
    o1 = tl.minimum(start + n - bi * BS, BS)
    blk = tl.load(block_tables + b * bt_stride + bi, mask=bi < table_width, other=-1).to(tl.int64)
    nxt = tl.load(block_tables + b * bt_stride + bi + 1, mask=bi + 1 < table_width, other=-1).to(tl.int64)
    has_nxt = (nxt >= 0) & (nxt < NUM_BLOCKS)
    fills = o1 == BS
    HALF: tl.constexpr = D // 2
    S_KV: tl.constexpr = BS * H * HALF  # one plane of a block
    P_BLK: tl.constexpr = BS * H * (2 + WK)
    if (o0 < o1) & (blk >= 0) & (blk < NUM_BLOCKS) & (((o0 == 0) & fills) | has_nxt):
        nxt = tl.where(has_nxt, nxt, 0)
        if ROWS == 1:
            tt = o0 + tl.zeros([1, 1, 1], tl.int64)
        else:
            tt = tl.arange(0, BS)[:, None, None]
        hh = (g * BLOCK_H + tl.arange(0, BLOCK_H))[None, :, None]
        dd = tl.arange(0, BLOCK_D2)[None, None, :]
        hm = hh < H
        ok = hm & (dd < HALF)  # [1, BLOCK_H, D/2] lanes
        new = (tt >= o0) & (tt < o1)  # rows of this call
        row0 = q0 + bi * BS - start  # input row of slot 0
        pos_f = (bi * BS + tt).to(tl.float32)
        # values: int4 rows, (scale, zero) in words 0, 1
        v_lo = _rows(v, row0, stride_vn, tt, hh, dd, ok & new, pos_f, inv_freq, ATTN_SCALE, False, ROT, INTERLEAVED,
                     STRIDE_VH, LIBDEVICE)
        v_hi = _rows(v, row0, stride_vn, tt, hh, HALF + dd, ok & new, pos_f, inv_freq, ATTN_SCALE, False, ROT,
                     INTERLEAVED, STRIDE_VH, LIBDEVICE)
        c_lo, c_hi, vs, vz = _row_codes(v_lo, v_hi, ok & new, 15.0, LIBDEVICE)
        vplane = pool + blk * (2 * S_KV) + S_KV
        tl.store(vplane + tt * S_TOK + hh * S_HEAD + dd, (c_lo | (c_hi << 4)).to(tl.uint8), mask=ok & new)
        vw = qparams + blk * P_BLK + tt * P_TOK + hh * P_HEAD
        tl.store(vw, vs, mask=hm & new)
        tl.store(vw + 1, vz, mask=hm & new)
        # keys, rotated
        k_lo = _rows(k, row0, stride_kn, tt, hh, dd, ok & new, pos_f, inv_freq, ATTN_SCALE, ROPE, ROT, INTERLEAVED,
                     STRIDE_KH, LIBDEVICE)
        k_hi = _rows(k, row0, stride_kn, tt, hh, HALF + dd, ok & new, pos_f, inv_freq, ATTN_SCALE, ROPE, ROT,
                     INTERLEAVED, STRIDE_KH, LIBDEVICE)
        kplane = pool + blk * (2 * S_KV) + tt * S_TOK + hh * S_HEAD + dd
        nplane = pool + nxt * (2 * S_KV) + tt * S_TOK + hh * S_HEAD + dd
        # key-area word 2 t / 2 t + 1: the (scale, zero) of int8 row t (slot (2 t) // WK, word 2 + (2 t) % WK)
        pk = qparams + blk * P_BLK + hh * P_HEAD
        kw = pk + key_area_word(2 * tt, WK, P_TOK)
        kz_w = pk + key_area_word(2 * tt + 1, WK, P_TOK)  # the next slot's when WK is odd
        if ROWS == 1:
            _int8_rows(k_lo, k_hi, ok & new, hm & new, kplane, nplane, kw, kz_w, LIBDEVICE)
        elif fills:
            # one half at a time (its earlier int8 rows read back, its channels' codes, fp16 scales and zeros: both
            # halves at once held 235 registers a thread on sm_90 against 168, four programs an SM against six), the
            # bytes once both halves' codes are known. The rows' (scale, zero) sit in the key-area words the
            # channels' scales and zeros replace: every thread reads its rows' before the barrier, any thread writes
            # after it
            old = tt < o0
            os = tl.load(kw, mask=hm & old, other=0.0)
            oz = tl.load(kz_w, mask=hm & old, other=0.0)
            tl.debug_barrier()
            rows = ok & (tt < BS)
            ph = _halves(qparams, blk * P_BLK + hh * P_HEAD)
            c_lo = _fill_half(k_lo, kplane, old, os, oz, rows, ph + key_area_half(dd, WK, P_TOK),
                              ph + key_area_half(D + dd, WK, P_TOK), ok, LIBDEVICE)
            c_hi = _fill_half(k_hi, nplane, old, os, oz, rows, ph + key_area_half(HALF + dd, WK, P_TOK),
                              ph + key_area_half(D + HALF + dd, WK, P_TOK), ok, LIBDEVICE)
            tl.store(kplane, (c_lo | (c_hi << 4)).to(tl.uint8), mask=rows)
        else:
            _int8_rows(k_lo, k_hi, ok & new, hm & new, kplane, nplane, kw, kz_w, LIBDEVICE)


@kernel(ints=("stride_kn", "stride_vn", "bt_stride", "table_width", "seq0", "n_progs"))
def _int4b_append_kernel(
    k, v,  # model dtype [N, H, D], head_dim contiguous, heads STRIDE_H apart
    pool, qparams,  # uint8 pool; float32 params (the full blocks' key areas read as float16)
    block_tables, cu_q_lens, k_lens, inv_freq,
    stride_kn, stride_vn, bt_stride, table_width, seq0, n_progs,
    MODE: tl.constexpr,  # 0: kv_lens [B] (tokens before the step), 1: cu_k_lens [B + 1] (after it)
    ROPE: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr, ATTN_SCALE: tl.constexpr,
    H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, NUM_BLOCKS: tl.constexpr, WK: tl.constexpr,
    S_TOK: tl.constexpr, S_HEAD: tl.constexpr, P_TOK: tl.constexpr, P_HEAD: tl.constexpr,
    STRIDE_KH: tl.constexpr, STRIDE_VH: tl.constexpr,
    BLOCK_H: tl.constexpr, ROW_HEADS: tl.constexpr, BLOCK_D2: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    # grid (B, n_progs, H) (one head a program, BLOCK_H = 1): program (b, c, g) writes head g of sequence seq0 + b's
    # blocks 1 + c, 1 + c + n_progs, .. of those the call reaches, and program c = 0 its first block before them (a
    # decode row that leaves its block partial: heads g .. g + ROW_HEADS - 1 when ROW_HEADS divides g). The
    # first block may read the second's key plane (its earlier int8 rows' second halves), which the second block's
    # write replaces: one program writes both, in that order. No other block reads a block the call writes.
    tl.static_assert(BLOCK_H == 1, "int4b append: one head a program")
    b = tl.program_id(0).to(tl.int64) + seq0
    c = tl.program_id(1)
    g = tl.program_id(2)
    q0 = tl.load(cu_q_lens + b).to(tl.int64)
    n = tl.load(cu_q_lens + b + 1).to(tl.int64) - q0
    if MODE == BY_KV_LENS:
        start = tl.load(k_lens + b).to(tl.int64)
    else:
        start = (tl.load(k_lens + b + 1) - tl.load(k_lens + b)).to(tl.int64) - n
    first = start // BS
    n_blk = tl.where(n > 0, (start + n - 1) // BS - first + 1, 0)  # blocks the call's rows touch
    if c == 0:
        if (n == 1) & ((start + 1) % BS != 0):
            # a decode row that leaves its block partial: that slot's row only (an int8 key row, an int4 value row),
            # ROW_HEADS heads from the program of the first (the others exit; ROW_HEADS <= BS keeps the tile within
            # the fill's): a row is little work, and a launch whose every (row, head) is a program of this kernel's
            # registers takes waves (H200, 256 rows x 8 heads: 11.4-13.0 us, 10.6 in one program a row)
            if g % ROW_HEADS == 0:
                _write_block(k, v, pool, qparams, block_tables, inv_freq, b, first, q0, start, n, g // ROW_HEADS,
                             stride_kn, stride_vn, bt_stride, table_width, ROPE, ROT, INTERLEAVED, ATTN_SCALE, H, D,
                             BS, NUM_BLOCKS, WK, S_TOK, S_HEAD, P_TOK, P_HEAD, STRIDE_KH, STRIDE_VH, ROW_HEADS,
                             BLOCK_D2, LIBDEVICE, 1)
        else:
            _write_block(k, v, pool, qparams, block_tables, inv_freq, b, first, q0, start, n, g, stride_kn,
                         stride_vn, bt_stride, table_width, ROPE, ROT, INTERLEAVED, ATTN_SCALE, H, D, BS, NUM_BLOCKS,
                         WK, S_TOK, S_HEAD, P_TOK, P_HEAD, STRIDE_KH, STRIDE_VH, BLOCK_H, BLOCK_D2, LIBDEVICE, BS)
        tl.debug_barrier()  # the first block's reads of the second's key plane end before any thread writes it
    for s in range(1 + c, n_blk, n_progs):
        _write_block(k, v, pool, qparams, block_tables, inv_freq, b, first + s, q0, start, n, g, stride_kn,
                     stride_vn, bt_stride, table_width, ROPE, ROT, INTERLEAVED, ATTN_SCALE, H, D, BS, NUM_BLOCKS, WK,
                     S_TOK, S_HEAD, P_TOK, P_HEAD, STRIDE_KH, STRIDE_VH, BLOCK_H, BLOCK_D2, LIBDEVICE, BS)


@kernel(ints=("sk_b", "sk_h", "sk_s", "sv_b", "sv_h", "sv_s", "bt_stride", "table_width", "s_out"))
def _int4b_gather_kernel(
    k_out, v_out,  # model dtype [B, H, S_out, D] (head_dim contiguous)
    pool, qparams, block_tables, k_lens,
    sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, bt_stride, table_width, s_out,
    MODE: tl.constexpr,  # 0: kv_lens [B], 1: cu_k_lens [B + 1]
    H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, NUM_BLOCKS: tl.constexpr, WK: tl.constexpr,
    S_TOK: tl.constexpr, S_HEAD: tl.constexpr, P_TOK: tl.constexpr, P_HEAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    # grid (cdiv(S_out, BS), B): block bi of sequence b, every head; tokens past the sequence (or in blocks outside
    # the pool, or in a partial block without its next block) are written as zeros
    bi = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    if MODE == BY_KV_LENS:
        total = tl.load(k_lens + b).to(tl.int64)
    else:
        total = (tl.load(k_lens + b + 1) - tl.load(k_lens + b)).to(tl.int64)
    HALF: tl.constexpr = D // 2
    S_KV: tl.constexpr = BS * H * HALF
    P_BLK: tl.constexpr = BS * H * (2 + WK)
    blk = tl.load(block_tables + b * bt_stride + bi, mask=bi < table_width, other=-1).to(tl.int64)
    nxt = tl.load(block_tables + b * bt_stride + bi + 1, mask=bi + 1 < table_width, other=-1).to(tl.int64)
    n = tl.minimum(total - bi * BS, BS)  # tokens of the sequence in this block
    full = n == BS
    ok_blk = (blk >= 0) & (blk < NUM_BLOCKS) & (full | ((nxt >= 0) & (nxt < NUM_BLOCKS)))
    blk = tl.where(ok_blk, blk, 0)
    nxt = tl.where((nxt >= 0) & (nxt < NUM_BLOCKS), nxt, 0)
    tt = tl.arange(0, BS)[:, None, None]
    hh = tl.arange(0, BLOCK_H)[None, :, None]
    dd = tl.arange(0, BLOCK_D2)[None, None, :]
    lane = (hh < H) & (dd < HALF)
    t = bi * BS + tt
    # (x * 0 + ...) makes the scalar a vector: triton's interpreter rejects vector & scalar masks
    okv = (hh * 0 + ok_blk.to(tl.int32)) != 0
    live = (tt < n) & okv  # [BS, H, 1]
    out_ok = lane & (t < s_out)
    kplane = pool + blk * (2 * S_KV) + tt * S_TOK + hh * S_HEAD + dd
    pbase = blk * P_BLK + hh * P_HEAD
    if full:
        raw = tl.load(kplane, mask=lane & live, other=0).to(tl.int32)
        s_lo, z_lo = channel_scale_zero(qparams, pbase, dd, D, WK, P_TOK, lane & okv)
        s_hi, z_hi = channel_scale_zero(qparams, pbase, HALF + dd, D, WK, P_TOK, lane & okv)
        k_lo = _mul_add((raw & 15).to(tl.float32), s_lo.to(tl.float32), z_lo.to(tl.float32), LIBDEVICE)
        k_hi = _mul_add(((raw >> 4) & 15).to(tl.float32), s_hi.to(tl.float32), z_hi.to(tl.float32), LIBDEVICE)
    else:
        q_lo = tl.load(kplane, mask=lane & live, other=0).to(tl.float32)
        q_hi = tl.load(pool + nxt * (2 * S_KV) + tt * S_TOK + hh * S_HEAD + dd, mask=lane & live, other=0)
        rs, rz = row_scale_zero(qparams, pbase, tt, WK, P_TOK, (hh < H) & live)
        k_lo = _mul_add(q_lo, rs, rz, LIBDEVICE)
        k_hi = _mul_add(q_hi.to(tl.float32), rs, rz, LIBDEVICE)
    k_lo = tl.where(live, k_lo, 0.0)
    k_hi = tl.where(live, k_hi, 0.0)
    kdst = k_out + b * sk_b + t * sk_s + hh * sk_h + dd
    tl.store(kdst, k_lo.to(k_out.dtype.element_ty), mask=out_ok)
    tl.store(kdst + HALF, k_hi.to(k_out.dtype.element_ty), mask=out_ok)
    raw = tl.load(kplane + S_KV, mask=lane & live, other=0).to(tl.int32)
    vs = tl.load(qparams + blk * P_BLK + tt * P_TOK + hh * P_HEAD, mask=(hh < H) & live, other=0.0)
    vz = tl.load(qparams + blk * P_BLK + tt * P_TOK + hh * P_HEAD + 1, mask=(hh < H) & live, other=0.0)
    v_lo = tl.where(live, _mul_add((raw & 15).to(tl.float32), vs, vz, LIBDEVICE), 0.0)
    v_hi = tl.where(live, _mul_add(((raw >> 4) & 15).to(tl.float32), vs, vz, LIBDEVICE), 0.0)
    vdst = v_out + b * sv_b + t * sv_s + hh * sv_h + dd
    tl.store(vdst, v_lo.to(v_out.dtype.element_ty), mask=out_ok)
    tl.store(vdst + HALF, v_hi.to(v_out.dtype.element_ty), mask=out_ok)
