"""KV block transfer between two ranks (``kvcache.distributed.send_blocks`` / ``recv_blocks``) against a plain
send of one contiguous tensor of the same bytes (the limit), as bandwidth for a long sequence and as latency for
a short one.

The set: 32 layers, Llama-3-8B-like 8 KV heads x 128, blocks of 16 tokens drawn at random from a pool of 2,048
blocks per layer (a served cache is fragmented), kv_dtype fp16 / fp8 / int8 / int4; ``--tokens`` (2,048) for
bandwidth, ``--latency-tokens`` (512: one sequence) for latency. Rank 0 sends, rank 1 receives into blocks from
its own allocator (given back after each trial).

Timing: both ranks meet at a barrier, then rank 1 measures host wall time until ``recv_blocks`` has returned and
the device is synchronized (a transfer's end-to-end latency: header and answer, packing, checksums, the chunks,
the checked scatter). Median of ``--trials`` after ``--warmup``. GB/s = payload bytes / time; % = of the plain
send's GB/s measured in the same run with the same bytes. Rows: ``send_blocks`` (default chunks), without
checksum, and each ``--chunk-mib`` size; alone on one rank (CUDA events): the chunk checksum over the payload,
packing (``index_select`` of the data pool's rows).

Launch on 2 GPUs of one host (NVLink multicast stays off)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        torchrun --standalone --nproc-per-node 2 benchmarks/distributed_transfer.py --json $OUT/transfer.json

On the CPU (gloo, tiny shapes: checks that the script runs; its figures mean nothing)::

    PYTHONPATH=src torchrun --standalone --nproc-per-node 2 benchmarks/distributed_transfer.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# never NVLink multicast: it can take a shared host's GPUs out of service (device notes); set before NCCL loads
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    if os.environ.setdefault(_k, _v) != _v:
        sys.exit(f"{_k}={os.environ[_k]!r}: this benchmark runs only with {_k}={_v}")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kvcache import BlockAllocator, PagedConfig, PagedKVCache  # noqa: E402
from kvcache.distributed import recv_blocks, send_blocks, wire  # noqa: E402

SHAPE = dict(layers=32, heads=8, head_dim=128, block=16, pool=2048)
TINY = dict(layers=2, heads=2, head_dim=64, block=16, pool=64)


def _sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(fn, warmup: int, trials: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Wall seconds of ``fn`` on this rank, both ranks starting together (barrier) and the device synced."""
    out = []
    for i in range(warmup + trials):
        dist.barrier()
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def _alone(fn, warmup: int, trials: int) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of ``fn`` on this rank alone: CUDA events on a GPU, wall time on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(trials):
        if torch.cuda.is_initialized():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _both(fn, args: argparse.Namespace, nbytes: int) -> dict:  # type: ignore[no-untyped-def]
    times: list = [None, None]
    dist.all_gather_object(times, _timed(fn, args.warmup, args.trials))
    med = statistics.median(times[1])  # the receiver's view: done when the blocks are in its cache
    return {"median_s": med, "min_s": min(times[1]), "GB_per_s": nbytes / med / 1e9}


def _transfer(cache: PagedKVCache, alloc: BlockAllocator, ids: list[int], rank: int, args: argparse.Namespace,
              sweep: bool) -> dict:
    """Plain send and send_blocks of blocks ``ids`` (every layer): the receiver's median times."""
    peer = 1 - rank
    cfg = cache.config
    nbytes = cfg.block_bytes * len(ids) + (cfg.num_layers * 8 if cfg.kv_dtype == "fp8" else 0)
    plain = torch.empty(nbytes, dtype=torch.uint8, device=cache.device)

    def plain_step() -> None:
        if rank == 0:
            dist.send(plain, dst=peer)
        else:
            dist.recv(plain, src=peer)

    def kv_step(checksum: bool, chunk: int | None):  # type: ignore[no-untyped-def]
        def step() -> None:
            if rank == 0:
                if not send_blocks(cache, ids, dst=peer, checksum=checksum, chunk_bytes=chunk):
                    raise RuntimeError("the receiver had no room")
            else:
                got = recv_blocks(cache, alloc, src=peer)
                if got is None:
                    raise RuntimeError("no room")
                alloc.free(got)
        return step

    res: dict = {"bytes": nbytes, "blocks": len(ids), "tokens": len(ids) * cfg.block_size,
                 "plain_send": _both(plain_step, args, nbytes)}
    cases = [("send_blocks", True, None), ("send_blocks_no_checksum", False, None)]
    if sweep:
        cases += [(f"send_blocks_chunk_{m}MiB", True, int(float(m) * 2**20)) for m in args.chunk_mib.split(",") if m]
    for name, checksum, chunk in cases:
        res[name] = _both(kv_step(checksum, chunk), args, nbytes)
        res[name]["pct_of_plain"] = 100 * res[name]["GB_per_s"] / res["plain_send"]["GB_per_s"]
    return res


def _measure(kv_dtype: str, args: argparse.Namespace, shape: dict, dev: torch.device, rank: int) -> dict:
    """One kv_dtype: bandwidth at --tokens (with the chunk sweep), latency at --latency-tokens, and the
    checksum and packing alone."""
    cfg = PagedConfig(num_layers=shape["layers"], num_kv_heads=shape["heads"], head_dim=shape["head_dim"],
                      block_size=shape["block"], num_blocks=shape["pool"], dtype=torch.float16, kv_dtype=kv_dtype,
                      device=dev)
    cache = PagedKVCache(cfg)
    cache.buffer.view(torch.uint8).random_(0, 256)
    if cache.params_buffer is not None:
        cache.params_buffer.uniform_()
    alloc = BlockAllocator(cfg.num_blocks, cfg.block_size)
    order = torch.randperm(cfg.num_blocks, generator=torch.Generator().manual_seed(0)).tolist()  # fragmented
    long_ids, short_ids = order[:args.tokens // cfg.block_size], order[:args.latency_tokens // cfg.block_size]
    res = {"kv_dtype": kv_dtype, "backend": args.backend, "torch": torch.__version__, "shape": shape,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if dev.type == "cuda" else None,
           "bandwidth": _transfer(cache, alloc, long_ids, rank, args, True),
           "latency": _transfer(cache, alloc, short_ids, rank, args, False)}
    nbytes = res["bandwidth"]["bytes"]
    body = torch.empty(wire.align(nbytes, 4), dtype=torch.uint8, device=dev).random_(0, 256)
    res["checksum_s"] = _alone(lambda: wire.checksum(body, 0), 3, args.trials)
    rows = cache.buffer.view(torch.uint8).view(cfg.num_layers * cfg.num_blocks, -1).view(torch.int64)
    idx = (torch.arange(cfg.num_layers)[:, None] * cfg.num_blocks + torch.tensor(long_ids)[None, :]).reshape(-1)
    idx = idx.to(dev)
    packed = rows.index_select(0, idx)
    res["pack_s"] = _alone(lambda: torch.index_select(rows, 0, idx, out=packed), 3, args.trials)
    return res


def _report(res: dict) -> None:
    bw, lat = res["bandwidth"], res["latency"]
    line = (f"{res['kv_dtype']:5s} {bw['bytes'] / 2**20:8.1f} MiB  plain {bw['plain_send']['GB_per_s']:7.1f} GB/s  "
            f"send_blocks {bw['send_blocks']['GB_per_s']:7.1f} GB/s ({bw['send_blocks']['pct_of_plain']:.0f}%)  "
            f"no checksum {bw['send_blocks_no_checksum']['GB_per_s']:7.1f} GB/s "
            f"({bw['send_blocks_no_checksum']['pct_of_plain']:.0f}%)  checksum "
            f"{bw['bytes'] / res['checksum_s'] / 1e9:.1f} GB/s  pack {res['pack_s'] * 1e6:.0f} us")
    sweep = [f"{k.split('_')[-1]} {v['pct_of_plain']:.0f}%" for k, v in bw.items() if k.startswith("send_blocks_chunk")]
    print(line + ("  chunks: " + ", ".join(sweep) if sweep else ""), flush=True)
    print(f"      {lat['tokens']} tokens ({lat['bytes'] / 2**20:.1f} MiB): plain "
          f"{lat['plain_send']['median_s'] * 1e6:.0f} us, send_blocks {lat['send_blocks']['median_s'] * 1e6:.0f} us, "
          f"no checksum {lat['send_blocks_no_checksum']['median_s'] * 1e6:.0f} us", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--kv-dtypes", default="auto,fp8,int8,int4")
    ap.add_argument("--backend", default="nccl", help="nccl (GPUs) or gloo (CPU)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the bandwidth transfer")
    ap.add_argument("--latency-tokens", type=int, default=512, help="tokens of the latency transfer")
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    ap.add_argument("--chunk-mib", default="4,8,16,32,64", help="chunk sizes also timed (MiB, comma-separated)")
    ap.add_argument("--tiny", action="store_true", help="gloo on the CPU, 2 layers x 2 heads x 64, a 64-block "
                    "pool, 256 / 64 tokens, 3 trials: checks that the script runs")
    args = ap.parse_args()
    shape = dict(SHAPE, layers=args.layers)
    if args.tiny:
        shape = dict(TINY)
        args.backend, args.tokens, args.latency_tokens, args.trials, args.warmup = "gloo", 256, 64, 3, 1
        args.chunk_mib = "0.0625"
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        sys.exit("run with 2 processes (torchrun --nproc-per-node 2)")
    if max(args.tokens, args.latency_tokens) // shape["block"] > shape["pool"]:
        sys.exit(f"--tokens: at most {shape['pool'] * shape['block']} (the pool)")
    rows = []
    for kv_dtype in args.kv_dtypes.split(","):
        res = _measure(kv_dtype, args, shape, dev, rank)
        rows.append(res)
        if rank == 1:
            _report(res)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 1 and args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
