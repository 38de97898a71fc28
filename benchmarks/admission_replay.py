"""Replay the fixed-budget engine workload through the paged scheduler alone (no model, no GPU): what an admission
policy does to the steps, the prompt tokens fed (recomputes included) and the preemptions, in seconds on the CPU.

The workload is ``python -m kvcache.bench.engine --capacity``'s: an 8B-shaped model's KV (32 layers, 8 KV heads x
128, bf16), 4 GiB of it, 192 requests x (512 prompt + 512 new) tokens (``--varied-lengths``: each request's
max_tokens drawn from 64..960, the bench's seed), EOS ignored, prefix caching off, a token budget of 8,192 a step.
Every sampled token is one fixed id: the scheduler decides from token counts alone, so the steps it takes are the
GPU run's (H200, 2026-11-29: 3,074 / 2,048 / 1,540 / 1,028 / 1,538 steps for bf16 / int8 / fp8 / int4 / k8v4 by
default, 2,562 / 1,533 / 1,492 / 951 / 1,033 with ``decode_reserve=0``; the preemption counts within a few).

Policies differ only in how the same decode rows are packed into steps and in what they recompute: every generated
token reads the same context under any policy. So the time a policy adds or saves against the first one listed is
estimated as ``a * steps + d * prompt tokens fed + e * steps that are not pure decode`` of the difference; the
constants are a least-squares fit of the bench's H200 runs (4.9 ms a step, 24.5 us a prompt token, 3.2 ms more for a
step outside the decode graphs), off by up to ~0.5 s a run: a guide for choosing what to measure, not a
measurement.

    python benchmarks/admission_replay.py --kv-dtypes auto,int4,k8v4 --decode-reserves default,0 [--varied-lengths]
"""

from __future__ import annotations

import argparse
import json

import torch

from kvcache.bench.engine import CAPACITY, SHAPE_8B, _capacity_lengths
from kvcache.engine.sampling import SamplingParams
from kvcache.engine.scheduler import Scheduler
from kvcache.engine.sequence import Sequence
from kvcache.ops.paged.format import KV_FORMATS
from kvcache.paged import BlockAllocator, cache_block_bytes

REQUESTS, PROMPT = CAPACITY["requests"], CAPACITY["prompt_tokens"]
BUDGET, BLOCK = 8192, 16  # the engine's token budget on CUDA, its default block size
KV_BYTES = CAPACITY["kv_gib"] * 2**30
COST = (4.9e-3, 24.5e-6, 3.2e-3)  # seconds: a step, a prompt token fed, a step outside the decode graphs


def replay(kv_dtype: str, reserve: float | None, varied: bool = False, requests: int = REQUESTS,
           kv_bytes: int = KV_BYTES) -> dict:
    """Steps, prompt tokens fed, non-decode steps and preemptions of the workload under ``decode_reserve=reserve``."""
    num_blocks = kv_bytes // cache_block_bytes(SHAPE_8B["num_hidden_layers"], SHAPE_8B["num_key_value_heads"],
                                               SHAPE_8B["head_dim"], BLOCK, torch.bfloat16, kv_dtype)
    new = _capacity_lengths(requests, varied)  # the bench's own draw
    s = Scheduler(BlockAllocator(num_blocks, BLOCK, enable_prefix_caching=False), max_num_seqs=requests,
                  max_num_batched_tokens=BUDGET, max_blocks_per_seq=-(-(PROMPT + max(new)) // BLOCK),
                  decode_reserve=reserve)
    for i, n in enumerate(new):
        s.add(Sequence(i, [1] * PROMPT, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))
    out = {"kv_dtype": kv_dtype, "decode_reserve": "default" if reserve is None else reserve, "num_blocks": num_blocks,
           "steps": 0, "prompt_tokens_fed": 0, "mixed_steps": 0}
    while s.has_unfinished():
        batch = s.schedule()
        out["steps"] += 1
        out["prompt_tokens_fed"] += sum(n for n in batch.num_tokens if n > 1)
        out["mixed_steps"] += not batch.is_decode
        s.postprocess(batch, [7 if f else None for f in batch.sample])
        for q, f in zip(batch.seqs, batch.sample):
            if f and q.num_generated >= q.params.max_tokens:
                s.finish(q, "length")
    out["preemptions"] = s.num_preemptions
    out["generated_tokens"] = sum(new)
    return out


def estimate_s(row: dict, base: dict, cost: tuple[float, float, float] = COST) -> float:
    """Seconds the fitted step-cost model gives ``row`` over ``base`` (the same workload under another policy)."""
    a, d, e = cost
    return sum(c * (row[k] - base[k]) for c, k in zip((a, d, e), ("steps", "prompt_tokens_fed", "mixed_steps")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-dtypes", default="auto,int8,fp8,int4,k8v4")
    p.add_argument("--decode-reserves", default="default,0")
    p.add_argument("--varied-lengths", action="store_true")
    p.add_argument("--requests", type=int, default=REQUESTS)
    p.add_argument("--kv-gib", type=float, default=KV_BYTES / 2**30)
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    kinds = a.kv_dtypes.split(",")
    if any(k not in KV_FORMATS for k in kinds):
        p.error(f"--kv-dtypes: expected values of {KV_FORMATS}, got {a.kv_dtypes!r}")
    reserves = [None if r == "default" else float(r) for r in a.decode_reserves.split(",")]
    rows, first = [], {}
    print(f"| kv_dtype | decode_reserve | blocks | steps | prompt tokens fed | mixed steps | preemptions | est. s vs "
          f"{a.decode_reserves.split(',')[0]} |\n|---|---|---:|---:|---:|---:|---:|---:|")
    for reserve in reserves:
        for kv in kinds:
            r = replay(kv, reserve, a.varied_lengths, a.requests, int(a.kv_gib * 2**30))
            r["estimated_s_vs_first"] = estimate_s(r, first.setdefault(kv, r))
            rows.append(r)
            print(f"| {kv} | {r['decode_reserve']} | {r['num_blocks']} | {r['steps']} | {r['prompt_tokens_fed']} | "
                  f"{r['mixed_steps']} | {r['preemptions']} | {r['estimated_s_vs_first']:+.2f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
