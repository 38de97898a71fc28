"""The load-order effect on a GPU (a development tool): the int8 decode append with RoPE and metadata_ready,
and the speculative one, timed per layer of a 32-layer graph in a process where another variant of the append
was loaded (and run once) first, or none.

    for first in none wait spec; do PYTHONPATH=src python3 benchmarks/load_order.py $first; done

``none``: the measured kernels load first; ``wait``: the launch that waits before its lookup; ``spec``: the
speculative one. Run each in its own process (the effect is per process).
"""
from __future__ import annotations

import sys

import torch

from kvcache.bench.linear import time_graph
from kvcache.bench.paged import D, H, decode_batch
from kvcache.ops import paged as P
from kvcache.paged import PagedConfig, PagedKVCache
from kvcache.rope import RopeConfig

dev = torch.device("cuda")
L = 32
b = decode_batch(dev, torch.Generator().manual_seed(1), 16)
c = PagedKVCache(PagedConfig(num_layers=L, num_kv_heads=H, head_dim=D, block_size=16, num_blocks=b.num_blocks,
                             kv_dtype="int8", device=dev), rope=RopeConfig(head_dim=D, base=500000.0))


def step(ready: bool) -> None:
    for layer in range(L):
        c.append(layer, b.k, b.v, block_tables=b.tables, cu_q_lens=b.cu_q, kv_lens=b.kv_lens, metadata_ready=ready)


first = sys.argv[1]
if first != "none":
    P._SPECULATE = first == "spec"
    step(False)  # compiles and loads that kernel
    torch.cuda.synchronize()
    P._SPECULATE = True
out = [f"{time_graph(lambda: step(True), 1) / L:.2f}" for _ in range(3)]
print(f"loaded first: {first:5s} ready: {' '.join(out)}  spec: "
      f"{' '.join(f'{time_graph(lambda: step(False), 1) / L:.2f}' for _ in range(3))}", flush=True)
