"""Sweep the attention kernel's launch parameters (tiles, warps, stages, splits) per kv_dtype and shape.

An experiment, not the library: it calls the private launcher with explicit :class:`AttentionPlan` values.
Conditions are the bench's (``kvcache.bench.attention``): 32 / 8 heads x 128, a pool of >= 8192 blocks, random
blocks from all of it, CUDA-graph replays with L2 flushed (``graph_replay_us``). Kernels are compiled first in
parallel worker processes (``--jobs``) on small pools of the same block shape, so the timed process only loads
them from Triton's cache.

    python benchmarks/attention_sweep.py --mode decode --formats auto,fp8,int8,int4 --out sweep.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import multiprocessing as mp
import sys
import time

import torch

HQ, H, D = 32, 8, 128
QDT = torch.float16  # query dtype (--qdtype); an "auto" pool is stored in it
LAYOUT = "NHD"  # pool layout (--layout)
TABLE = "random"  # block tables (--table): random blocks of the whole pool, or each sequence's blocks contiguous
DECODE = [(64, 1024), (64, 4096), (64, 16384), (1, 131072)]


def _set_shape(head_dim: int, decode: str | None, prefill: str | None = None, qdtype: str = "fp16") -> None:
    """Head dim, decode shapes ("64x640,16x2048"), prefill shapes ("64x512x0") and query dtype of this process
    (and of the bench module's Pool)."""
    global D, DECODE, PREFILL, QDT
    QDT = torch.bfloat16 if qdtype == "bf16" else torch.float16
    import kvcache.bench.attention as ba

    D = ba.D = head_dim
    if decode:
        DECODE = [tuple(int(v) for v in item.split("x")) for item in decode.split(",")]
    if prefill:
        PREFILL = [tuple(int(v) for v in item.split("x")) for item in prefill.split(",")]
PREFILL = [(8, 2048, 0), (8, 2048, 4096)]


def plans(mode: str, only: str | None = None) -> list[tuple[int, int, int, int, int]]:
    """(block_q, block_n, num_warps, num_stages, warp_split) candidates; block_q counts tokens (G_P = 4 here).
    ``only``: an explicit list instead, "bq,bn,w,s[,ws];bq,bn,w,s[,ws]".
    """
    if only:
        out = [tuple(int(v) for v in item.split(",")) for item in only.split(";") if item]
        return [c + (0,) * (5 - len(c)) for c in out]  # type: ignore[misc]
    if mode == "decode":
        grid = itertools.product([4], [32, 64, 128, 256], [4], [2, 3, 4], [0, 1])
        return [c for c in grid if not c[4] or c[1] // c[2] >= 16]
    return [c + (0,) for c in itertools.product([16, 32, 64], [32, 64, 128], [4, 8], [2, 3, 4])]


def splits_for(batch: int, seq: int) -> list[int]:
    if batch == 1:
        return [16, 33, 64]
    return [1, 2, 4] if seq >= 4096 else [1, 2]


def _pool(kv_dtype: str, bs: int, num_blocks: int, dev: torch.device, gen: torch.Generator):
    sys.path.insert(0, "src")
    from kvcache.bench.attention import Pool

    p = Pool(kv_dtype, bs, num_blocks, dev, gen, layout=LAYOUT)
    if kv_dtype == "auto":
        p.pool = p.pool.to(QDT)
    return p


def _launch_fn(p, q, bt, cu, kl, out, plan, ws):
    from kvcache.ops.attention._launch import AttentionPart, launch_paged_attention
    from kvcache.ops.paged import PagedLayer, StepPlan
    from kvcache.ops.paged.format import kv_format

    layer = PagedLayer(p.pool, p.params, p.kv_scales if kv_format(p.kv_dtype).per_layer_scale else None, p.kv_dtype,
                       p.layout)
    step = StepPlan.build(layer.geometry, q.device, dict(block_tables=bt, cu_q_lens=cu, seq_lens=kl),
                          dict(scale=D ** -0.5), lens_name="kv_lens")
    part = AttentionPart(bt, cu, kl, plan, D ** -0.5)

    def fn() -> None:
        launch_paged_attention(q, out, None, None, layer, step, part, ws)

    return fn


def _case(batch: int, q_len: int, seq: int, p, gen, dev):
    n = batch * q_len
    q = torch.randn((n, HQ, D), dtype=QDT, device=dev, generator=gen)
    cu = torch.arange(0, n + 1, q_len, dtype=torch.int32, device=dev)
    kl = torch.full((batch,), seq, dtype=torch.int32, device=dev)
    nblk = -(-seq // p.bs)
    if TABLE == "contiguous":  # each sequence's blocks side by side, as a fresh allocator hands them out
        bt = torch.arange(batch * nblk, dtype=torch.int32, device=dev).view(batch, nblk) % p.num_blocks
    elif p.num_blocks < batch * nblk:
        bt = torch.randint(0, p.num_blocks, (batch, nblk), dtype=torch.int32, device=dev, generator=gen)
    else:
        bt = torch.randperm(p.num_blocks, device=dev, generator=gen)[: batch * nblk].view(batch, nblk).to(torch.int32)
    return q, bt, cu, kl


def _cap_registers(n: int) -> None:
    """Launch the attention kernel with ``maxnreg=n`` in this process (an experiment: the library sets no cap)."""
    from kvcache.ops.attention import _launch

    class _Capped:
        def __init__(self, k):  # type: ignore[no-untyped-def]
            self.k = k

        def launch(self, *a, **kw):  # type: ignore[no-untyped-def]
            return self.k.launch(*a, maxnreg=n, **kw)

    if not isinstance(_launch._attention_kernel, _Capped):
        _launch._attention_kernel = _Capped(_launch._attention_kernel)


def _compile(args: tuple) -> str:
    """Worker: compile one (format, plan) on a small pool with the timed shapes' constexprs."""
    global LAYOUT
    fmt, bs, mode, cfg, head_dim, decode, prefill, qdtype, maxnreg, LAYOUT = args
    sys.path.insert(0, "src")
    if maxnreg:
        _cap_registers(maxnreg)
    _set_shape(head_dim, decode, prefill, qdtype)
    from kvcache.ops.attention.policy import AttentionPlan
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    p = _pool(fmt, bs, 512, dev, gen)
    t0 = time.time()
    shapes = [(b, 1, s) for b, s in DECODE] if mode == "decode" else [(b, ql, ql + c) for b, ql, c in PREFILL]
    for batch, q_len, seq in shapes[:1] + shapes[-1:]:
        q, bt, cu, kl = _case(batch, q_len, seq, p, gen, dev)
        for sp in (1, 2):
            plan = AttentionPlan(block_q=cfg[0], block_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3], num_splits=sp,
                                 warp_split=bool(cfg[4]))
            ws = torch.empty(sp * q.shape[0] * HQ * (D + 1) + 1, dtype=torch.float32, device=dev)
            try:
                _launch_fn(p, q, bt, cu, kl, torch.empty_like(q), plan, ws)()
            except Exception as e:  # noqa: BLE001
                return f"{fmt} {cfg}: {type(e).__name__}: {str(e)[:120]}"
    torch.cuda.synchronize()
    return f"{fmt} {cfg}: {time.time() - t0:.1f}s"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--formats", default="auto,fp8,int8,int4")
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--jobs", type=int, default=14)
    ap.add_argument("--rep", type=int, default=30)
    ap.add_argument("--out", default="sweep.json")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--decode", default=None, help="decode shapes, e.g. 64x640,16x2048 (batch x tokens)")
    ap.add_argument("--qdtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--prefill", default=None, help="prefill shapes, e.g. 64x512x0 (batch x new x cached)")
    ap.add_argument("--plans", default=None, help="explicit plans 'bq,bn,w,s;...' instead of the grid")
    ap.add_argument("--splits", default=None, help="explicit KV splits '1,2' instead of the per-shape list")
    ap.add_argument("--ceiling", action="store_true", help="decode: also time a copy of the same blocks per format")
    ap.add_argument("--verbose", action="store_true", help="print every plan's time")
    ap.add_argument("--maxnreg", type=int, default=0, help="cap the attention kernel's registers per thread (ptxas)")
    ap.add_argument("--layout", choices=("NHD", "HND"), default="NHD", help="pool layout")
    ap.add_argument("--table", choices=("random", "contiguous"), default="random", help="block tables")
    args = ap.parse_args()
    global LAYOUT, TABLE
    LAYOUT = args.layout
    TABLE = args.table
    sys.path.insert(0, "src")
    if args.maxnreg:
        _cap_registers(args.maxnreg)
    _set_shape(args.head_dim, args.decode, args.prefill, args.qdtype)
    from kvcache.bench.attention import attention_flops, ceiling_rows, kv_bytes
    from kvcache.bench.timing import graph_replay_us
    from kvcache.ops.attention.policy import AttentionPlan, attention_plan

    formats = args.formats.split(",")
    cfgs = plans(args.mode, args.plans)
    t0 = time.time()
    work = [(f, args.bs, args.mode, c, args.head_dim, args.decode, args.prefill, args.qdtype, args.maxnreg, args.layout)
            for f in formats
            for c in cfgs]
    with cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as ex:
        for msg in ex.map(_compile, work):
            if "Error" in msg:
                print("compile:", msg, flush=True)
    print(f"# compiled {len(work)} variants in {time.time() - t0:.0f} s", flush=True)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    if args.mode == "decode":
        shapes = [(b, 1, s - 1, f"{b} x {s}") for b, s in DECODE]
    else:
        shapes = [(b, ql, c, f"{b} x {ql} new, {c} cached") for b, ql, c in PREFILL]
    most = max(b * (q + c) for b, q, c, _ in shapes)
    nb = max(8192, int(1.1 * most / args.bs) + 1)
    nb = -(-nb // 16) * 16
    for fmt in formats:
        p = _pool(fmt, args.bs, nb, dev, gen)
        for batch, q_len, cached, name in shapes:
            seq = cached + q_len
            q, bt, cu, kl = _case(batch, q_len, seq, p, gen, dev)
            out = torch.empty_like(q)
            default = attention_plan(num_q_heads=HQ, num_kv_heads=H, head_dim=D, n_tokens=q.shape[0], num_seqs=batch,
                                     max_kv_len=seq, kv_dtype=fmt)
            best = None
            sps = [int(v) for v in args.splits.split(",")] if args.splits else \
                (splits_for(batch, seq) if args.mode == "decode" else [1])
            cand = [(c, s) for c in cfgs for s in sps]
            cand.append(((default.block_q, default.block_n, default.num_warps, default.num_stages,
                          int(default.warp_split)), default.num_splits))
            if args.ceiling and args.mode == "decode":
                for c in ceiling_rows("decode", name, p, bt, args.rep):
                    rows.append(dict(fmt=fmt, shape=name, bs=args.bs, impl=c.impl, us=c.us, gbs=c.gbs))
                    print(f"{fmt:5s} {name:24s} {c.impl} {c.us:8.1f} us ({c.gbs:.0f} GB/s read + write)", flush=True)
            for cfg, sp in cand:
                plan = AttentionPlan(block_q=cfg[0], block_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3],
                                     num_splits=sp, warp_split=bool(cfg[4]))
                ws = torch.empty(sp * q.shape[0] * HQ * (D + 1) + 1, dtype=torch.float32, device=dev)
                try:
                    us, _ = graph_replay_us(_launch_fn(p, q, bt, cu, kl, out, plan, ws), rep=args.rep, warmup=5)
                except Exception as e:  # noqa: BLE001
                    print(f"{fmt} {name} {cfg} s{sp}: {type(e).__name__}", flush=True)
                    continue
                row = dict(fmt=fmt, shape=name, bs=args.bs, layout=args.layout, block_q=cfg[0], block_n=cfg[1],
                           warps=cfg[2], stages=cfg[3], warp_split=cfg[4], splits=sp, us=us, maxnreg=args.maxnreg,
                           default=(cfg, sp) == cand[-1])
                if args.mode == "decode":
                    row["gbs"] = kv_bytes(batch * seq, fmt) / us / 1e3
                else:
                    row["tflops"] = attention_flops(batch, q_len, cached) / us / 1e6
                rows.append(row)
                if best is None or us < best["us"]:
                    best = row
            dflt = next(r for r in rows[::-1] if r.get("default") and r["fmt"] == fmt and r["shape"] == name)
            print(f"{fmt:5s} {name:24s} default {dflt['us']:8.1f} us | best {best['us']:8.1f} us "
                  f"{tuple(best[k] for k in ('block_q', 'block_n', 'warps', 'stages', 'warp_split', 'splits'))}",
                  flush=True)
            if args.verbose:
                for r in rows:
                    if r["fmt"] == fmt and r["shape"] == name and "block_n" in r:
                        print(f"    {r['block_n']:4d} keys w{r['warps']} s{r['stages']} ws{r['warp_split']} "
                              f"splits {r['splits']:2d}: {r['us']:8.1f} us", flush=True)
        del p
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
