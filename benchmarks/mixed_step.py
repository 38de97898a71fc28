"""Attention of a mixed continuous-batching step: many decode rows plus one prefill chunk, launched as one batch
(``num_decode=0``: every sequence gets the prefill tiles the batch's average calls for) or split into decode and
prefill tiles (``num_decode`` = the leading decode sequences). Beside them, the decode rows alone and the chunk alone
(the split's two halves as separate calls).

Conditions are the attention bench's: a pool of >= 8192 blocks (random blocks from all of it), CUDA-graph replays
with L2 flushed. head_dim 128 with fp16 queries (issue 14's heads), and the engine's head_dim 64 with bf16 queries.

    python benchmarks/mixed_step.py --out mixed.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

# (label, head_dim, query dtype, decode sequences, their cached tokens, prefill chunk rows, its cached tokens)
CASES = [
    ("63 x 4k decode + 512-token chunk, D 128", 128, torch.float16, 63, 4096, 512, 0),
    ("63 x 600 decode + 512-token chunk, D 64", 64, torch.bfloat16, 63, 600, 512, 0),
    ("31 x 16k decode + 2048-token chunk after 2048, D 128", 128, torch.float16, 31, 16384, 2048, 2048),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="auto,fp8,int8,int4")
    ap.add_argument("--rep", type=int, default=60)
    ap.add_argument("--out", default="mixed_step.json")
    args = ap.parse_args()
    sys.path.insert(0, "src")
    import kvcache.bench.attention as ba
    from kvcache.bench.timing import graph_replay_us
    from kvcache.ops import paged_attention

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for label, d, qdt, nd, dec_ctx, chunk, chunk_cached in CASES:
        ba.D = d
        for fmt in args.formats.split(","):
            seqs = [(1, dec_ctx)] * nd + [(chunk, chunk_cached + chunk)]
            tokens = sum(kv for _, kv in seqs)
            p = ba.Pool(fmt, 16, max(8192, -(-int(1.2 * tokens) // 16)), dev, gen)
            if fmt == "auto":
                p.pool = p.pool.to(qdt)
            width = max(-(-kv // 16) for _, kv in seqs)
            perm = torch.randperm(p.num_blocks, device=dev, generator=gen)
            bt = torch.zeros((len(seqs), width), dtype=torch.int32, device=dev)
            at = 0
            for b, (_, kv) in enumerate(seqs):
                nb = -(-kv // 16)
                bt[b, :nb] = perm[at: at + nb].to(torch.int32)
                at += nb
            cu = [0]
            for ql, _ in seqs:
                cu.append(cu[-1] + ql)
            cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
            kl = torch.tensor([kv for _, kv in seqs], dtype=torch.int32, device=dev)
            q = torch.randn((cu[-1], ba.HQ, d), dtype=qdt, device=dev, generator=gen)
            out = torch.empty_like(q)
            max_kv = max(kv for _, kv in seqs)

            def call(q_, bt_, cu_, kl_, out_, num_decode=0, p=p, fmt=fmt, max_kv=max_kv):  # type: ignore[no-untyped-def]
                return lambda: paged_attention(q_, p.pool, p.params, p.kv_scales, kv_dtype=fmt, layout="NHD",
                                               block_tables=bt_, cu_q_lens=cu_, kv_lens=kl_, out=out_,
                                               max_kv_len=max_kv, num_decode=num_decode)

            one, _ = graph_replay_us(call(q, bt, cu_t, kl, out), rep=args.rep)
            split, _ = graph_replay_us(call(q, bt, cu_t, kl, out, num_decode=nd), rep=args.rep)
            ref = out.clone()
            call(q, bt, cu_t, kl, out)()
            err = (out.float() - ref.float()).abs().max().item()
            dec_only, _ = graph_replay_us(call(q[:nd], bt[:nd], cu_t[:nd + 1], kl[:nd], out[:nd]), rep=args.rep)
            cu_c = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
            chunk_only, _ = graph_replay_us(call(q[nd:], bt[nd:], cu_c, kl[nd:], out[nd:]), rep=args.rep)
            row = dict(case=label, fmt=fmt, one_launch_us=one, split_us=split, decode_alone_us=dec_only,
                       chunk_alone_us=chunk_only, max_abs_diff_split_vs_one=err)
            rows.append(row)
            print(f"{label:52s} {fmt:5s} one launch {one:8.1f} us | num_decode={nd}: {split:8.1f} us "
                  f"({one / split:.2f}x) | decode alone {dec_only:7.1f} + chunk alone {chunk_only:7.1f} us | "
                  f"max |diff| {err:.2e}", flush=True)
            del p
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
