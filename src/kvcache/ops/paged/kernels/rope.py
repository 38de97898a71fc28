"""RoPE inside the kernels: pairing of elements, rotation of a row, cos / sin of a position."""

from __future__ import annotations

import triton
import triton.language as tl

from .numerics import _SINCOS_MAX, _sincos, _sincos_full


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



@triton.jit
def _rotate(x, xp, f, first, in_rot, pos_f, attn_scale, LIBDEVICE: tl.constexpr):
    # x * cos + rotate_half(x) * sin, as transformers: cos / sin of (position * inv_freq) in float32 (one
    # [1, BLOCK] row of them per token, shared by every head), scaled by attention_scaling
    c, sn = _sincos_full(pos_f * f, LIBDEVICE)  # accurate, full range reduction
    c = c * attn_scale
    sn = sn * attn_scale
    return tl.where(in_rot, x * c + xp * tl.where(first, -sn, sn), x)



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

