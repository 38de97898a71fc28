"""int4b key tiles of the attention kernel: a full block's int4 codes with its channels' fp16 (scale, zero), the
partial last block's int8 rows (halves in its own and in the next block's key plane, a float32 (scale, zero) per
row); the byte format of :mod:`kvcache.ops.paged.block_keys`.

Full blocks are dequantized per element, ``code * scale + zero`` with the block's per-channel pair spread over its
keys: float16 operands (float16 queries, and bfloat16 decode queries rescaled to float16) in one inline-PTX call per
four bytes, the codes made exact by the magic-number rule then one packed ``fma.rn.f16x2`` (a single rounding of the
exact product and sum); bfloat16 prefill and float32 in float32, one rounding to the operand. The partial block's
int8 rows: on decode tiles (``FOLD``) as their exact codes, with each row's (scale, zero) returned for the scores
(``s = scale * (q . codes) + zero * sum(q)``, as int8's decode tiles); on prefill tiles dequantized in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._convert import _SUB_F16, _u4_pairs, codes_f32, codes_to

# int4 byte rows ($4) -> exact float16 codes (low nibbles $0, $1; high $2, $3) -> c * scale + zero, the low nibbles'
# (scale, zero) pairs in $5, $6 / $7, $8 and the high nibbles' in $9, $10 / $11, $12
_DQ4B_F16 = tl.constexpr("{\n.reg .b32 t, u, m, k;\n" + _u4_pairs("0x64646464", "0x64006400", _SUB_F16)
                         + "fma.rn.f16x2 $0, $0, $5, $7;\nfma.rn.f16x2 $1, $1, $6, $8;\n"
                         "fma.rn.f16x2 $2, $2, $9, $11;\nfma.rn.f16x2 $3, $3, $10, $12;\n}")


@triton.jit
def _pairs(qparams, word_off, mask):
    # (scale, zero) float16 from fp16 pairs packed in float32 words (scale in the low half)
    w = tl.load(qparams + word_off, mask=mask, other=0.0).to(tl.int32, bitcast=True)
    s = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    z = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True)
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
def _dequant(raw, s_lo, z_lo, s_hi, z_hi, DT: tl.constexpr, INTERP: tl.constexpr):
    # codes * scale + zero of both halves (low / high nibbles of the byte rows) as DT, one rounding
    if DT == tl.float16 and not INTERP:
        k_lo, k_hi = tl.inline_asm_elementwise(_DQ4B_F16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                                               [raw, s_lo, z_lo, s_hi, z_hi], dtype=(tl.float16, tl.float16),
                                               is_pure=False, pack=4)
    else:
        k_lo = (codes_f32(raw & 15) * s_lo.to(tl.float32) + z_lo.to(tl.float32)).to(DT)
        k_hi = (codes_f32(raw >> 4) * s_hi.to(tl.float32) + z_hi.to(tl.float32)).to(DT)
    return k_lo, k_hi


@triton.jit
def block_key_tile(raw, t, j, ok_n, blk, tok, kvh, bt_row, j_hi, n_blocks, full_end, table_width, pool, qparams, dd,
                   ok_lo, ok_hi,
                   H1: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, S_BLK: tl.constexpr,
                   S_TOK: tl.constexpr, S_HEAD: tl.constexpr, P_BLK: tl.constexpr, P_TOK: tl.constexpr,
                   P_HEAD: tl.constexpr, WK: tl.constexpr, DT: tl.constexpr, FOLD: tl.constexpr,
                   INTERP: tl.constexpr):
    """Key halves ``[HALF_P, BLOCK_N]`` (channels down, keys across) of tile ``t`` of an int4b pool as ``DT`` (the
    dots' operand dtype): ``raw`` the int4 byte rows (uint8, as loaded for int4), keys ``j`` below ``full_end`` in
    full blocks, the rest in the partial one. A tile of whole blocks loads each block's (scale, zero) row once and
    spreads it over its keys. Returns (k_lo, k_hi, ok_n, ks, kz, kb), float32 ``[BLOCK_N]`` vectors for the scores
    after the dot: ``FOLD`` tiles take ``s * ks + sum(q) * kz`` (a partial block's rows are their codes, with their
    (scale, zero); 1, 0 elsewhere), every tile ``+ kb``. A partial block's key whose next block is past the table or
    the pool is dropped (not read; ``ok_n`` False, ``kb`` -inf, so unmasked tiles drop it too), as the torch path
    drops it."""
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
    k_lo, k_hi = _dequant(raw, s_lo, z_lo, s_hi, z_hi, DT, INTERP)
    ks = tl.full([BLOCK_N], 1.0, tl.float32)
    kz = tl.zeros([BLOCK_N], tl.float32)
    kb = tl.zeros([BLOCK_N], tl.float32)
    part = ok_n & (j >= full_end)
    if tl.max(part.to(tl.int32), 0) > 0:  # the tile reaches the partial block: its int8 rows
        has = part & (j // BS + 1 < table_width)
        nxt = tl.load(bt_row + j // BS + 1, mask=has, other=-1)
        ok8 = has & (nxt >= 0) & (nxt < n_blocks)
        ok_n = ok_n & (~part | ok8)
        kb = tl.where(part & ~ok8, float("-inf"), kb)
        nxt = tl.where(ok8, nxt, 0).to(tl.int64)
        row = tok * S_TOK + kvh * S_HEAD
        c_lo = tl.load(pool + (blk * S_BLK + row)[None, :] + dd[:, None], mask=ok8[None, :] & ok_lo[:, None],
                       other=0)
        c_hi = tl.load(pool + (nxt * S_BLK + row)[None, :] + dd[:, None], mask=ok8[None, :] & ok_hi[:, None],
                       other=0)
        pb = blk * P_BLK + kvh * P_HEAD
        rs = _word(qparams, pb, 2 * tok, WK, P_TOK, ok8)
        rz = _word(qparams, pb, 2 * tok + 1, WK, P_TOK, ok8)
        if FOLD:  # the rows' exact codes; their (scale, zero) act on the scores
            k_lo = tl.where(part[None, :], codes_to(c_lo, DT, 8), k_lo)
            k_hi = tl.where(part[None, :], codes_to(c_hi, DT, 8), k_hi)
            ks = tl.where(part, rs, ks)
            kz = tl.where(part, rz, kz)
        else:
            k_lo = tl.where(part[None, :], (c_lo.to(tl.float32) * rs[None, :] + rz[None, :]).to(DT), k_lo)
            k_hi = tl.where(part[None, :], (c_hi.to(tl.float32) * rs[None, :] + rz[None, :]).to(DT), k_hi)
    return k_lo, k_hi, ok_n, ks, kz, kb
