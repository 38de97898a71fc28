"""``kvcache bench paged``: append (fused RoPE + quantize) and gather, measured as a server runs.

Conditions: a realistic pool (>= 8192 blocks per layer, several GiB), the blocks of every batch drawn at random
from all of it, L2 flushed between calls (``triton.testing.do_bench``), each call captured in a CUDA graph
(decode: a 32-layer step, distinct K / V per layer). In the same run, beside kvcache: the plain PyTorch a user
would write (index_put + RoPE; index + copy_) and two ceiling copies of the same bytes, one contiguous and one in
the op's pattern (append: a plain Triton copy of the rows to consecutive slots / to the same slots, no index work;
gather: :func:`kvcache.bench.ceiling.copy_rows` of blocks ``0 .. n-1`` / of the same blocks). Shapes: 8 KV heads,
head_dim 128, fp16; prefill 8 x 2048 new tokens, decode 256 x 1 token (1-1000 cached), gather 64 x 2048 tokens;
blocks of 16 and 64.

Bytes are what must be read + written (K and V read in the model dtype, the stored bytes and (scale, zero)
written, or the reverse for the gather; a copy counts its reads and writes alike). "% ceiling" is a row's
bandwidth over its op and shape's ceiling: the faster of the two copies (the rule of :mod:`kvcache.bench.ceiling`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ..ops.paged.format import KV_FORMATS, kv_format
from ..paged import PagedConfig, PagedKVCache, cache_block_bytes
from ..rope import RopeConfig
from .ceiling import measure_ceiling
from .timing import graph_replay_us

H, D = 8, 128
LAYERS = 32
# int4b appends by block table only (no slot mapping) and keeps per-block key scales: its kernels are timed by
# benchmarks/block_keys_gpu.py
FORMATS = tuple(k for k in KV_FORMATS if not kv_format(k).block_keys)
COMMAND = "kvcache bench paged"


@triton.jit
def _slot_copy(k, v, pool, slots, ROW: tl.constexpr, BS: tl.constexpr):
    # the append's memory traffic without its index work: row n of k and v [N, ROW] (fp16) to slot slots[n] of a
    # pool [nb, 2, BS, ROW] (NHD), one program per row
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, ROW)
    slot = tl.load(slots + n)
    dst = pool + (slot // BS) * (2 * BS * ROW) + (slot % BS) * ROW + e
    tl.store(dst, tl.load(k + n * ROW + e))
    tl.store(dst + BS * ROW, tl.load(v + n * ROW + e))


@dataclasses.dataclass
class Result:
    """One measured row: ``role`` is ``kvcache``, ``baseline`` (plain PyTorch) or ``ceiling`` (a plain copy)."""

    op: str
    shape: str
    impl: str
    role: str
    us: float
    bytes: int

    @property
    def gbs(self) -> float:
        return self.bytes / (self.us * 1e-6) / 1e9


def bench_graph(fn: Callable[[], object], per: int = 1) -> float:
    """Microseconds per call of ``fn`` captured in a CUDA graph and replayed with L2 flushed before every replay
    (median), divided by ``per`` (calls inside ``fn``)."""
    return graph_replay_us(fn)[0] / per


def store_bytes(n_tokens: int, kv_dtype: str) -> int:
    """Bytes the append writes (and the gather reads) for ``n_tokens`` tokens: K and V, (scale, zero) included."""
    return cache_block_bytes(1, H, D, 1, torch.float16, kv_dtype) * n_tokens


def random_slots(n_rows: int, start: torch.Tensor, q_len: int, bs: int, nb: int, gen: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables whose written blocks are distinct and drawn at random from the whole pool (entries only
    read by attention are random blocks too), and the slot of every row."""
    n_seqs = start.shape[0]
    per_seq = math.ceil((int(start.max()) + q_len) / bs)
    tables = torch.randint(0, nb, (n_seqs, per_seq), generator=gen, dtype=torch.int32)
    first, last = start // bs, (start + q_len - 1) // bs
    fresh = torch.randperm(nb, generator=gen).to(torch.int32)
    used = 0
    for b in range(n_seqs):
        w = int(last[b] - first[b]) + 1
        tables[b, int(first[b]): int(last[b]) + 1] = fresh[used: used + w]
        used += w
    pos = start[:, None].long() + torch.arange(q_len)[None, :]
    slots = tables.long().gather(1, pos // bs) * bs + pos % bs
    return tables, slots.reshape(n_rows)


def _torch_append(pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
                  cos: torch.Tensor | None, sin: torch.Tensor | None) -> None:
    """What a user writes: HF-style RoPE on K (model dtype), then index_put into the pool (NHD)."""
    if cos is not None:
        half = D // 2
        k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
    pool[blk, 0, off] = k
    pool[blk, 1, off] = v


def _prefill(dev: torch.device, gen: torch.Generator, quick: bool) -> list[Result]:
    out: list[Result] = []
    n_seqs, seq = (8, 2048) if not quick else (2, 512)
    n = n_seqs * seq
    rope = RopeConfig(head_dim=D, base=500000.0)
    k = torch.randn(n, H, D, dtype=torch.float16, device=dev)
    v = torch.randn(n, H, D, dtype=torch.float16, device=dev)
    cu_q = torch.arange(0, n + 1, seq, dtype=torch.int32, device=dev)
    kv_lens = torch.zeros(n_seqs, dtype=torch.int32, device=dev)
    for bs in (16, 64):
        nb = (1 << 20) // bs if not quick else 8192  # 4 GiB of fp16 pool
        shape = f"{n_seqs} x {seq} tok, block {bs}, {nb} blocks"
        tables, slots = random_slots(n, torch.zeros(n_seqs, dtype=torch.long), seq, bs, nb, gen)
        tables, slots = tables.to(dev), slots.to(dev)
        for kv_dtype in FORMATS:
            cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                                             dtype=torch.float16, kv_dtype=kv_dtype, device=dev), rope=rope)
            for use_rope in (False, True):
                plan = cache.plan(tables, cu_q, kv_lens, rope=None if use_rope else False)

                def fn(cache=cache, plan=plan) -> None:  # type: ignore[no-untyped-def]
                    cache.append(0, k, v, plan)
                out.append(Result("prefill append", shape, f"kvcache {kv_dtype}{' + rope' if use_rope else ''}",
                                  "kvcache", bench_graph(fn), 2 * n * H * D * 2 + store_bytes(n, kv_dtype)))
            del cache
        moved = 2 * n * H * D * 2 + store_bytes(n, "auto")
        pool = torch.zeros((nb, 2, bs, H, D), dtype=torch.float16, device=dev)
        for name, rows in (("consecutive", torch.arange(n, device=dev)), ("the same", slots)):
            def ceiling(pool=pool, rows=rows, bs=bs) -> None:  # type: ignore[no-untyped-def]
                _slot_copy[(n,)](k, v, pool, rows, ROW=H * D, BS=bs, num_warps=4)

            out.append(Result("prefill append", shape, f"Triton copy of the rows to {name} slots", "ceiling",
                              bench_graph(ceiling), moved))
        blk, off = slots // bs, slots % bs
        cos, sin = rope.cos_sin(torch.arange(seq, device=dev).repeat(n_seqs))
        cos, sin = cos.to(torch.float16)[:, None, :], sin.to(torch.float16)[:, None, :]
        for use_rope in (False, True):
            def tfn(pool=pool, blk=blk, off=off, c=cos if use_rope else None,  # type: ignore[no-untyped-def]
                    s=sin if use_rope else None) -> None:
                _torch_append(pool, k, v, blk, off, c, s)
            out.append(Result("prefill append", shape, f"torch index_put{' + rope' if use_rope else ''}", "baseline",
                              bench_graph(tfn), moved))
        del pool
        torch.cuda.empty_cache()
    return out


def _decode(dev: torch.device, gen: torch.Generator, quick: bool) -> list[Result]:
    """Per layer of a 32-layer decode step (one graph), 256 sequences x 1 new token."""
    out: list[Result] = []
    n_seqs = 256
    layers = LAYERS if not quick else 4
    rope = RopeConfig(head_dim=D, base=500000.0)
    ks = [torch.randn(n_seqs, H, D, dtype=torch.float16, device=dev) for _ in range(layers)]
    vs = [torch.randn(n_seqs, H, D, dtype=torch.float16, device=dev) for _ in range(layers)]
    cu_q = torch.arange(0, n_seqs + 1, dtype=torch.int32, device=dev)
    start = torch.randint(1, 1000, (n_seqs,), generator=gen)
    kv_lens = start.to(torch.int32).to(dev)
    positions = start.to(dev)
    moved = 2 * n_seqs * H * D * 2
    for bs in (16, 64):
        nb = 8192 if bs == 16 else 4096  # 16 / 32 GiB of fp16 pool over the 32 layers
        shape = f"{n_seqs} x 1 tok, block {bs}, {nb} blocks x {layers} layers"
        tables, slots = random_slots(n_seqs, start, 1, bs, nb, gen)
        tables, slots = tables.to(dev), slots.to(dev)
        for kv_dtype in FORMATS:
            cache = PagedKVCache(PagedConfig(num_layers=layers, num_kv_heads=H, head_dim=D, block_size=bs,
                                             num_blocks=nb, dtype=torch.float16, kv_dtype=kv_dtype, device=dev),
                                 rope=rope)
            nbytes = moved + store_bytes(n_seqs, kv_dtype)

            def ragged(cache=cache, tables=tables, ready=False) -> None:  # type: ignore[no-untyped-def]
                plan = cache.plan(tables, cu_q, kv_lens, metadata_ready=ready)  # once per step, as an engine does
                for i in range(layers):
                    cache.append(i, ks[i], vs[i], plan)

            def by_slots(cache=cache, slots=slots) -> None:  # type: ignore[no-untyped-def]
                plan = cache.plan(slot_mapping=slots, positions=positions)
                for i in range(layers):
                    cache.append(i, ks[i], vs[i], plan)

            out.append(Result("decode append", shape, f"kvcache {kv_dtype} + rope (ragged)", "kvcache",
                              bench_graph(ragged, layers), nbytes))
            out.append(Result("decode append", shape, f"kvcache {kv_dtype} + rope (slot mapping)", "kvcache",
                              bench_graph(by_slots, layers), nbytes))
            out.append(Result("decode append", shape, f"kvcache {kv_dtype} + rope (ragged, metadata_ready)",
                              "kvcache", bench_graph(lambda f=ragged: f(ready=True), layers), nbytes))
            del cache
            torch.cuda.empty_cache()
        pools = torch.zeros((layers, nb, 2, bs, H, D), dtype=torch.float16, device=dev)
        for name, rows in (("consecutive", torch.arange(n_seqs, device=dev)), ("the same", slots)):
            def ceiling(pools=pools, rows=rows, bs=bs) -> None:  # type: ignore[no-untyped-def]
                for i in range(layers):
                    _slot_copy[(n_seqs,)](ks[i], vs[i], pools[i], rows, ROW=H * D, BS=bs, num_warps=4)

            out.append(Result("decode append", shape, f"Triton copy of the rows to {name} slots", "ceiling",
                              bench_graph(ceiling, layers), moved + store_bytes(n_seqs, "auto")))
        blk, off = slots // bs, slots % bs
        cos, sin = rope.cos_sin(positions)
        cos, sin = cos.to(torch.float16)[:, None, :], sin.to(torch.float16)[:, None, :]

        def tfn(pools=pools, blk=blk, off=off, c=cos, s=sin) -> None:  # type: ignore[no-untyped-def]
            for i in range(layers):
                _torch_append(pools[i], ks[i], vs[i], blk, off, c, s)

        out.append(Result("decode append", shape, "torch index_put + rope", "baseline", bench_graph(tfn, layers),
                          moved + store_bytes(n_seqs, "auto")))
        del pools
        torch.cuda.empty_cache()
    return out


def _gather(dev: torch.device, gen: torch.Generator, quick: bool) -> list[Result]:
    out: list[Result] = []
    n_seqs, seq, bs = (64, 2048, 16) if not quick else (8, 512, 16)
    nb = 65536 if not quick else 8192  # 4 GiB of fp16 pool
    shape = f"{n_seqs} x {seq} tok, block {bs}, {nb} blocks"
    tables = torch.randperm(nb, generator=gen)[: n_seqs * seq // bs].view(n_seqs, -1).to(torch.int32).to(dev)
    lens = torch.full((n_seqs,), seq, dtype=torch.int32, device=dev)
    k_out = torch.empty(n_seqs, H, seq, D, dtype=torch.float16, device=dev)
    v_out = torch.empty_like(k_out)
    moved = 2 * n_seqs * seq * H * D * 2
    for kv_dtype in FORMATS:
        cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                                         dtype=torch.float16, kv_dtype=kv_dtype, device=dev))
        cache.buffer.view(torch.uint8).random_(0, 256)
        if cache.params_buffer is not None:
            cache.params_buffer.uniform_(0.001, 0.01)
        if kv_dtype in ("fp8", "fp8k"):
            cache.buffer.view(torch.uint8).bitwise_and_(0x77)  # finite e4m3 values only
        if kv_dtype == "auto":
            cache.buffer.view(torch.uint8).bitwise_and_(0xBF)  # finite fp16 values only

        plan = cache.plan(tables, seq_lens=lens)

        def fn(cache=cache, plan=plan) -> None:  # type: ignore[no-untyped-def]
            cache.gather(0, plan, k_out=k_out, v_out=v_out)

        out.append(Result("gather", shape, f"kvcache {kv_dtype}", "kvcache", bench_graph(fn),
                          moved + store_bytes(n_seqs * seq, kv_dtype)))
        if kv_dtype == "auto":
            pool = cache.pool(0)
            flat = tables.long().flatten()
            c = measure_ceiling([pool.view(nb, -1)], flat)
            out.append(Result("gather", shape, "copy of blocks 0 .. n-1", "ceiling", c.contiguous_us, c.bytes))
            out.append(Result("gather", shape, "copy of the same blocks", "ceiling", c.same_pattern_us, c.bytes))

            def tfn(pool=pool, flat=flat) -> None:  # type: ignore[no-untyped-def]
                g = pool[flat].view(n_seqs, seq // bs, 2, bs, H, D)
                k_out.copy_(g[:, :, 0].reshape(n_seqs, seq, H, D).transpose(1, 2))
                v_out.copy_(g[:, :, 1].reshape(n_seqs, seq, H, D).transpose(1, 2))

            out.append(Result("gather", shape, "torch index + copy_", "baseline", bench_graph(tfn),
                              moved + store_bytes(n_seqs * seq, "auto")))
        del cache
        torch.cuda.empty_cache()
    return out


def ceilings(results: list[Result]) -> dict[tuple[str, str], float]:
    """``{(op, shape): GB/s}``: the faster of the ceiling copies of each op and shape.

    Example
    -------
    >>> ceilings([Result("gather", "s", "copy a", "ceiling", 2.0, 8000), Result("gather", "s", "copy b", "ceiling",
    ...                                                                        1.0, 8000)])
    {('gather', 's'): 8.0}
    """
    best: dict[tuple[str, str], float] = {}
    for r in results:
        if r.role == "ceiling":
            best[(r.op, r.shape)] = max(best.get((r.op, r.shape), 0.0), r.gbs)
    return best


def table(results: list[Result], device: str, date: str) -> str:
    """Markdown: one row per measurement, with its op and shape's ceiling (the faster copy) as the reference."""
    lines = ["| op | shape | implementation | us | GB/s | % ceiling | device | date |",
             "|---|---|---|---:|---:|---:|---|---|"]
    best = ceilings(results)
    for r in results:
        ceil = best.get((r.op, r.shape))
        pct = f"{100 * r.gbs / ceil:.1f}" if ceil else "-"
        lines.append(f"| {r.op} | {r.shape} | {r.impl} | {r.us:.2f} | {r.gbs:.0f} | {pct} | {device} | {date} |")
    return "\n".join(lines)


def main(quick: bool = False, json_path: str | None = None) -> int:
    """Run the paged benchmark on the current CUDA device; print a table, write JSON to ``json_path``."""
    if not torch.cuda.is_available():
        print("kvcache bench paged: needs a CUDA device")
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(dev)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"device: {name} | torch {torch.__version__} | triton {triton.__version__} | {date}")
    gen = torch.Generator().manual_seed(0)
    results = _prefill(dev, gen, quick) + _decode(dev, gen, quick) + _gather(dev, gen, quick)
    print(table(results, name, date))
    print(f"command: {COMMAND}{' --quick' if quick else ''}")
    if json_path:
        best = ceilings(results)
        with open(json_path, "w") as f:
            json.dump({"device": name, "date": date, "command": COMMAND, "torch": torch.__version__,
                       "triton": triton.__version__,
                       "rows": [dict(dataclasses.asdict(r), gbs=r.gbs, ceiling_gbs=best.get((r.op, r.shape)))
                                for r in results]}, f, indent=1)
    return 0
