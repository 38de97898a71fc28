"""The read ceiling of decode attention's access pattern: a Triton kernel that reads exactly the bytes paged
attention reads, in the same order and from the same programs (one program per (sequence, KV head), the heads of
a sequence side by side, KV tiles of BLOCK_N keys through the block table, K and V rows of one head plus the
(scale, zero) pairs of the quantized formats), and does nothing with them but a checksum. Its time is what the
memory system gives this pattern; the attention kernel cannot read faster. "Copy of the same blocks" (the bench's
ceiling) reads whole blocks, a friendlier pattern.

Conditions are the bench's (``kvcache.bench.attention``): 32 / 8 heads x 128, block 16, a pool of >= 8192 blocks,
random blocks from all of it, CUDA-graph replays with L2 flushed. The best of a few (BLOCK_N, warps, stages) per
case is the ceiling.

    python benchmarks/pattern_ceiling.py --layouts NHD,HND --out pattern.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton
import triton.language as tl

DECODE = [(64, 1024), (64, 4096), (64, 16384), (1, 131072)]


@triton.jit
def _read_kernel(pool, qparams, bt, out, kv_len, bt_stride, n_splits, S_BLK: tl.constexpr, S_KV: tl.constexpr,
                 S_TOK: tl.constexpr, S_HEAD: tl.constexpr, P_BLK: tl.constexpr, P_KV: tl.constexpr,
                 P_TOK: tl.constexpr, P_HEAD: tl.constexpr, NUM_KV: tl.constexpr, BLOCK_N: tl.constexpr,
                 BS: tl.constexpr, ROW: tl.constexpr, QUANT: tl.constexpr):
    """pool / strides in int32 words; qparams (not ``params``: triton 3.6's binder has a local of that name) in
    float32 elements."""
    x = tl.program_id(0)
    b = x // NUM_KV
    kvh = x % NUM_KV
    split = tl.program_id(1)
    n_t = tl.cdiv(kv_len, BLOCK_N)
    per = tl.cdiv(n_t, n_splits)
    t0 = split * per
    t1 = tl.minimum(t0 + per, n_t)
    offs = tl.arange(0, BLOCK_N)
    rr = tl.arange(0, ROW)
    acc = tl.zeros([BLOCK_N, ROW], tl.int32)
    pacc = tl.zeros([BLOCK_N], tl.float32)
    bt_row = bt + b.to(tl.int64) * bt_stride
    for t in range(t0, t1):
        j = t * BLOCK_N + offs
        ok = j < kv_len
        blk = tl.load(bt_row + j // BS, mask=ok, other=0).to(tl.int64)
        base = blk * S_BLK + (j % BS) * S_TOK + kvh * S_HEAD
        k = tl.load(pool + base[:, None] + rr[None, :], mask=ok[:, None], other=0)
        v = tl.load(pool + base[:, None] + S_KV + rr[None, :], mask=ok[:, None], other=0)
        acc += k ^ v
        if QUANT:
            pb = blk * P_BLK + (j % BS) * P_TOK + kvh * P_HEAD
            pacc += tl.load(qparams + pb, mask=ok, other=0.0) + tl.load(qparams + pb + P_KV, mask=ok, other=0.0)
            pacc += tl.load(qparams + pb + 1, mask=ok, other=0.0) + tl.load(qparams + pb + P_KV + 1, mask=ok, other=0.0)
    tl.store(out + x * tl.num_programs(1) + split, tl.sum(tl.sum(acc, 1), 0) + tl.sum(pacc, 0).to(tl.int32))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="auto,fp8,int8,int4")
    ap.add_argument("--layouts", default="NHD")
    ap.add_argument("--out", default="pattern.json")
    args = ap.parse_args()
    sys.path.insert(0, "src")
    import kvcache.bench.attention as ba
    from kvcache.bench.timing import graph_replay_us

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bs = 16
    most = max(b * s for b, s in DECODE)
    nb = -(-max(8192, int(1.1 * most / bs) + 1) // 16) * 16
    rows = []
    for layout, fmt in itertools.product(args.layouts.split(","), args.formats.split(",")):
        p = ba.Pool(fmt, bs, nb, dev, gen, layout=layout)
        words = p.pool.view(torch.uint8).view(torch.int32)  # the pool's bytes as int32 words
        st = [s // 4 for s in p.pool.view(torch.uint8).stride()]  # byte strides -> words
        if layout == "NHD":
            s_blk, s_kv, s_tok, s_head = st[0], st[1], st[2], st[3]
        else:
            s_blk, s_kv, s_head, s_tok = st[0], st[1], st[2], st[3]
        row = {"auto": 2 * ba.D, "fp8": ba.D, "int8": ba.D, "int4": ba.D // 2}[fmt] // 4
        quant = p.params is not None
        params = p.params if quant else torch.zeros(1, device=dev)
        if quant:
            ps = p.params.stride()
            pst = (ps[0], ps[1], ps[2], ps[3]) if layout == "NHD" else (ps[0], ps[1], ps[3], ps[2])
        else:
            pst = (0, 0, 0, 0)
        for batch, seq in DECODE:
            bt = p.tables(batch, seq, gen)
            splits = 1 if batch * ba.H >= 132 else 33
            out = torch.empty(batch * ba.H * splits, dtype=torch.int32, device=dev)
            best = None
            args_ = (words, params, bt, out, seq, bt.stride(0), splits)
            consts = dict(S_BLK=s_blk, S_KV=s_kv, S_TOK=s_tok, S_HEAD=s_head, P_BLK=pst[0], P_KV=pst[1],
                          P_TOK=pst[2], P_HEAD=pst[3], NUM_KV=ba.H, BS=bs, ROW=row, QUANT=quant)
            grid = (batch * ba.H, splits)
            for block_n, warps, stages in itertools.product((32, 64, 128), (4,), (3, 4)):
                def fn(a=args_, c=consts, g=grid, bn=block_n, w=warps, ns=stages):  # type: ignore[no-untyped-def]
                    _read_kernel[g](*a, **c, BLOCK_N=bn, num_warps=w, num_stages=ns)
                try:
                    us, _ = graph_replay_us(fn, rep=30, warmup=5)
                except Exception as e:  # noqa: BLE001
                    print(f"{layout} {fmt} {batch}x{seq} {block_n}/{warps}/{stages}: {type(e).__name__}: "
                          f"{str(e)[:300]}", flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, block_n, warps, stages)
            if best is None:
                continue
            gbs = ba.kv_bytes(batch * seq, fmt) / best[0] / 1e3
            rows.append(dict(layout=layout, fmt=fmt, shape=f"{batch} x {seq}", us=best[0], gbs=gbs,
                             block_n=best[1], warps=best[2], stages=best[3]))
            print(f"{layout} {fmt:5s} {batch:3d} x {seq:6d}: pattern read {best[0]:8.1f} us ({gbs:5.0f} GB/s read), "
                  f"best of {best[1:]}", flush=True)
        del p
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
