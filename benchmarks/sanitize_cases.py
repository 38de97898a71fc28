"""A small case of every kvcache kernel, through the public API, for compute-sanitizer (scripts/sanitize.sh).

Each case launches its kernels on tiny inputs and synchronizes; a Python exception fails the case (the
sanitizer reports device errors itself). Prints ``ok <case>`` / ``FAIL <case>: <error>`` per case and a last
line ``cases: <ok>/<total> ok``; exits 1 when a case failed.

    python benchmarks/sanitize_cases.py                  # on the GPU
    python benchmarks/sanitize_cases.py --device cpu     # a smoke test of the cases (interpreter with
                                                         # KVCACHE_TRITON_INTERPRET=1)
    python benchmarks/sanitize_cases.py --list

Covered: lengths (increment int / tensor / bounded, compact), build_batch_mapping, compaction (one layer, one
launch over heterogeneous layers, any tensor in place and into another), save / restore (one layer, strided
over a uniform cache, table over heterogeneous layers, packed snapshots), the linear caches' commit / evict /
save / restore, paged append in every format (auto, fp8, int8, int4) and layout (NHD, HND) by ragged batch
(kv_lens, cu_k_lens, decode-sized rows), slot mapping and with RoPE, gather in every format and layout (and
with RoPE), copy_blocks, and, where ``kvcache.ops`` has them, paged / linear attention and merge of states.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable

import torch

from kvcache import (
    CacheConfig,
    KVCacheManager,
    KVLayerConfig,
    LinearKVCache,
    ManagerConfig,
    PagedConfig,
    PagedKVCache,
    RopeConfig,
    ops,
)

CASES: list[tuple[str, Callable[[torch.device], None]]] = []


def case(name: str):  # type: ignore[no-untyped-def]
    def register(fn):  # type: ignore[no-untyped-def]
        CASES.append((name, fn))
        return fn

    return register


def i32(xs, dev):  # type: ignore[no-untyped-def]
    return torch.tensor(list(xs), dtype=torch.int32, device=dev)


# ------------------------------------------------------------------------------------------------ linear ops


@case("increment_lengths")
def _increment(dev: torch.device) -> None:
    lengths = i32([3, 0, 7, 1, 2], dev)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    ops.increment_lengths(lengths, 1)
    ops.increment_lengths(lengths, i32([1, 2, 0, 4, 1], dev))
    ops.increment_lengths(lengths, 2, max_len=10, overflow=flag)
    ops.increment_lengths(lengths, 2**31 - 1)  # saturates


@case("build_batch_mapping+compact_lengths")
def _mapping(dev: torch.device) -> None:
    finished = torch.tensor([False, True, False, True, False], device=dev)
    out = torch.empty(5, dtype=torch.int32, device=dev)
    count = torch.empty(1, dtype=torch.int32, device=dev)
    mapping, _ = ops.build_batch_mapping(finished, out=out, new_active_out=count)
    lengths = i32([3, 1, 4, 1, 5], dev)
    ops.compact_lengths(lengths, mapping, 5, 3)
    ops.compact_lengths(lengths, i32([1, 0, 0, 7, -3], dev), 5, 3)  # malformed: skipped entries


@case("compact_kv_layer")
def _compact_layer(dev: torch.device) -> None:
    layer = torch.randn(4, 2, 3, 8, 80, device=dev).to(torch.float16)
    lengths = i32([8, 2, 12, -1], dev)  # past capacity and negative: clamped
    ops.compact_kv_layer(layer, i32([-1, 0, 1, 2], dev), lengths, 4, 3, dst_lengths=lengths)


@case("compact_kv_layers (heterogeneous)")
def _compact_layers(dev: torch.device) -> None:
    layers = [torch.randn(3, 2, h, 6, d, device=dev).to(torch.bfloat16) for h, d in ((1, 64), (4, 96), (2, 8))]
    lengths = i32([6, 3, 9], dev)
    ops.compact_kv_layers(layers, i32([-1, 0, 1], dev), lengths, 3, 2, dst_lengths=lengths)


@case("compact_batch")
def _compact_batch(dev: torch.device) -> None:
    src = torch.randn(5, 7, device=dev)
    ops.compact_batch(src, i32([0, -1, 1, -1, 2], dev), src, 5, 3)
    dst = torch.zeros(3, 7, device=dev)
    ops.compact_batch(src, i32([-1, 0, 1, 2, 9], dev), dst, 5, 3)


@case("save/restore_kv_layer")
def _save_restore_one(dev: torch.device) -> None:
    layer = torch.randn(3, 2, 2, 16, 96, device=dev).to(torch.float8_e4m3fn)
    snap = torch.empty(2, 2, 5, 96, dtype=torch.float8_e4m3fn, device=dev)
    ops.save_kv_layer(layer, snap, 1)
    ops.restore_kv_layer(snap, layer, 2)


@case("save/restore_kv_layers (table)")
def _save_restore_many(dev: torch.device) -> None:
    layers = [torch.randn(2, 2, h, 8, d, device=dev).to(torch.float16) for h, d in ((1, 64), (3, 80))]
    snaps = [torch.empty(2, h, 4, d, dtype=torch.float16, device=dev) for h, d in ((1, 64), (3, 80))]
    ops.save_kv_layers(layers, snaps, 1, 4)
    ops.restore_kv_layers(snaps, layers, 0, 4)


@case("LinearKVCache commit/evict/save/restore")
def _linear_cache(dev: torch.device) -> None:
    c = LinearKVCache(CacheConfig(2, 4, 16, 2, 64, dtype=torch.float16, device=dev))
    c.reset_for_new_sequences([3, 0, 5, 1])
    c.commit(i32([2, 4, 1, 0], dev))
    c.commit(1)
    snap = c.save(2, 6)
    c.evict([False, True, False, False])
    c.restore(snap, 3)


@case("KVCacheManager (heterogeneous) evict/save/restore")
def _manager(dev: torch.device) -> None:
    m = KVCacheManager(ManagerConfig(3, 12, [KVLayerConfig(1, 64), KVLayerConfig(4, 80)], dtype=torch.bfloat16,
                                     device=dev))
    m.reset_for_new_sequences([4, 7, 2])
    snap = m.save(1, 7)
    m.evict(torch.tensor([True, False, False], device=dev))
    m.restore(snap, 2)


# ------------------------------------------------------------------------------------------------ paged ops

FORMATS = ("auto", "fp8", "int8", "int4")
LAYOUTS = ("NHD", "HND")
H, D, BS, NB = 2, 64, 4, 12


def paged_cache(dev: torch.device, kv_dtype: str, layout: str, rope: bool = False) -> PagedKVCache:
    cfg = PagedConfig(2, H, D, BS, NB, dtype=torch.float16, kv_dtype=kv_dtype, layout=layout, device=dev)
    return PagedKVCache(cfg, rope=RopeConfig(D) if rope else None)


def ragged(dev: torch.device, q_lens, kv_lens):  # type: ignore[no-untyped-def]
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    tables = i32(range(3 * len(q_lens)), dev).view(len(q_lens), 3)
    n = cu[-1]
    k = torch.randn(n, H, D, device=dev).to(torch.float16)
    v = torch.randn(n, H, D, device=dev).to(torch.float16)
    return k, v, tables, i32(cu, dev), i32(kv_lens, dev)


def _append_case(kv_dtype: str, layout: str, mode: str) -> Callable[[torch.device], None]:
    def run(dev: torch.device) -> None:
        c = paged_cache(dev, kv_dtype, layout, rope=mode == "rope")
        if mode == "slots":
            k, v, *_ = ragged(dev, [3, 2], [0, 0])
            slots = torch.tensor([0, 5, 9, -1, 30], dtype=torch.int64, device=dev)
            c.append(0, k, v, c.plan(slot_mapping=slots))
            return
        q_lens, kv_lens = ([1, 1, 1], [4, 0, 7]) if mode == "decode" else ([5, 0, 3], [2, 6, 0])
        k, v, tables, cu, lens = ragged(dev, q_lens, kv_lens)
        if mode == "cu_k_lens":
            totals = [a + b for a, b in zip(q_lens, kv_lens)]
            cu_k = [0]
            for t in totals:
                cu_k.append(cu_k[-1] + t)
            c.append(1, k, v, c.plan(tables, cu, cu_k_lens=i32(cu_k, dev)))
        else:
            c.append(0, k, v, c.plan(tables, cu, lens))
            if mode == "decode":  # the caller's promise path too
                c.append(1, k, v, c.plan(tables, cu, lens, metadata_ready=True))
        c.gather(0, c.plan(tables, seq_lens=lens))

    return run


for _fmt in FORMATS:
    for _lay in LAYOUTS:
        case(f"append+gather {_fmt} {_lay} ragged")(_append_case(_fmt, _lay, "ragged"))
    case(f"append {_fmt} NHD slot_mapping")(_append_case(_fmt, "NHD", "slots"))
    case(f"append+gather {_fmt} HND decode")(_append_case(_fmt, "HND", "decode"))
case("append+gather int8 NHD cu_k_lens")(_append_case("int8", "NHD", "cu_k_lens"))
case("append+gather auto NHD rope")(_append_case("auto", "NHD", "rope"))
case("append+gather int4 HND rope")(_append_case("int4", "HND", "rope"))


@case("gather with rope (un-rotated keys)")
def _gather_rope(dev: torch.device) -> None:
    c = paged_cache(dev, "auto", "NHD")
    k, v, tables, cu, lens = ragged(dev, [5, 3], [0, 0])
    c.append(0, k, v, c.plan(tables, cu, lens))
    c.gather(0, c.plan(tables, seq_lens=i32([5, 3], dev)), rope=RopeConfig(D))


@case("copy_blocks")
def _copy_blocks(dev: torch.device) -> None:
    for fmt in ("auto", "int4"):
        c = paged_cache(dev, fmt, "NHD")
        c.copy_blocks([0, 1], [5, 6])
        bufs = [c.buffer] + ([c.params_buffer] if c.params_buffer is not None else [])
        ops.copy_blocks(bufs, torch.tensor([[2, 7], [3, 99]], dtype=torch.int64, device=dev), check=False)


def _attention_cases() -> None:
    if hasattr(ops, "paged_attention"):
        for fmt in FORMATS:
            @case(f"paged_attention {fmt} NHD")
            def _paged_attn(dev: torch.device, fmt: str = fmt) -> None:
                c = paged_cache(dev, fmt, "NHD")
                k, v, tables, cu, lens = ragged(dev, [4, 1], [0, 6])
                c.append(0, k, v, c.plan(tables, cu, lens))
                q = torch.randn(5, 2 * H, D, device=dev).to(torch.float16)
                scales = c.kv_scales[0] if fmt == "fp8" else None
                ops.paged_attention(q, c.pool(0), c.params(0), scales, kv_dtype=fmt, layout="NHD",
                                    block_tables=tables, cu_q_lens=cu, kv_lens=i32([4, 7], dev))
                ops.paged_attention(q, c.pool(0), c.params(0), scales, kv_dtype=fmt, layout="NHD",
                                    block_tables=tables, cu_q_lens=cu, kv_lens=i32([4, 7], dev), num_splits=2,
                                    window=3, softcap=30.0)
    if hasattr(ops, "linear_attention"):
        @case("linear_attention")
        def _linear_attn(dev: torch.device) -> None:
            layer = torch.randn(3, 2, H, 16, D, device=dev).to(torch.float16)
            q = torch.randn(2, 2 * H, 3, D, device=dev).to(torch.float16)
            ops.linear_attention(q, layer, i32([4, 9], dev))
            ops.linear_attention(q, layer, i32([4, 9], dev), num_splits=2)
    if hasattr(ops, "merge_attention_states"):
        @case("merge_attention_states")
        def _merge(dev: torch.device) -> None:
            a, b = torch.randn(5, 4, D, device=dev).half(), torch.randn(5, 4, D, device=dev).half()
            la, lb = torch.randn(5, 4, device=dev), torch.randn(5, 4, device=dev)
            ops.merge_attention_states(a, la, b, lb)


_attention_cases()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("-k", default="", help="run only cases whose name contains this")
    args = parser.parse_args()
    if args.list:
        for name, _ in CASES:
            print(name)
        return 0
    dev = torch.device(args.device)
    torch.manual_seed(0)
    ok = total = 0
    for name, fn in CASES:
        if args.k not in name:
            continue
        total += 1
        try:
            fn(dev)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            ok += 1
            print(f"ok {name}", flush=True)
        except Exception as e:  # report and go on: the sanitizer's log holds the device side
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(file=sys.stdout)
    print(f"cases: {ok}/{total} ok", flush=True)
    return 0 if ok == total else 1


if __name__ == "__main__":
    sys.exit(main())
