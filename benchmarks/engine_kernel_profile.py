"""GPU time per kernel of one engine ``generate`` per kv_dtype (the engine bench's workload: Llama-3.2-1B-shaped
random weights, 64 x (512 + 128) tokens, greedy), from ``torch.profiler``: where one kv_dtype's time goes against
another's. An experiment beside ``kvcache.bench.engine``.

    python benchmarks/engine_kernel_profile.py --kv-dtypes auto,int8 --top 14
"""

from __future__ import annotations

import argparse
import collections
import sys


def _attention_by_launch(prof, kv: str) -> None:  # type: ignore[no-untyped-def]
    """The attention kernel's GPU time per (grid, block) of its launches: decode and prefill launches differ in
    both (decode: 16-row tiles, one program per (tile, head, split); prefill: 64- or 128-row tiles)."""
    import json
    import os
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    groups: dict = collections.defaultdict(lambda: [0, 0.0])
    for ev in events:
        if ev.get("cat") == "kernel" and ev.get("name", "").startswith("_attention_kernel"):
            a = ev.get("args", {})
            key = (tuple(a.get("grid", ())), tuple(a.get("block", ())))
            groups[key][0] += 1
            groups[key][1] += ev.get("dur", 0.0)
    print(f"## {kv}: attention launches by (grid, block)")
    print("| grid | block | launches | total ms | mean us |")
    print("| --- | --- | ---: | ---: | ---: |")
    for (grid, block), (n, us) in sorted(groups.items(), key=lambda kv_: -kv_[1][1])[:12]:
        print(f"| {grid} | {block} | {n} | {us / 1e3:.2f} | {us / max(n, 1):.1f} |")


def _gaps(prof, kv: str, top: int = 15, largest: int = 0) -> None:  # type: ignore[no-untyped-def]
    """Where the GPU sits idle during the generate: gaps between consecutive GPU activities (kernels, copies, sets)
    of the trace, with the activities on either side. The profiler slows the host's launches, so gaps are upper
    bounds of the unprofiled run's."""
    import json
    import os
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    acts = sorted((ev["ts"], ev["ts"] + ev.get("dur", 0.0), ev.get("name", "")[:48]) for ev in events
                  if ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in ev)
    if not acts:
        print(f"## {kv}: no GPU activity in the trace")
        return
    span = acts[-1][1] - acts[0][0]
    busy = 0.0
    end = acts[0][0]
    gaps = []
    for i, (a, b, name) in enumerate(acts):
        if a > end:
            gaps.append((a - end, acts[i - 1][2] if i else "", name, end - acts[0][0]))
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    big = [g for g in gaps if g[0] > 20.0]
    print(f"## {kv}: GPU timeline of one generate")
    print(f"span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, idle {(span - busy) / 1e3:.2f} ms; "
          f"{len(gaps)} gaps, {len(big)} over 20 us ({sum(g[0] for g in big) / 1e3:.2f} ms)")
    pairs: dict = collections.defaultdict(lambda: [0, 0.0])
    for us, before, after, _ in big:
        pairs[(before, after)][0] += 1
        pairs[(before, after)][1] += us
    print("| after kernel | before kernel | gaps > 20 us | total ms | mean us |")
    print("| --- | --- | ---: | ---: | ---: |")
    for (before, after), (n, us) in sorted(pairs.items(), key=lambda kv_: -kv_[1][1])[:top]:
        print(f"| {before} | {after} | {n} | {us / 1e3:.2f} | {us / n:.1f} |")
    if largest:
        print(f"the {largest} largest gaps: | at ms | us | after | before |")
        for us, before, after, at in sorted(gaps, key=lambda g: -g[0])[:largest]:
            print(f"| {at / 1e3:.2f} | {us:.0f} | {before} | {after} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-dtypes", default="auto,int8")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--split-attention", action="store_true",
                    help="also print the attention kernel's time per launch shape (grid, block) from the trace")
    ap.add_argument("--gaps", action="store_true", help="also print where the GPU sits idle (from the trace)")
    ap.add_argument("--largest", type=int, default=0, help="with --gaps: list the N largest gaps and when they fell")
    ap.add_argument("--phases", action="store_true",
                    help="also time (unprofiled, median of 3) generate with max_tokens 1 and the full 128: the prefill "
                         "phase's wall time and the decode steps' mean")
    args = ap.parse_args()
    sys.path.insert(0, "src")
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvcache.bench import engine as be
    from kvcache.engine import LLM, SamplingParams

    dev = torch.device("cuda")
    n_req, plen, new = 64, 512, 128
    prompts = be._prompts(n_req, plen, be.SHAPE["vocab_size"])
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    tables = {}
    for kv in args.kv_dtypes.split(","):
        llm = LLM(be._model(dev), tokenizer=be._IdsOnlyTokenizer(), kv_dtype=kv, max_num_seqs=n_req,
                  kv_cache_memory=8 * 2**30, max_model_len=plen + new, enable_prefix_caching=False)
        llm.generate(prompts, sp)  # compile and capture
        torch.cuda.synchronize()
        if args.phases:
            import statistics
            import time
            ms = {}
            for m in (1, new):
                p1 = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                llm.generate(prompts, p1)
                times = []
                for _ in range(3):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    llm.generate(prompts, p1)
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
                ms[m] = statistics.median(times)
            print(f"## {kv}: generate max_tokens=1 {ms[1]:.1f} ms (prefill steps), max_tokens={new} {ms[new]:.1f} ms: "
                  f"{(ms[new] - ms[1]) / (new - 1) * 1e3:.0f} us per decode step, {n_req * new / ms[new] * 1e3:,.0f} "
                  "tok/s")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, sp)
            torch.cuda.synchronize()
        per = collections.Counter()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                per[ev.name[:60]] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        tables[kv] = per
        if args.split_attention:
            _attention_by_launch(prof, kv)
        if args.gaps:
            _gaps(prof, kv, largest=args.largest)
        del llm
        torch.cuda.empty_cache()
    names = collections.Counter()
    for per in tables.values():
        names.update(per)
    kvs = list(tables)
    print("| kernel | " + " | ".join(f"{kv} (ms)" for kv in kvs) + " |")
    print("| --- |" + " ---: |" * len(kvs))
    for name, _ in names.most_common(args.top):
        print(f"| {name} | " + " | ".join(f"{tables[kv][name] / 1e3:.2f}" for kv in kvs) + " |")
    print("| total | " + " | ".join(f"{sum(tables[kv].values()) / 1e3:.2f}" for kv in kvs) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
