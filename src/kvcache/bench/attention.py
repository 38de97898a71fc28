"""``kvcache bench attention``: paged attention over every kv_dtype, beside its copy ceiling and dense SDPA.

Conditions: one layer's pool as a server holds it (>= 8192 blocks, several GiB; 1.1x the largest shape's tokens),
each batch's blocks drawn at random from all of it, L2 flushed between calls (``triton.testing.do_bench``), every
call captured in a CUDA graph (launch cost out of the measurement; the graph also proves the op capturable).
Shapes: 32 q heads / 8 KV heads, head_dim 128, fp16 queries; decode 64 x {1k, 4k, 16k} and 1 x 128k cached tokens;
prefill / extend 8 x 2048 new tokens with 0 and 4096 cached (causal); blocks of 16 and 64.

Rows of each shape, in the same run:

* ``kvcache <kv_dtype>``: :func:`kvcache.ops.paged_attention`, one row per kv_dtype of the ``KVFormat`` table.
* ``torch gather + sdpa``: the plain PyTorch a user would write (index the blocks into contiguous K / V, then
  ``scaled_dot_product_attention``), and ``sdpa contiguous``: SDPA on contiguous K / V of the same shapes. Both
  run SDPA's flash backend (``enable_gqa``; extend rows with a cached prefix pass a bottom-right causal bias).
* decode only, per kv_dtype: ``copy contiguous`` and ``copy same blocks``, the two copies of
  :mod:`kvcache.bench.ceiling` of the bytes that kv_dtype's attention reads (its blocks and their (scale, zero)
  pairs).

What each row reports:

* **decode** (memory-bound): GB/s = the K / V bytes the attention must read (stored bytes, plus (scale, zero) for
  int8 / int4) per second, and "% ceiling" = that over the **ceiling** of its kv_dtype: the faster of the
  contiguous and the same-blocks copy of the same bytes (each counted read + written, twice the bytes copied).
  The baselines read fp16 K / V and are set against the fp16 ceiling.
* **prefill** (compute-bound): TFLOP/s and "% SDPA" = that over ``sdpa contiguous``'s TFLOP/s for the same shape.
  FLOPs = 4 * Hq * D per (query, visible key) pair (QK^T and PV, 2 FLOPs a multiply-add), summed over the
  batch: a sequence of ``q`` new tokens after ``c`` cached ones has ``q * c + q * (q + 1) / 2`` pairs (the full
  rectangle over the prefix, the causal half of the ``q x q`` square with its diagonal), see
  :func:`attention_flops`.

Output: a table on stdout; ``--json PATH`` writes every row with the figures above (``gbs``, ``ceiling_gbs``,
``pct_ceiling``, ``tflops``, ``sdpa_tflops``, ``pct_sdpa``). ``--quick``: a small subset (smoke test, < 30 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..ops.paged.format import KV_FORMATS, kv_format
from .timing import graph_replay_us

HQ, H, D = 32, 8, 128
# every kv_dtype of the KVFormat table but int4b, whose bytes per token depend on the block size and whose kernels are
# timed by benchmarks/block_keys_gpu.py
FORMATS = tuple(k for k in KV_FORMATS if not kv_format(k).block_keys)
COMMAND = "kvcache bench attention"
SUITE = "attention"
SDPA = "sdpa contiguous"  # the dense reference of the prefill rows


@dataclasses.dataclass
class Result:
    """One measured row. ``role``: ``kvcache``, ``baseline`` (PyTorch / SDPA) or ``ceiling`` (a copy);
    ``kv_dtype``: the format it reads (``auto`` for the fp16 baselines)."""

    op: str
    shape: str
    block_size: int
    impl: str
    role: str
    kv_dtype: str
    us: float
    bytes: int = 0
    flops: float = 0.0
    max_err: float | None = None
    graph: bool = True

    @property
    def gbs(self) -> float:
        return self.bytes / (self.us * 1e3) if self.us > 0 else 0.0

    @property
    def tflops(self) -> float:
        return self.flops / (self.us * 1e6) if self.us > 0 else 0.0


def bench_us(fn: Callable[[], object], rep: int) -> tuple[float, bool]:
    """Median microseconds of ``fn`` replayed from a CUDA graph with L2 flushed before every call; ``(us, True)``.
    Falls back to eager calls (``(us, False)``) where ``fn`` cannot be captured."""
    return graph_replay_us(fn, rep=rep, warmup=10, eager_fallback=True)


def kv_bytes(n_tokens: int, kv_dtype: str) -> int:
    """Bytes of K and V that attention over ``n_tokens`` tokens must read (H KV heads of head_dim D, fp16 model
    dtype): stored bytes plus (scale, zero) pairs, as :func:`kvcache.paged.cache_block_bytes` counts them.

    Example
    -------
    >>> kv_bytes(1024, "auto")  # 2 (K, V) x 1024 tokens x 8 heads x 128 x 2 bytes
    4194304
    """
    from ..paged import cache_block_bytes

    return cache_block_bytes(1, H, D, 1, torch.float16, kv_dtype) * n_tokens


def attention_flops(batch: int, q_len: int, cached: int, num_q_heads: int | None = None,
                    head_dim: int | None = None) -> float:
    """FLOPs of causal attention of ``batch`` sequences of ``q_len`` new tokens after ``cached`` cached ones.

    ``4 * Hq * D`` per (query, visible key) pair (QK^T and PV, 2 FLOPs per multiply-add); query ``i`` (0-based)
    sees ``cached + i + 1`` keys, so a sequence has ``q_len * cached + q_len * (q_len + 1) / 2`` pairs: the full
    rectangle over the cached prefix and the causal half (diagonal included) of the new tokens' square. A decode
    step (``q_len`` 1) is the full ``4 * Hq * D * (cached + 1)``.

    Parameters
    ----------
    batch, q_len, cached : int
        Sequences, new tokens per sequence (>= 1), cached tokens per sequence (>= 0).
    num_q_heads, head_dim : int, optional
        Default: the bench's ``HQ`` and ``D``.

    Example
    -------
    >>> attention_flops(1, 2, 3, num_q_heads=1, head_dim=1)  # queries see 4 and 5 keys
    36.0
    """
    for name, v, lo in (("batch", batch, 1), ("q_len", q_len, 1), ("cached", cached, 0)):
        if not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
    hq = HQ if num_q_heads is None else num_q_heads
    d = D if head_dim is None else head_dim
    pairs = q_len * cached + q_len * (q_len + 1) // 2
    return 4.0 * hq * d * batch * pairs


class Pool:
    """One layer's pool of a kv_dtype and block size, filled with plausible values, and its kvcache arguments."""

    def __init__(self, kv_dtype: str, bs: int, num_blocks: int, dev: torch.device, gen: torch.Generator,
                 layout: str = "NHD") -> None:
        from ..paged import PagedConfig

        cfg = PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=num_blocks,
                          dtype=torch.float16, kv_dtype=kv_dtype, layout=layout, device=dev)
        fmt = kv_format(kv_dtype)
        self.kv_dtype, self.bs, self.num_blocks, self.layout = kv_dtype, bs, num_blocks, layout
        shape = cfg.pool_shape()
        if fmt.is_float:  # fp16, or fp8 codes of fp16 values
            values = torch.randn(shape, dtype=torch.float16, device=dev, generator=gen)
            self.pool = values.to(fmt.storage_dtype(torch.float16))
        else:  # int8 codes, or two random int4 codes per byte (k8v4: both, in their planes)
            self.pool = torch.randint(0, 256, shape, dtype=torch.uint8, device=dev, generator=gen)
        self.params = None
        if fmt.row_params:
            self.params = torch.empty(cfg.params_shape(), dtype=torch.float32, device=dev)
            self.params[:, 0, ..., 0] = 6.0 / fmt.qmax_of(0)
            self.params[:, 1, ..., 0] = 6.0 / fmt.qmax_of(1)
            self.params[..., 1] = -3.0
        elif fmt.key_scale:  # fp8k: a scale per key row
            self.params = torch.full(cfg.params_shape(), 1.0 / 64, dtype=torch.float32, device=dev)
        self.kv_scales = torch.ones(2, dtype=torch.float32, device=dev) if fmt.per_layer_scale else None

    def tables(self, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        """int32 [batch, ceil(seq_len / bs)] of distinct blocks drawn at random from the whole pool."""
        nblk = -(-seq_len // self.bs)
        perm = torch.randperm(self.num_blocks, device=self.pool.device, generator=gen)[: batch * nblk]
        return perm.view(batch, nblk).to(torch.int32)

    def block_views(self) -> list[torch.Tensor]:
        """The data pool and the (scale, zero) pool (int8 / int4), each viewed as [num_blocks, bytes of a block]."""
        views = [self.pool.view(torch.uint8).view(self.num_blocks, -1)]
        if self.params is not None:
            views.append(self.params.view(torch.uint8).view(self.num_blocks, -1))
        return views


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


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int) -> torch.Tensor:
    """SDPA's flash backend: q [B, HQ, q_len, D], k / v [B, H, cached + q_len, D]; causal, bottom-right aligned."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    q_len, seq = q.shape[2], k.shape[2]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        if q_len > 1 and cached > 0:  # row i sees keys <= cached + i
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, seq), enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, enable_gqa=True)


def ceiling_rows(op: str, shape: str, p: Pool, bt: torch.Tensor, rep: int) -> list[Result]:
    """The contiguous and the same-blocks copy of the bytes that attention over ``bt`` reads from ``p``
    (:func:`kvcache.bench.ceiling.measure_ceiling`); two ``ceiling`` rows, bytes read + written."""
    from .ceiling import measure_ceiling

    c = measure_ceiling(p.block_views(), bt.reshape(-1).long(), rep)
    return [Result(op, shape, p.bs, "copy contiguous", "ceiling", p.kv_dtype, c.contiguous_us, c.bytes),
            Result(op, shape, p.bs, "copy same blocks", "ceiling", p.kv_dtype, c.same_pattern_us, c.bytes)]


def _baseline_rows(op: str, shape: str, batch: int, q_len: int, cached: int, fp16: Pool, bt16: torch.Tensor,
                   q: torch.Tensor, rep: int) -> tuple[list[Result], torch.Tensor | None]:
    """``torch gather + sdpa`` and ``sdpa contiguous`` on the fp16 pool's blocks of ``bt16``, and the former's
    output [B, HQ, q_len, D] (the reference of the max error); no rows where memory runs out."""
    seq = cached + q_len
    nbytes, flops = kv_bytes(batch * seq, "auto"), attention_flops(batch, q_len, cached)
    qb = q.view(batch, q_len, HQ, D).transpose(1, 2)  # [B, HQ, q_len, D]
    rows: list[Result] = []
    try:
        def gather_sdpa() -> torch.Tensor:
            k, v = _torch_gather(fp16.pool, bt16, seq)
            return _sdpa(qb, k, v, cached)

        ref_out = gather_sdpa()
        us, graphed = bench_us(gather_sdpa, rep)
        rows.append(Result(op, shape, fp16.bs, "torch gather + sdpa", "baseline", "auto", us, nbytes, flops,
                           graph=graphed))
        k, v = (t.contiguous() for t in _torch_gather(fp16.pool, bt16, seq))
        us, graphed = bench_us(lambda k=k, v=v: _sdpa(qb, k, v, cached), rep)
        rows.append(Result(op, shape, fp16.bs, SDPA, "baseline", "auto", us, nbytes, flops, graph=graphed))
        del k, v
    except (torch.OutOfMemoryError, RuntimeError) as e:  # no memory, or no flash kernel for the shape
        torch.cuda.empty_cache()
        print(f"# {op} {shape} bs {fp16.bs}: PyTorch baselines skipped ({type(e).__name__}: {str(e)[:120]})")
        return rows, None
    return rows, ref_out


def _shape_rows(op: str, shape: str, batch: int, q_len: int, cached: int, pools: dict[str, Pool],
                gen: torch.Generator, rep: int, dev: torch.device) -> list[Result]:
    """Every row of one (shape, block size): kvcache per kv_dtype, the decode ceilings, the PyTorch baselines."""
    seq = cached + q_len
    n = batch * q_len
    q = torch.randn((n, HQ, D), dtype=torch.float16, device=dev, generator=gen)
    cu = torch.arange(0, n + 1, q_len, dtype=torch.int32, device=dev)
    kl = torch.full((batch,), seq, dtype=torch.int32, device=dev)
    rows: list[Result] = []
    tables = {fmt: p.tables(batch, seq, gen) for fmt, p in pools.items()}
    out16 = torch.empty_like(q)
    for fmt, p in pools.items():
        out = out16 if fmt == "auto" else torch.empty_like(q)
        us, graphed = bench_us(_attention_fn(p, q, tables[fmt], cu, kl, seq, out), rep)
        rows.append(Result(op, shape, p.bs, f"kvcache {fmt}", "kvcache", fmt, us, kv_bytes(batch * seq, fmt),
                           attention_flops(batch, q_len, cached), graph=graphed))
    if op == "decode":  # memory-bound: each kv_dtype against the copies of its own bytes
        for fmt, p in pools.items():
            rows += ceiling_rows(op, shape, p, tables[fmt], rep)
    base, ref_out = _baseline_rows(op, shape, batch, q_len, cached, pools["auto"], tables["auto"], q, rep)
    rows += base
    if ref_out is not None:
        err = (out16.view(batch, q_len, HQ, D).transpose(1, 2).float() - ref_out.float()).abs().max().item()
        rows[0].max_err = err
    return rows


def summarize(results: list[Result]) -> list[dict[str, Any]]:
    """Every row as a dict (the JSON rows) with its figures: ``gbs`` and ``tflops``; decode rows ``ceiling_gbs``
    (the faster of the two copies of their kv_dtype, same op, shape and block size) and ``pct_ceiling``; prefill
    rows ``sdpa_tflops`` (``sdpa contiguous`` of the same shape and block size) and ``pct_sdpa``; kvcache rows
    ``x_auto`` (speed over ``kvcache auto``). Figures that do not apply are None.

    Example
    -------
    >>> rows = summarize([Result("decode", "1 x 1k", 16, "kvcache auto", "kvcache", "auto", 10.0, 40_000),
    ...                   Result("decode", "1 x 1k", 16, "copy contiguous", "ceiling", "auto", 30.0, 120_000),
    ...                   Result("decode", "1 x 1k", 16, "copy same blocks", "ceiling", "auto", 20.0, 120_000)])
    >>> rows[0]["ceiling_gbs"], rows[0]["pct_ceiling"]
    (6.0, 66.66666666666667)
    """
    ceiling: dict[tuple, float] = {}
    sdpa: dict[tuple, float] = {}
    auto_us: dict[tuple, float] = {}
    for r in results:
        key = (r.op, r.shape, r.block_size)
        if r.role == "ceiling":
            ceiling[key + (r.kv_dtype,)] = max(ceiling.get(key + (r.kv_dtype,), 0.0), r.gbs)
        elif r.impl == SDPA:
            sdpa[key] = r.tflops
        elif r.impl == "kvcache auto":
            auto_us[key] = r.us
    out = []
    for r in results:
        key = (r.op, r.shape, r.block_size)
        row = dict(dataclasses.asdict(r), gbs=r.gbs, tflops=r.tflops, ceiling_gbs=None, pct_ceiling=None,
                   sdpa_tflops=None, pct_sdpa=None, x_auto=None)
        if r.op == "decode" and ceiling.get(key + (r.kv_dtype,)):
            row["ceiling_gbs"] = ceiling[key + (r.kv_dtype,)]
            row["pct_ceiling"] = 100 * r.gbs / row["ceiling_gbs"]
        if r.op != "decode" and r.role != "ceiling" and sdpa.get(key):
            row["sdpa_tflops"] = sdpa[key]
            row["pct_sdpa"] = 100 * r.tflops / sdpa[key]
        if r.role == "kvcache" and key in auto_us and r.us > 0:
            row["x_auto"] = auto_us[key] / r.us
        out.append(row)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown of :func:`summarize`'s rows: decode rows in GB/s and % of their ceiling, prefill rows in TFLOP/s
    and % of SDPA."""
    def f(v: float | None, fmt: str) -> str:
        return "" if v is None else format(v, fmt)

    lines = ["| op | shape | block | impl | us | GB/s | % ceiling | TFLOP/s | % SDPA | x auto | max err vs sdpa |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        decode = r["op"] == "decode"
        us = f"{r['us']:.1f}" + ("" if r["graph"] else " (eager)")
        impl = r["impl"] if r["role"] == "kvcache" or r["kv_dtype"] == "auto" else f"{r['impl']} {r['kv_dtype']}"
        lines.append(f"| {r['op']} | {r['shape']} | {r['block_size']} | {impl} | {us} | "
                     f"{f(r['gbs'], '.0f') if decode else ''} | {f(r['pct_ceiling'], '.0f')} | "
                     f"{'' if decode else f(r['tflops'], '.0f')} | {f(r['pct_sdpa'], '.0f')} | "
                     f"{f(r['x_auto'], '.2f')} | {f(r['max_err'], '.2e')} |")
    return "\n".join(lines)


def run(quick: bool, formats: tuple[str, ...] = FORMATS, block_sizes: tuple[int, ...] = (16, 64)) -> list[Result]:
    """Every row of the bench on the current CUDA device (``quick``: two small shapes of each family, block 16)."""
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
        cases = [("decode", f"{b} x {s // 1024}k", b, 1, s - 1) for b, s in decode]
        cases += [("prefill", f"{b} x {q} new, {c} cached", b, q, c) for b, q, c in prefill]
        for op, shape, batch, q_len, cached in cases:
            rows = _shape_rows(op, shape, batch, q_len, cached, pools, gen, rep, dev)
            print(table(summarize(rows)), flush=True)
            results += rows
        del pools
        torch.cuda.empty_cache()
    return results


def write_json(path: str, results: list[Result], *, device: str, date: str, quick: bool) -> None:
    """The bench's JSON: ``command``, ``suite`` ("attention"), ``device``, ``date``, ``torch``, ``quick`` and
    ``rows`` (:func:`summarize`)."""
    with open(path, "w") as f:
        json.dump({"command": COMMAND, "suite": SUITE, "device": device, "date": date, "torch": torch.__version__,
                   "quick": quick, "rows": summarize(results)}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvcache bench attention`` (``python -m kvcache.bench.attention``); 2 without a GPU."""
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small subset (smoke test, < 30 s)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--formats", default=",".join(FORMATS), help="kv_dtypes to measure (comma-separated)")
    ap.add_argument("--block-sizes", default="16,64", help="block sizes (comma-separated)")
    args = ap.parse_args(argv)
    formats = tuple(f for f in args.formats.split(",") if f)
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        ap.error(f"--formats: expected a subset of {FORMATS}, got {bad}")
    if not torch.cuda.is_available():
        print(f"{COMMAND}: needs a CUDA device")
        return 2
    sizes = tuple(int(x) for x in args.block_sizes.split(",") if x)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    name = torch.cuda.get_device_name()
    print(f"# {COMMAND}{' --quick' if args.quick else ''}: {name}, torch {torch.__version__}, {date}")
    results = run(args.quick, formats, sizes)
    print("\n## all rows\n")
    print(table(summarize(results)))
    if args.json:
        write_json(args.json, results, device=name, date=date, quick=args.quick)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
