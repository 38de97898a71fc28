"""Issue 16 item 5: bandwidth of a KV block transfer between two GPUs (``kvcache.distributed.send_blocks`` /
``recv_blocks`` over NCCL) against a plain NCCL send of one contiguous tensor of the same bytes (the limit).

The set: 2,048 tokens of one sequence, 32 layers, Llama-3-8B-like 8 KV heads x 128, blocks of 16 tokens drawn
at random from a pool of 2,048 blocks per layer (a served cache is fragmented), kv_dtype fp16 / fp8 / int8 /
int4. Rank 0 sends, rank 1 receives into blocks from its own allocator (given back after each trial).

Timing: both ranks meet at a barrier, then rank 1 measures host wall time until ``recv_blocks`` has returned and
the device is synchronized (a transfer's end-to-end latency: header, answer, packing on the sender
(``index_select``), the payload, checksum, scattering on the receiver (``index_copy_``)). Median of
``--trials`` after ``--warmup``. GB/s = payload bytes / time; % = of the plain send's GB/s measured in the same
run with the same bytes. Also timed on each side alone with CUDA events: packing and scattering.

Launch (2 GPUs of one host; NVLink multicast stays off):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
            benchmarks/distributed_transfer.py --json $OUT/transfer.json
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
from kvcache.distributed import recv_blocks, send_blocks  # noqa: E402

LAYERS, H, D, BLOCK, TOKENS, POOL = 32, 8, 128, 16, 2048, 2048


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


def _sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _events(fn, warmup: int, trials: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        fn()
    times = []
    if not torch.cuda.is_initialized():  # the CPU smoke run (--backend gloo)
        for _ in range(trials):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _measure(kv_dtype: str, args: argparse.Namespace, dev: torch.device, rank: int, layers: int, n_blocks: int,
             ids: list[int]) -> dict:
    """One kv_dtype: the plain send, send_blocks with and without checksum, packing and scattering alone."""
    peer = 1 - rank
    cfg = PagedConfig(num_layers=layers, num_kv_heads=H, head_dim=D, block_size=BLOCK, num_blocks=POOL,
                      dtype=torch.float16, kv_dtype=kv_dtype, device=dev)
    cache = PagedKVCache(cfg)
    cache.buffer.view(torch.uint8).random_(0, 256)
    if cache.params_buffer is not None:
        cache.params_buffer.uniform_()
    alloc = BlockAllocator(POOL, BLOCK)
    payload = cfg.block_bytes * n_blocks + (layers * 8 if kv_dtype == "fp8" else 0)
    plain = torch.empty(payload, dtype=torch.uint8, device=dev)
    res: dict = {"kv_dtype": kv_dtype, "bytes": payload, "blocks": n_blocks, "layers": layers, "tokens": args.tokens,
                 "backend": args.backend, "torch": torch.__version__,
                 "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "nccl": ".".join(map(str, torch.cuda.nccl.version())) if dev.type == "cuda" else None}

    def plain_step() -> None:
        if rank == 0:
            dist.send(plain, dst=peer)
        else:
            dist.recv(plain, src=peer)

    def kv_step(checksum: bool):  # type: ignore[no-untyped-def]
        def step() -> None:
            if rank == 0:
                if not send_blocks(cache, ids, dst=peer, checksum=checksum):
                    raise RuntimeError("receiver had no room")
            else:
                got = recv_blocks(cache, alloc, src=peer)
                if got is None:
                    raise RuntimeError("no room")
                alloc.free(got)
        return step

    for name, fn in (("plain_send", plain_step), ("send_blocks", kv_step(True)),
                     ("send_blocks_no_checksum", kv_step(False))):
        t = _timed(fn, args.warmup, args.trials)
        times: list = [None, None]
        dist.all_gather_object(times, t)
        med = statistics.median(times[1])  # the receiver's view: done when the blocks are in its cache
        res[name] = {"median_s": med, "GB_per_s": payload / med / 1e9, "min_s": min(times[1])}
    for name in ("send_blocks", "send_blocks_no_checksum"):
        res[name]["pct_of_plain"] = 100 * res[name]["GB_per_s"] / res["plain_send"]["GB_per_s"]
    idx = torch.tensor(ids, device=dev)
    # what send_blocks / recv_blocks run on the data pool: 8-byte words of whole blocks
    dview = cache.buffer.view(torch.uint8).view(layers, POOL, -1).view(torch.int64)
    packed = dview.index_select(1, idx)
    res["pack_s"] = _events(lambda: torch.index_select(dview, 1, idx, out=packed), 3, args.trials)
    res["scatter_s"] = _events(lambda: dview.index_copy_(1, idx, packed), 3, args.trials)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--kv-dtypes", default="auto,fp8,int8,int4")
    ap.add_argument("--backend", default="nccl", help="nccl (GPUs); gloo runs a CPU smoke test")
    ap.add_argument("--tokens", type=int, default=TOKENS)
    ap.add_argument("--layers", type=int, default=LAYERS)
    args = ap.parse_args()
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        sys.exit("run with 2 processes (torchrun --nproc_per_node=2)")
    layers = args.layers
    n_blocks = args.tokens // BLOCK
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(POOL, generator=gen)[:n_blocks].tolist()  # a fragmented sequence
    rows = []
    for kv_dtype in args.kv_dtypes.split(","):
        res = _measure(kv_dtype, args, dev, rank, layers, n_blocks, ids)
        rows.append(res)
        if rank == 1:
            print(f"{kv_dtype:5s} {res['bytes'] / 2**20:7.1f} MiB  plain {res['plain_send']['GB_per_s']:7.1f} GB/s  "
                  f"send_blocks {res['send_blocks']['GB_per_s']:7.1f} GB/s ({res['send_blocks']['pct_of_plain']:.0f}%)"
                  f"  no checksum {res['send_blocks_no_checksum']['GB_per_s']:7.1f} GB/s "
                  f"({res['send_blocks_no_checksum']['pct_of_plain']:.0f}%)  pack {res['pack_s'] * 1e6:.0f} us  "
                  f"scatter {res['scatter_s'] * 1e6:.0f} us", flush=True)
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
