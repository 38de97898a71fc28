"""Sweep launch parameters of the paged kernels (a development tool; run on a GPU machine).

    PYTHONPATH=src python3 benchmarks/paged_tune.py
"""

from __future__ import annotations

import torch

from kvcache.bench.linear import _copy_time, time_graph
from kvcache.ops.paged import append_paged_kv_launch, gather_paged_kv_launch
from kvcache.paged import PagedConfig, PagedKVCache
from kvcache.rope import RopeConfig

H, D = 8, 128


def main() -> None:
    dev = torch.device("cuda")
    copy_bw = 2 * (1 << 29) * 2 / (_copy_time(1 << 29, torch.float16, dev) * 1e-6) / 1e9
    print(f"copy {copy_bw:.0f} GB/s")
    g = torch.Generator().manual_seed(0)
    n_seqs, seq, bs = 8, 2048, 16
    n = n_seqs * seq
    k = torch.randn(n, H, D, dtype=torch.float16, device=dev)
    v = torch.randn(n, H, D, dtype=torch.float16, device=dev)
    cu_q = torch.arange(0, n + 1, seq, dtype=torch.int32, device=dev)
    kv_lens = torch.zeros(n_seqs, dtype=torch.int32, device=dev)
    nb = n // bs + 64
    tables = torch.randperm(nb, generator=g)[: n // bs].view(n_seqs, -1).to(torch.int32).to(dev)
    rope = RopeConfig(head_dim=D, base=500000.0).kernel_params(device=dev)
    per_row = {"auto": D * 2, "fp8": D, "int8": D + 8, "int4": D // 2 + 8}
    for kv_dtype in ("auto", "fp8", "int8", "int4"):
        c = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                                     kv_dtype=kv_dtype, device=dev))
        nbytes = 2 * n * H * D * 2 + 2 * n * H * per_row[kv_dtype]
        for use_rope in (False, True):
            res = []
            for w in (1, 2, 4, 8):
                def fn(w=w, use_rope=use_rope, c=c, kv_dtype=kv_dtype) -> None:  # type: ignore[no-untyped-def]
                    append_paged_kv_launch(k, v, c.pool(0), c.params(0), kv_dtype=kv_dtype, layout="NHD",
                                           block_tables=tables, cu_q_lens=cu_q, kv_lens=kv_lens, cu_k_lens=None,
                                           slot_mapping=None, positions=None, rope=rope if use_rope else None,
                                           fp8_scales=c.kv_scales[0], cp_rank=0, cp_size=1, num_warps=w)
                t = time_graph(fn, 3)
                res.append(f"w{w}: {100 * nbytes / (t * 1e-6) / 1e9 / copy_bw:.1f}%")
            print(f"append {kv_dtype}{' rope' if use_rope else ''}: " + "  ".join(res))
    n_seqs, seq = 64, 2048
    nb = n_seqs * seq // bs + 16
    tables = torch.randperm(nb, generator=g)[: n_seqs * seq // bs].view(n_seqs, -1).to(torch.int32).to(dev)
    lens = torch.full((n_seqs,), seq, dtype=torch.int32, device=dev)
    ko = torch.empty(n_seqs, H, seq, D, dtype=torch.float16, device=dev)
    vo = torch.empty_like(ko)
    for kv_dtype in ("auto", "int8", "int4"):
        c = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                                     kv_dtype=kv_dtype, device=dev))
        c.buffer.view(torch.uint8).random_(0, 256)
        if c.params_buffer is not None:
            c.params_buffer.uniform_(0.001, 0.01)
        nbytes = 2 * n_seqs * seq * H * per_row[kv_dtype] + 2 * n_seqs * seq * H * D * 2
        res = []
        for tok in (1, 2, 4, 8, 16):
            for w in (2, 4, 8):
                def gfn(tok=tok, w=w, c=c, kv_dtype=kv_dtype) -> None:  # type: ignore[no-untyped-def]
                    gather_paged_kv_launch(ko, vo, c.pool(0), c.params(0), kv_dtype=kv_dtype, layout="NHD",
                                           block_tables=tables, kv_lens=lens, cu_k_lens=None, rope=None,
                                           fp8_scales=c.kv_scales[0], cp_rank=0, cp_size=1, num_warps=w, tok=tok)
                t = time_graph(gfn, 2)
                res.append(f"t{tok}w{w}: {100 * nbytes / (t * 1e-6) / 1e9 / copy_bw:.1f}%")
        print(f"gather {kv_dtype}: " + "  ".join(res))


if __name__ == "__main__":
    main()
