"""Decode-step GEMMs (M <= 64 rows against a weight matrix streamed from memory): cuBLAS (``F.linear``, what the
engine runs) against a split-K Triton kernel, at the engine bench's shapes (an experiment; run on a GPU).

    PYTHONPATH=src python benchmarks/skinny_gemm.py [--m 64] [--out FILE]

Each weight is its own tensor of the real size and L2 is flushed before every call (``do_bench``): in a decode
step every layer's weights come from memory. The Triton kernel: programs over (N tiles, K splits), each streams its
``[BN, K / SPLIT]`` slice of the weight through ``num_stages`` buffers and dots it with the rows; with SPLIT > 1 the
float32 partials are summed by a second kernel. Reported per shape: cuBLAS, the best Triton configuration, and the
bandwidth of the weight's bytes at each.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

# (name, N, K) of the Llama-3.2-1B-shaped bench model's decode GEMMs
SHAPES = [("qkv", 3072, 2048), ("o_proj", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
          ("lm_head", 128256, 2048)]


@triton.jit
def _skinny(x, w, out, ws, M, N, K_SPLIT, s_x, s_w, s_o, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            SPLIT: tl.constexpr):
    pn = tl.program_id(0)
    pk = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k0 = pk * K_SPLIT
    ok_m = rm < M
    ok_n = rn < N
    xp = x + rm[:, None].to(tl.int64) * s_x + k0 + rk[None, :]
    wp = w + rn[:, None].to(tl.int64) * s_w + k0 + rk[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for _ in range(0, K_SPLIT, BK):
        a = tl.load(xp, mask=ok_m[:, None], other=0.0)
        b = tl.load(wp, mask=ok_n[:, None], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        xp += BK
        wp += BK
    if SPLIT == 1:
        ok = ok_m[:, None] & ok_n[None, :]
        tl.store(out + rm[:, None] * s_o + rn[None, :], acc.to(out.dtype.element_ty), mask=ok)
    else:
        tl.store(ws + (pk * M + rm[:, None]) * N + rn[None, :], acc, mask=ok_m[:, None] & ok_n[None, :])


@triton.jit
def _reduce(ws, out, M, N, s_o, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ws + s * M * N + i, mask=ok, other=0.0)
    m = i // N
    n = i - m * N
    tl.store(out + m * s_o + n, acc.to(out.dtype.element_ty), mask=ok)


def skinny(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, ws: torch.Tensor, bn: int, bk: int, split: int,
           stages: int, warps: int) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    bm = max(16, triton.next_power_of_2(m))
    k_split = k // split
    _skinny[(triton.cdiv(n, bn), split)](x, w, out, ws, m, n, k_split, x.stride(0), w.stride(0), out.stride(0),
                                         BM=bm, BN=bn, BK=bk, SPLIT=split, num_warps=warps, num_stages=stages)
    if split > 1:
        block = 1024
        _reduce[(triton.cdiv(m * n, block),)](ws, out, m, n, out.stride(0), SPLIT=split, BLOCK=block, num_warps=4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    m = args.m
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, M = {m}")
    for name, n, k in SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x, w)
        gb = n * k * 2 / 1e9
        t_cublas = do_bench(functools.partial(torch.nn.functional.linear, x, w), warmup=25, rep=200)
        best = None
        tried = 0
        for bn in (32, 64, 128):
            tiles = triton.cdiv(n, bn)
            for split in (1, 2, 4, 8, 16):
                progs = tiles * split
                if (k // split) % 128 or progs < 66 or progs > 1100 or (split > 1 and tiles * split > 4 * 132):
                    continue
                for bk in (128,):
                    if (k // split) % bk:
                        continue
                    for stages in (3, 5):
                        if bn * bk * 2 * stages + 64 * bk * 2 * stages > 200 * 1024:
                            continue
                        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                        ws = torch.empty(split * m * n if split > 1 else 1, device=dev, dtype=torch.float32)
                        try:
                            skinny(x, w, out, ws, bn, bk, split, stages, 4)
                        except Exception as e:  # noqa: BLE001 (a configuration that does not compile)
                            print(f"  {name} bn{bn} bk{bk} s{split} st{stages}: {type(e).__name__}")
                            continue
                        err = (out.float() - ref.float()).abs().max().item()
                        if err > 0.05 * ref.float().abs().max().item() + 1e-2:
                            print(f"  {name} bn{bn} bk{bk} s{split} st{stages}: wrong (max err {err:.3g})")
                            continue
                        t = do_bench(functools.partial(skinny, x, w, out, ws, bn, bk, split, stages, 4), warmup=10,
                                     rep=60)
                        tried += 1
                        if best is None or t < best[0]:
                            best = (t, bn, bk, split, stages)
        t, bn, bk, split, stages = best
        row = dict(name=name, N=n, K=k, M=m, cublas_us=t_cublas * 1e3, cublas_tbs=gb / t_cublas, triton_us=t * 1e3,
                   triton_tbs=gb / t, config=dict(BN=bn, BK=bk, SPLIT=split, stages=stages), tried=tried)
        rows.append(row)
        print(f"{name:8s} N={n:6d} K={k:5d}: cuBLAS {t_cublas * 1e3:7.1f} us ({gb / t_cublas:.2f} TB/s), Triton best "
              f"{t * 1e3:7.1f} us ({gb / t:.2f} TB/s) BN={bn} BK={bk} SPLIT={split} stages={stages} "
              f"({tried} configs), x{t_cublas / t:.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
