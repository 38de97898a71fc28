"""Speculation on mixed batches (a development tool, GPU): one 1000-token chunk beside 500 decode rows, and a
256 x 1 decode batch, each launch per call in a CUDA graph of 4 appends (8 x 128 heads, RoPE, block 16), for the
default launch, ``speculate=False``, ``metadata_ready=True`` and forced ``speculate=True``.

    PYTHONPATH=src python3 benchmarks/mixed_batch.py
"""

from __future__ import annotations

import torch

from kvcache.bench.linear import time_graph
from kvcache.bench.paged import D, H
from kvcache.ops import paged as P
from kvcache.paged import PagedConfig, PagedKVCache
from kvcache.rope import RopeConfig

VARIANTS = (("default", {}), ("speculate=False", {"speculate": False}), ("metadata_ready", {"metadata_ready": True}),
            ("speculate=True", {"speculate": True, "rope_ready": True}))


def time_batch(c: PagedKVCache, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, kv_lens: torch.Tensor,
               tables: torch.Tensor, rope: object) -> dict[str, float]:
    """us per append of each variant (a CUDA graph of 4 appends into layer 0 of ``c``)."""
    res = {}
    for label, over in VARIANTS:
        def fn(over: dict = over) -> None:
            for _ in range(4):
                P.append_paged_kv_launch(
                    k, v, c.pool(0), c.params(0), kv_dtype=c.config.kv_dtype, layout="NHD", block_tables=tables,
                    cu_q_lens=cu, kv_lens=kv_lens, cu_k_lens=None, slot_mapping=None, positions=None,
                    rope=rope, fp8_scales=c.kv_scales[0], cp_rank=0, cp_size=1, **over)  # type: ignore[arg-type]
        res[label] = time_graph(fn, 1) / 4
    return res


def main() -> None:
    dev = torch.device("cuda")
    rope = RopeConfig(head_dim=D, base=500000.0).kernel_params(device=dev)
    bs, per = 16, 70  # block size, blocks per sequence
    for kv_dtype in ("auto", "int8"):
        for name, q_lens in (("mixed 1x1000+500x1", [1000] + [1] * 500), ("decode 256x1", [1] * 256)):
            n, b = sum(q_lens), len(q_lens)
            nb = b * per + 8
            c = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                                         kv_dtype=kv_dtype, device=dev))
            k = torch.randn(n, H, D, dtype=torch.float16, device=dev)
            cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
            kv_lens = torch.randint(0, 50, (b,), dtype=torch.int32, device=dev)
            tables = torch.randperm(nb, device=dev)[:b * per].view(b, per).to(torch.int32)
            res = time_batch(c, k, torch.randn_like(k), cu, kv_lens, tables, rope)
            print(kv_dtype, name, "  ".join(f"{key}: {t:.2f}" for key, t in res.items()), flush=True)


if __name__ == "__main__":
    main()
