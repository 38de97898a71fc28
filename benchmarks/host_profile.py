"""Where the host time of one op call goes (a development tool; run on a GPU machine).

    PYTHONPATH=src python3 benchmarks/host_profile.py
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from kvcache import CacheConfig, KVSnapshot, LinearKVCache, ops
from kvcache._backend import _current_stream
from kvcache.ops.lengths import _increment_lengths_kernel


def profile_calls(fn, n: int = 3000, top: int = 14) -> None:  # type: ignore[no-untyped-def]
    """cProfile of ``n`` calls of ``fn``: the ``top`` functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def per_call(fn, n: int = 2000) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return best


def main() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    lens = torch.zeros(64, dtype=torch.int32, device=dev)
    cache = LinearKVCache(CacheConfig(num_layers=32, max_batch_size=8, max_seq_len=256, num_kv_heads=8, head_dim=128,
                                      device=dev))
    cache.reset_for_new_sequences([64] * 8)
    snap = KVSnapshot.empty([(8, 128)] * 32, 16, dtype=torch.float16, device=dev)
    layer0 = cache.layer(0)
    snap1 = torch.empty(2, 8, 16, 128, dtype=torch.float16, device=dev)
    big = LinearKVCache(CacheConfig(num_layers=2, max_batch_size=64, max_seq_len=1 << 16, num_kv_heads=1, head_dim=1,
                                    device=dev))
    big.reset_for_new_sequences([0] * 64)
    ops.increment_lengths(lens, 1)
    entry = next(iter(_increment_lengths_kernel._fast.values()))
    run, function, packed, consts = entry
    idx = dev.index
    cases = {
        "torch add_": lambda: lens.add_(1),
        "torch.cuda.current_device()": lambda: torch.cuda.current_device(),
        "_current_stream(idx)": lambda: _current_stream(idx),
        "raw triton launcher (increment)": lambda: run(1, 1, 1, _current_stream(idx), function, packed, None, None,
                                                      None, lens, lens, lens, 64, 1, 0, *consts),
        "ops.increment_lengths": lambda: ops.increment_lengths(lens, 1),
        "cache.commit(1)": lambda: big.commit(1),
        "ops.save_kv_layer": lambda: ops.save_kv_layer(layer0, snap1, 3),
        "cache.save(out=)": lambda: cache.save(3, 16, out=snap),
        "cache.restore": lambda: cache.restore(snap, 5),
    }
    for name, fn in cases.items():
        print(f"{name:34s} {per_call(fn):7.2f} us")
    for name in ("ops.increment_lengths", "cache.save(out=)"):
        print(f"\n--- {name}")
        profile_calls(cases[name], top=14)


if __name__ == "__main__":
    main()
