"""``kvcache bench linear``: linear-cache ops on a Llama-3-8B-like cache against the device-to-device copy
bandwidth and against the plain PyTorch a user would write, in one run.

Shapes (issue 2): 32 layers, 8 KV heads, head_dim 128, fp16, max batch 64, max seq 4096 (34.4 GB).
Bytes are what must be read + written. Times: median of CUDA-event-timed trials; "eager" is wall time per
call over back-to-back calls (what an engine sees without graphs), "graph" is per call inside a replayed
CUDA graph, "host" is the CPU time of one call (launch path + validation), measured without syncing (minimum
over trials).

Ceiling ("% copy BW"): the faster of two copies of the same 2 x 1 GiB, both counted read + written: ``copy_``
eager, and :func:`kvcache.bench.ceiling.copy_rows` (the kernel of every bench's ceiling) in a CUDA graph. The
linear cache's ops move contiguous runs of ``s x head_dim`` elements, so the contiguous copy is also their
same-pattern copy. A graph-captured ``copy_`` is not a ceiling: it becomes a driver memcpy node, about 2.7 TB/s
on the H200 against 4.2 TB/s for either of the two (:mod:`kvcache.bench.ceiling`).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from .. import ops
from ..linear import CacheConfig, KVSnapshot, LinearKVCache
from .ceiling import copy_rows
from .timing import graph_replay_us


@dataclass
class Row:
    case: str
    impl: str
    eager_us: float | None = None
    graph_us: float | None = None
    host_us: float | None = None
    bytes: int | None = None
    extra: dict = field(default_factory=dict)


def _sync() -> None:
    torch.cuda.synchronize()


def time_eager(fn: Callable[[], object], iters: int, trials: int = 7) -> float:
    """Wall-clock microseconds per call of ``iters`` back-to-back calls (median of ``trials``)."""
    for _ in range(3):
        fn()
    _sync()
    out = []
    for _ in range(trials):
        _sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync()
        out.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(out)


def time_host(fn: Callable[[], object], iters: int = 50, trials: int = 15) -> float:
    """CPU microseconds per call, without waiting for the GPU (the queue absorbs the launches): the minimum
    over trials, since noise from a shared host only ever adds to it."""
    fn()
    _sync()
    out = []
    for _ in range(trials):
        _sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        out.append((time.perf_counter() - t0) / iters * 1e6)
        _sync()
    return min(out)


def time_graph(fn: Callable[[], object], calls: int, replays: int = 15, captures: int = 2) -> float:
    """Microseconds per call inside a CUDA graph of ``calls`` calls: the median over ``replays`` replays (CUDA
    events), the minimum over ``captures`` separate captures. An occasional capture replays 10-40% slower
    on every replay, at a different row each run (seen on the H100); a second capture does not."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    _sync()
    best = float("inf")
    for _ in range(captures):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        g.replay()
        _sync()
        out = []
        for _ in range(replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            _sync()
            out.append(a.elapsed_time(b) * 1e3 / calls)
        del g
        best = min(best, statistics.median(out))
    return best


def _fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _copy_time(n: int, dtype: torch.dtype, dev: torch.device) -> float:
    src = torch.empty(n, dtype=dtype, device=dev).normal_()
    dst = torch.empty_like(src)
    return time_eager(lambda: dst.copy_(src), iters=10)


def copy_bandwidth(dev: torch.device, n: int = 1 << 29) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written per second) of ``n`` fp16 elements: the
    faster of eager ``copy_`` and :func:`~kvcache.bench.ceiling.copy_rows` in a CUDA graph."""
    return 2 * n * 2 / (min(_copy_time(n, torch.float16, dev), _copy_rows_time(n, dev)) * 1e-6) / 1e9


def _copy_rows_time(n: int, dev: torch.device) -> float:
    """Microseconds of :func:`~kvcache.bench.ceiling.copy_rows` copying ``n`` fp16 elements (64 KiB rows, in order)
    in a CUDA graph, L2 flushed before every replay."""
    src = torch.empty(n, dtype=torch.float16, device=dev).normal_().view(-1, 32768)
    dst = torch.empty_like(src)
    rows = torch.arange(src.shape[0], device=dev)
    return graph_replay_us(lambda: copy_rows(src, rows, dst), rep=100, warmup=10)[0]


def _save_restore(cache: LinearKVCache, s: int) -> list[Row]:
    L, B, _, H, S, D = cache.buffer.shape
    buf, dtype, dev = cache.buffer, cache.dtype, cache.device
    layers = list(buf.unbind(0))
    slot, dst_slot = 5, 9
    snap = KVSnapshot.empty([(H, D)] * L, s, dtype=dtype, device=dev)
    ref = torch.empty(L, 2, H, s, D, dtype=dtype, device=dev)
    nbytes = 2 * L * 2 * H * s * D * buf.element_size()
    big = s >= 512
    iters, calls = (10, 3) if big else (200, 20)
    rows: list[Row] = []

    def save_loop() -> None:
        for layer in range(L):
            ref[layer].copy_(buf[layer, slot, :, :, :s])

    def restore_loop() -> None:
        for layer in range(L):
            buf[layer, dst_slot, :, :, :s].copy_(ref[layer])

    save_loop()
    cache.save(slot, s, out=snap)
    if not torch.equal(snap.flat.view(L, 2, H, s, D), ref):  # type: ignore[union-attr]
        raise RuntimeError("save mismatch")
    cache.restore(snap, dst_slot)
    if not torch.equal(buf[:, dst_slot, :, :, :s], ref):
        raise RuntimeError("restore mismatch")
    cases: list[tuple[str, str, Callable[[], object]]] = [
        ("save", "kvcache LinearKVCache.save(out=)", lambda: cache.save(slot, s, out=snap)),
        ("save", "kvcache ops.save_kv_layers", lambda: ops.save_kv_layers(layers, list(snap.layers), slot, s)),
        ("save", "torch per-layer copy_ loop", save_loop),
        ("save", "torch one strided copy_", lambda: ref.copy_(buf[:, slot, :, :, :s])),
        ("restore", "kvcache LinearKVCache.restore", lambda: cache.restore(snap, dst_slot)),
        ("restore", "kvcache ops.restore_kv_layers",
         lambda: ops.restore_kv_layers(list(snap.layers), layers, dst_slot, s)),
        ("restore", "torch per-layer copy_ loop", restore_loop),
        ("restore", "torch one strided copy_", lambda: buf[:, dst_slot, :, :, :s].copy_(ref)),
    ]
    for what, impl, fn in cases:
        rows.append(Row(f"{what} {s} tok x {L} layers", impl, eager_us=time_eager(fn, iters),
                        graph_us=time_graph(fn, calls), host_us=None if big else time_host(fn), bytes=nbytes))
    return rows


def _compaction(cache: LinearKVCache) -> list[Row]:
    L, B, _, H, S, D = cache.buffer.shape
    buf, dev = cache.buffer, cache.device
    layers = list(buf.unbind(0))
    g = torch.Generator().manual_seed(1)
    old = B
    evicted = set(torch.randperm(old, generator=g)[: B // 4].tolist())
    finished = [i in evicted for i in range(old)]
    lens_host = torch.randint(S // 2 - S // 8, S // 2 + S // 8 + 1, (old,), generator=g, dtype=torch.int32)
    lengths = lens_host.to(dev)
    mapping, new = ops.build_batch_mapping(torch.tensor(finished, device=dev))
    keep = [i for i in range(old) if not finished[i]]
    moved = [(i, j, int(lens_host[i])) for j, i in enumerate(keep) if i != j]
    tok_bytes = 2 * H * D * buf.element_size()
    ours_bytes = 2 * L * tok_bytes * sum(n for _, _, n in moved)
    full_bytes = 2 * L * new * S * tok_bytes
    print(f"compaction {old} -> {new}: {len(moved)} sequences move, lengths {int(lens_host.min())}.."
          f"{int(lens_host.max())} of {S}")
    keep_idx = torch.tensor(keep, device=dev)
    out_buf = torch.empty((L, new, 2, H, S, D), dtype=buf.dtype, device=dev)

    def index_select() -> None:
        for layer in range(L):
            torch.index_select(buf[layer], 0, keep_idx, out=out_buf[layer])

    def torch_inplace() -> None:
        for i, j, n in moved:
            buf[:, j, :, :, :n].copy_(buf[:, i, :, :, :n])

    # correctness once: ours vs index_select on the valid prefixes
    index_select()
    cache._store.compact(mapping, lengths, old, new)
    for j, i in enumerate(keep):
        n = int(lens_host[i])
        if not torch.equal(buf[:, j, :, :, :n], out_buf[:, j, :, :, :n]):
            raise RuntimeError(f"compaction mismatch at new slot {j}")
    cases: list[tuple[str, Callable[[], object], int]] = [
        ("kvcache LinearKVCache.evict kernel (strided, in place)",
         lambda: cache._store.compact(mapping, lengths, old, new), ours_bytes),
        ("kvcache ops.compact_kv_layers (table, in place)",
         lambda: ops.compact_kv_layers(layers, mapping, lengths, old, new), ours_bytes),
        ("torch index_select per layer (2nd buffer, full rows)", index_select, full_bytes),
        ("torch in-place copy_ per moved sequence", torch_inplace, ours_bytes),
    ]
    return [
        Row(f"compact {old}->{new} x {L} layers", impl, eager_us=time_eager(fn, 3, trials=5),
            graph_us=time_graph(fn, 2, replays=5), bytes=nbytes)
        for impl, fn, nbytes in cases
    ]


def _small_ops(cache: LinearKVCache) -> list[Row]:
    L, B, _, H, S, D = cache.buffer.shape
    dev, dtype = cache.device, cache.dtype
    layer0 = cache.layer(0)
    finished = torch.zeros(B, dtype=torch.bool, device=dev)
    finished[::4] = True
    mapping, new = ops.build_batch_mapping(finished)
    lengths = torch.randint(1, S, (B,), dtype=torch.int32, device=dev)
    lens_out = torch.empty_like(lengths)
    lens_small = torch.zeros(B, dtype=torch.int32, device=dev)
    map_out = torch.empty(B, dtype=torch.int32, device=dev)
    cnt_out = torch.empty(1, dtype=torch.int32, device=dev)
    snap1 = torch.empty(2, H, 16, D, dtype=dtype, device=dev)
    x = torch.randn(B, 4096, device=dev)
    # cache.commit(1) on a small cache with room for the ~2000 commits the timing loops make
    small_cache = LinearKVCache(CacheConfig(num_layers=2, max_batch_size=B, max_seq_len=1 << 16, num_kv_heads=1,
                                            head_dim=1, dtype=dtype, device=dev))
    small_cache.reset_for_new_sequences([0] * B)
    inc = f"increment lengths (+1, {B} seqs)"
    cases: list[tuple[str, str, Callable[[], object], bool]] = [
        (inc, "kvcache ops.increment_lengths", lambda: ops.increment_lengths(lens_small, 1), True),
        (inc, "torch add_", lambda: lens_small.add_(1), True),
        (inc, "kvcache LinearKVCache.commit(1)", lambda: small_cache.commit(1), False),
        (f"build mapping ({B} seqs)", "kvcache ops.build_batch_mapping(new_active_out=)",
         lambda: ops.build_batch_mapping(finished, out=map_out, new_active_out=cnt_out), True),
        (f"compact lengths ({B} -> {new})", "kvcache ops.compact_lengths",
         lambda: ops.compact_lengths(lengths, mapping, B, new, lens_out), True),
        ("save 16 tok, 1 layer", "kvcache ops.save_kv_layer", lambda: ops.save_kv_layer(layer0, snap1, 5), True),
        ("save 16 tok, 1 layer", "torch copy_", lambda: snap1.copy_(layer0[5, :, :, :16]), True),
        (f"compact_batch [{B}, 4096] fp32", "kvcache ops.compact_batch (in place)",
         lambda: ops.compact_batch(x, mapping, x, B, new), True),
    ]
    rows = [
        Row(case, impl, eager_us=time_eager(fn, 200), graph_us=time_graph(fn, 20) if graphable else None,
            host_us=time_host(fn))
        for case, impl, fn, graphable in cases
    ]
    # the same op through triton's own JITFunction.run launch path, for comparison
    from ..ops.lengths import _increment_lengths_kernel

    _increment_lengths_kernel._allow_fast = False
    try:
        fn = cases[0][2]
        rows.insert(1, Row(inc, "kvcache ops.increment_lengths (triton JIT launch path)",
                           eager_us=time_eager(fn, 200), host_us=time_host(fn)))
    finally:
        _increment_lengths_kernel._allow_fast = True
    return rows


def main(quick: bool = False, json_path: str | None = None) -> int:
    if not torch.cuda.is_available():
        print("kvcache bench linear: needs a CUDA device")
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    L, B, H, S, D = (32, 64, 8, 4096, 128) if not quick else (8, 16, 8, 1024, 128)
    dtype = torch.float16
    print(f"device: {props.name} ({props.multi_processor_count} SMs) | torch {torch.__version__}")
    print(f"cache: L={L} B={B} H={H} S={S} D={D} {dtype} ({L * B * 2 * H * S * D * 2 / 1e9:.1f} GB)")

    # copy bandwidth: the ceiling, measured in this run (the faster of the two copies of the same bytes)
    n = (1 << 29) if not quick else (1 << 26)
    t_eager, t_rows = _copy_time(n, dtype, dev), _copy_rows_time(n, dev)
    copy_bw = 2 * n * 2 / (min(t_eager, t_rows) * 1e-6) / 1e9
    case = f"copy 2 x {2 * n / 2**30:g} GiB"
    rows = [Row(case, "torch copy_ (eager)", eager_us=t_eager, bytes=2 * n * 2),
            Row(case, "kvcache.bench.ceiling.copy_rows (graph)", graph_us=t_rows, bytes=2 * n * 2)]
    print(f"device-to-device copy: {copy_bw:.0f} GB/s (read + write; the faster of copy_ eager "
          f"{2 * n * 2 / t_eager / 1e3:.0f} and copy_rows in a graph {2 * n * 2 / t_rows / 1e3:.0f})")

    torch.manual_seed(0)
    cache = LinearKVCache(CacheConfig(num_layers=L, max_batch_size=B, max_seq_len=S, num_kv_heads=H,
                                      head_dim=D, dtype=dtype, device=dev))
    for layer in range(L):  # random data, never zeros
        cache.buffer[layer].normal_()
    cache.reset_for_new_sequences([S] * B)
    for s in (2048, 16) if not quick else (512, 16):
        rows += _save_restore(cache, s)
    rows += _compaction(cache)
    rows += _small_ops(cache)

    print()
    print(f"copy bandwidth (same run): {copy_bw:.0f} GB/s")
    print("| case | implementation | eager us | graph us | host us | GB/s | % copy BW | vs best torch (eager) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    by_case: dict[str, list[Row]] = {}
    for r in rows:
        by_case.setdefault(r.case, []).append(r)
    for case, rs in by_case.items():
        torch_eager = [r.eager_us for r in rs if r.impl.startswith("torch") and r.eager_us]
        for r in rs:
            t_use = r.graph_us if r.graph_us is not None else r.eager_us
            gbs = r.bytes / (t_use * 1e-6) / 1e9 if r.bytes and t_use else None
            pct = 100 * gbs / copy_bw if gbs else None
            speed = None
            if torch_eager and r.eager_us and not r.impl.startswith("torch"):
                speed = min(torch_eager) / r.eager_us
            r.extra = {"gbs": gbs, "pct_copy": pct, "speedup_vs_best_torch_eager": speed}
            print(f"| {case} | {r.impl} | {_fmt(r.eager_us)} | {_fmt(r.graph_us)} | {_fmt(r.host_us)} | "
                  f"{_fmt(gbs, 0)} | {_fmt(pct, 1)} | {_fmt(speed, 2) + 'x' if speed else '-'} |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": props.name, "copy_gbs": copy_bw, "shape": [L, B, H, S, D],
                       "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0
