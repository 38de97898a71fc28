"""Loads of K / V tiles and of their (scale, zero) pairs (any rank: the caller builds the offsets and masks of its own
tile shape), the lookup of a query tile's sequence in ``cu_q_lens``, and the constants shared by the attention
kernel's tiles."""

from __future__ import annotations

import triton
import triton.language as tl

from ._convert import codes_to, u4_to, u8_magic, u8_to

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
PV_RANGE = tl.constexpr(32768.0)  # int8 / int4 decode tiles: the largest P operand of PV (_kernel's docstring)


@triton.jit
def _key_rows(j, j_hi, b, bt_row, n_blocks, kvh, BS: tl.constexpr, S_BLK: tl.constexpr, S_TOK: tl.constexpr,
              S_HEAD: tl.constexpr, LINEAR: tl.constexpr):
    """Where the keys ``j`` (any shape) of a tile live: (ok_n, block id as int64, token in the block, element
    offset of the key row of head ``kvh``). ``ok_n``: below the tile's bound ``j_hi`` and, paged, a block id inside
    the pool (a key that fails it is never read). Linear caches: block ``b`` holds sequence ``b``."""
    ok_n = j < j_hi
    if LINEAR:
        blk = b.to(tl.int64) + j * 0
        tok = j
    else:
        blk = tl.load(bt_row + j // BS, mask=ok_n, other=0)
        ok_n = ok_n & (blk >= 0) & (blk < n_blocks)
        blk = blk.to(tl.int64)
        tok = j % BS
    return ok_n, blk, tok, blk * S_BLK + tok * S_TOK + kvh * S_HEAD


@triton.jit
def _load_kv(pool, off, m_lo, m_hi, HI: tl.constexpr, QUANT: tl.constexpr, DT: tl.constexpr, RAW: tl.constexpr,
             INTERP: tl.constexpr, MAGIC: tl.constexpr):
    """The two halves of K or V rows: elements ``[0, H1)`` at ``pool + off`` (mask ``m_lo``) and ``[H1, D)`` at
    ``pool + off + HI`` (mask ``m_hi``; ``HI`` is ``H1``, or a plane's stride for k8v4 keys, whose second half is the
    next plane; int4: the high nibbles of the same bytes). ``QUANT``: the format of these rows (k8v4 keys: 2,
    values: 3; fp8k keys: 5, values: 1).

    ``RAW``: as stored (16-bit values, fp8 values, int8 codes as uint8, int4 byte rows as uint8 twice); the caller
    converts at the dot (prefill tiles dequantize int8 / int4 there). Else (int8 / int4 decode tiles only) the
    codes as exact ``DT`` values, by the inline-PTX form of :mod:`._convert` when compiled; with ``MAGIC`` (int8,
    float16 ``DT``) as float16 magic numbers with their offset left in (``u8_magic``: 1024 + c), which the caller
    removes after the dots.

    int4: one load of the byte row; the low nibbles are the first half, the high nibbles the second. fp8 pools
    arrive as their bytes (uint8), so masked lanes read as +0.0 (a masked load's ``other`` cannot be an fp8
    constant), then bitcast.
    """
    if QUANT == 3:
        tl.static_assert(not MAGIC, "_load_kv: int4 codes convert exactly")
        raw = tl.load(pool + off, mask=m_lo, other=0)
        if RAW:
            lo = raw
            hi = raw
        elif INTERP or DT == tl.float32:
            lo = codes_to(raw & 15, DT, 4)
            hi = codes_to(raw >> 4, DT, 4)
        else:
            lo, hi = u4_to(raw, DT)
    else:
        lo = tl.load(pool + off, mask=m_lo, other=0)
        hi = tl.load(pool + off + HI, mask=m_hi, other=0)
        if QUANT == 1 or QUANT == 5:  # fp8, fp8k
            b_lo = lo
            b_hi = hi
            lo = b_lo.to(tl.float8e4nv, bitcast=True)
            hi = b_hi.to(tl.float8e4nv, bitcast=True)
            if INTERP:  # the interpreter reads the NaN bytes 0x7F / 0xFF as +-480: decode them by hand
                lo = tl.where((b_lo & 0x7F) == 0x7F, float("nan"), lo.to(tl.float32))
                hi = tl.where((b_hi & 0x7F) == 0x7F, float("nan"), hi.to(tl.float32))
        elif QUANT == 2 and MAGIC and not RAW:
            tl.static_assert(DT == tl.float16, "_load_kv: magic numbers are float16")
            lo = u8_magic(lo, INTERP)
            hi = u8_magic(hi, INTERP)
        elif QUANT == 2 and not RAW:
            if INTERP or DT == tl.float32:
                lo = codes_to(lo, DT, 8)
                hi = codes_to(hi, DT, 8)
            else:
                lo = u8_to(lo, DT)
                hi = u8_to(hi, DT)
    return lo, hi


@triton.jit
def _softcapped(s, qk_scale, SOFTCAP: tl.constexpr):
    # softcap * tanh(s * scale) in base 2 (times log2(e)): tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both saturations
    return (1.0 - 2.0 / (tl.exp2((s * qk_scale) * (2.0 * LOG2E)) + 1.0)) * (SOFTCAP * LOG2E)


@triton.jit
def _load_params(qparams, pbase, ok_n):
    """(scale, zero) of each token of a tile (``pbase`` of any shape): one 8-byte load per token, split in
    registers."""
    par = tl.load(qparams + tl.expand_dims(pbase, -1) + tl.arange(0, 2), mask=tl.expand_dims(ok_n, -1), other=0.0)
    return tl.split(par)


@triton.jit
def _search_tile(pid, cu_q, n_seqs, BLOCK_Q: tl.constexpr, LOG_B: tl.constexpr):
    """(b, cu_q[b], rows of b) for the last ``b`` with ``cu_q[b] // BLOCK_Q + b <= pid``, by a binary search."""
    lo = pid * 0
    hi = lo + n_seqs
    for _ in tl.static_range(LOG_B):
        mid = (lo + hi) // 2
        start = tl.load(cu_q + mid) // BLOCK_Q + mid
        take = start <= pid
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid)
    row0 = tl.load(cu_q + lo)
    return lo, row0, tl.load(cu_q + lo + 1) - row0


@triton.jit
def _find_tile(pid, cu_q, n_seqs, BLOCK_Q: tl.constexpr, LOG_B: tl.constexpr, GUESS: tl.constexpr):
    """Sequence ``b`` of query tile ``pid``, its first row ``cu_q[b]`` and its number of rows. Sequence ``b`` owns
    tiles ``cu_q[b] // BLOCK_Q + b`` .. ``cu_q[b + 1] // BLOCK_Q + b`` (one more than it needs at most), so the grid
    ``n_rows // BLOCK_Q + B`` covers every split of ``n_rows`` rows into sequences (fixed at CUDA-graph capture).
    ``GUESS`` (decode tiles): first the sequence the tile has when every sequence holds one row (tiles start at
    ``b + b // BLOCK_Q``), checked against cu_q's two entries that the tile reads anyway, then the one before it
    (a spare tile, one more load); the binary search only where both checks fail (other batches)."""
    if GUESS:
        g = tl.minimum(pid - pid // (BLOCK_Q + 1), n_seqs - 1)
        c0 = tl.load(cu_q + g)
        c1 = tl.load(cu_q + g + 1)
        if (c0 // BLOCK_Q + g <= pid) & (pid <= c1 // BLOCK_Q + g):
            b = g
            row0 = c0
            q_len = c1 - c0
        else:
            gm = tl.maximum(g - 1, 0)
            cm = tl.load(cu_q + gm)
            if (cm // BLOCK_Q + gm <= pid) & (pid <= c0 // BLOCK_Q + gm):
                b = gm
                row0 = cm
                q_len = c0 - cm
            else:
                b, row0, q_len = _search_tile(pid, cu_q, n_seqs, BLOCK_Q, LOG_B)
    else:
        b, row0, q_len = _search_tile(pid, cu_q, n_seqs, BLOCK_Q, LOG_B)
    return b, row0, q_len
