"""``kvcache bench paged``: fused RoPE + quantize + append, and gather, against the device copy bandwidth and
the plain PyTorch a user would write (index_put into the pool + a separate RoPE), in one run.

Shapes (issue 3): 8 KV heads, head_dim 128, fp16; prefill 16384 new tokens (8 x 2048), decode 256 x 1,
block 16 and 64, kv_dtype auto / fp8 / int8 / int4, with and without RoPE; gather of 64 x 2048. Bytes are
what must be read + written (K and V in the model dtype read, the stored bytes and parameters written).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..ops import paged as paged_ops
from ..paged import PagedConfig, PagedKVCache
from ..rope import RopeConfig
from .linear import Row, _fmt, copy_bandwidth, time_eager, time_graph, time_host

H, D = 8, 128


@triton.jit
def _rows_copy(k, v, pool, blocks, ROW: tl.constexpr, BS: tl.constexpr, SCATTER: tl.constexpr, TOK: tl.constexpr):
    # the append's memory traffic without its index work (a ceiling for the fp16 append on this device):
    # TOK consecutive rows of k and v [N, ROW] into their token slots of a pool [nb, 2, BS, ROW], block
    # blocks[n // BS] (SCATTER) or block n // BS; TOK divides BS
    n0 = tl.program_id(0).to(tl.int64) * TOK
    t = tl.arange(0, TOK)[:, None]
    e = tl.arange(0, ROW)[None, :]
    xk = tl.load(k + (n0 + t) * ROW + e)
    xv = tl.load(v + (n0 + t) * ROW + e)
    blk = n0 // BS
    if SCATTER:
        blk = tl.load(blocks + blk).to(tl.int64)
    base = blk * (2 * BS * ROW) + (n0 % BS + t) * ROW
    tl.store(pool + base + e, xk)
    tl.store(pool + base + BS * ROW + e, xv)


class _pdl_off:
    """Appends without programmatic dependent launch inside the block (the comparison rows)."""

    def __enter__(self) -> None:
        self.saved = paged_ops._PDL_ENV
        paged_ops._PDL_ENV = False

    def __exit__(self, *a: object) -> None:
        paged_ops._PDL_ENV = self.saved


class _speculation_off:
    """Decode appends that wait for the previous kernel before their lookup inside the block (the comparison
    rows: the default before speculation)."""

    def __enter__(self) -> None:
        self.saved = paged_ops._SPECULATE
        paged_ops._SPECULATE = False

    def __exit__(self, *a: object) -> None:
        paged_ops._SPECULATE = self.saved


def _tables(n_seqs: int, blocks_per_seq: int, num_blocks: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    ids = torch.randperm(num_blocks, generator=gen)[: n_seqs * blocks_per_seq]
    return ids.view(n_seqs, blocks_per_seq).to(torch.int32).to(dev)


class DecodeBatch(NamedTuple):
    """One decode step's appends: ``n_seqs`` sequences of 1-``ctx`` cached tokens, one new token each."""

    k: torch.Tensor  # fp16 [n_seqs, H, D]
    v: torch.Tensor  # fp16 [n_seqs, H, D]
    cu_q: torch.Tensor  # int32 [n_seqs + 1]: 0, 1, ..., n_seqs
    kv_lens: torch.Tensor  # int32 [n_seqs]
    tables: torch.Tensor  # int32 [n_seqs, blocks per sequence]: randomly permuted blocks
    slots: torch.Tensor  # int64 [n_seqs]: the same targets as slot mapping
    positions: torch.Tensor  # int64 [n_seqs]
    num_blocks: int


def decode_batch(dev: torch.device, gen: torch.Generator, block_size: int, n_seqs: int = 256,
                 ctx: int = 1000) -> DecodeBatch:
    """The decode benchmark's batch (``kvcache bench paged`` and the tuning scripts in ``benchmarks/``)."""
    k = torch.randn(n_seqs, H, D, dtype=torch.float16, device=dev)
    v = torch.randn(n_seqs, H, D, dtype=torch.float16, device=dev)
    cu_q = torch.arange(0, n_seqs + 1, dtype=torch.int32, device=dev)
    kv_lens = torch.randint(1, ctx, (n_seqs,), generator=gen, dtype=torch.int32).to(dev)
    per_seq = math.ceil((ctx + 1) / block_size)
    nb = n_seqs * per_seq + 8
    tables = _tables(n_seqs, per_seq, nb, gen, dev)
    rows = torch.arange(n_seqs, device=dev)
    slots = tables.long()[rows, (kv_lens // block_size).long()] * block_size + (kv_lens % block_size).long()
    return DecodeBatch(k, v, cu_q, kv_lens, tables, slots, kv_lens.long(), nb)


class PrefillBatch(NamedTuple):
    """A prefill of ``n_seqs`` new sequences of ``seq`` tokens each, into randomly permuted blocks."""

    k: torch.Tensor  # fp16 [n_seqs * seq, H, D]
    v: torch.Tensor  # fp16 [n_seqs * seq, H, D]
    cu_q: torch.Tensor  # int32 [n_seqs + 1]
    kv_lens: torch.Tensor  # int32 [n_seqs]: zeros
    tables: torch.Tensor  # int32 [n_seqs, seq // block_size]
    num_blocks: int


def prefill_batch(dev: torch.device, gen: torch.Generator, block_size: int, n_seqs: int = 8,
                  seq: int = 2048) -> PrefillBatch:
    """The prefill benchmark's batch (``kvcache bench paged`` and the tuning scripts in ``benchmarks/``)."""
    n = n_seqs * seq
    k = torch.randn(n, H, D, dtype=torch.float16, device=dev)
    v = torch.randn(n, H, D, dtype=torch.float16, device=dev)
    cu_q = torch.arange(0, n + 1, seq, dtype=torch.int32, device=dev)
    kv_lens = torch.zeros(n_seqs, dtype=torch.int32, device=dev)
    nb = n // block_size + 64
    return PrefillBatch(k, v, cu_q, kv_lens, _tables(n_seqs, seq // block_size, nb, gen, dev), nb)


def launch_decode_layers(cache: PagedKVCache, b: DecodeBatch, *, ragged: bool, rope: object,
                         **overrides: object) -> None:
    """One decode step: ``b`` appended to every layer of ``cache`` through ``append_paged_kv_launch`` (no
    validation, no prepared plan), ragged or by slot mapping, with ``rope`` (RopeKernelParams or None) and the
    launcher's tuning ``overrides`` (num_warps, split, pdl, early, head_groups, max_registers). For the tuning
    scripts."""
    cfg = cache.config
    for layer in range(cfg.num_layers):
        paged_ops.append_paged_kv_launch(
            b.k, b.v, cache.pool(layer), cache.params(layer), kv_dtype=cfg.kv_dtype, layout=cfg.layout,
            block_tables=b.tables if ragged else None, cu_q_lens=b.cu_q if ragged else None,
            kv_lens=b.kv_lens if ragged else None, cu_k_lens=None, slot_mapping=None if ragged else b.slots,
            positions=None if ragged or rope is None else b.positions, rope=rope, fp8_scales=cache.kv_scales[layer],
            cp_rank=0, cp_size=1, **overrides,  # type: ignore[arg-type]
        )


def _store_bytes(n_tokens: int, kv_dtype: str) -> int:
    per_row = {"auto": D * 2, "fp8": D, "int8": D + 8, "int4": D // 2 + 8}[kv_dtype]
    return 2 * n_tokens * H * per_row


def _torch_append(pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
                  cos: torch.Tensor | None, sin: torch.Tensor | None) -> None:
    """What a user writes: HF-style RoPE on K (model dtype), then index_put into the pool (NHD)."""
    if cos is not None:
        half = D // 2
        rot = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
        k = k * cos + rot * sin
    pool[blk, 0, off] = k
    pool[blk, 1, off] = v


def _prefill_rows(dev: torch.device, copy_bw: float, quick: bool) -> list[Row]:
    rows: list[Row] = []
    gen = torch.Generator().manual_seed(0)
    n_seqs, seq = (8, 2048) if not quick else (4, 512)
    n = n_seqs * seq
    rope_cfg = RopeConfig(head_dim=D, base=500000.0)
    for bs in (16, 64):
        b = prefill_batch(dev, gen, bs, n_seqs, seq)
        tables, nb = b.tables, b.num_blocks
        # the torch baseline's per-token block / offset and HF cos / sin (model dtype), computed outside timing
        pos = torch.arange(seq, device=dev).repeat(n_seqs)
        seq_idx = torch.arange(n, device=dev) // seq
        blk = tables.long()[seq_idx, pos // bs]
        off = pos % bs
        cos, sin = rope_cfg.cos_sin(pos)
        cos, sin = cos.to(torch.float16)[:, None, :], sin.to(torch.float16)[:, None, :]
        for kv_dtype in ("auto", "fp8", "int8", "int4"):
            cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                                             dtype=torch.float16, kv_dtype=kv_dtype, device=dev), rope=rope_cfg)
            nbytes = 2 * n * H * D * 2 + _store_bytes(n, kv_dtype)
            for use_rope in (False, True):
                def fn(cache=cache, use_rope=use_rope, b=b) -> None:  # type: ignore[no-untyped-def]
                    cache.append(0, b.k, b.v, block_tables=b.tables, cu_q_lens=b.cu_q, kv_lens=b.kv_lens,
                                 rope=None if use_rope else False)
                impl = f"kvcache {kv_dtype}{' + rope' if use_rope else ''}"
                rows.append(Row(f"prefill append {n} tok, block {bs}", impl,
                                eager_us=time_eager(fn, 10), graph_us=time_graph(fn, 3), bytes=nbytes))
                if not use_rope and paged_ops._pdl_default(dev):
                    # back-to-back appends overlap with PDL; a model's append follows a GEMM instead
                    with _pdl_off():
                        rows.append(Row(f"prefill append {n} tok, block {bs}", f"{impl} (no PDL)",
                                        eager_us=time_eager(fn, 10), graph_us=time_graph(fn, 3), bytes=nbytes))
            del cache
        pool = torch.zeros((nb, 2, bs, H, D), dtype=torch.float16, device=dev)
        # ceilings for the fp16 append: the same bytes through torch's copy_, and a Triton row copy with the
        # append's exact traffic (rows into randomly placed blocks) but no index work
        kv = torch.stack([b.k, b.v])
        kv_dst = torch.empty_like(kv)
        moved = 2 * n * H * D * 2 + _store_bytes(n, "auto")
        def ccopy(kv_dst=kv_dst, kv=kv) -> None:  # type: ignore[no-untyped-def]
            kv_dst.copy_(kv)

        rows.append(Row(f"prefill append {n} tok, block {bs}", "torch copy_ of the same bytes (contiguous)",
                        eager_us=time_eager(ccopy, 10), graph_us=time_graph(ccopy, 3), bytes=moved))
        perm = torch.randperm(nb, generator=gen)[: n // bs].to(torch.int32).to(dev)

        def rcopy(pool=pool, perm=perm, bs=bs, b=b) -> None:  # type: ignore[no-untyped-def]
            _rows_copy[(n,)](b.k, b.v, pool, perm, ROW=H * D, BS=bs, SCATTER=True, TOK=1, num_warps=8)

        rows.append(Row(f"prefill append {n} tok, block {bs}", "Triton row copy into random blocks (no indexing)",
                        eager_us=time_eager(rcopy, 10), graph_us=time_graph(rcopy, 3), bytes=moved))
        for use_rope in (False, True):
            def tfn(use_rope=use_rope, pool=pool, blk=blk, off=off, cos=cos, sin=sin, b=b) -> None:  # type: ignore[no-untyped-def]
                _torch_append(pool, b.k, b.v, blk, off, cos if use_rope else None, sin if use_rope else None)
            rows.append(Row(f"prefill append {n} tok, block {bs}", f"torch index_put{' + rope' if use_rope else ''}",
                            eager_us=time_eager(tfn, 10), graph_us=time_graph(tfn, 3),
                            bytes=2 * n * H * D * 2 + _store_bytes(n, "auto")))
    return rows


def _decode_rows(dev: torch.device, quick: bool) -> list[Row]:
    """256 sequences x 1 token: per-layer time inside a 32-layer CUDA graph, eager time and host overhead."""
    rows: list[Row] = []
    gen = torch.Generator().manual_seed(1)
    n_seqs, layers = 256, 32
    rope_cfg = RopeConfig(head_dim=D, base=500000.0)
    for bs in (16, 64):
        b = decode_batch(dev, gen, bs, n_seqs)
        for kv_dtype in ("auto", "fp8", "int8", "int4"):
            cache = PagedKVCache(PagedConfig(num_layers=layers, num_kv_heads=H, head_dim=D, block_size=bs,
                                             num_blocks=b.num_blocks, dtype=torch.float16, kv_dtype=kv_dtype,
                                             device=dev),
                                 rope=rope_cfg)

            def step(cache=cache, b=b, ready=False) -> None:  # type: ignore[no-untyped-def]
                for layer in range(layers):
                    cache.append(layer, b.k, b.v, block_tables=b.tables, cu_q_lens=b.cu_q, kv_lens=b.kv_lens,
                                 metadata_ready=ready)

            def one(cache=cache, b=b) -> None:  # type: ignore[no-untyped-def]
                cache.append(0, b.k, b.v, block_tables=b.tables, cu_q_lens=b.cu_q, kv_lens=b.kv_lens)

            def step_norope(cache=cache, b=b, ready=False) -> None:  # type: ignore[no-untyped-def]
                for layer in range(layers):
                    cache.append(layer, b.k, b.v, block_tables=b.tables, cu_q_lens=b.cu_q, kv_lens=b.kv_lens,
                                 rope=False, metadata_ready=ready)

            per_layer = time_graph(step, 1) / layers
            rows.append(Row(f"decode append {n_seqs} x 1 tok, block {bs}", f"kvcache {kv_dtype} + rope (ragged)",
                            eager_us=time_eager(one, 200), graph_us=per_layer, host_us=time_host(one),
                            bytes=2 * n_seqs * H * D * 2 + _store_bytes(n_seqs, kv_dtype)))
            rows.append(Row(f"decode append {n_seqs} x 1 tok, block {bs}", f"kvcache {kv_dtype} (ragged, no rope)",
                            graph_us=time_graph(step_norope, 1) / layers,
                            bytes=2 * n_seqs * H * D * 2 + _store_bytes(n_seqs, kv_dtype)))
            # slot-mapping mode (vLLM's convention): one index load per token instead of a batch search
            def step_slots(cache=cache, b=b, ready=False) -> None:  # type: ignore[no-untyped-def]
                for layer in range(layers):
                    cache.append(layer, b.k, b.v, slot_mapping=b.slots, positions=b.positions, metadata_ready=ready)

            def one_slots(cache=cache, b=b) -> None:  # type: ignore[no-untyped-def]
                cache.append(0, b.k, b.v, slot_mapping=b.slots, positions=b.positions)

            rows.append(Row(f"decode append {n_seqs} x 1 tok, block {bs}", f"kvcache {kv_dtype} + rope (slots)",
                            eager_us=time_eager(one_slots, 200), graph_us=time_graph(step_slots, 1) / layers,
                            host_us=time_host(one_slots),
                            bytes=2 * n_seqs * H * D * 2 + _store_bytes(n_seqs, kv_dtype)))

            def step_slots_norope(cache=cache, b=b, ready=False) -> None:  # type: ignore[no-untyped-def]
                for layer in range(layers):
                    cache.append(layer, b.k, b.v, slot_mapping=b.slots, rope=False, metadata_ready=ready)

            rows.append(Row(f"decode append {n_seqs} x 1 tok, block {bs}", f"kvcache {kv_dtype} (slots, no rope)",
                            graph_us=time_graph(step_slots_norope, 1) / layers,
                            bytes=2 * n_seqs * H * D * 2 + _store_bytes(n_seqs, kv_dtype)))
            if paged_ops._pdl_default(dev):  # metadata_ready: the lookup overlaps the previous kernel's tail
                for mode, rope_on, fn in (("ragged", True, step), ("ragged", False, step_norope),
                                          ("slots", True, step_slots), ("slots", False, step_slots_norope)):
                    name = (f"kvcache {kv_dtype} + rope ({mode}, metadata ready)" if rope_on else
                            f"kvcache {kv_dtype} ({mode}, no rope, metadata ready)")
                    rows.append(Row(f"decode append {n_seqs} x 1 tok, block {bs}", name,
                                    graph_us=time_graph(functools.partial(fn, ready=True), 1) / layers,
                                    bytes=2 * n_seqs * H * D * 2 + _store_bytes(n_seqs, kv_dtype)))
                with _speculation_off():  # the same graphs waiting before the lookup (no speculation)
                    for mode, rope_on, fn in (("ragged", True, step), ("ragged", False, step_norope),
                                              ("slots", True, step_slots), ("slots", False, step_slots_norope)):
                        name = (f"kvcache {kv_dtype} + rope ({mode}, no speculation)" if rope_on else
                                f"kvcache {kv_dtype} ({mode}, no rope, no speculation)")
                        rows.append(Row(f"decode append {n_seqs} x 1 tok, block {bs}", name,
                                        graph_us=time_graph(fn, 1) / layers,
                                        bytes=2 * n_seqs * H * D * 2 + _store_bytes(n_seqs, kv_dtype)))
                with _pdl_off():  # the same graphs without programmatic dependent launch
                    for impl, fn in (("ragged", step), ("slots", step_slots)):
                        rows.append(Row(f"decode append {n_seqs} x 1 tok, block {bs}",
                                        f"kvcache {kv_dtype} + rope ({impl}, no PDL)",
                                        graph_us=time_graph(fn, 1) / layers,
                                        bytes=2 * n_seqs * H * D * 2 + _store_bytes(n_seqs, kv_dtype)))
            del cache
    return rows


def _gather_rows(dev: torch.device, quick: bool) -> list[Row]:
    rows: list[Row] = []
    gen = torch.Generator().manual_seed(2)
    n_seqs, seq, bs = (64, 2048, 16) if not quick else (16, 512, 16)
    nb = n_seqs * seq // bs + 16
    tables = _tables(n_seqs, seq // bs, nb, gen, dev)
    lens = torch.full((n_seqs,), seq, dtype=torch.int32, device=dev)
    k_out = torch.empty(n_seqs, H, seq, D, dtype=torch.float16, device=dev)
    v_out = torch.empty_like(k_out)
    for kv_dtype in ("auto", "fp8", "int8", "int4"):
        cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                                         dtype=torch.float16, kv_dtype=kv_dtype, device=dev))
        cache.buffer.view(torch.uint8).random_(0, 256)
        if cache.params_buffer is not None:
            cache.params_buffer.uniform_(0.001, 0.01)
        if kv_dtype == "fp8":
            cache.buffer.view(torch.uint8).bitwise_and_(0x77)  # finite e4m3 values only

        def fn(cache=cache) -> None:  # type: ignore[no-untyped-def]
            cache.gather(0, tables, kv_lens=lens, k_out=k_out, v_out=v_out)


        nbytes = _store_bytes(n_seqs * seq, kv_dtype) + 2 * n_seqs * seq * H * D * 2
        rows.append(Row(f"gather {n_seqs} x {seq}, block {bs}", f"kvcache {kv_dtype}", eager_us=time_eager(fn, 5),
                        graph_us=time_graph(fn, 2), bytes=nbytes))
        if kv_dtype == "auto":
            pool = cache.pool(0)
            flat = tables.long()

            def tfn(pool=pool, flat=flat) -> None:  # type: ignore[no-untyped-def]
                # what a user writes: gather the blocks, then lay them out [B, H, S, D]
                g = pool[flat]  # [B, blocks, 2, bs, H, D]
                k_out.copy_(g[:, :, 0].reshape(n_seqs, seq, H, D).transpose(1, 2))
                v_out.copy_(g[:, :, 1].reshape(n_seqs, seq, H, D).transpose(1, 2))

            rows.append(Row(f"gather {n_seqs} x {seq}, block {bs}", "torch index + copy_", eager_us=time_eager(tfn, 5),
                            graph_us=time_graph(tfn, 2), bytes=nbytes))
        del cache
    return rows


def attention_error(dev: torch.device) -> dict[str, float]:
    """Relative L2 error of attention outputs computed from int8 / int4 / fp8 caches vs the fp16 cache, on
    random data (4 sequences x 2048 tokens, 32 query heads over 8 KV heads, RoPE on K)."""
    gen = torch.Generator(device="cpu").manual_seed(3)
    n_seqs, seq, bs, hq = 4, 2048, 16, 32
    n = n_seqs * seq
    k = torch.randn(n, H, D, generator=gen).to(torch.float16).to(dev)
    v = torch.randn(n, H, D, generator=gen).to(torch.float16).to(dev)
    q = torch.randn(n_seqs, hq, 16, D, generator=gen).to(dev).float()  # 16 queries per sequence
    cu_q = torch.arange(0, n + 1, seq, dtype=torch.int32, device=dev)
    kv_lens = torch.zeros(n_seqs, dtype=torch.int32, device=dev)
    lens = torch.full((n_seqs,), seq, dtype=torch.int32, device=dev)
    tables = torch.arange(n // bs, dtype=torch.int32, device=dev).view(n_seqs, -1)
    rope_cfg = RopeConfig(head_dim=D, base=500000.0)

    def attn(kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        kk = kk.float().repeat_interleave(hq // H, dim=1)
        vv = vv.float().repeat_interleave(hq // H, dim=1)
        s = torch.einsum("bhqd,bhkd->bhqk", q, kk) / math.sqrt(D)
        return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), vv)

    out: dict[str, float] = {}
    ref = None
    for kv_dtype in ("auto", "fp8", "int8", "int4"):
        cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs,
                                         num_blocks=n // bs, dtype=torch.float16, kv_dtype=kv_dtype, device=dev),
                             rope=rope_cfg)
        cache.append(0, k, v, block_tables=tables, cu_q_lens=cu_q, kv_lens=kv_lens)
        kk, vv = cache.gather(0, tables, kv_lens=lens, max_len=seq)
        o = attn(kk, vv)
        if ref is None:
            ref = o
        out[kv_dtype] = float((o - ref).norm() / ref.norm())
    return out


def main(quick: bool = False, json_path: str | None = None) -> int:
    if not torch.cuda.is_available():
        print("kvcache bench paged: needs a CUDA device")
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    print(f"device: {props.name} ({props.multi_processor_count} SMs) | torch {torch.__version__}")
    copy_bw = copy_bandwidth(dev, (1 << 29) if not quick else (1 << 26))
    print(f"device-to-device copy: {copy_bw:.0f} GB/s (read + write)")
    rows = _prefill_rows(dev, copy_bw, quick) + _decode_rows(dev, quick) + _gather_rows(dev, quick)
    err = attention_error(dev)
    print()
    print(f"copy bandwidth (same run): {copy_bw:.0f} GB/s")
    print("| case | implementation | eager us | graph us (per layer for decode) | host us | GB/s | % copy BW |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        t_use = r.graph_us if r.graph_us is not None else r.eager_us
        gbs = r.bytes / (t_use * 1e-6) / 1e9 if r.bytes and t_use else None
        pct = 100 * gbs / copy_bw if gbs else None
        r.extra = {"gbs": gbs, "pct_copy": pct}
        print(f"| {r.case} | {r.impl} | {_fmt(r.eager_us)} | {_fmt(r.graph_us, 2)} | {_fmt(r.host_us)} | "
              f"{_fmt(gbs, 0)} | {_fmt(pct, 1)} |")
    print()
    print("attention-output relative L2 error vs the fp16 cache (4 x 2048 tokens, 32 q heads / 8 kv heads, rope):")
    for kd, e in err.items():
        print(f"  {kd}: {e:.2e}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": props.name, "copy_gbs": copy_bw, "rows": [asdict(r) for r in rows],
                       "attention_error": err}, f, indent=1)
    return 0

