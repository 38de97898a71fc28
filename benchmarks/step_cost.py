"""Cost of one whole model step through the paged cache: every layer's append + attention, eager (host time per
layer included), for a decode step and a prefill step of an 8B-shaped model (32 layers, 32 / 8 heads, head_dim
128, bf16, the engine's calls: keys rotated by the append, queries inside the attention kernel).

Server conditions: a pool of GiBs, each sequence's blocks drawn at random from all of it, L2 flushed before each
step. Reported per case: the median wall time of a step (host launch + device, synchronised at the end) and the
median device time (CUDA events), over ``--steps`` steps.

Runs against whichever ``kvcache`` is first on ``sys.path`` (``--src DIR`` puts DIR first): the step-plan API
(``cache.plan`` once per step, then ``append(i, k, v, plan)`` / ``attention(i, q, plan)``) when the cache has it,
else the keyword form the engine used before it (``cache.append(i, k, v, block_tables=...)`` and
``ops.paged_attention`` with the layer's pools). Compare two trees by alternating processes:

    for i in 1 2 3; do for t in base/src src; do python benchmarks/step_cost.py --src $t --json-line; done; done
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

L, HQ, H, D, BS = 32, 32, 8, 128, 16


def _tables(torch, n_seqs: int, lens: list[int], num_blocks: int, dev):  # type: ignore[no-untyped-def]
    width = max(-(-n // BS) for n in lens)
    perm = torch.randperm(num_blocks, device=dev)[: n_seqs * width].view(n_seqs, width)
    return perm.to(torch.int32).contiguous()


def _case(torch, kv, cache, name: str, before: list[int], q_lens: list[int], steps: int):  # type: ignore[no-untyped-def]
    from kvcache import ops

    dev = cache.device
    n_seqs = len(before)
    after = [b + q for b, q in zip(before, q_lens)]
    n = sum(q_lens)
    bt = _tables(torch, n_seqs, after, cache.config.num_blocks, dev)
    i32 = dict(dtype=torch.int32, device=dev)
    cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), **i32)
    kv_before = torch.tensor(before, **i32)
    kv_after = torch.tensor(after, **i32)
    qkv = torch.randn(L, n, HQ + 2 * H, D, dtype=torch.bfloat16, device=dev)
    out = torch.empty(n, HQ, D, dtype=torch.bfloat16, device=dev)
    pos = torch.arange(max(after) + 1, device=dev, dtype=torch.float32)
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
    ang = torch.outer(pos, inv)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(torch.bfloat16).contiguous()
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(torch.bfloat16).contiguous()
    num_decode = sum(1 for _ in itertools.takewhile(lambda x: x == 1, q_lens))
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    has_plan = hasattr(cache, "plan")
    cfg = cache.config

    def step() -> None:
        if has_plan:
            plan = cache.plan(block_tables=bt, cu_q_lens=cu, kv_lens=kv_before, seq_lens=kv_after, scale=D**-0.5,
                              q_rope=(cos, sin), max_kv_len=max(after), num_decode=num_decode)
            for i in range(L):
                x = qkv[i]
                cache.append(i, x[:, HQ:HQ + H], x[:, HQ + H:], plan)
                cache.attention(i, x[:, :HQ], plan, out=out)
        else:
            for i in range(L):
                x = qkv[i]
                cache.append(i, x[:, HQ:HQ + H], x[:, HQ + H:], block_tables=bt, cu_q_lens=cu, kv_lens=kv_before)
                ops.paged_attention(x[:, :HQ], cache.pool(i), cache.params(i), cache.kv_scales[i],
                                    kv_dtype=cfg.kv_dtype, layout=cfg.layout, block_tables=bt, cu_q_lens=cu,
                                    kv_lens=kv_after, scale=D**-0.5, max_kv_len=max(after), num_decode=num_decode,
                                    q_rope=(cos, sin), out=out)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    walls, devs = [], []
    for _ in range(steps):
        flush.zero_()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        step()
        e1.record()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e6)
        devs.append(e0.elapsed_time(e1) * 1e3)
    return {"case": name, "kv_dtype": kv, "api": "plan" if has_plan else "keywords",
            "wall_us": statistics.median(walls), "device_us": statistics.median(devs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default="src", help="put this kvcache source tree first on sys.path")
    ap.add_argument("--kv-dtypes", default="auto,int8")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--gib", type=float, default=24.0,
                    help="KV pool size (the decode case needs 8,192 blocks of 16 tokens)")
    ap.add_argument("--json-line", action="store_true", help="print one JSON line per case")
    args = ap.parse_args()
    sys.path.insert(0, args.src)
    import torch

    from kvcache import PagedConfig, PagedKVCache, RopeConfig, cache_block_bytes

    dev = torch.device("cuda")
    cases = [("decode 64 x 2048", [2047] * 64, [1] * 64), ("prefill 8 x 512", [0] * 8, [512] * 8),
             ("mixed 63 decode + 512 chunk", [2047] * 63 + [0], [1] * 63 + [512])]
    for kv in [k for k in args.kv_dtypes.split(",") if k]:
        nb = int(args.gib * 2**30 // cache_block_bytes(L, H, D, BS, torch.bfloat16, kv))
        cfg = PagedConfig(num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=nb, dtype=torch.bfloat16,
                          kv_dtype=kv, device=dev)
        cache = PagedKVCache(cfg, rope=RopeConfig(head_dim=D, base=500000.0))
        for name, before, q_lens in cases:
            row = _case(torch, kv, cache, name, before, q_lens, args.steps)
            row["src"] = args.src
            print(json.dumps(row) if args.json_line else
                  f"{row['src']:>10} {kv:>5} {name:<28} wall {row['wall_us']:9.1f} us  "
                  f"device {row['device_us']:9.1f} us",
                  flush=True)
        del cache
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
