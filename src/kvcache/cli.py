"""Command line: kvcache demo | plan | eval | info | bench | plot, and --version.

  demo        SmolLM2 answers chat questions on kvcache's engine (kvcache demo --help).
  eval        quality of each stored KV format against full precision on a model and a text (kvcache eval --help).
  plan        bytes per token, and tokens / sequences that fit in a memory budget, per kv_dtype, for a model.
  info        backends, devices and a smoke run of the linear and paged ops through the public API.
  bench       GPU benchmarks: linear | paged | attention | engine; with --json FILE also a PNG plot beside it.
  plot        the PNGs of a bench result written earlier (e.g. on another machine), one per case family.

Bad input (a missing file, an unknown dtype or device, an unsupported model) is reported in one line,
"kvcache: error: ...", with exit code 2; --debug (before or after the command) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads inside the commands that run something: --help answers without it
    import torch


def _devices() -> list[torch.device]:
    import torch

    devs = [torch.device("cpu")]
    if torch.cuda.is_available():
        devs.insert(0, torch.device("cuda", torch.cuda.current_device()))
    return devs


def _smoke(device: torch.device) -> list[tuple[str, bool, str]]:
    """Run every op once on small random data and compare with an explicit expectation."""
    import torch

    from . import ops
    from .linear import CacheConfig, KVCacheManager, KVLayerConfig, LinearKVCache, ManagerConfig

    g = torch.Generator(device="cpu").manual_seed(0)
    results: list[tuple[str, bool, str]] = []

    def run(name: str, fn: Callable[[], bool]) -> None:
        try:
            ok = bool(fn())
            results.append((name, ok, "" if ok else "mismatch"))
        except Exception as e:  # report, keep going
            results.append((name, False, f"{type(e).__name__}: {e}"))

    B, H, S, D = 4, 3, 24, 80
    layer = torch.randn(B, 2, H, S, D, generator=g).to(torch.float16).to(device)

    def t_increment() -> bool:
        lens = torch.tensor([1, 2, 3], dtype=torch.int32, device=device)
        ops.increment_lengths(lens, 2)
        ops.increment_lengths(lens, torch.tensor([1, 0, 5], dtype=torch.int32, device=device))
        return lens.tolist() == [4, 4, 10]

    def t_save_restore() -> bool:
        snap = torch.empty(2, H, 9, D, dtype=torch.float16, device=device)
        ops.save_kv_layer(layer, snap, 2)
        other = layer.clone()
        ops.restore_kv_layer(snap, other, 0)
        return torch.equal(snap, layer[2, :, :, :9]) and torch.equal(other[0, :, :, :9], layer[2, :, :, :9])

    def t_layers() -> bool:
        layers = [torch.randn(B, 2, h, S, d, generator=g).to(torch.bfloat16).to(device) for h, d in ((1, 64), (3, 96))]
        snaps = [torch.empty(2, t.shape[2], 7, t.shape[4], dtype=t.dtype, device=device) for t in layers]
        ops.save_kv_layers(layers, snaps, 1, 7)
        back = [torch.zeros_like(t) for t in layers]
        ops.restore_kv_layers(snaps, back, 3, 7)
        return all(torch.equal(b[3, :, :, :7], t[1, :, :, :7]) for b, t in zip(back, layers))

    def t_compact() -> bool:
        mapping, new = ops.build_batch_mapping(torch.tensor([False, True, False, False], device=device))
        lens = torch.tensor([5, 6, 7, 8], dtype=torch.int32, device=device)
        work = layer.clone()
        ops.compact_kv_layer(work, mapping, lens, 4, new, dst_lengths=lens)
        ok = lens[:3].tolist() == [5, 7, 8] and mapping.tolist() == [0, -1, 1, 2]
        moves = ((0, 0, 5), (2, 1, 7), (3, 2, 8))
        return ok and all(torch.equal(work[j, :, :, :n], layer[i, :, :, :n]) for i, j, n in moves)

    def t_compact_batch() -> bool:
        x = torch.randn(4, 5, generator=g).to(device)
        mapping, new = ops.build_batch_mapping([True, False, True, False])
        y = torch.empty(2, 5, device=device)
        ops.compact_batch(x, mapping.to(device), y, 4, new)
        return torch.equal(y, x[[1, 3]])

    def t_linear() -> bool:
        cache = LinearKVCache(CacheConfig(num_layers=2, max_batch_size=3, max_seq_len=16, num_kv_heads=2,
                                          head_dim=8, device=device))
        cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=g).to(torch.float16))
        cache.reset_for_new_sequences([3, 4, 5])
        cache.commit(1)
        snap = cache.save(2, 6)
        cache.evict([True, False, False])
        cache.restore(snap, 2)
        return cache.lengths.tolist() == [5, 6] and torch.equal(cache.layer(1)[2, :, :, :6], snap.layers[1])

    def t_manager() -> bool:
        cfg = ManagerConfig(max_batch_size=3, max_seq_len=16, layers=[KVLayerConfig(2, 8), KVLayerConfig(1, 80)],
                            dtype=torch.float8_e4m3fn, device=device)
        m = KVCacheManager(cfg)
        for i in range(m.num_layers):
            m.layer(i).copy_(torch.randn(m.layer(i).shape, generator=g).to(torch.float8_e4m3fn))
        ref = [m.layer(i).clone() for i in range(m.num_layers)]
        m.reset_for_new_sequences([2, 9, 4])
        m.evict([False, True, False])
        return m.lengths.tolist() == [2, 4] and all(
            torch.equal(m.layer(i)[1, :, :, :4].view(torch.uint8), ref[i][2, :, :, :4].view(torch.uint8))
            for i in range(2)
        )

    def t_linear_append() -> bool:
        cache = LinearKVCache(CacheConfig(num_layers=1, max_batch_size=2, max_seq_len=8, num_kv_heads=2,
                                          head_dim=8, dtype=torch.float32, device=device))
        cache.reset_for_new_sequences([1, 3])
        k = torch.randn(2, 2, 4, 8, generator=g).to(device)
        cache.append(0, k, -k)
        cache.commit(4)
        kc, vc = cache.kv(0)
        return (cache.lengths.tolist() == [5, 7] and torch.equal(kc[0, :, 1:5], k[0])
                and torch.equal(vc[1, :, 3:7], -k[1]))

    for name, fn in (
        ("increment_lengths", t_increment),
        ("save_kv_layer / restore_kv_layer", t_save_restore),
        ("save_kv_layers / restore_kv_layers", t_layers),
        ("build_batch_mapping / compact_kv_layer", t_compact),
        ("compact_batch", t_compact_batch),
        ("LinearKVCache", t_linear),
        ("KVCacheManager (fp8, mixed heads)", t_manager),
        ("LinearKVCache.append (float32, ragged lengths)", t_linear_append),
    ):
        run(name, fn)
    for name, fn in _paged_smoke(device, g):
        run(name, fn)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return results


def _paged_smoke(device: torch.device, g: torch.Generator) -> list[tuple[str, Callable[[], bool]]]:
    """Paged half of the smoke run: allocator, append -> gather per kv_dtype, copy_blocks, paged attention."""
    import torch

    from . import ops
    from .ops.paged.format import kv_format
    from .paged import BlockAllocator, PagedConfig, PagedKVCache

    H, D, bs = 2, 64, 4
    lens = [5, 3]  # two sequences, the first across a block boundary

    def filled(kv_dtype: str, layout: str = "NHD") -> tuple[PagedKVCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = PagedKVCache(PagedConfig(num_layers=2, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=8,
                                         dtype=torch.float32, kv_dtype=kv_dtype, layout=layout, device=device))
        alloc = BlockAllocator(num_blocks=8, block_size=bs)
        tables = [alloc.allocate(cache.config.blocks_for(n)) for n in lens]  # int4b: the block after a partial one
        width = max(len(t) for t in tables)  # type: ignore[arg-type]
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)  # type: ignore[operator]
        k = torch.randn(sum(lens), H, D, generator=g).to(device)
        v = torch.randn(sum(lens), H, D, generator=g).to(device)
        cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=device)
        cache.append(1, k, v, cache.plan(bt, cu, torch.zeros(2, dtype=torch.int32, device=device)))
        return cache, bt, k, v

    def round_trip(kv_dtype: str, layout: str) -> bool:
        cache, bt, k, v = filled(kv_dtype, layout)
        kl = torch.tensor(lens, dtype=torch.int32, device=device)
        ko, vo = cache.gather(1, cache.plan(bt, seq_lens=kl), max_len=max(lens))
        got_k = torch.cat([ko[0, :, :lens[0]].transpose(0, 1), ko[1, :, :lens[1]].transpose(0, 1)])
        got_v = torch.cat([vo[0, :, :lens[0]].transpose(0, 1), vo[1, :, :lens[1]].transpose(0, 1)])
        if kv_dtype == "auto":
            return torch.equal(got_k, k) and torch.equal(got_v, v)
        ok = True
        for x, y in ((k, got_k), (v, got_v)):
            if kv_dtype == "fp8" or (kv_dtype == "fp8k" and x is v):  # e4m3: 3 mantissa bits, half a step
                bound = x.abs() / 16 + 2.0**-9
            elif kv_dtype == "fp8k":  # keys scaled per row by amax / 448: subnormals step by scale / 512
                bound = torch.maximum(x.abs() / 16, x.abs().amax(-1, keepdim=True) / 448 / 1024) * 1.001 + 1e-6
            elif kv_dtype == "int4b" and x is k:  # half a step: a full block's per channel (within the channel's
                # range over the sequence / 15) with fp16 (scale, zero), a partial block's int8 row's (its range / 255)
                rng = torch.cat([(s.amax(0) - s.amin(0)).expand_as(s) for s in x.split(lens)])
                row = x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)
                bound = torch.maximum(rng / 15, row / 255) / 2 * 1.001 + (x.abs() + rng) * 2.0**-9 + 1e-6
            else:  # scale / 2 per (token, head) row, scale = (max - min) / (2^bits - 1)
                levels = kv_format(kv_dtype).qmax_of(0 if x is k else 1)
                rng = x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)
                bound = rng / levels / 2 * 1.001 + 1e-6
            ok = ok and bool(((x - y).abs() <= bound).all())
        return ok

    def t_copy_blocks() -> bool:
        cache, bt, _, _ = filled("int8")
        src = int(bt[0, 0])
        cache.copy_blocks([src], [7])
        return all(torch.equal(cache.pool(i)[7], cache.pool(i)[src]) and torch.equal(cache.params(i)[7],
                                                                                      cache.params(i)[src])
                   for i in range(2))

    def t_allocator() -> bool:
        alloc = BlockAllocator(num_blocks=4, block_size=bs)
        a = alloc.allocate(3)
        shared = alloc.fork(a)  # type: ignore[arg-type]
        full = alloc.allocate(2) is None
        alloc.free(a)  # type: ignore[arg-type]
        alloc.free(shared)
        return full and alloc.num_free_blocks == 4

    def t_attention() -> bool:
        cache, bt, k, v = filled("auto")
        q = torch.randn(sum(lens), 4, D, generator=g).to(device)  # GQA: 4 query heads over 2 KV heads
        cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=device)
        out = ops.paged_attention(q, cache.pool(1), kv_dtype="auto", layout="NHD", block_tables=bt, cu_q_lens=cu,
                                  kv_lens=torch.tensor(lens, dtype=torch.int32, device=device))
        ok = True
        for s, n in ((0, lens[0]), (lens[0], lens[1])):
            qs, ks, vs = (t[s : s + n].transpose(0, 1) for t in (q, k, v))
            ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            ok = ok and torch.allclose(out[s : s + n], ref.transpose(0, 1), atol=1e-4, rtol=1e-4)
        return ok

    checks: list[tuple[str, Callable[[], bool]]] = [("BlockAllocator (allocate, fork, free)", t_allocator)]
    for kv_dtype, layout in (("auto", "NHD"), ("fp8", "HND"), ("int8", "NHD"), ("int4", "HND"), ("k8v4", "NHD"),
                             ("fp8k", "HND"), ("int4b", "NHD")):
        checks.append((f"PagedKVCache append -> gather ({kv_dtype}, {layout})",
                       lambda kv_dtype=kv_dtype, layout=layout: round_trip(kv_dtype, layout)))
    checks.append(("PagedKVCache.copy_blocks (int8: data and params)", t_copy_blocks))
    if hasattr(ops, "paged_attention"):
        checks.append(("paged_attention (GQA, two sequences) vs SDPA", t_attention))
    return checks


def cmd_info(args: argparse.Namespace) -> int:
    import torch
    import triton

    from . import __version__
    from ._backend import backend_name, force_interpreter

    print(f"kvcache {__version__} | python {platform.python_version()} | torch {torch.__version__} | "
          f"triton {triton.__version__}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"cuda:{i}  {p.name}  {p.total_memory / 2**30:.1f} GiB  {p.multi_processor_count} SMs")
    else:
        print("cuda: not available")
    failed = 0
    runs: list[tuple[torch.device, str]] = []
    for dev in _devices():
        runs.append((dev, "default"))
    if not torch.cuda.is_available():
        runs.append((torch.device("cpu"), "interpreter"))
    for dev, mode in runs:
        with force_interpreter() if mode == "interpreter" else contextlib.nullcontext():
            print(f"\nsmoke run on {dev} (backend: {backend_name(dev)})")
            for name, ok, msg in _smoke(dev):
                failed += not ok
                print(f"  {'ok  ' if ok else 'FAIL'}  {name}{'  ' + msg if msg else ''}")
    print(f"\n{'all ops ok' if not failed else f'{failed} op(s) FAILED'}")
    return 1 if failed else 0


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():  # every suite times CUDA kernels
        print(f"kvcache: error: bench {args.suite}: needs a CUDA device (torch {torch.__version__} sees none)",
              file=sys.stderr)
        return 2
    if args.suite == "linear":
        from .bench.linear import main as bench_main

        rc = bench_main(quick=args.quick, json_path=args.json)
    elif args.suite == "paged":
        from .bench.paged import main as paged_main

        rc = paged_main(quick=args.quick, json_path=args.json)
    elif args.suite == "attention":
        from .bench.attention import main as attention_main

        rc = attention_main((["--quick"] if args.quick else []) + (["--json", args.json] if args.json else []))
    elif args.suite == "engine":
        from .bench.engine import main as engine_main

        rc = engine_main((["--quick"] if args.quick else []) + (["--out", args.json] if args.json else []))
    else:
        raise SystemExit(f"unknown bench suite {args.suite!r}")
    if args.json and rc == 0:
        try:
            from .bench.plot import plot_bench

            for png in plot_bench(args.json):
                print(f"plot: {png}")
        except ImportError as e:  # matplotlib is in the bench extra
            print(f"plot: skipped ({e}; pip install 'kvcache[bench]')")
    return rc


def cmd_plot(args: argparse.Namespace) -> int:
    from .bench.plot import plot_bench

    for png in plot_bench(args.json, args.png):  # bad input raises: main prints one line, exit 2
        print(png)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    import torch

    from .hf.plan import describe_windows, load_model_config, parse_memory, plan

    memory = parse_memory(args.memory)  # bad input raises: main prints one line, exit 2
    config = load_model_config(args.model)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    shape, dtype, rows = plan(config, memory, args.seq_len, block_size=args.block_size, dtype=dtype)
    print(f"model: {args.model or 'SmolLM2-135M-Instruct (default)'}: {shape.num_layers} layers, "
          f"{shape.num_kv_heads} KV heads x head_dim {shape.head_dim}, model dtype {str(dtype).removeprefix('torch.')}")
    windows = describe_windows(config, args.seq_len, args.block_size)  # window layers count at their window
    if windows:
        print(windows)
    print(f"memory: {memory / 2**30:.2f} GiB for the cache, sequences of {args.seq_len} tokens, "
          f"paged block_size {args.block_size}\n")
    print(f"| {'cache':<6} | {'kv_dtype':<16} | {'bytes/token':>12} | {'tokens':>14} | {'sequences':>10} |")
    print(f"|{'-' * 8}|{'-' * 18}|{'-' * 14}|{'-' * 16}|{'-' * 12}|")
    for r in rows:
        print(f"| {r.cache:<6} | {r.kv_dtype:<16} | {r.bytes_per_token:>12,.0f} | {r.tokens:>14,} "
              f"| {r.sequences:>10,} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "memory": memory, "seq_len": args.seq_len, "block_size": args.block_size,
                       "shape": dataclasses.asdict(shape), "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
    return 0


def cmd_demo(argv: list[str]) -> int:
    try:
        from .engine.demo import demo_main
    except ImportError as e:
        print(f"kvcache demo: the engine is not available ({e}); install the hf extra: bash scripts/setup.sh "
              "io,bench,hf", file=sys.stderr)
        return 2
    return int(demo_main(argv))


# What kvcache raises for bad input (validation names the argument): printed as one line. Anything else is a bug
# and keeps its traceback.
_USER_ERRORS = (ValueError, TypeError, OSError)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvcache`` console script (and ``python -m kvcache``); returns the exit code.

    Parameters
    ----------
    argv : list of str, optional
        The arguments after ``kvcache`` (default ``sys.argv[1:]``). ``--debug`` anywhere shows tracebacks.

    Returns
    -------
    int
        The command's exit code; 2 for bad input, reported as one line ``kvcache: error: ...`` on stderr.

    Example
    -------
    >>> main(["plan", "--memory", "80"])   # doctest: +SKIP
    kvcache: error: memory: expected a number with a unit ...
    2
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        return _dispatch(argv)
    except _USER_ERRORS as e:
        if debug:
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"kvcache: error: {message} (--debug shows the traceback)", file=sys.stderr)
        return 2


def _dispatch(argv: list[str]) -> int:
    from . import __version__

    if argv[:1] == ["demo"]:
        return cmd_demo(argv[1:])  # every option belongs to the demo's own parser
    if argv[:1] == ["eval"]:
        from .eval.cli import eval_main

        return eval_main(argv[1:])  # every option belongs to the eval's own parser
    parser = argparse.ArgumentParser(prog="kvcache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvcache {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="SmolLM2 answers chat questions on kvcache's engine (kvcache demo --help)")
    sub.add_parser("eval", help="quality of each stored KV format against full precision: perplexity, KL, top-1 "
                   "and greedy agreement, bytes per token (kvcache eval --help)")
    p_plan = sub.add_parser("plan", help="bytes per token and how many tokens / sequences fit, per kv_dtype")
    p_plan.add_argument("--model", default=None, help="config.json, a model folder or a .gguf file (default: "
                        "SmolLM2-135M-Instruct)")
    p_plan.add_argument("--memory", required=True, help="memory for the KV cache with its unit (B, KB, MB, GB, "
                        "TB, KiB, MiB, GiB, TiB), e.g. 80GiB, 40GB, 512MiB")
    p_plan.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    p_plan.add_argument("--block-size", type=int, default=16, help="paged block size (default 16)")
    p_plan.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                        help="model dtype (default: the config's, else float16)")
    p_plan.add_argument("--json", default=None, help="also write the plan to this JSON file")
    p_plan.set_defaults(fn=cmd_plan)
    p_info = sub.add_parser("info", help="backends, devices and a smoke run of every op")
    p_info.set_defaults(fn=cmd_info)
    p_bench = sub.add_parser("bench", help="GPU benchmarks against copy bandwidth and plain PyTorch: linear | paged | "
                             "attention | engine")
    p_bench.add_argument("suite", choices=["linear", "paged", "attention", "engine"])
    p_bench.add_argument("--quick", action="store_true", help="smaller shapes (a smoke test of the bench)")
    p_bench.add_argument("--json", default=None, help="also write the results to this JSON file, and a PNG plot "
                         "beside it")
    p_bench.set_defaults(fn=cmd_bench)
    p_plot = sub.add_parser("plot", help="PNG plot of a bench JSON file: bandwidth per op against the copy")
    p_plot.add_argument("json", help="a file written by kvcache bench ... --json")
    p_plot.add_argument("--png", default=None, help="output path (default: beside the JSON)")
    p_plot.set_defaults(fn=cmd_plot)
    args = parser.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
