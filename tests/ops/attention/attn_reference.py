"""Independent attention reference for the tests, written from the docstrings of
:func:`kvcache.ops.paged_attention` / :func:`kvcache.ops.linear_attention`, not from the library's code.

K / V come back through the public :func:`kvcache.ops.gather_paged_kv` (dequantized to float32: the values the
kernels are supposed to see), and attention is a float64 loop per (sequence, q head) with an explicit mask:
position of query row ``i`` = ``kv_len - q_len + i``; key at global position ``p`` allowed iff ``p <= pos`` and
(window ``w``) ``p > pos - w``; score ``scale * q . k``, then ``softcap * tanh(score / softcap)``; a sink is one
more softmax term ``exp(sink)`` with a zero value; ``lse = log(sum of exp terms)``, ``-inf`` when empty.

Tolerances: outputs of float16 / bfloat16 queries go through the kernels' 16-bit P (and dequantized 16-bit K /
V tiles for quantized pools) and a 16-bit output: within ``ATOL + RTOL * |ref|`` with the flash-attention
tolerances below (inputs of magnitude ~1). float32: 1e-4.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

import torch

import kvcache
from kvcache.ops import gather_paged_kv

TOL = {torch.float16: (6e-3, 6e-3), torch.bfloat16: (3e-2, 3e-2), torch.float32: (1e-4, 1e-4)}
LSE_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}


def i32(x, device) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.tensor(x, dtype=torch.int32, device=device)


def cumsum0(xs: list[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def dense_attention(q, k, v, q_pos, k_pos, *, scale, window=None, softcap=None, sinks=None):  # type: ignore[no-untyped-def]
    """q [n_q, Hq, D], k / v [n_k, H, D] (any float), positions as lists. float64 out [n_q, Hq, D], lse [n_q, Hq]."""
    n_q, hq, d = q.shape
    h = k.shape[1]
    g = hq // h
    out = torch.zeros((n_q, hq, d), dtype=torch.float64)
    lse = torch.full((n_q, hq), -math.inf, dtype=torch.float64)
    qd, kd, vd = q.double().cpu(), k.double().cpu(), v.double().cpu()
    for i in range(n_q):
        keys = [j for j, p in enumerate(k_pos) if p <= q_pos[i] and (window is None or p > q_pos[i] - window)]
        for hh in range(hq):
            kv_h = hh // g
            terms = []
            if keys:
                s = (kd[keys, kv_h] @ qd[i, hh]) * scale
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                terms.append(s)
            if sinks is not None:
                terms.append(sinks[hh].double().cpu().reshape(1))
            if not terms:
                continue
            allv = torch.cat(terms)
            m = allv.max()
            w = torch.exp(allv - m)
            tot = w.sum()
            lse[i, hh] = m + torch.log(tot)
            if keys:
                out[i, hh] = (w[: len(keys)] / tot) @ vd[keys, kv_h]
    return out, lse


@contextlib.contextmanager
def torch_backend() -> Iterator[None]:
    """Build and read back caches with the library's torch path on the CPU: the append / gather kernels have
    their own tests, and under the interpreter they would dominate these tests' time."""
    old = os.environ.get("KVCACHE_TRITON_INTERPRET")
    os.environ["KVCACHE_TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["KVCACHE_TRITON_INTERPRET"]
        else:
            os.environ["KVCACHE_TRITON_INTERPRET"] = old


def make_paged(device, *, kv_dtype, layout, H, D, bs, lens, dtype=torch.float16, num_blocks=None, seed=0,
               cp_rank=0, cp_size=1, kv=None, k_scale=1.0, v_scale=1.0, spare=0):  # type: ignore[no-untyped-def]
    """A one-layer PagedKVCache holding sequences of global lengths ``lens`` (random K / V, or ``kv``), blocks
    drawn at random. Returns (cache, block_tables, (k_list, v_list)) with K / V per sequence on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    local = [max(0, -(-(n - cp_rank) // cp_size)) for n in lens]
    need = [-(-n // bs) + spare for n in local]
    width = max(1, max(need) if need else 1)
    total = sum(need)
    nb = num_blocks or total + 3
    cfg = kvcache.PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, dtype=dtype,
                              kv_dtype=kv_dtype, layout=layout, device=device)
    cache = kvcache.PagedKVCache(cfg)
    if kv_dtype in ("fp8", "fp8k"):  # fp8k reads v_scale alone (its keys carry their own scales)
        cache.kv_scales[0, 0] = k_scale
        cache.kv_scales[0, 1] = v_scale
    perm = torch.randperm(nb, generator=gen).tolist()
    table, at = [], 0
    for n in need:
        table.append(perm[at:at + n] + [0] * (width - n))
        at += n
    bt = i32(table, device)
    if kv is None:
        ks = [torch.randn((n, H, D), generator=gen).to(dtype) for n in lens]
        vs = [torch.randn((n, H, D), generator=gen).to(dtype) for n in lens]
    else:
        ks, vs = kv
    if sum(lens):
        with torch_backend():
            plan = cache.plan(bt, i32(cumsum0(list(lens)), device), i32([0] * len(lens), device), cp_rank=cp_rank,
                              cp_size=cp_size)
            cache.append(0, torch.cat(ks).to(device), torch.cat(vs).to(device), plan)
    return cache, bt, (ks, vs)


def dequantized(cache, bt, lens, *, cp_rank=0, cp_size=1):  # type: ignore[no-untyped-def]
    """float32 K / V of each sequence's local tokens as the cache holds them, through the public gather:
    lists of [n_local, H, D] on the CPU."""
    cfg = cache.config
    kv_lens = i32(list(lens), bt.device)
    with torch_backend():
        k, v = gather_paged_kv(cache.pool(0), cache.params(0), kv_dtype=cfg.kv_dtype, layout=cfg.layout,
                               block_tables=bt, kv_lens=kv_lens, dtype=torch.float32,
                               max_len=max([max(0, -(-(n - cp_rank) // cp_size)) for n in lens] + [0]),
                               fp8_scales=cache.kv_scales[0] if cfg.kv_dtype in ("fp8", "fp8k") else None,
                               cp_rank=cp_rank, cp_size=cp_size)
    out_k, out_v = [], []
    for b, n in enumerate(lens):
        m = max(0, -(-(n - cp_rank) // cp_size))
        out_k.append(k[b, :, :m].transpose(0, 1).cpu())
        out_v.append(v[b, :, :m].transpose(0, 1).cpu())
    return out_k, out_v


def paged_expected(q, cache, bt, q_lens, kv_lens, *, scale, window=None, softcap=None, sinks=None, cp_rank=0,
                   cp_size=1):  # type: ignore[no-untyped-def]
    """float64 (out, lse) of every real row of q (padding rows zero / -inf) from the dense reference."""
    ks, vs = dequantized(cache, bt, kv_lens, cp_rank=cp_rank, cp_size=cp_size)
    n = q.shape[0]
    out = torch.zeros((n, *q.shape[1:]), dtype=torch.float64)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64)
    row = 0
    for b, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        q_pos = [kl - ql + i for i in range(ql)]
        k_pos = [j * cp_size + cp_rank for j in range(ks[b].shape[0])]
        o, l_ = dense_attention(q[row:row + ql], ks[b], vs[b], q_pos, k_pos, scale=scale, window=window,
                                softcap=softcap, sinks=sinks if cp_rank == 0 else None)
        out[row:row + ql], lse[row:row + ql] = o, l_
        row += ql
    return out, lse


def assert_attn_close(out, lse, exp_out, exp_lse, dtype, rows=None, what=""):  # type: ignore[no-untyped-def]
    """out within the dtype's tolerance of the reference, lse within LSE_TOL (equal -inf where empty)."""
    atol, rtol = TOL[dtype]
    o = out.double().cpu()
    if rows is not None:
        o, exp_out = o[rows], exp_out[rows]
    assert torch.isfinite(o).all(), f"{what}: non-finite output"
    err = (o - exp_out).abs() - rtol * exp_out.abs()
    assert err.max() <= atol, f"{what}: max error {(o - exp_out).abs().max().item():.3g} > {atol} + {rtol} * |ref|"
    if lse is not None:
        ll = lse.double().cpu()
        if rows is not None:
            ll, exp_lse = ll[rows], exp_lse[rows]
        inf = torch.isinf(exp_lse)
        assert torch.equal(torch.isinf(ll), inf), f"{what}: lse -inf pattern differs"
        assert (ll[inf] == exp_lse[inf]).all()
        if (~inf).any():
            d = (ll[~inf] - exp_lse[~inf]).abs().max().item()
            assert d <= LSE_TOL[dtype], f"{what}: lse error {d:.3g}"
