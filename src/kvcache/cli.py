"""Command line: ``kvcache info`` (backends, devices, smoke run of every op) and ``kvcache bench linear``."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable

import torch


def _devices() -> list[torch.device]:
    devs = [torch.device("cpu")]
    if torch.cuda.is_available():
        devs.insert(0, torch.device("cuda", torch.cuda.current_device()))
    return devs


def _smoke(device: torch.device) -> list[tuple[str, bool, str]]:
    """Run every op once on small random data and compare with an explicit expectation."""
    from . import ops
    from .config import CacheConfig, KVLayerConfig, ManagerConfig
    from .linear import LinearKVCache
    from .manager import KVCacheManager

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

    for name, fn in (
        ("increment_lengths", t_increment),
        ("save_kv_layer / restore_kv_layer", t_save_restore),
        ("save_kv_layers / restore_kv_layers", t_layers),
        ("build_batch_mapping / compact_kv_layer", t_compact),
        ("compact_batch", t_compact_batch),
        ("LinearKVCache", t_linear),
        ("KVCacheManager (fp8, mixed heads)", t_manager),
    ):
        run(name, fn)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return results


def cmd_info(args: argparse.Namespace) -> int:
    import triton

    from . import __version__
    from ._backend import INTERPRET_ENV, backend_name

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
        old = os.environ.get(INTERPRET_ENV)
        if mode == "interpreter":
            os.environ[INTERPRET_ENV] = "1"
        try:
            print(f"\nsmoke run on {dev} (backend: {backend_name(dev)})")
            for name, ok, msg in _smoke(dev):
                failed += not ok
                print(f"  {'ok  ' if ok else 'FAIL'}  {name}{'  ' + msg if msg else ''}")
        finally:
            if mode == "interpreter":
                if old is None:
                    os.environ.pop(INTERPRET_ENV, None)
                else:
                    os.environ[INTERPRET_ENV] = old
    print(f"\n{'all ops ok' if not failed else f'{failed} op(s) FAILED'}")
    return 1 if failed else 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.suite == "linear":
        from .bench.linear import main as bench_main

        return bench_main(quick=args.quick, json_path=args.json)
    if args.suite == "paged":
        from .bench.paged import main as paged_main

        return paged_main(quick=args.quick, json_path=args.json)
    raise SystemExit(f"unknown bench suite {args.suite!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcache", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_info = sub.add_parser("info", help="backends, devices and a smoke run of every op")
    p_info.set_defaults(fn=cmd_info)
    p_bench = sub.add_parser("bench", help="GPU benchmarks against copy bandwidth and plain PyTorch")
    p_bench.add_argument("suite", choices=["linear", "paged"])
    p_bench.add_argument("--quick", action="store_true", help="smaller shapes (a smoke test of the bench)")
    p_bench.add_argument("--json", default=None, help="also write the results to this JSON file")
    p_bench.set_defaults(fn=cmd_bench)
    args = parser.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
