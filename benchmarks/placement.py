"""The load-order effect against code placement (a development tool, GPU): K unrelated small kernels, each a
module of its own size, compiled and launched once before the int8 decode append with RoPE and metadata_ready
is timed (us per layer of a 32-layer graph). Run each K in its own process.

    for k in 0 1 2 3 5 8 13; do PYTHONPATH=src python3 benchmarks/placement.py $k; done
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from kvcache.bench.linear import time_graph
from kvcache.bench.paged import D, H, decode_batch
from kvcache.paged import PagedConfig, PagedKVCache
from kvcache.rope import RopeConfig

K = int(sys.argv[1])


@triton.jit
def dummy(x, N: tl.constexpr, S: tl.constexpr):
    o = tl.arange(0, N)
    v = tl.load(x + o)
    for i in tl.static_range(S):
        v = v * 1.0001 + i
    tl.store(x + o, v)


dev = torch.device("cuda")
buf = torch.zeros(128, device=dev)
for j in range(K):
    dummy[(1,)](buf, N=128, S=64 + j)  # a distinct module each (different code size)
torch.cuda.synchronize()
L = 32
b = decode_batch(dev, torch.Generator().manual_seed(1), 16)
c = PagedKVCache(PagedConfig(num_layers=L, num_kv_heads=H, head_dim=D, block_size=16, num_blocks=b.num_blocks,
                             kv_dtype="int8", device=dev), rope=RopeConfig(head_dim=D, base=500000.0))


def step(ready):
    for layer in range(L):
        c.append(layer, b.k, b.v, block_tables=b.tables, cu_q_lens=b.cu_q, kv_lens=b.kv_lens, metadata_ready=ready)


r = [f"{time_graph(lambda: step(True), 1) / L:.2f}" for _ in range(3)]
print(f"dummies {K:2d}: ready {' '.join(r)}", flush=True)
