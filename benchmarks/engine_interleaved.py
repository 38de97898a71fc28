"""Engine throughput per kv_dtype, measured in interleaved rounds (an experiment beside ``kvcache.bench.engine``).

One engine per kv_dtype (each on its own copy of the model: an engine fuses its model's weights) is built and warmed
up once; then every round times one ``generate`` of each, in an order that rotates from round to round, so slow
drifts of the GPU (clocks, temperature) fall on every kv_dtype alike (a number of rounds that is a multiple of the
engines' count gives each engine every position equally often).
Reported per kv_dtype: the median over rounds, and per round the ratio to the first kv_dtype's time of the same
round (paired), with its median and range: "int8 no slower than bf16" is judged on those paired ratios.
Optionally times transformers' ``generate`` with a StaticCache after a full-size warm-up call, so its compilation
is not inside the timed call (the fair same-run baseline).

    python benchmarks/engine_interleaved.py --kv-dtypes auto,int8,int4 --rounds 9 --static --out inter.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-dtypes", default="auto,int8,int4")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--static", action="store_true", help="also time HF generate + StaticCache (warmed up)")
    ap.add_argument("--out", default="engine_interleaved.json")
    ap.add_argument("--hnd", action="store_true", help="also one engine per kv_dtype on an HND pool (label KV@HND)")
    ap.add_argument("--layout", choices=("NHD", "HND"), default="NHD", help="pool layout of the --kv-dtypes engines")
    ap.add_argument("--tile", action="append", default=[],
                    help="an extra engine LABEL=KV:BLOCK_N,STAGES[,WARPS[,WARP_SPLIT]] whose head_dim<=64 decode "
                         "tiles differ from the policy's (e.g. int4-128=int4:128,2; warp-split tiles at any length: "
                         "int8-ws2=int8:64,3,2,1); HND pools with --hnd; repeatable")
    ap.add_argument("--kv-gib", type=float, default=8.0, help="KV cache memory per engine (GiB)")
    ap.add_argument("--split", action="append", default=[],
                    help="an extra engine LABEL=KV:SPLITS whose decode launches split the KV range SPLITS ways "
                         "(forced, as num_splits=; e.g. int8-s2=int8:2); HND pools with --hnd; repeatable")
    ap.add_argument("--variant", action="append", default=[],
                    help="an extra engine LABEL=KV:WHAT, WHAT one of step-by-step (every step read before the next "
                         "is scheduled: no overlapped eager steps), rope-kernel (the queries rotated by their own "
                         "kernel, not inside attention); layout as --layout; repeatable")
    args = ap.parse_args()
    sys.path.insert(0, "src")
    import torch

    from kvcache.bench import engine as be
    from kvcache.engine import LLM, SamplingParams
    from kvcache.ops.attention import paged, policy

    dev = torch.device("cuda")
    n_req, plen, new = 64, 512, 128
    model = be._model(dev)  # the StaticCache baseline's; each engine fuses the weights of its own copy
    prompts = be._prompts(n_req, plen, be.SHAPE["vocab_size"])
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    kvs = [k for k in args.kv_dtypes.split(",") if k]
    fmt = {kv: kv for kv in kvs}
    layout = {kv: args.layout for kv in kvs}
    if args.hnd:
        for kv in list(kvs):
            kvs.append(f"{kv}@HND")
            fmt[kvs[-1]], layout[kvs[-1]] = kv, "HND"
    tiles: dict[str, tuple[int, int, int, bool]] = {}
    for t in args.tile:
        label, spec = t.split("=")
        kv, cfg = spec.split(":")
        bn, st, *w = (int(x) for x in cfg.split(","))
        kvs.append(label)
        fmt[label], layout[label] = kv, "HND" if args.hnd else args.layout
        tiles[label] = (bn, st, w[0] if w else 4, len(w) > 1 and bool(w[1]))
    splits: dict[str, int] = {}
    for t in args.split:
        label, spec = t.split("=")
        kv, n = spec.split(":")
        kvs.append(label)
        fmt[label], layout[label] = kv, "HND" if args.hnd else args.layout
        splits[label] = int(n)
    variants: dict[str, str] = {}
    for t in args.variant:
        label, spec = t.split("=")
        kv, what = spec.split(":")
        if what not in ("step-by-step", "rope-kernel"):
            raise SystemExit(f"--variant: unknown {what!r}")
        kvs.append(label)
        fmt[label], layout[label] = kv, args.layout
        variants[label] = what
    llms = {}
    plan0 = paged.attention_plan

    def split_plan(n: int):  # type: ignore[no-untyped-def]
        def plan(**kw):  # type: ignore[no-untyped-def]
            if kw["n_tokens"] <= policy.DECODE_ROWS * max(kw["num_seqs"], 1):
                kw["num_splits"] = n
            return plan0(**kw)
        return plan

    def gen(label: str) -> None:
        """generate on the engine ``label``, with its decode tiles in the policy while it runs (and captures)."""
        kv = fmt[label]
        old = policy.DECODE_TILE_SMALL[kv]
        ws_min = policy.WARP_SPLIT_MIN_KV
        policy.DECODE_TILE_SMALL[kv] = tiles.get(label, old)
        if tiles.get(label, old)[3]:
            policy.WARP_SPLIT_MIN_KV = 0
        paged.attention_plan = split_plan(splits[label]) if label in splits else plan0
        try:
            llms[label].generate(prompts, sp)
        finally:
            policy.DECODE_TILE_SMALL[kv] = old
            policy.WARP_SPLIT_MIN_KV = ws_min
            paged.attention_plan = plan0

    from kvcache.engine.paged_loop import PagedLoop

    class StepByStep(LLM):
        def _run(self, core, seqs, st, progress):  # type: ignore[no-untyped-def]
            PagedLoop(self.scheduler, self.runner, self._finish_reason, overlap=False).run(seqs, st, progress)

    for label in kvs:
        cls = StepByStep if variants.get(label) == "step-by-step" else LLM
        llms[label] = cls(be._model(dev), tokenizer=be._IdsOnlyTokenizer(), kv_dtype=fmt[label], max_num_seqs=n_req,
                          kv_cache_memory=int(args.kv_gib * 2**30), max_model_len=plen + new,
                          enable_prefix_caching=False,
                          layout=layout[label])
        if variants.get(label) == "rope-kernel":
            llms[label].runner._q_rope = None  # the model rotates the queries (its RoPE kernel) before attention
        gen(label)  # compile and capture every decode bucket
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {kv: [] for kv in kvs}
    for r in range(args.rounds):
        order = kvs[r % len(kvs):] + kvs[: r % len(kvs)]
        for kv in order:
            gen(kv)
            times[kv].append(llms[kv].stats.elapsed_s)
        print(f"round {r}: " + ", ".join(f"{kv} {n_req * new / times[kv][-1]:,.0f} tok/s" for kv in kvs), flush=True)
    base = kvs[0]
    rows = []
    for kv in kvs:
        tok_s = [n_req * new / t for t in times[kv]]
        ratios = [times[base][i] / times[kv][i] for i in range(args.rounds)]  # > 1: faster than the base
        rows.append(dict(kv_dtype=fmt[kv], label=kv, layout=layout[kv], tiles=tiles.get(kv), variant=variants.get(kv),
                         median_tok_s=statistics.median(tok_s),
                         runs_tok_s=[round(x) for x in tok_s],
                         paired_speed_vs_base_median=statistics.median(ratios), paired_min=min(ratios),
                         paired_max=max(ratios)))
        print(f"{kv:9s} median {statistics.median(tok_s):8,.0f} tok/s; vs {base} per round: median "
              f"{statistics.median(ratios):.4f} (min {min(ratios):.4f}, max {max(ratios):.4f})", flush=True)
    result = {"rounds": args.rounds, "workload": f"{n_req} x ({plen} + {new})", "rows": rows,
              "device": torch.cuda.get_device_name(dev), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    llms.clear()
    be._free()
    if args.static:
        ids = torch.tensor(prompts, device=dev)
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(ids),
                  pad_token_id=model.config.pad_token_id, cache_implementation="static")
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(ids, **kw)  # full-size warm-up: compilation happens here
            torch.cuda.synchronize()
            warm = time.perf_counter() - t0
            st = []
            for _ in range(3):
                t0 = time.perf_counter()
                out = model.generate(ids, **kw)
                torch.cuda.synchronize()
                st.append(time.perf_counter() - t0)
        n = (out.shape[1] - ids.shape[1]) * out.shape[0]
        tok_s = [n / t for t in st]
        result["hf_static"] = dict(warmup_s=warm, runs_tok_s=[round(x) for x in tok_s],
                                   median_tok_s=statistics.median(tok_s))
        print(f"HF generate + StaticCache: warm-up {warm:.1f} s, then {[round(x) for x in tok_s]} tok/s", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
