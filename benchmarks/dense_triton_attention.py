"""What Triton itself reaches for dense causal prefill attention on contiguous K/V (no paging), and with which
kernel structure.

The work is the attention bench's prefill: 8 sequences x 2048 new tokens after 0 or 4096 cached ones, 32 query
heads over 8 kv heads (GQA), head_dim 128, fp16 (``--dtype bf16``). One ``@triton.jit`` kernel; its variants are
constexprs and launch options:

* tiles ``BLOCK_M`` x ``BLOCK_N``, ``num_warps``, ``num_stages``; tiles through plain pointer loads;
* ``pack``: GQA packing, a program's M rows are ``BLOCK_M // G`` tokens x the G query heads of one kv head, so each
  K/V tile feeds G heads: ``pack`` row m = token m // G, head m % G; ``pack-hm`` row m = head m // (BLOCK_M // G),
  token m % (BLOCK_M // G) (one 3-D box of Q). Otherwise one query head per program;
* ``pipe``: next-QK-first software pipelining: iteration t issues ``S_{t+1} = Q K_{t+1}^T`` before the softmax
  of ``S_t`` and ``acc += P_t V_t`` (Hopper wgmma is asynchronous and Triton waits for a dot only at the first
  use of its result, so the next tile's MMA can overlap the exponentials); the last tile is peeled;
* ``tma``: Q, K and V tiles through tensor descriptors (Q of ``pack`` through pointers: its rows are no box), made
  in the kernel (``tma-dev``: ``tl.make_tensor_descriptor``, scratch from ``triton.set_allocator``) or on the
  host (``tma-host``: ``triton.tools.tensor_descriptor.TensorDescriptor``);
* ``1loop``: one KV loop that masks every tile; ``ws``: that loop as ``tl.range(..., warp_specialize=True)``.
  Triton 3.6 specializes Hopper loops only in that form: one loop in the kernel, all tiles (Q too) from
  descriptors, 4 warps (it adds a producer warpgroup, two consumer warpgroups split M: 12 warps). Host descriptors
  deadlock there and M128 N64 at 3 stages returns NaN, so the list holds in-kernel descriptors only and marks the
  NaN row WRONG;
* ``natural``: query tiles launched in order; the others launch the heaviest (last) tiles first.

Causal rule: query row i sits at position ``S_kv - S_q + i`` and sees the keys at positions <= its own. KV tiles
wholly below a query tile's first row run without a mask; only the tiles that cross the diagonal are masked.

    python benchmarks/dense_triton_attention.py --check           # CPU, Triton interpreter, small shapes
    python benchmarks/dense_triton_attention.py --compile-sm90    # CPU, compile every GPU variant for sm_90
    python benchmarks/dense_triton_attention.py --out dense.json  # GPU: check against SDPA, then time

GPU timings are ``triton.testing.do_bench`` medians (L2 flushed between calls); FLOPs are the bench's
``4 * D * Hq * B * (S_q * cached + S_q * (S_q + 1) / 2)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable

if "--check" in sys.argv:  # the interpreter is chosen when triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
TMA_KINDS = {"none": 0, "dev": 1, "host": 2}


@triton.jit
def _load_kv(ptr, desc, row0, n0, S_KV, offs_n, offs_d, D: tl.constexpr, TMA: tl.constexpr, MASK: tl.constexpr):
    """The [BLOCK_N, D] tile of keys (or values) n0.. of one kv head; ``row0`` is the head's first row in the
    flattened [B * Hkv * S_kv, D] tensor. Descriptor rows past S_kv belong to the next head (or are zero past the
    tensor): they are always masked out by the causal rule, so only pointer loads need the bound."""
    if TMA > 0:
        return desc.load([row0 + n0, 0])
    else:
        ptrs = ptr + (n0 + offs_n)[:, None] * D + offs_d[None, :]
        if MASK:
            return tl.load(ptrs, mask=(n0 + offs_n)[:, None] < S_KV, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _softmax_step(s, v, acc, m_i, l_i, qk_scale, pos, n0, offs_n, MASKED: tl.constexpr):
    """One online-softmax step in base 2 on raw scores ``s`` (``qk_scale`` holds log2(e) / sqrt(D)); a masked
    step drops the keys after each row's position ``pos``."""
    if MASKED:
        s = tl.where((n0 + offs_n)[None, :] <= pos[:, None], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _attn_fwd(Q, K, V, Out, Q_desc, K_desc, V_desc, qk_scale, S_Q, S_KV, KV_ROWS,
              HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              PACK: tl.constexpr, PIPE: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr, ONE_LOOP: tl.constexpr,
              REV: tl.constexpr, EVEN_Q: tl.constexpr, EVEN_KV: tl.constexpr):
    """Grid (B * heads, query tiles): heads are Hkv when PACK > 0 (G query heads per program), else Hq.
    PACK 1: row m = token m // G, head m % G; PACK 2: row m = head m // TOK, token m % TOK. With TMA > 0, Q goes
    through a descriptor too (PACK 0: 2-D, PACK 2: 3-D [B * Hq, S_q, D]; PACK 1 rows are no box: pointers);
    Q_desc / K_desc / V_desc are the host descriptors when TMA == 2, otherwise unused copies of Q / K / V.
    ONE_LOOP: a single KV loop masking every tile (the form Hopper warp specialization accepts)."""
    G: tl.constexpr = HQ // HKV
    TOK: tl.constexpr = BLOCK_M // G if PACK > 0 else BLOCK_M  # query tokens per program
    pid_bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1) if REV else tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    t0 = pid_m * TOK
    if PACK > 0:
        b = pid_bh // HKV
        kvh = pid_bh % HKV
        if PACK == 1:
            tok = t0 + rows // G
            head = kvh * G + rows % G
        else:
            tok = t0 + rows % TOK
            head = kvh * G + rows // TOK
    else:
        b = pid_bh // HQ
        kvh = (pid_bh % HQ) // G
        tok = t0 + rows
        head = pid_bh % HQ
    q_rows = ((b * HQ + head).to(tl.int64) * S_Q + tok) * D
    if TMA > 0 and PACK != 1:
        # descriptor rows past S_q (2-D: the next head's) only feed rows that are never stored
        if PACK == 0:
            if TMA == 1:
                qd = tl.make_tensor_descriptor(Q, shape=[tl.num_programs(0) * S_Q, D], strides=[D, 1],
                                               block_shape=[BLOCK_M, D])
            else:
                qd = Q_desc
            q = qd.load([pid_bh * S_Q + t0, 0])
        else:
            if TMA == 1:
                qd = tl.make_tensor_descriptor(Q, shape=[tl.num_programs(0) * G, S_Q, D], strides=[S_Q * D, D, 1],
                                               block_shape=[G, TOK, D])
            else:
                qd = Q_desc
            q = qd.load([pid_bh * G, t0, 0]).reshape(BLOCK_M, D)
    else:
        q_ptrs = Q + q_rows[:, None] + offs_d[None, :]
        if EVEN_Q:
            q = tl.load(q_ptrs)
        else:
            q = tl.load(q_ptrs, mask=(tok < S_Q)[:, None], other=0.0)

    row0 = (b * HKV + kvh) * S_KV
    k_ptr = K + row0.to(tl.int64) * D
    v_ptr = V + row0.to(tl.int64) * D
    if TMA == 1:
        k_desc = tl.make_tensor_descriptor(K, shape=[KV_ROWS, D], strides=[D, 1], block_shape=[BLOCK_N, D])
        v_desc = tl.make_tensor_descriptor(V, shape=[KV_ROWS, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    else:
        k_desc = K_desc
        v_desc = V_desc

    cached = S_KV - S_Q
    pos = cached + tok
    n_full = (cached + t0 + 1) // BLOCK_N  # tiles every row of this program sees whole
    n_end = tl.cdiv(cached + tl.minimum(t0 + TOK, S_Q), BLOCK_N)  # tiles any row sees
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)

    if PIPE:
        # S for tile t + 1 is issued before tile t's softmax; the last tile (masked: correct whatever it holds)
        # is peeled so no iteration loads past n_end.
        n_last = n_end - 1
        n_a = tl.minimum(n_full, n_last)
        k = _load_kv(k_ptr, k_desc, row0, 0, S_KV, offs_n, offs_d, D, TMA, not EVEN_KV)
        s = tl.dot(q, k.T)
        for n in tl.range(0, n_a, warp_specialize=WS):
            n0 = tl.multiple_of(n * BLOCK_N, BLOCK_N)
            k = _load_kv(k_ptr, k_desc, row0, n0 + BLOCK_N, S_KV, offs_n, offs_d, D, TMA, not EVEN_KV)
            s_next = tl.dot(q, k.T)
            v = _load_kv(v_ptr, v_desc, row0, n0, S_KV, offs_n, offs_d, D, TMA, False)
            acc, m_i, l_i = _softmax_step(s, v, acc, m_i, l_i, qk_scale, pos, n0, offs_n, False)
            s = s_next
        for n in tl.range(n_a, n_last, warp_specialize=WS):
            n0 = tl.multiple_of(n * BLOCK_N, BLOCK_N)
            k = _load_kv(k_ptr, k_desc, row0, n0 + BLOCK_N, S_KV, offs_n, offs_d, D, TMA, not EVEN_KV)
            s_next = tl.dot(q, k.T)
            v = _load_kv(v_ptr, v_desc, row0, n0, S_KV, offs_n, offs_d, D, TMA, not EVEN_KV)
            acc, m_i, l_i = _softmax_step(s, v, acc, m_i, l_i, qk_scale, pos, n0, offs_n, True)
            s = s_next
        n0 = n_last * BLOCK_N
        v = _load_kv(v_ptr, v_desc, row0, n0, S_KV, offs_n, offs_d, D, TMA, not EVEN_KV)
        acc, m_i, l_i = _softmax_step(s, v, acc, m_i, l_i, qk_scale, pos, n0, offs_n, True)
    else:
        n_lo = 0 if ONE_LOOP else n_full
        if not ONE_LOOP:
            for n in tl.range(0, n_full, warp_specialize=WS):
                n0 = tl.multiple_of(n * BLOCK_N, BLOCK_N)
                k = _load_kv(k_ptr, k_desc, row0, n0, S_KV, offs_n, offs_d, D, TMA, False)
                s = tl.dot(q, k.T)
                v = _load_kv(v_ptr, v_desc, row0, n0, S_KV, offs_n, offs_d, D, TMA, False)
                acc, m_i, l_i = _softmax_step(s, v, acc, m_i, l_i, qk_scale, pos, n0, offs_n, False)
        for n in tl.range(n_lo, n_end, warp_specialize=WS):
            n0 = tl.multiple_of(n * BLOCK_N, BLOCK_N)
            k = _load_kv(k_ptr, k_desc, row0, n0, S_KV, offs_n, offs_d, D, TMA, not EVEN_KV)
            s = tl.dot(q, k.T)
            v = _load_kv(v_ptr, v_desc, row0, n0, S_KV, offs_n, offs_d, D, TMA, not EVEN_KV)
            acc, m_i, l_i = _softmax_step(s, v, acc, m_i, l_i, qk_scale, pos, n0, offs_n, True)

    out = (acc / l_i[:, None]).to(Out.dtype.element_ty)
    o_ptrs = Out + q_rows[:, None] + offs_d[None, :]
    if EVEN_Q:
        tl.store(o_ptrs, out)
    else:
        tl.store(o_ptrs, out, mask=(tok < S_Q)[:, None])


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel structure and launch configuration."""

    name: str
    block_m: int
    block_n: int
    warps: int
    stages: int
    pack: int = 0  # 0: one q head per program; 1: rows token-major (token m // G); 2: head-major (head m // TOK)
    pipe: bool = False
    tma: str = "none"  # none | dev | host
    ws: bool = False
    one_loop: bool = False
    rev: bool = True

    def config(self) -> str:
        return f"M{self.block_m} N{self.block_n} w{self.warps} s{self.stages}"


def _grid_variants() -> list[Variant]:
    """The GPU list: the tutorial's Hopper tiles for the plain kernel, each structural variant at its likely
    best couple of configurations. At M 128 x D 128, 4 warps hold a 128-register fp32 accumulator per thread and
    spill (``--compile-sm90`` shows it); 8 warps do not. ``1loop-tma-dev`` is the baseline of ``ws``."""
    v = [Variant("plain", 128, 64, 4, s) for s in (2, 3)] + [Variant("plain", 128, 64, 8, s) for s in (2, 3, 4)]
    v += [Variant("plain", 128, 128, 8, s) for s in (2, 3)] + [Variant("plain", 64, 64, 4, 3)]
    v += [Variant("plain-natural", 128, 64, 8, 3, rev=False)]
    v += [Variant("pack", 128, 64, 4, 2, pack=1), Variant("pack", 128, 64, 8, 3, pack=1)]
    v += [Variant("pack", 64, 64, 4, 3, pack=1), Variant("pack-hm", 128, 64, 8, 3, pack=2)]
    v += [Variant("pipe", 128, 64, 4, 2, pipe=True), Variant("pipe", 128, 64, 8, 3, pipe=True)]
    v += [Variant("pipe", 128, 128, 8, 2, pipe=True), Variant("pack-pipe", 128, 64, 8, 3, pack=1, pipe=True)]
    v += [Variant("tma-dev", 128, 64, 8, 3, tma="dev"), Variant("tma-dev", 128, 128, 8, 3, tma="dev")]
    v += [Variant("tma-host", 128, 64, 8, s, tma="host") for s in (2, 3)]
    v += [Variant("tma-host", 128, 128, 8, s, tma="host") for s in (2, 3)]
    v += [Variant("pack-hm-tma-host", 128, 64, 8, 3, pack=2, tma="host"),
          Variant("pipe-tma-host", 128, 64, 8, 3, pipe=True, tma="host"),
          Variant("pipe-tma-host", 128, 128, 8, 2, pipe=True, tma="host")]
    v += [Variant("1loop-tma-dev", 128, 64, 8, 3, tma="dev", one_loop=True),
          Variant("1loop-tma-dev", 128, 128, 8, 2, tma="dev", one_loop=True)]
    v += [Variant("ws-tma-dev", 128, 64, 4, s, tma="dev", ws=True, one_loop=True) for s in (2, 3)]
    v += [Variant("ws-tma-dev", 128, 128, 4, 2, tma="dev", ws=True, one_loop=True)]
    return v


def _check_variants() -> list[Variant]:
    """Small tiles for the interpreter: every structure and launch order. The interpreter ignores
    ``warp_specialize`` (a compiler transform), so ``ws`` rows check the single-loop code it runs on."""
    out = []
    for bm, bn in ((16, 16), (32, 16), (16, 32)):
        for pack, pipe, one_loop, tma in itertools.product((0, 1, 2), (False, True), (False, True), TMA_KINDS):
            if pipe and one_loop:
                continue
            ws = one_loop and tma != "none"
            parts = [["", "pack", "pack-hm"][pack], "pipe" * pipe, ("ws" if ws else "1loop") * one_loop,
                     f"tma-{tma}" * (tma != "none"), "natural" * (bm == 32)]
            out.append(Variant("-".join(x for x in parts if x) or "plain", bm, bn, 4, 2, pack=pack, pipe=pipe,
                               tma=tma, ws=ws, one_loop=one_loop, rev=bm != 32))
    return out


def _host_desc(x: torch.Tensor, shape: list[int], block: list[int]):  # type: ignore[no-untyped-def]
    from triton.tools.tensor_descriptor import TensorDescriptor

    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    return TensorDescriptor(x, shape=shape, strides=strides, block_shape=block)


def _q_block(var: Variant, g: int, d: int) -> list[int]:
    return [g, var.block_m // g, d] if var.pack == 2 else [var.block_m, d]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, var: Variant) -> Callable[[], torch.Tensor]:
    """A launcher of ``var`` on q [B, Hq, S_q, D], k / v [B, Hkv, S_kv, D] (contiguous); it returns ``out``."""
    b, hq, s_q, d = q.shape
    hkv, s_kv = k.shape[1], k.shape[2]
    g = hq // hkv
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and hq % hkv == 0 and s_kv >= s_q
    assert not var.pack or var.block_m % g == 0
    tok = var.block_m // g if var.pack else var.block_m
    out = torch.empty_like(q)
    qd, kd, vd = q, k, v
    if var.tma == "host":
        kd, vd = (_host_desc(x, [b * hkv * s_kv, d], [var.block_n, d]) for x in (k, v))
        if var.pack == 2:
            qd = _host_desc(q, [b * hq, s_q, d], _q_block(var, g, d))
        elif var.pack == 0:
            qd = _host_desc(q, [b * hq * s_q, d], _q_block(var, g, d))
    grid = (b * (hkv if var.pack else hq), triton.cdiv(s_q, tok))
    scale = LOG2E / math.sqrt(d)

    def run() -> torch.Tensor:
        _attn_fwd[grid](q, k, v, out, qd, kd, vd, scale, s_q, s_kv, b * hkv * s_kv, HQ=hq, HKV=hkv, D=d,
                        BLOCK_M=var.block_m, BLOCK_N=var.block_n, PACK=var.pack, PIPE=var.pipe,
                        TMA=TMA_KINDS[var.tma], WS=var.ws, ONE_LOOP=var.one_loop, REV=var.rev,
                        EVEN_Q=s_q % tok == 0, EVEN_KV=s_kv % var.block_n == 0, num_warps=var.warps,
                        num_stages=var.stages)
        return out

    return run


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 attention with an explicit causal mask (row i at position S_kv - S_q + i)."""
    g = q.shape[1] // k.shape[1]
    s_q, s_kv = q.shape[2], k.shape[2]
    kf, vf = (x.float().repeat_interleave(g, dim=1) for x in (k, v))
    s = q.float() @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    keep = torch.arange(s_kv)[None, :] <= (s_kv - s_q + torch.arange(s_q))[:, None]
    return torch.softmax(s.masked_fill(~keep.to(s.device), float("-inf")), dim=-1) @ vf


def _alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def check() -> int:
    """Every variant on small shapes through the interpreter, fp16 against the float32 reference."""
    triton.set_allocator(_alloc)
    torch.manual_seed(0)
    fails = 0
    for b, hq, hkv, s_q, s_kv, d in ((2, 4, 2, 40, 40, 64), (2, 4, 2, 24, 88, 64), (1, 8, 2, 33, 47, 32)):
        q = torch.randn(b, hq, s_q, d).half()
        k, v = (torch.randn(b, hkv, s_kv, d).half() for _ in range(2))
        ref = reference(q, k, v)
        for var in _check_variants():
            if var.pack and var.block_m % (hq // hkv):
                continue
            label = f"B{b} Hq{hq} Hkv{hkv} S_q{s_q} S_kv{s_kv} D{d} {var.name:<18} {var.config()}"
            try:
                err = (attention(q, k, v, var)().float() - ref).abs().max().item()
            except Exception as e:  # noqa: BLE001 - an unsupported variant is reported, the rest still run
                print(f"skip {label}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            ok = err < 2e-2
            fails += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {label} max err {err:.2e}", flush=True)
    print("all checked variants pass" if not fails else f"{fails} failures")
    return 1 if fails else 0


def _resources(cubin: bytes) -> str:
    """Registers per thread, stack and local bytes (spills) of a cubin, from the cuobjdump bundled with Triton
    (without a GPU the compiled kernel's n_regs / n_spills stay unset: they are filled when it is loaded)."""
    import re
    import subprocess
    import tempfile

    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    return f"regs {m[1]} stack {m[2]} local {m[3]}" if m else "regs ?"


def compile_sm90(dtype: str) -> int:
    """Compile every GPU variant for sm_90 without a GPU (frontend, passes, ptxas) at the bench shapes."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ty = "fp16" if dtype == "fp16" else "bf16"
    names = list(inspect.signature(_attn_fwd.fn).parameters)
    fails = 0
    for var in _grid_variants():
        sig = {n: f"*{ty}" for n in ("Q", "K", "V", "Out", "Q_desc", "K_desc", "V_desc")}
        if var.tma == "host":
            sig["K_desc"] = sig["V_desc"] = f"tensordesc<{ty}[{var.block_n},128]>"
            if var.pack != 1:
                sig["Q_desc"] = f"tensordesc<{ty}[{','.join(map(str, _q_block(var, 4, 128)))}]>"
        sig.update(qk_scale="fp32", S_Q="i32", S_KV="i32", KV_ROWS="i32")
        consts = dict(HQ=32, HKV=8, D=128, BLOCK_M=var.block_m, BLOCK_N=var.block_n, PACK=var.pack,
                      PIPE=var.pipe, TMA=TMA_KINDS[var.tma], WS=var.ws, ONE_LOOP=var.one_loop, REV=var.rev,
                      EVEN_Q=True, EVEN_KV=True)
        sig.update({n: "constexpr" for n in consts})
        sig = {n: sig[n] for n in names}
        # as the launcher specialises them: pointers 16-byte aligned, the int sizes multiples of 16
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if sig[n].startswith("*") or sig[n] == "i32"}
        t = time.time()
        try:
            c = triton.compile(ASTSource(fn=_attn_fwd, signature=sig, constexprs=consts, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32), options=dict(num_warps=var.warps,
                                                                               num_stages=var.stages))
            ws = "ttg.warp_specialize" in c.asm["ttgir"]
            print(f"ok   {var.name:<18} {var.config():<20} {_resources(c.asm['cubin'])} smem {c.metadata.shared} "
                  f"warps {c.metadata.num_warps}{' specialized' if ws else ''} ({time.time() - t:.1f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failing configuration
            fails += 1
            print(f"FAIL {var.name:<18} {var.config():<20} {type(e).__name__}: {str(e)[-600:]}", flush=True)
    return 1 if fails else 0


def flops(b: int, hq: int, s_q: int, cached: int, d: int) -> float:
    return 4 * d * hq * b * (s_q * cached + s_q * (s_q + 1) / 2)


def _watchdog(seconds: float, label: str) -> threading.Timer:
    """Ends the process when one variant runs past ``seconds``: a deadlocked kernel cannot be interrupted, and the
    rows written so far are already in the JSON file."""
    def fire() -> None:
        print(f"{label}: no result after {seconds:.0f} s (deadlock?): exiting", flush=True)
        os._exit(3)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()
    return t


def bench(dtype: str, only: str | None, out_path: str | None, cached_list: list[int], limit_s: float,
          repeat: int) -> int:
    """Check every variant against SDPA, then time it, at each cached length (8 x 2048 new tokens)."""
    from triton.testing import do_bench

    triton.set_allocator(_alloc)
    dt = torch.float16 if dtype == "fp16" else torch.bfloat16
    b, hq, hkv, d, s_q = 8, 32, 8, 128, 2048
    variants = [v for v in _grid_variants() if not only or any(p in v.name for p in only.split(","))]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  {dtype}")
    rows: list[dict] = []

    def save() -> None:
        if out_path:
            with open(out_path, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), triton=triton.__version__,
                               torch=torch.__version__, dtype=dtype, rows=rows), f, indent=1)

    for cached in cached_list:
        s_kv = s_q + cached
        torch.manual_seed(0)
        q = torch.randn(b, hq, s_q, d, device="cuda", dtype=dt)
        k, v = (torch.randn(b, hkv, s_kv, d, device="cuda", dtype=dt) for _ in range(2))
        fl = flops(b, hq, s_q, cached, d)
        ke, ve = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
        if cached:  # SDPA's is_causal aligns top-left: a cached prefix needs an explicit mask
            keep = torch.arange(s_kv, device="cuda")[None, :] <= (cached + torch.arange(s_q, device="cuda"))[:, None]
            ref_fn = functools.partial(torch.nn.functional.scaled_dot_product_attention, q, ke, ve, attn_mask=keep)
            ref_name = "sdpa (bool mask)"
        else:
            ref_fn = functools.partial(torch.nn.functional.scaled_dot_product_attention, q, ke, ve, is_causal=True)
            ref_name = "sdpa (is_causal)"
        ref = ref_fn()
        ms = do_bench(ref_fn, warmup=25, rep=100, return_mode="median")
        print(f"\n== B{b} S_q {s_q} cached {cached} Hq {hq} Hkv {hkv} D {d}")
        print(f"{ref_name:<18} {'':<20} {ms * 1e3:9.1f} us {fl / ms / 1e9:7.1f} TFLOP/s", flush=True)
        rows.append(dict(cached=cached, name=ref_name, config="", us=ms * 1e3, tflops=fl / ms / 1e9, err=0.0))
        timed: list[tuple[Callable[[], torch.Tensor], dict]] = []
        for var in variants:
            row = dict(cached=cached, config=var.config(), **dataclasses.asdict(var))
            dog = _watchdog(limit_s, f"{var.name} {var.config()} cached {cached}")
            try:
                fn = attention(q, k, v, var)
                t = time.time()
                err = (fn().float() - ref.float()).abs().max().item()
                row.update(first_call_s=time.time() - t, err=err, ok=err < 2e-2)
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                row.update(us=ms * 1e3, tflops=fl / ms / 1e9, us_runs=[ms * 1e3])
                timed.append((fn, row))
                mark = "" if row["ok"] else "  WRONG"
                print(f"{var.name:<18} {var.config():<20} {ms * 1e3:9.1f} us {fl / ms / 1e9:7.1f} TFLOP/s "
                      f"err {err:.1e}{mark}", flush=True)
            except Exception as e:  # noqa: BLE001 - a variant that fails to build is reported and skipped
                row.update(error=f"{type(e).__name__}: {str(e)[-800:]}")
                print(f"{var.name:<18} {var.config():<20} ERROR {type(e).__name__}: {str(e)[-400:]}", flush=True)
            dog.cancel()
            rows.append(row)
            save()
            torch.cuda.synchronize()
        if repeat > 1:  # further passes over the whole list, so that drift hits every variant alike
            for _ in range(repeat - 1):
                for fn, row in timed:
                    row["us_runs"].append(do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3)
            print(f"-- median of {repeat} passes, fastest first (min .. max TFLOP/s)")
            for _, row in sorted(timed, key=lambda r: sorted(r[1]["us_runs"])[repeat // 2]):
                us = sorted(row["us_runs"])
                row.update(us=us[repeat // 2], tflops=fl / us[repeat // 2] / 1e6)
                print(f"{row['name']:<18} {row['config']:<20} {row['us']:9.1f} us {row['tflops']:7.1f} TFLOP/s "
                      f"({fl / us[-1] / 1e6:.0f} .. {fl / us[0] / 1e6:.0f}){'' if row['ok'] else '  WRONG'}")
            save()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="CPU interpreter correctness check, small shapes")
    ap.add_argument("--compile-sm90", action="store_true", help="compile every GPU variant for sm_90 offline")
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--variants", help="comma-separated name substrings to keep (GPU mode)")
    ap.add_argument("--out", help="write the GPU rows to this JSON file (after every variant)")
    ap.add_argument("--cached", default="0,4096", help="cached lengths before the 2048 new tokens (GPU mode)")
    ap.add_argument("--repeat", type=int, default=1, help="timing passes over the list; the median is kept")
    ap.add_argument("--limit-s", type=float, default=90.0, help="end the run when one variant takes longer")
    a = ap.parse_args()
    if a.check:
        return check()
    if a.compile_sm90:
        return compile_sm90(a.dtype)
    return bench(a.dtype, a.variants, a.out, [int(c) for c in a.cached.split(",")], a.limit_s,
                 a.repeat)


if __name__ == "__main__":
    sys.exit(main())
