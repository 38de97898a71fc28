"""Sweep launch parameters of the paged kernels (a development tool; run on a GPU machine).

    PYTHONPATH=src python3 benchmarks/paged_tune.py [prefill] [decode] [gather] [host]

Prefill append: num_warps x persistent programs per SM, every format, with and without RoPE, against a
same-size device copy. Decode: per-layer time in a 32-layer graph, ragged / slot mapping, with and without
programmatic dependent launch. Gather: tokens per program x num_warps. Host: CPU time of one eager append
through the cache (prepared launch) and through the validating op, next to small torch ops.
"""

from __future__ import annotations

import functools
import sys

import torch
from host_profile import profile_calls  # benchmarks/, the script's folder

from kvcache.bench.linear import copy_bandwidth, time_eager, time_graph, time_host
from kvcache.bench.paged import _rows_copy, decode_batch, launch_decode_layers, prefill_batch
from kvcache.ops import paged as paged_ops
from kvcache.ops.paged import append_paged_kv_launch, gather_paged_kv_launch
from kvcache.paged import PagedConfig, PagedKVCache
from kvcache.rope import RopeConfig

H, D = 8, 128
PER_ROW = {"auto": D * 2, "fp8": D, "int8": D + 8, "int4": D // 2 + 8}


def _pct(nbytes: int, us: float, copy_bw: float) -> float:
    return 100 * nbytes / (us * 1e-6) / 1e9 / copy_bw


def ceilings(dev: torch.device, copy_bw: float) -> None:
    """The prefill append's traffic through plain copies: torch copy_ of the same bytes, Triton copies of 1-8
    rows per program into blocks in order or randomly placed."""
    g = torch.Generator().manual_seed(0)
    n, bs = 16384, 16
    kv = torch.randn(2, n, H, D, dtype=torch.float16, device=dev)
    k, v = kv[0], kv[1]
    dst = torch.empty_like(kv)
    time_graph(lambda: dst.copy_(kv), 3)  # warm-up
    t = time_graph(lambda: dst.copy_(kv), 3)
    moved = 2 * kv.numel() * 2
    print(f"same-size copy_ (K and V, {moved / 1e6:.0f} MB moved): {_pct(moved, t, copy_bw):.1f}%")
    pool = torch.empty(n // bs, 2, bs, H * D, dtype=torch.float16, device=dev)
    perm = torch.randperm(n // bs, generator=g).to(torch.int32).to(dev)
    for scatter in (False, True):
        for tok in (1, 2, 4, 8):
            res = []
            for w in (2, 4, 8, 16):
                t = time_graph(lambda w=w, scatter=scatter, tok=tok: _rows_copy[(n // tok,)](
                    k, v, pool, perm, ROW=H * D, BS=bs, SCATTER=scatter, TOK=tok, num_warps=w), 3)
                res.append(f"w{w}: {_pct(moved, t, copy_bw):.1f}")
            print(f"triton copy of {tok} rows per program ({'random blocks' if scatter else 'block order'}): "
                  + "  ".join(res), flush=True)


def prefill(dev: torch.device, copy_bw: float) -> None:
    g = torch.Generator().manual_seed(0)
    bs = 16
    k, v, cu_q, kv_lens, tables, nb = prefill_batch(dev, g, bs)
    n = k.shape[0]
    rope = RopeConfig(head_dim=D, base=500000.0).kernel_params(device=dev)
    for kv_dtype in ("auto", "fp8", "int8", "int4"):
        c = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                                     kv_dtype=kv_dtype, device=dev))
        nbytes = 2 * n * H * D * 2 + 2 * n * H * PER_ROW[kv_dtype]
        warps = (1, 2, 4)
        for use_rope in (False, True):
            res = []
            for split in (False, True):
                for w in warps:
                    def fn(w=w, use_rope=use_rope, c=c, kv_dtype=kv_dtype, split=split) -> None:  # type: ignore[no-untyped-def]
                        append_paged_kv_launch(k, v, c.pool(0), c.params(0), kv_dtype=kv_dtype, layout="NHD",
                                               block_tables=tables, cu_q_lens=cu_q, kv_lens=kv_lens, cu_k_lens=None,
                                               slot_mapping=None, positions=None, rope=rope if use_rope else None,
                                               fp8_scales=c.kv_scales[0], cp_rank=0, cp_size=1, num_warps=w,
                                               split=split)
                    t = time_graph(fn, 3)
                    res.append(f"{'s' if split else 'r'}w{w}: {_pct(nbytes, t, copy_bw):.1f}")
            print(f"append {kv_dtype}{' rope' if use_rope else ''}: " + "  ".join(res), flush=True)


def decode(dev: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    layers, bs = 32, 16
    b = decode_batch(dev, gen, bs)
    rope = RopeConfig(head_dim=D, base=500000.0).kernel_params(device=dev)
    pdl_ok = paged_ops._pdl_supported(dev)
    variants = [(pdl, split, w) for pdl in ((False, True) if pdl_ok else (False,)) for split in (False, True)
                for w in (1, 2, 4)]
    if "decode-rope" in sys.argv:  # with and without RoPE, the default launch only
        variants = [(pdl_ok, True, 2)]
    for kv_dtype in ("auto", "int8", "int4"):
        c = PagedKVCache(PagedConfig(num_layers=layers, num_kv_heads=H, head_dim=D, block_size=bs,
                                     num_blocks=b.num_blocks, kv_dtype=kv_dtype, device=dev))
        for mode in ("ragged", "slots"):
            res = []
            for pdl, split, w in variants:
                ragged = mode == "ragged"

                for use_rope in ((True, False) if "decode-rope" in sys.argv else (True,)):
                    step = functools.partial(launch_decode_layers, c, b, ragged=ragged,
                                             rope=rope if use_rope else None, num_warps=w, pdl=pdl, split=split)
                    name = f"{'pdl' if pdl else 'std'}{'-split' if split else ''}-w{w}{'' if use_rope else '-norope'}"
                    res.append(f"{name}: {time_graph(step, 1) / layers:.2f}")

            print(f"decode {kv_dtype}, {mode} (us per layer): " + "  ".join(res), flush=True)


def gather(dev: torch.device, copy_bw: float) -> None:
    g = torch.Generator().manual_seed(2)
    n_seqs, seq, bs = 64, 2048, 16
    nb = n_seqs * seq // bs + 16
    tables = torch.randperm(nb, generator=g)[: n_seqs * seq // bs].view(n_seqs, -1).to(torch.int32).to(dev)
    lens = torch.full((n_seqs,), seq, dtype=torch.int32, device=dev)
    ko = torch.empty(n_seqs, H, seq, D, dtype=torch.float16, device=dev)
    vo = torch.empty_like(ko)
    for kv_dtype in ("auto", "fp8", "int8", "int4"):
        c = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                                     kv_dtype=kv_dtype, device=dev))
        c.buffer.view(torch.uint8).random_(0, 256)
        if kv_dtype == "fp8":
            c.buffer.view(torch.uint8).bitwise_and_(0x77)
        if c.params_buffer is not None:
            c.params_buffer.uniform_(0.001, 0.01)
        nbytes = 2 * n_seqs * seq * H * PER_ROW[kv_dtype] + 2 * n_seqs * seq * H * D * 2
        res = []
        for tok in (1, 2, 4):
            for w in (1, 2, 4):
                def gfn(tok=tok, w=w, c=c, kv_dtype=kv_dtype) -> None:  # type: ignore[no-untyped-def]
                    gather_paged_kv_launch(ko, vo, c.pool(0), c.params(0), kv_dtype=kv_dtype, layout="NHD",
                                           block_tables=tables, kv_lens=lens, cu_k_lens=None, rope=None,
                                           fp8_scales=c.kv_scales[0], cp_rank=0, cp_size=1, num_warps=w, tok=tok)
                tg = time_graph(gfn, 2)
                te = time_eager(gfn, 5)
                res.append(f"t{tok}w{w}: {_pct(nbytes, tg, copy_bw):.1f}/{_pct(nbytes, te, copy_bw):.1f}")
        print(f"gather {kv_dtype} (graph/eager %): " + "  ".join(res), flush=True)


def host(dev: torch.device) -> None:
    gen = torch.Generator().manual_seed(3)
    n_seqs, bs, layers = 256, 16, 4
    k = torch.randn(n_seqs, H, D, dtype=torch.float16, device=dev)
    v = torch.randn(n_seqs, H, D, dtype=torch.float16, device=dev)
    cu_q = torch.arange(0, n_seqs + 1, dtype=torch.int32, device=dev)
    kv_lens = torch.randint(1, 900, (n_seqs,), generator=gen, dtype=torch.int32).to(dev)
    tables = torch.randperm(n_seqs * 64, generator=gen).view(n_seqs, 64).to(torch.int32).to(dev)
    slots = (tables.long()[torch.arange(n_seqs, device=dev), (kv_lens // bs).long()] * bs + (kv_lens % bs).long())
    positions = kv_lens.long()
    rope = RopeConfig(head_dim=D, base=500000.0)
    small = torch.zeros(16, device=dev)
    idx = torch.arange(4, device=dev)
    src = torch.ones(4, device=dev)
    print(f"host: torch x.add_(1) {time_host(lambda: small.add_(1)):.1f} us, "
          f"index_copy_ {time_host(lambda: small.index_copy_(0, idx, src)):.1f} us", flush=True)
    from kvcache._backend import _current_device, _current_stream, _hooks_active
    for name, fn in (("k.data_ptr()", k.data_ptr), ("k.stride()", k.stride), ("_hooks_active()", _hooks_active),
                     ("_current_device()", _current_device), ("_current_stream(0)", lambda: _current_stream(0))):
        print(f"host piece {name}: {time_host(fn, iters=2000):.3f} us")
    for kv_dtype in ("auto", "int4"):
        c = PagedKVCache(PagedConfig(num_layers=layers, num_kv_heads=H, head_dim=D, block_size=bs,
                                     num_blocks=n_seqs * 64, kv_dtype=kv_dtype, device=dev), rope=rope)
        ragged = lambda c=c: c.append(1, k, v, block_tables=tables, cu_q_lens=cu_q, kv_lens=kv_lens)  # noqa: E731
        slot = lambda c=c: c.append(1, k, v, slot_mapping=slots, positions=positions)  # noqa: E731
        op = lambda c=c, kd=kv_dtype: paged_ops.append_paged_kv(  # noqa: E731
            k, v, c.pool(1), c.params(1), kv_dtype=kd, block_tables=tables, cu_q_lens=cu_q, kv_lens=kv_lens,
            rope=c._rope_params, fp8_scales=c.kv_scales[1])
        print(f"host {kv_dtype} + rope: cache ragged {time_host(ragged):.1f} us, cache slots {time_host(slot):.1f} us,"
              f" op (validating) {time_host(op):.1f} us, plans {len(c._plans)}", flush=True)
        plan = next(iter(c._plans.values()))  # the ragged call's
        pl = plan.prepared
        pool_p, params_p, inv_p, scales_p = c._ptrs[1]
        args = paged_ops._append_args(
            k=k.data_ptr(), v=v.data_ptr(), pool=pool_p, params=params_p, block_tables=tables.data_ptr(),
            cu_q=cu_q.data_ptr(), kv_info=kv_lens.data_ptr(), slots=None, positions=None, inv_freq=inv_p,
            fp8_scales=scales_p, stride_kn=k.stride(0) // plan.vec, stride_vn=v.stride(0) // plan.vec,
            bt_stride=tables.stride(0), table_width=tables.shape[1], n_seqs=n_seqs, n_rows=n_seqs)
        raw = lambda pl=pl, plan=plan, args=args: pl.run(  # noqa: E731
            plan.per_row * n_seqs, 1, 1, _current_stream(0), *pl.head, *args, *pl.consts)
        how = "C entry point" if pl.direct else "launcher object"
        print(f"host {kv_dtype}: the launcher alone (raw pointers, {how}) {time_host(raw):.1f} us", flush=True)
        profile_calls(ragged, top=8)


def main() -> None:
    dev = torch.device("cuda")
    what = set(sys.argv[1:]) or {"ceilings", "prefill", "decode", "gather", "host"}
    copy_bw = copy_bandwidth(dev)
    print(f"copy {copy_bw:.0f} GB/s", flush=True)
    if "host" in what:
        host(dev)
    if "decode" in what:
        decode(dev)
    if "ceilings" in what:
        ceilings(dev, copy_bw)
    if "prefill" in what:
        prefill(dev, copy_bw)
    if "gather" in what:
        gather(dev, copy_bw)


if __name__ == "__main__":
    main()
