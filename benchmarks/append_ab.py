"""A/B runs for the paged append on a GPU (a development tool), interleaved, three rounds each:

* ``early``: the kernel's EARLY setting (RoPE / quantization before the block-table wait, or after it) and 1 or
  2 warps, per decode layer in a 32-layer graph and on the 16384-row prefill;
* ``hints``: cache hints (loads evict_first, stores .cs / evict_first) on the prefill's copy ceiling;
* ``ceiling``: that ceiling by block size (16, 64), stored row width (fp16, 1 byte) and program order;
* ``heads``: decode-sized (split) launches with a row's heads in 1 or 2 programs, 1 or 2 warps each, ragged
  and slot mapping, with and without RoPE;
* ``regs``: prefill-sized appends with a register cap (occupancy), with EARLY on / off;
* ``versions OLD.py``: this tree's append kernel against another version of ``kvcache/ops/paged.py`` (a file,
  e.g. ``git show REV:src/kvcache/ops/paged.py > OLD.py``), prefill and decode, every format, with and
  without RoPE, and split decode launches of 1 and 2 warps, and of 2 head groups.

Environment switches read at import (``KVCACHE_FAST_TRIG``, ``KVCACHE_APPEND_HINTS``) are compared by running
the script twice.

    PYTHONPATH=src python3 benchmarks/append_ab.py [early] [hints] [ceiling] [heads] [regs]
        [versions OLD.py [quick] [decode | prefill] [NAME:PATH | NAME:KEY=VALUE[,KEY=VALUE] ...]]
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import re
import sys

import torch
import triton
import triton.language as tl

from kvcache.bench.linear import copy_bandwidth, time_graph
from kvcache.bench.paged import D, H, _store_bytes, decode_batch, launch_decode_layers, prefill_batch
from kvcache.ops import paged as paged_ops
from kvcache.ops.paged import append_paged_kv_launch
from kvcache.paged import PagedConfig, PagedKVCache
from kvcache.rope import RopeConfig


@triton.jit
def _hinted_copy(k, v, pool, blocks, ROW: tl.constexpr, BS: tl.constexpr, LOAD_HINT: tl.constexpr,
                 STORE_HINT: tl.constexpr):
    # one row of k and v [N, ROW] into its token slot of a pool [nb, 2, BS, ROW], block blocks[n // BS]
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, ROW)
    if LOAD_HINT:
        xk = tl.load(k + n * ROW + e, eviction_policy="evict_first")
        xv = tl.load(v + n * ROW + e, eviction_policy="evict_first")
    else:
        xk = tl.load(k + n * ROW + e)
        xv = tl.load(v + n * ROW + e)
    blk = tl.load(blocks + n // BS).to(tl.int64)
    base = blk * (2 * BS * ROW) + (n % BS) * ROW
    if STORE_HINT == 1:
        tl.store(pool + base + e, xk, cache_modifier=".cs")
        tl.store(pool + base + BS * ROW + e, xv, cache_modifier=".cs")
    elif STORE_HINT == 2:
        tl.store(pool + base + e, xk, eviction_policy="evict_first")
        tl.store(pool + base + BS * ROW + e, xv, eviction_policy="evict_first")
    else:
        tl.store(pool + base + e, xk)
        tl.store(pool + base + BS * ROW + e, xv)


def hints(dev: torch.device, copy_bw: float) -> None:
    g = torch.Generator().manual_seed(0)
    n, bs = 16384, 16
    kv = torch.randn(2, n, H, D, dtype=torch.float16, device=dev)
    pool = torch.empty(n // bs, 2, bs, H * D, dtype=torch.float16, device=dev)
    perm = torch.randperm(n // bs, generator=g).to(torch.int32).to(dev)
    moved = 2 * kv.numel() * 2
    res: dict[str, list[float]] = {}
    for _ in range(3):
        for lh in (False, True):
            for sh in (0, 1, 2):
                for w in (2, 4):
                    t = time_graph(lambda lh=lh, sh=sh, w=w: _hinted_copy[(n,)](
                        kv[0], kv[1], pool, perm, ROW=H * D, BS=bs, LOAD_HINT=lh, STORE_HINT=sh, num_warps=w), 3)
                    name = f"load{'-ef' if lh else ''}/store{['', '-cs', '-ef'][sh]}/w{w}"
                    res.setdefault(name, []).append(100 * moved / (t * 1e-6) / 1e9 / copy_bw)
    for name, ps in res.items():
        print(f"hinted copy {name}: " + " ".join(f"{p:.1f}" for p in ps), flush=True)


LAYERS = 32


@triton.jit
def _order_copy(k, v, pool, blocks, ROW: tl.constexpr, BS: tl.constexpr, SEQS: tl.constexpr, SEQ_LEN: tl.constexpr,
                ORDER: tl.constexpr):
    # one fp16 row of k and v [N, ROW] into its token slot of a pool [nb, 2, BS, ROW] of the pool's dtype (fp16,
    # or 1 byte: the traffic of an fp8 / int8 append without its parameters), block blocks[n // BS], with the
    # prefill's cache hints. ORDER 0: program p copies row p (the append's order: a sequence's rows one after
    # another); 1: row (p % SEQS) * SEQ_LEN + p // SEQS (programs in flight spread over every sequence)
    p = tl.program_id(0).to(tl.int64)
    if ORDER == 1:
        n = (p % SEQS) * SEQ_LEN + p // SEQS
    else:
        n = p
    e = tl.arange(0, ROW)
    xk = tl.load(k + n * ROW + e, eviction_policy="evict_first")
    xv = tl.load(v + n * ROW + e, eviction_policy="evict_first")
    blk = tl.load(blocks + n // BS).to(tl.int64)
    base = blk * (2 * BS * ROW) + (n % BS) * ROW
    tl.store(pool + base + e, xk.to(pool.dtype.element_ty), cache_modifier=".cs")
    tl.store(pool + base + BS * ROW + e, xv.to(pool.dtype.element_ty), cache_modifier=".cs")


def ceiling(dev: torch.device, copy_bw: float) -> None:
    """The prefill's copy ceiling (random blocks, no index work) by block size, stored row width (fp16, or
    1-byte like fp8 / int8) and program order, three rounds, % of ``copy_bw``: is the block-64 deficit of the
    1-byte formats the memory system's, and does spreading programs over the sequences change it?"""
    g = torch.Generator().manual_seed(0)
    seqs, seq_len = 8, 2048
    n = seqs * seq_len
    kv = torch.randn(2, n, H * D, dtype=torch.float16, device=dev)
    for out_dtype in (torch.float16, torch.int8):
        for bs in (16, 64):
            pool = torch.empty(n // bs, 2, bs, H * D, dtype=out_dtype, device=dev)
            perm = torch.randperm(n // bs, generator=g).to(torch.int32).to(dev)
            moved = kv.numel() * 2 + 2 * n * H * D * pool.element_size()
            res: dict[str, list[float]] = {}
            for _ in range(3):
                for order in (0, 1):
                    t = time_graph(lambda order=order, pool=pool, perm=perm, bs=bs: _order_copy[(n,)](
                        kv[0], kv[1], pool, perm, ROW=H * D, BS=bs, SEQS=seqs, SEQ_LEN=seq_len, ORDER=order,
                        num_warps=2), 3)
                    res.setdefault(f"order{order}", []).append(100 * moved / (t * 1e-6) / 1e9 / copy_bw)
                if out_dtype is torch.float16:
                    # torch at block granularity: each block's K and V rows [bs, ROW] as one index_copy_ row
                    # into randomly placed blocks, and into blocks in order (the same bytes, contiguous)
                    kb = kv.view(2, n // bs, bs * H * D)
                    dst = pool.view(n // bs, 2, bs * H * D)
                    ident = torch.arange(n // bs, device=dev)
                    for name, ids in (("torch-index_copy-random", perm.long()), ("torch-index_copy-in-order", ident)):
                        def tfn(ids=ids, dst=dst, kb=kb) -> None:  # type: ignore[no-untyped-def]
                            dst[:, 0].index_copy_(0, ids, kb[0])
                            dst[:, 1].index_copy_(0, ids, kb[1])
                        t = time_graph(tfn, 3)
                        res.setdefault(name, []).append(100 * moved / (t * 1e-6) / 1e9 / copy_bw)
                    flat = torch.empty_like(kv)
                    t = time_graph(lambda flat=flat: flat.copy_(kv), 3)
                    res.setdefault("torch-copy_-contiguous", []).append(100 * moved / (t * 1e-6) / 1e9 / copy_bw)
            print(f"ceiling {str(out_dtype).split('.')[-1]} block {bs} (% of copy, 3 rounds): "
                  + "  ".join(f"{k}: {' '.join(f'{p:.1f}' for p in ps)}" for k, ps in res.items()), flush=True)


@triton.jit
def _block_copy(k, v, pool, blocks, ROW: tl.constexpr, BS: tl.constexpr):
    # block b's BS rows of k or v (axis 1: 0 = K, 1 = V) [N, ROW] into block blocks[b] of a pool [nb, 2, BS, ROW]
    b = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    t = tl.arange(0, BS)[:, None]
    e = tl.arange(0, ROW)[None, :]
    src = tl.where(kv == 0, k, v)
    x = tl.load(src + (b * BS + t) * ROW + e, eviction_policy="evict_first")
    blk = tl.load(blocks + b).to(tl.int64)
    tl.store(pool + (blk * 2 + kv) * (BS * ROW) + t * ROW + e, x, cache_modifier=".cs")


@triton.jit
def _tma_copy(k_desc, v_desc, pool_desc, blocks, ROW: tl.constexpr, BS: tl.constexpr, CW: tl.constexpr,
              CHUNKS: tl.constexpr):
    # the same through TMA descriptors: k / v [N, ROW], the pool as [nb * 2 * BS, ROW], tiles [BS, CW]; program
    # (b, kv * (ROW // CW // CHUNKS) + part) moves CHUNKS column tiles of block b's K or V
    b = tl.program_id(0)
    parts: tl.constexpr = ROW // CW // CHUNKS
    kv = tl.program_id(1) // parts
    part = tl.program_id(1) % parts
    blk = tl.load(blocks + b)
    for c in tl.static_range(CHUNKS):
        col = (part * CHUNKS + c) * CW
        if kv == 0:
            x = k_desc.load([b * BS, col])
        else:
            x = v_desc.load([b * BS, col])
        pool_desc.store([(blk * 2 + kv) * BS, col], x)


def ceiling2(dev: torch.device, copy_bw: float) -> None:
    """Is the fp16 random-block ceiling the placement or the program shape? Row copies, block copies and TMA
    block copies into random blocks and into blocks in order, three rounds, % of ``copy_bw``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    g = torch.Generator().manual_seed(0)
    n, row = 16384, H * D
    kv = torch.randn(2, n, row, dtype=torch.float16, device=dev)
    moved = 2 * kv.numel() * 2
    for bs in (16, 64):
        nb = n // bs
        pool = torch.empty(nb, 2, bs, row, dtype=torch.float16, device=dev)
        orders = {"random": torch.randperm(nb, generator=g).to(torch.int32).to(dev),
                  "in-order": torch.arange(nb, dtype=torch.int32, device=dev)}
        res: dict[str, list[float]] = {}
        for _ in range(3):
            for oname, perm in orders.items():
                cands = {
                    "rows": lambda perm=perm, pool=pool, bs=bs: _order_copy[(n,)](
                        kv[0], kv[1], pool, perm, ROW=row, BS=bs, SEQS=8, SEQ_LEN=n // 8, ORDER=0, num_warps=4),
                }
                if bs == 16:
                    cands["blocks"] = lambda perm=perm, pool=pool, bs=bs, nb=nb: _block_copy[(nb, 2)](
                        kv[0], kv[1], pool, perm, ROW=row, BS=bs, num_warps=8)
                for cw, chunks in ((256, 4), (256, 1), (128, 2)):
                    kd = TensorDescriptor.from_tensor(kv[0], [bs, cw])
                    vd = TensorDescriptor.from_tensor(kv[1], [bs, cw])
                    pd = TensorDescriptor.from_tensor(pool.view(nb * 2 * bs, row), [bs, cw])
                    cands[f"tma{cw}x{chunks}"] = (
                        lambda perm=perm, kd=kd, vd=vd, pd=pd, cw=cw, chunks=chunks, bs=bs, nb=nb: _tma_copy[
                            (nb, 2 * (row // cw // chunks))](kd, vd, pd, perm, ROW=row, BS=bs, CW=cw, CHUNKS=chunks,
                                                             num_warps=4))
                for cname, fn in cands.items():
                    pool.zero_()
                    fn()
                    ref = kv.view(2, nb, bs, row).transpose(0, 1)
                    if not torch.equal(pool[perm.long()], ref):
                        raise RuntimeError(f"ceiling2 {cname} {oname}: wrong bytes")
                    t = time_graph(fn, 3)
                    res.setdefault(f"{cname}-{oname}", []).append(100 * moved / (t * 1e-6) / 1e9 / copy_bw)
            flat = torch.empty_like(kv)
            t = time_graph(lambda flat=flat: flat.copy_(kv), 3)
            res.setdefault("torch-copy_-contiguous", []).append(100 * moved / (t * 1e-6) / 1e9 / copy_bw)
        print(f"ceiling2 fp16 block {bs} (% of copy, 3 rounds): "
              + "  ".join(f"{k}: {' '.join(f'{p:.1f}' for p in ps)}" for k, ps in res.items()), flush=True)


def _decode_setup(dev: torch.device):  # type: ignore[no-untyped-def]
    """RoPE params, the decode batch (block 16) and a 32-layer cache of each format."""
    rope = RopeConfig(head_dim=D, base=500000.0).kernel_params(device=dev)
    b = decode_batch(dev, torch.Generator().manual_seed(1), 16)
    caches = {kv_dtype: PagedKVCache(PagedConfig(num_layers=LAYERS, num_kv_heads=H, head_dim=D, block_size=16,
                                                 num_blocks=b.num_blocks, kv_dtype=kv_dtype, device=dev))
              for kv_dtype in ("auto", "fp8", "int8", "int4")}
    return rope, b, caches


def heads(dev: torch.device) -> None:
    rope, b, caches = _decode_setup(dev)
    layers = LAYERS
    for kv_dtype, c in caches.items():
        for ragged in (True, False):
            res: dict[str, list[float]] = {}
            for _ in range(3):
                for use_rope in (False, True):
                    for hg, w in ((1, 1), (1, 2), (2, 1), (2, 2)):
                        step = functools.partial(launch_decode_layers, c, b, ragged=ragged,
                                                 rope=rope if use_rope else None, head_groups=hg, num_warps=w,
                                                 split=True)
                        name = f"{'rope' if use_rope else 'norope'}-g{hg}w{w}"
                        res.setdefault(name, []).append(time_graph(step, 1) / layers)
            print(f"decode {kv_dtype} {'ragged' if ragged else 'slots'} (us per layer, 3 rounds): "
                  + "  ".join(f"{n}: {' '.join(f'{t:.2f}' for t in ts)}" for n, ts in res.items()), flush=True)


def _prefill_cache(dev: torch.device, bs: int, nb: int, kv_dtype: str, n: int) -> tuple[PagedKVCache, int]:
    """A one-layer cache for the n-row prefill, and the bytes one append moves."""
    c = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                                 kv_dtype=kv_dtype, device=dev))
    return c, 2 * n * H * D * 2 + _store_bytes(n, kv_dtype)


def regs(dev: torch.device, copy_bw: float) -> None:
    rope = RopeConfig(head_dim=D, base=500000.0).kernel_params(device=dev)
    bs = 16
    k, v, cu_q, kv_lens, tables, nb = prefill_batch(dev, torch.Generator().manual_seed(0), bs)
    n = k.shape[0]
    for kv_dtype in ("fp8", "int8", "int4"):
        c, nbytes = _prefill_cache(dev, bs, nb, kv_dtype, n)
        res: dict[str, list[float]] = {}
        for _ in range(3):
            for use_rope in (False, True):
                for early in (False, True):
                    for cap in (None, 40, 32):
                        def fn(c=c, kv_dtype=kv_dtype, use_rope=use_rope, early=early, cap=cap) -> None:  # type: ignore[no-untyped-def]
                            append_paged_kv_launch(k, v, c.pool(0), c.params(0), kv_dtype=kv_dtype, layout="NHD",
                                                   block_tables=tables, cu_q_lens=cu_q, kv_lens=kv_lens,
                                                   cu_k_lens=None, slot_mapping=None, positions=None,
                                                   rope=rope if use_rope else None, fp8_scales=c.kv_scales[0],
                                                   cp_rank=0, cp_size=1, early=early, max_registers=cap)
                        t = time_graph(fn, 3)
                        name = f"{'rope' if use_rope else 'norope'}-{'early' if early else 'late'}-r{cap or 0}"
                        res.setdefault(name, []).append(100 * nbytes / (t * 1e-6) / 1e9 / copy_bw)
        print(f"prefill {kv_dtype} (% of copy, 3 rounds): "
              + "  ".join(f"{n}: {' '.join(f'{p:.1f}' for p in ps)}" for n, ps in res.items()), flush=True)


def _module_from(path: str, name: str = "other"):  # type: ignore[no-untyped-def]
    """Another version of kvcache/ops/paged.py, imported inside the kvcache.ops package (its relative imports
    resolve against this tree)."""
    spec = importlib.util.spec_from_file_location(f"kvcache.ops._paged_{name}", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@contextlib.contextmanager
def _flags(mod, over: dict):  # type: ignore[no-untyped-def]
    """Module switches (the ``_NAME`` keys of ``over``) set on ``mod`` for the duration."""
    flags = {a: x for a, x in over.items() if a.startswith("_")}
    saved = {a: getattr(mod, a) for a in flags}
    for a, x in flags.items():
        setattr(mod, a, x)
    try:
        yield
    finally:
        for a, x in saved.items():
            setattr(mod, a, x)


def _rope_table(rope, positions: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """float32 [N, 2, ROT / 2]: cos and sin of each row's angles (position * inv_freq, one float32 product),
    for A/B variants that take per-row cos / sin through the ``inv_freq`` pointer (``_AB_ROPE_TABLE``)."""
    angle = positions.to(torch.float32)[:, None] * rope.inv_freq[None, :]
    return torch.stack((torch.cos(angle), torch.sin(angle)), dim=1).contiguous()


def versions(dev: torch.device, copy_bw: float, old_path: str, quick: bool = False,
             extra: tuple[str, ...] = (), decode_only: bool = False, prefill_only: bool = False) -> None:
    """This tree's append against the one in ``old_path``, interleaved, three rounds: the 16384-row prefill
    (block 16 and 64, every format, with and without RoPE; % of ``copy_bw``) and the 32-layer decode graph
    (every format, ragged and slot mapping; us per layer), the latter also with 2 warps and 2 head groups unless
    ``quick``; no prefill if ``decode_only``, no decode if ``prefill_only``. ``extra``: more variants,
    ``NAME:PATH`` (another paged.py) or ``NAME:KEY=VALUE[,KEY=VALUE ...]`` (this tree with module switches
    ``_KEY`` set, or launch overrides ``KEY``, e.g. ``num_warps=4``; VALUE a Python literal)."""
    old = _module_from(old_path)
    more = []
    for spec in extra:
        name, what = spec.split(":", 1)
        if "=" in what and not what.endswith(".py"):  # KEY=VALUE[,KEY=VALUE ...]
            over = {}
            for item in re.split(r",(?=\w+=)", what):  # a VALUE may hold commas (a tuple)
                key, val = item.split("=", 1)
                over[key] = ast.literal_eval(val)
            more.append((name, paged_ops, over))
        else:
            more.append((name, _module_from(what, name), {}))
    pairs = [("old", old, {}), ("new", paged_ops, {})] + more
    rope = RopeConfig(head_dim=D, base=500000.0).kernel_params(device=dev)
    for bs in () if decode_only else (16, 64):  # prefill
        k, v, cu_q, kv_lens, tables, nb = prefill_batch(dev, torch.Generator().manual_seed(0), bs)
        n = k.shape[0]
        for kv_dtype in ("auto", "fp8", "int8", "int4"):
            c, nbytes = _prefill_cache(dev, bs, nb, kv_dtype, n)
            res: dict[str, list[float]] = {}
            for _ in range(3):
                for use_rope in (False, True):
                    for name, mod, over in pairs:
                        def fn(over=over, c=c, kv_dtype=kv_dtype, use_rope=use_rope, mod=mod, k=k, v=v, cu_q=cu_q,  # type: ignore[no-untyped-def]
                               kv_lens=kv_lens, tables=tables) -> None:
                            launch = {a: x for a, x in over.items() if not a.startswith("_")}
                            with _flags(mod, over):
                                mod.append_paged_kv_launch(
                                    k, v, c.pool(0), c.params(0), kv_dtype=kv_dtype, layout="NHD",
                                    block_tables=tables, cu_q_lens=cu_q, kv_lens=kv_lens, cu_k_lens=None,
                                    slot_mapping=None, positions=None, rope=rope if use_rope else None,
                                    fp8_scales=c.kv_scales[0], cp_rank=0, cp_size=1, **launch)
                        t = time_graph(fn, 3)
                        res.setdefault(f"{'rope' if use_rope else 'norope'}-{name}", []).append(
                            100 * nbytes / (t * 1e-6) / 1e9 / copy_bw)
            print(f"prefill block {bs} {kv_dtype} (% of copy, 3 rounds): "
                  + "  ".join(f"{n}: {' '.join(f'{p:.1f}' for p in ps)}" for n, ps in res.items()), flush=True)
    if prefill_only:
        return
    rope, b, caches = _decode_setup(dev)
    variants = list(pairs)
    if not quick:
        variants += [("new-w2", paged_ops, {"num_warps": 2}), ("new-g2", paged_ops, {"head_groups": 2})]
    for kv_dtype, c in caches.items():
        for ragged in (True, False):
            res = {}
            for _ in range(3):
                for use_rope in (False, True):
                    for name, mod, over in variants:
                        mod_rope = rope
                        if getattr(mod, "_AB_ROPE_TABLE", False):  # a variant that takes per-row cos / sin
                            mod_rope = rope._replace(inv_freq=_rope_table(rope, b.positions if not ragged else
                                                                           b.kv_lens.long()))

                        def step(c=c, ragged=ragged, use_rope=use_rope, mod=mod, over=over,  # type: ignore[no-untyped-def]
                                 rope=mod_rope) -> None:
                            cfg = c.config
                            launch = {a: x for a, x in over.items() if not a.startswith("_")}
                            with _flags(mod, over):
                                for layer in range(cfg.num_layers):
                                    mod.append_paged_kv_launch(
                                        b.k, b.v, c.pool(layer), c.params(layer), kv_dtype=cfg.kv_dtype,
                                        layout=cfg.layout, block_tables=b.tables if ragged else None,
                                        cu_q_lens=b.cu_q if ragged else None,
                                        kv_lens=b.kv_lens if ragged else None, cu_k_lens=None,
                                        slot_mapping=None if ragged else b.slots,
                                        positions=None if ragged or not use_rope else b.positions,
                                        rope=rope if use_rope else None, fp8_scales=c.kv_scales[layer], cp_rank=0,
                                        cp_size=1, **launch)
                        res.setdefault(f"{'rope' if use_rope else 'norope'}-{name}", []).append(
                            time_graph(step, 1) / LAYERS)
            print(f"decode {kv_dtype} {'ragged' if ragged else 'slots'} (us per layer, 3 rounds): "
                  + "  ".join(f"{n}: {' '.join(f'{t:.2f}' for t in ts)}" for n, ts in res.items()), flush=True)


def main() -> None:
    dev = torch.device("cuda")
    copy_bw = copy_bandwidth(dev)
    print(f"copy {copy_bw:.0f} GB/s", flush=True)
    what = set(sys.argv[1:]) or {"early", "hints", "heads"}
    if "versions" in what:
        versions(dev, copy_bw, sys.argv[sys.argv.index("versions") + 1], "quick" in what,
                 tuple(a for a in sys.argv[sys.argv.index("versions") + 2:] if ":" in a), "decode" in what,
                 "prefill" in what)
    if "hints" in what:
        hints(dev, copy_bw)
    if "ceiling" in what:
        ceiling(dev, copy_bw)
    if "ceiling2" in what:
        ceiling2(dev, copy_bw)
    if "heads" in what:
        heads(dev)
    if "regs" in what:
        regs(dev, copy_bw)
    if "early" in what:
        early(dev, copy_bw)


def early(dev: torch.device, copy_bw: float) -> None:
    rope, b, caches = _decode_setup(dev)
    layers = LAYERS
    for kv_dtype, c in caches.items():  # decode
        res: dict[str, list[float]] = {}
        for _ in range(3):
            for use_rope, early, w in [(r, e, 2) for r in (False, True) for e in (False, True)] + [(False, True, 1),
                                                                                                 (True, True, 1)]:
                step = functools.partial(launch_decode_layers, c, b, ragged=True, rope=rope if use_rope else None,
                                         early=early, num_warps=w)
                name = f"{'rope' if use_rope else 'norope'}-{'early' if early else 'late'}-w{w}"
                res.setdefault(name, []).append(time_graph(step, 1) / layers)
        print(f"decode {kv_dtype} (us per layer, 3 rounds): "
              + "  ".join(f"{n}: {' '.join(f'{t:.2f}' for t in ts)}" for n, ts in res.items()), flush=True)
    # prefill
    bs = 16
    k, v, cu_q, kv_lens, tables, nb = prefill_batch(dev, torch.Generator().manual_seed(0), bs)
    n = k.shape[0]
    for kv_dtype in ("auto", "fp8", "int8", "int4"):
        c, nbytes = _prefill_cache(dev, bs, nb, kv_dtype, n)
        res = {}
        for _ in range(3):
            for use_rope in (False, True):
                for early in (False, True):
                    def fn(c=c, kv_dtype=kv_dtype, use_rope=use_rope, early=early) -> None:  # type: ignore[no-untyped-def]
                        append_paged_kv_launch(k, v, c.pool(0), c.params(0), kv_dtype=kv_dtype, layout="NHD",
                                               block_tables=tables, cu_q_lens=cu_q, kv_lens=kv_lens, cu_k_lens=None,
                                               slot_mapping=None, positions=None, rope=rope if use_rope else None,
                                               fp8_scales=c.kv_scales[0], cp_rank=0, cp_size=1, early=early)
                    t = time_graph(fn, 3)
                    name = f"{'rope' if use_rope else 'norope'}-{'early' if early else 'late'}"
                    res.setdefault(name, []).append(100 * nbytes / (t * 1e-6) / 1e9 / copy_bw)
        print(f"prefill {kv_dtype} (% of copy, 3 rounds): "
              + "  ".join(f"{n}: {' '.join(f'{p:.1f}' for p in ps)}" for n, ps in res.items()), flush=True)


if __name__ == "__main__":
    main()
