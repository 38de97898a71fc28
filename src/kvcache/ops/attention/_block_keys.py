"""int4b key tiles of the attention kernel: a full block's int4 codes with its channels' fp16 (scale, zero), the
partial last block's int8 rows (halves in its own and in the next block's key plane, a float32 (scale, zero) per
row); the byte format of :mod:`kvcache.ops.paged.block_keys`."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _pairs(qparams, word_off, mask):
    # (scale, zero) float32 from fp16 pairs packed in float32 words (scale in the low half)
    w = tl.load(qparams + word_off, mask=mask, other=0.0).to(tl.int32, bitcast=True)
    s = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    z = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return s, z


@triton.jit
def _word(qparams, pbase, w, WK: tl.constexpr, P_TOK: tl.constexpr, mask):
    # key-area word w of the block at pbase (slot w // WK, word 2 + w % WK)
    return tl.load(qparams + pbase + (w // WK) * P_TOK + 2 + w % WK, mask=mask, other=0.0)


@triton.jit
def _spread(x, HALF_P: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr):
    # [HALF_P, NB] per block -> [HALF_P, NB * BS] per key (the block's BS keys side by side)
    return tl.reshape(tl.broadcast_to(x[:, :, None], (HALF_P, NB, BS)), (HALF_P, NB * BS))


@triton.jit
def block_key_tile(raw, t, j, ok_n, blk, tok, kvh, bt_row, j_hi, n_blocks, full_end, table_width, pool, qparams, dd,
                   ok_lo, ok_hi,
                   H1: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, S_BLK: tl.constexpr,
                   S_TOK: tl.constexpr, S_HEAD: tl.constexpr, P_BLK: tl.constexpr, P_TOK: tl.constexpr,
                   P_HEAD: tl.constexpr, WK: tl.constexpr, DT: tl.constexpr):
    """Key halves ``[HALF_P, BLOCK_N]`` (channels down, keys across) of tile ``t`` of an int4b pool in ``DT`` (the
    dots' operand dtype; full blocks dequantized in it, the partial block's int8 rows in float32): ``raw`` the int4
    byte rows (uint8, as loaded for int4), keys ``j`` below ``full_end`` in full blocks, the rest in the partial
    one. A tile of whole blocks loads each block's (scale, zero) row once and spreads it over its keys. Returns
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
        c = dd[:, None]
        s_lo, z_lo = _pairs(qparams, pbase + (c // WK) * P_TOK + 2 + c % WK, ok_b[None, :] & ok_lo[:, None])
        c = H1 + dd[:, None]
        s_hi, z_hi = _pairs(qparams, pbase + (c // WK) * P_TOK + 2 + c % WK, ok_b[None, :] & ok_hi[:, None])
        s_lo = _spread(s_lo, HALF_P, NB, BS)
        z_lo = _spread(z_lo, HALF_P, NB, BS)
        s_hi = _spread(s_hi, HALF_P, NB, BS)
        z_hi = _spread(z_hi, HALF_P, NB, BS)
    else:
        pbase = blk[None, :] * P_BLK + kvh * P_HEAD  # [1, N]
        c = dd[:, None]
        s_lo, z_lo = _pairs(qparams, pbase + (c // WK) * P_TOK + 2 + c % WK, ok_n[None, :] & ok_lo[:, None])
        c = H1 + dd[:, None]
        s_hi, z_hi = _pairs(qparams, pbase + (c // WK) * P_TOK + 2 + c % WK, ok_n[None, :] & ok_hi[:, None])
    # float16 operands: the products in float16 (codes and the stored fp16 scales exact); bfloat16: in float32, one
    # rounding to the operand (bfloat16 would round the scale and then the product)
    if DT == tl.float16:
        MATH: tl.constexpr = tl.float16
    else:
        MATH: tl.constexpr = tl.float32
    k_lo = ((raw & 15).to(MATH) * s_lo.to(MATH) + z_lo.to(MATH)).to(DT)
    k_hi = ((raw >> 4).to(MATH) * s_hi.to(MATH) + z_hi.to(MATH)).to(DT)
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
        rs = _word(qparams, pb, 2 * tok, WK, P_TOK, ok8)
        rz = _word(qparams, pb, 2 * tok + 1, WK, P_TOK, ok8)
        k_lo = tl.where(part[None, :], (q_lo * rs[None, :] + rz[None, :]).to(DT), k_lo)
        k_hi = tl.where(part[None, :], (q_hi * rs[None, :] + rz[None, :]).to(DT), k_hi)
    return k_lo, k_hi, ok_n
