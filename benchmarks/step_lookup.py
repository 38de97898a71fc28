"""Issue 12 item 2: is resolving each row's target once per step (one small kernel writing a slot mapping that
every layer reuses) as fast as each layer's append looking its rows up?

One process, H100. A 32-layer step captured in a CUDA graph (a server's decode), replayed with L2 flushed
between replays (``triton.testing.do_bench``), over a pool of >= 8192 blocks per layer with blocks drawn at
random from all of it, distinct K / V per layer:

* ``ragged``: 32 x ``PagedKVCache.append(layer, k, v, plan)`` of a plan ``cache.plan(block_tables, cu_q_lens,
  kv_lens)`` (the kernel looks each row up);
* ``slots``: one resolve kernel (block tables + lengths -> slot mapping + positions) + 32 x
  ``append(layer, k, v, plan)`` of ``cache.plan(slot_mapping=, positions=)``.

Usage: python benchmarks/step_lookup.py [--json PATH]   (PYTHONPATH=src)
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from kvcache import PagedConfig, PagedKVCache, RopeConfig
from kvcache.bench.paged import random_slots
from kvcache.bench.timing import graph_replay_us

H, D, LAYERS = 8, 128, 32


@triton.jit
def _resolve(block_tables, cu_q, kv_lens, slots, positions, n_rows, n_seqs, bt_stride, table_width,
             BLOCK_SIZE: tl.constexpr, NUM_BLOCKS: tl.constexpr, LOG_B: tl.constexpr, R: tl.constexpr):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    inb = rows < n_rows
    lo = rows * 0
    hi = lo + n_seqs
    for _ in tl.static_range(LOG_B):
        mid = (lo + hi) // 2
        go = tl.load(cu_q + mid, mask=inb, other=0) <= rows
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    b = lo
    q0 = tl.load(cu_q + b, mask=inb, other=0)
    q1 = tl.load(cu_q + b + 1, mask=inb, other=0)
    pos = tl.load(kv_lens + b, mask=inb, other=0) + rows - q0
    valid = inb & (rows < q1) & (pos >= 0)
    bi = pos // BLOCK_SIZE
    valid = valid & (bi < table_width)
    blk = tl.load(block_tables + b.to(tl.int64) * bt_stride + bi, mask=valid, other=-1).to(tl.int64)
    valid = valid & (blk >= 0) & (blk < NUM_BLOCKS)
    tl.store(slots + rows, tl.where(valid, blk * BLOCK_SIZE + pos % BLOCK_SIZE, -1), mask=inb)
    tl.store(positions + rows, tl.where(valid, pos, 0).to(tl.int64), mask=inb)


def resolve(block_tables, cu_q, kv_lens, slots, positions, block_size, num_blocks):  # type: ignore[no-untyped-def]
    n, b = slots.shape[0], kv_lens.shape[0]
    r = 128
    _resolve[(triton.cdiv(n, r),)](block_tables, cu_q, kv_lens, slots, positions, n, b, block_tables.stride(0),
                                   block_tables.shape[1], BLOCK_SIZE=block_size, NUM_BLOCKS=num_blocks,
                                   LOG_B=max(b - 1, 0).bit_length(), R=r, num_warps=4)


def case(kind: str, n_seqs: int, q_len: int, ctx: int, bs: int, kv_dtype: str, nb: int, rope: bool) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    cfg = PagedConfig(num_layers=LAYERS, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                      dtype=torch.float16, kv_dtype=kv_dtype, device=dev)
    cache = PagedKVCache(cfg, rope=RopeConfig(head_dim=D, base=500000.0) if rope else None)
    n = n_seqs * q_len
    kv_lens = torch.full((n_seqs,), ctx, dtype=torch.int32)
    if q_len == 1:
        kv_lens = torch.randint(1, ctx, (n_seqs,), generator=gen, dtype=torch.int32)
    # every block a step writes is distinct and drawn at random from the whole pool (as kvcache bench paged)
    tables, _ = random_slots(n, kv_lens, q_len, bs, nb, gen)
    tables, kv_lens = tables.to(dev), kv_lens.to(dev)
    cu_q = torch.arange(0, n + 1, q_len, dtype=torch.int32, device=dev)
    ks = [torch.randn(n, H, D, dtype=torch.float16, device=dev) for _ in range(LAYERS)]
    vs = [torch.randn(n, H, D, dtype=torch.float16, device=dev) for _ in range(LAYERS)]
    slots = torch.empty(n, dtype=torch.int64, device=dev)
    positions = torch.empty(n, dtype=torch.int64, device=dev)

    def ragged() -> None:
        plan = cache.plan(tables, cu_q, kv_lens)
        for i in range(LAYERS):
            cache.append(i, ks[i], vs[i], plan)

    def by_slots() -> None:
        resolve(tables, cu_q, kv_lens, slots, positions, bs, nb)
        plan = cache.plan(slot_mapping=slots, positions=positions)
        for i in range(LAYERS):
            cache.append(i, ks[i], vs[i], plan)

    def by_slots_ready() -> None:
        resolve(tables, cu_q, kv_lens, slots, positions, bs, nb)
        first = cache.plan(slot_mapping=slots, positions=positions)  # the resolve kernel may still run: no promise
        ready = cache.plan(slot_mapping=slots, positions=positions, metadata_ready=True)
        for i in range(LAYERS):
            cache.append(i, ks[i], vs[i], ready if i > 0 else first)

    def resolve_only() -> None:
        resolve(tables, cu_q, kv_lens, slots, positions, bs, nb)

    out = {"kind": kind, "rows": n, "block_size": bs, "kv_dtype": kv_dtype, "rope": rope, "num_blocks": nb}
    # the two variants store the same bytes
    def written() -> list[torch.Tensor]:  # the rows this step writes, layers 0 and 31 (NHD)
        s = slots[slots >= 0]
        return [cache.buffer[i].view(nb, 2, bs, -1)[s // bs, :, s % bs].clone() for i in (0, LAYERS - 1)]

    resolve_only()
    cache.buffer.fill_(0)
    ragged()
    ref = written()
    cache.buffer.fill_(0)
    by_slots()
    out["same_bytes"] = all(torch.equal(a, b) for a, b in zip(ref, written())) and bool((slots >= 0).all())
    del ref
    for name, fn in (("ragged", ragged), ("slots", by_slots), ("slots_ready", by_slots_ready),
                     ("resolve_only", resolve_only)):
        out[name + "_us"] = graph_replay_us(fn, rep=300, warmup=50)[0]
    out["slots_vs_ragged_pct"] = 100.0 * (out["slots_us"] / out["ragged_us"] - 1.0)
    out["slots_ready_vs_ragged_pct"] = 100.0 * (out["slots_ready_us"] / out["ragged_us"] - 1.0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    rows = []
    for rnd in range(a.rounds):
        for kv_dtype in ("auto", "fp8", "int8", "int4"):
            for bs in (16, 64):
                nb = 8192 if bs == 16 else 2048  # 16 GiB of fp16 pool over the 32 layers
                for kind, n_seqs, q_len, ctx in (("decode", 256, 1, 1000), ("prefill", 8, 2048, 0)):
                    r = case(kind, n_seqs, q_len, ctx, bs, kv_dtype, nb, rope=True)
                    r["round"] = rnd
                    rows.append(r)
                    torch.cuda.empty_cache()  # the case's cache is gone: give its pool back before the next one
                    print(f"{kind:8s} {kv_dtype:5s} b{bs:<3d} ragged {r['ragged_us']:8.1f} us  slots "
                          f"{r['slots_us']:8.1f} ({r['slots_vs_ragged_pct']:+5.1f}%)  slots+ready "
                          f"{r['slots_ready_us']:8.1f} ({r['slots_ready_vs_ragged_pct']:+5.1f}%)  resolve "
                          f"{r['resolve_only_us']:5.1f}  same bytes {r['same_bytes']}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
