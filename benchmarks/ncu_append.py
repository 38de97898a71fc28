"""One prefill append (16384 tokens, 8 x 128 heads) per kv_dtype, or with ``decode`` one decode step (256
sequences x 1 token, ragged), for Nsight Compute:

    ncu --kernel-name regex:_append --launch-skip 1 --launch-count 1 --section SpeedOfLight \\
        python3 benchmarks/ncu_append.py auto [rope] [decode]
"""

import sys

import torch

from kvcache import PagedConfig, PagedKVCache, RopeConfig

kv_dtype = sys.argv[1] if len(sys.argv) > 1 else "auto"
use_rope = "rope" in sys.argv[2:]
dev = torch.device("cuda")
n_seqs, seq, bs, H, D = 8, 2048, 16, 8, 128
if "decode" in sys.argv[2:]:
    n_seqs, seq = 256, 1
n = n_seqs * seq
nb = n // bs + 64 if seq > 1 else n_seqs * 64 + 64
c = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                             kv_dtype=kv_dtype, device=dev), rope=RopeConfig(head_dim=D))
k = torch.randn(n, H, D, dtype=torch.float16, device=dev)
v = torch.randn(n, H, D, dtype=torch.float16, device=dev)
tables = torch.randperm(nb)[: n_seqs * (64 if seq == 1 else seq // bs)].view(n_seqs, -1).to(torch.int32).to(dev)
cu_q = torch.arange(0, n + 1, seq, dtype=torch.int32, device=dev)
kv_lens = torch.zeros(n_seqs, dtype=torch.int32, device=dev)
if seq == 1:  # decode: 0-999 cached tokens per sequence
    kv_lens = torch.randint(0, 1000, (n_seqs,), dtype=torch.int32, device=dev)
for _ in range(2):
    c.append(0, k, v, c.plan(tables, cu_q, kv_lens, rope=None if use_rope else False))
torch.cuda.synchronize()
