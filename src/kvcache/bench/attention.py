"""``kvcache bench attention``: paged attention over every kv_dtype, side by side with copies and SDPA.

Conditions: one layer's pool as a server holds it (>= 8192 blocks, several GiB; 1.1x the largest shape's tokens),
each batch's blocks drawn at random from all of it, L2 flushed between calls (``triton.testing.do_bench``), every
call captured in a CUDA graph (launch cost out of the measurement; the graph also proves the op capturable).
Shapes (issue 14): 32 q heads / 8 KV heads, head_dim 128, fp16 queries; decode 64 x {1k, 4k, 16k} and 1 x 128k
cached tokens; prefill / extend 8 x 2048 new tokens with 0 and 4096 cached (causal); blocks of 16 and 64.

Rows of each shape, in the same run:

* ``kvcache <kv_dtype>``: :func:`kvcache.ops.paged_attention`; GB/s counts the K / V bytes it must read (stored
  bytes, plus (scale, zero) for int8 / int4); prefill rows report TFLOP/s (causal FLOPs, 4 * D per (q head, key)).
* ``copy contiguous``: ``copy_`` of as many bytes as the fp16 K / V (the device's copy bandwidth; GB/s =
  read + written bytes), and ``copy same blocks``: ``index_select`` of the same blocks of the fp16 pool (the
  same access pattern); "% copy" of a kvcache row = its GB/s over the contiguous copy's.
* ``torch gather + sdpa``: the plain PyTorch a user would write (index the blocks into contiguous K / V, then
  ``scaled_dot_product_attention`` with ``enable_gqa``), and ``sdpa contiguous``: SDPA on contiguous K / V of the
  same shapes (the dense kernel of this machine). Extend rows with a cached prefix pass a bottom-right causal mask.

Output: a table on stdout; ``--json PATH`` writes every row. ``--quick``: a small subset (smoke test, < 30 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .timing import graph_replay_us

HQ, H, D = 32, 8, 128
FORMATS = ("auto", "fp8", "int8", "int4")
COMMAND = "kvcache bench attention"


@dataclasses.dataclass
class Result:
    """One measured row. ``role``: ``kvcache``, ``baseline`` (PyTorch / SDPA) or ``ceiling`` (a copy)."""

    op: str
    shape: str
    block_size: int
    impl: str
    role: str
    us: float
    bytes: int = 0
    flops: float = 0.0
    max_err: float | None = None
    graph: bool = True

    @property
    def gbs(self) -> float:
        return self.bytes / (self.us * 1e-6) / 1e9 if self.us > 0 else 0.0

    @property
    def tflops(self) -> float:
        return self.flops / (self.us * 1e-6) / 1e12 if self.us > 0 else 0.0


def bench_us(fn: Callable[[], object], rep: int) -> tuple[float, bool]:
    """Median microseconds of ``fn`` replayed from a CUDA graph with L2 flushed before every call; ``(us, True)``.
    Falls back to eager calls (``(us, False)``) where ``fn`` cannot be captured."""
    return graph_replay_us(fn, rep=rep, warmup=10, eager_fallback=True)


def kv_bytes(n_tokens: int, kv_dtype: str) -> int:
    """Bytes of K and V that attention over ``n_tokens`` tokens must read (8 KV heads, head_dim 128)."""
    row = {"auto": 2 * D, "fp8": D, "int8": D + 8, "int4": D // 2 + 8}[kv_dtype]
    return 2 * n_tokens * H * row


def causal_flops(batch: int, q_len: int, cached: int) -> float:
    """FLOPs of QK^T and PV for causal rows: row i of a sequence sees cached + i + 1 keys."""
    keys = batch * (q_len * cached + q_len * (q_len + 1) // 2)
    return 4.0 * D * HQ * keys


class Pool:
    """One layer's pool of a kv_dtype and block size, filled with plausible values, and its kvcache arguments."""

    def __init__(self, kv_dtype: str, bs: int, num_blocks: int, dev: torch.device, gen: torch.Generator,
                 layout: str = "NHD") -> None:
        from ..paged import PagedConfig

        cfg = PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=num_blocks,
                          dtype=torch.float16, kv_dtype=kv_dtype, layout=layout, device=dev)
        self.kv_dtype, self.bs, self.num_blocks, self.layout = kv_dtype, bs, num_blocks, layout
        shape = cfg.pool_shape()
        if kv_dtype == "auto":
            self.pool = torch.randn(shape, dtype=torch.float16, device=dev, generator=gen)
        elif kv_dtype == "fp8":
            self.pool = torch.randn(shape, dtype=torch.float16, device=dev, generator=gen).to(torch.float8_e4m3fn)
        else:
            # int8 codes, or two random int4 codes per byte
            self.pool = torch.randint(0, 256, shape, dtype=torch.uint8, device=dev, generator=gen)
        self.params = None
        if cfg.quantized:
            self.params = torch.empty(cfg.params_shape(), dtype=torch.float32, device=dev)
            levels = 255.0 if kv_dtype == "int8" else 15.0
            self.params[..., 0] = 6.0 / levels
            self.params[..., 1] = -3.0
        self.kv_scales = torch.ones(2, dtype=torch.float32, device=dev) if kv_dtype == "fp8" else None

    def tables(self, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        """int32 [batch, ceil(seq_len / bs)] of distinct blocks drawn at random from the whole pool."""
        nblk = -(-seq_len // self.bs)
        perm = torch.randperm(self.num_blocks, device=self.pool.device, generator=gen)[: batch * nblk]
        return perm.view(batch, nblk).to(torch.int32)


def _attention_fn(p: Pool, q: torch.Tensor, bt: torch.Tensor, cu: torch.Tensor, kl: torch.Tensor, max_kv: int,
                  out: torch.Tensor) -> Callable[[], object]:
    from ..ops.attention import attention_plan, attention_workspace_size, paged_attention

    plan = attention_plan(num_q_heads=HQ, num_kv_heads=H, head_dim=D, n_tokens=q.shape[0], num_seqs=bt.shape[0],
                          max_kv_len=max_kv, num_sms=torch.cuda.get_device_properties(q.device).multi_processor_count,
                          kv_dtype=p.kv_dtype)
    ws = torch.empty(max(1, attention_workspace_size(q.shape[0], HQ, D, plan.num_splits)), dtype=torch.float32,
                     device=q.device)

    def fn() -> None:
        paged_attention(q, p.pool, p.params, p.kv_scales, kv_dtype=p.kv_dtype, layout="NHD", block_tables=bt,
                        cu_q_lens=cu, kv_lens=kl, out=out, max_kv_len=max_kv, workspace=ws)

    return fn


def _torch_gather(pool: torch.Tensor, bt: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks of ``bt`` as contiguous [B, H, seq_len, D] K and V (plain PyTorch indexing)."""
    b = bt.shape[0]
    blocks = pool[bt.long()]  # [B, nblk, 2, bs, H, D]
    k = blocks[:, :, 0].reshape(b, -1, H, D)[:, :seq_len].transpose(1, 2)
    v = blocks[:, :, 1].reshape(b, -1, H, D)[:, :seq_len].transpose(1, 2)
    return k, v


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)


def _copy_blocks_row(op: str, shape: str, bs: int, fmt: str, p: Pool, bt: torch.Tensor, rep: int) -> Result:
    """``index_select`` of the blocks of ``bt`` from ``p``'s pool (and its (scale, zero) pairs): the same bytes in
    the same pattern as attention over that table reads. GB/s counts read + written bytes."""
    ids = bt.reshape(-1).long()
    srcs = [p.pool.view(torch.uint8).view(p.num_blocks, -1)]
    if p.params is not None:
        srcs.append(p.params.view(p.num_blocks, -1))
    dsts = [torch.empty((ids.numel(), s.shape[1]), dtype=s.dtype, device=s.device) for s in srcs]

    def copy() -> None:
        for s, d in zip(srcs, dsts):
            torch.index_select(s, 0, ids, out=d)

    us, graphed = bench_us(copy, rep)
    nbytes = sum(d.numel() * d.element_size() for d in dsts)
    name = "copy same blocks" if fmt == "auto" else f"copy same blocks {fmt}"
    return Result(op, shape, bs, name, "ceiling", us, 2 * nbytes, graph=graphed)


def _shape_rows(op: str, shape: str, batch: int, q_len: int, cached: int, pools: dict[str, Pool], bs: int,
                gen: torch.Generator, rep: int, dev: torch.device) -> list[Result]:
    """Every row of one (shape, block size): kvcache per kv_dtype, copies, gather + SDPA, contiguous SDPA."""
    seq = cached + q_len
    n = batch * q_len
    flops = causal_flops(batch, q_len, cached)
    q = torch.randn((n, HQ, D), dtype=torch.float16, device=dev, generator=gen)
    cu = torch.arange(0, n + 1, q_len, dtype=torch.int32, device=dev)
    kl = torch.full((batch,), seq, dtype=torch.int32, device=dev)
    rows: list[Result] = []
    ref_out = None
    outs: dict[str, torch.Tensor] = {}
    fp16 = pools["auto"]
    bt16 = fp16.tables(batch, seq, gen)
    tables: dict[str, torch.Tensor] = {}
    for fmt, p in pools.items():
        bt = bt16 if fmt == "auto" else p.tables(batch, seq, gen)
        tables[fmt] = bt
        out = torch.empty_like(q)
        us, graphed = bench_us(_attention_fn(p, q, bt, cu, kl, seq, out), rep)
        outs[fmt] = out
        rows.append(Result(op, shape, bs, f"kvcache {fmt}", "kvcache", us, kv_bytes(batch * seq, fmt), flops,
                           graph=graphed))
    # ceilings: a copy of the blocks each format's attention reads (its own table), stored bytes and (scale, zero)
    for fmt, p in pools.items():
        if op == "decode":
            rows.append(_copy_blocks_row(op, shape, bs, fmt, p, tables[fmt], rep))
    # baselines on the fp16 pool's blocks of the same table
    nbytes = kv_bytes(batch * seq, "auto")
    if op != "decode":
        rows.append(_copy_blocks_row(op, shape, bs, "auto", fp16, bt16, rep))
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=dev)
    dst = torch.empty_like(src)
    us, graphed = bench_us(lambda a=src, b=dst: b.copy_(a), rep)
    rows.append(Result(op, shape, bs, "copy contiguous", "ceiling", us, 2 * nbytes, graph=graphed))
    del src, dst
    qb = q.view(batch, q_len, HQ, D).transpose(1, 2)  # [B, HQ, q_len, D]
    mask = None
    causal = q_len > 1 and cached == 0
    if q_len > 1 and cached > 0:  # bottom-right causal: row i sees keys <= cached + i
        mask = (torch.arange(seq, device=dev)[None, :] <= cached + torch.arange(q_len, device=dev)[:, None])
    try:
        def gather_sdpa() -> torch.Tensor:
            k, v = _torch_gather(fp16.pool, bt16, seq)
            return _sdpa(qb, k, v, mask, causal)

        ref_out = gather_sdpa()
        us, graphed = bench_us(gather_sdpa, rep)
        rows.append(Result(op, shape, bs, "torch gather + sdpa", "baseline", us, nbytes, flops, graph=graphed))
        k, v = _torch_gather(fp16.pool, bt16, seq)
        k, v = k.contiguous(), v.contiguous()
        us, graphed = bench_us(lambda k=k, v=v: _sdpa(qb, k, v, mask, causal), rep)
        rows.append(Result(op, shape, bs, "sdpa contiguous", "baseline", us, nbytes, flops, graph=graphed))
        del k, v
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        print(f"# {op} {shape} bs {bs}: out of memory for the PyTorch baselines, skipped")
    if ref_out is not None:
        err = (outs["auto"].view(batch, q_len, HQ, D).transpose(1, 2).float() - ref_out.float()).abs().max().item()
        rows[0].max_err = err
    return rows


def run(quick: bool, formats: tuple[str, ...] = FORMATS, block_sizes: tuple[int, ...] = (16, 64)) -> list[Result]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    if quick:
        decode = [(8, 1024), (1, 8192)]
        prefill = [(2, 256, 0), (2, 256, 512)]
        block_sizes = block_sizes[:1]
        rep = 20
    else:
        decode = [(64, 1024), (64, 4096), (64, 16384), (1, 131072)]
        prefill = [(8, 2048, 0), (8, 2048, 4096)]
        rep = 60
    most = max([b * s for b, s in decode] + [b * (c + q) for b, q, c in prefill])
    results: list[Result] = []
    for bs in block_sizes:
        num_blocks = max(8192, int(1.1 * most / bs) + 1)
        pools = {fmt: Pool(fmt, bs, num_blocks, dev, gen) for fmt in ("auto",) + tuple(f for f in formats
                                                                                       if f != "auto")}
        for batch, seq in decode:
            shape = f"{batch} x {seq // 1024}k"
            results += _shape_rows("decode", shape, batch, 1, seq - 1, pools, bs, gen, rep, dev)
            print(table(results[-(2 * len(pools) + 3):]), flush=True)
        for batch, q_len, cached in prefill:
            shape = f"{batch} x {q_len} new, {cached} cached"
            results += _shape_rows("prefill", shape, batch, q_len, cached, pools, bs, gen, rep, dev)
            print(table(results[-(len(pools) + 4):]), flush=True)
        del pools
        torch.cuda.empty_cache()
    return results


def table(results: list[Result]) -> str:
    copy = {(r.op, r.shape, r.block_size): r.gbs for r in results if r.impl == "copy contiguous"}
    own = {(r.op, r.shape, r.block_size, r.impl.removeprefix("copy same blocks").strip() or "auto"): r.gbs
           for r in results if r.impl.startswith("copy same blocks")}
    fp16 = {(r.op, r.shape, r.block_size): r.us for r in results if r.impl == "kvcache auto"}
    head = "| op | shape | block | impl | us | GB/s | % copy | % own-block copy | TFLOP/s | x fp16 | max err vs sdpa |"
    lines = [head,
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        key = (r.op, r.shape, r.block_size)
        pct = f"{100 * r.gbs / copy[key]:.0f}%" if key in copy and r.role != "ceiling" and copy[key] else ""
        okey = key + (r.impl.removeprefix("kvcache ").strip(),)
        opct = f"{100 * r.gbs / own[okey]:.0f}%" if r.op == "decode" and r.role == "kvcache" and own.get(okey) else ""
        speed = f"{fp16[key] / r.us:.2f}" if r.role == "kvcache" and key in fp16 else ""
        tf = f"{r.tflops:.0f}" if r.op == "prefill" and r.role != "ceiling" else ""
        err = f"{r.max_err:.2e}" if r.max_err is not None else ""
        us = f"{r.us:.1f}" + ("" if r.graph else " (eager)")
        lines.append(f"| {r.op} | {r.shape} | {r.block_size} | {r.impl} | {us} | {r.gbs:.0f} | {pct} | {opct} | {tf} | "
                     f"{speed} | {err} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvcache bench attention`` (``python -m kvcache.bench.attention``)."""
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small subset (smoke test, < 30 s)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--formats", default=",".join(FORMATS), help="kv_dtypes to measure (comma-separated)")
    ap.add_argument("--block-sizes", default="16,64", help="block sizes (comma-separated)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{COMMAND}: needs a CUDA device")
        return 1
    formats = tuple(f for f in args.formats.split(",") if f)
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        ap.error(f"--formats: expected a subset of {FORMATS}, got {bad}")
    sizes = tuple(int(x) for x in args.block_sizes.split(",") if x)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    name = torch.cuda.get_device_name()
    print(f"# {COMMAND}{' --quick' if args.quick else ''}: {name}, torch {torch.__version__}, {date}")
    results = run(args.quick, formats, sizes)
    print("\n## all rows\n")
    print(table(results))
    if args.json:
        rows = [dict(dataclasses.asdict(r), gbs=r.gbs, tflops=r.tflops) for r in results]
        with open(args.json, "w") as f:
            json.dump({"command": COMMAND, "device": name, "date": date, "torch": torch.__version__,
                       "quick": args.quick, "rows": rows}, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
