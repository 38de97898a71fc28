"""int4b's kernels on a GPU: compiled against the torch path, and timed beside int4 / k8v4 (an experiment's check).

``--check``: for fp16 / bf16 models, a two-sequence cache through prefill chunks and decode rows: the compiled
append's pool and params bit-exact with the torch path's (no RoPE), gather bit-exact, attention within four ulps of
the model dtype at the largest output. ``--speed``: decode attention (64 x 1k / 16k, 4 x 16k and 256 x 2k tokens,
32 / 8 heads x 128, fp16 and bf16 queries, random blocks, L2 flushed, the median of 30 calls; HND fp16 rows with the
same-condition ceiling of reading the same blocks: the faster of a contiguous and a same-blocks copy), decode append
(256 x 1 token, one layer: random lengths, rows that leave their block partial, rows that fill it) and prefill
append (8 x 2,048 tokens), in us. ``--tiles``: int4b's one-warp decode tiles (keys, stages) swept. ``--ratios``:
int4b / int4 decode attention with both caches timed alternating in one process (and 96 x 768 tokens).
``--layouts``: NHD, HND or both (default).

    python benchmarks/block_keys_gpu.py --check --speed --tiles
"""

import argparse
import math
import time

import torch

from kvcache import PagedConfig, PagedKVCache

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
H, HQ, D, BS = 8, 32, 128, 16


def cfg(kv, layout, dtype, nb, device):
    return PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=nb, dtype=dtype,
                       kv_dtype=kv, layout=layout, device=device)


def correctness(layouts=("NHD", "HND")):
    bad = 0
    worst = {}
    for layout in layouts:
        for dtype in (torch.float16, torch.bfloat16):
            g = torch.Generator().manual_seed(0)
            nb = 64
            gpu = PagedKVCache(cfg("int4b", layout, dtype, nb, dev))
            cpu = PagedKVCache(cfg("int4b", layout, dtype, nb, "cpu"))
            perm = torch.randperm(nb, generator=g)
            tables = perm[:2 * 12].reshape(2, 12).to(torch.int32)
            lens = [0, 0]
            for step in ([37, 46], [1, 1], [1, 1], [1, 1], [20, 1], [12, 14], [1, 1]):
                n = sum(step)
                cu = torch.tensor([0, step[0], n], dtype=torch.int32)
                kvl = torch.tensor(lens, dtype=torch.int32)
                k = (torch.randn(n, H, D, generator=g) * torch.linspace(0.2, 8, D) + 1).to(dtype)
                v = torch.randn(n, H, D, generator=g).to(dtype)
                q = torch.randn(n, HQ, D, generator=g).to(dtype)
                pg = gpu.plan(tables.to(dev), cu.to(dev), kvl.to(dev))
                pc = cpu.plan(tables, cu, kvl)
                gpu.append(0, k.to(dev), v.to(dev), pg)
                cpu.append(0, k, v, pc)
                same_pool = torch.equal(gpu.pool(0).cpu(), cpu.pool(0))
                same_par = torch.equal(gpu.params(0).cpu().view(torch.int32), cpu.params(0).view(torch.int32))
                og = gpu.attention(0, q.to(dev), pg).float().cpu()
                oc = cpu.attention(0, q, pc).float()
                err = (og - oc).abs().max().item()
                lens = [a + b for a, b in zip(lens, step)]
                sl = torch.tensor(lens, dtype=torch.int32)
                kg, vg = gpu.gather(0, gpu.plan(tables.to(dev), seq_lens=sl.to(dev)))
                kc, vc = cpu.gather(0, cpu.plan(tables, seq_lens=sl))
                same_g = torch.equal(kg.cpu(), kc) and torch.equal(vg.cpu(), vc)
                # the operands' rounding (K dequantized in the dot's dtype) and the output's: four ulps of the model
                # dtype at the largest output (measured: 3 float16, 2 bfloat16)
                ulp = 2.0 ** (math.floor(math.log2(oc.abs().max().item())) - (7 if dtype == torch.bfloat16 else 10))
                worst[dtype] = max(worst.get(dtype, 0.0), err / ulp)
                ok = same_pool and same_par and err <= 4 * ulp and same_g
                bad += not ok
                if not ok:
                    print("MISMATCH", layout, dtype, step, same_pool, same_par, err, same_g, flush=True)
            print("checked", layout, dtype, flush=True)
    print("correctness failures:", bad, "| attention's largest error in ulps of the output:",
          {str(k)[6:]: round(v, 2) for k, v in worst.items()}, flush=True)


def timed(fn, flush, n=30):
    ts = []
    for _ in range(n):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1000)
    ts.sort()
    return ts[len(ts) // 2]


def _decode_cache(kv, layout, n_seqs, seq, dtype=torch.float16):
    """A random pool for ``n_seqs`` sequences of ``seq`` tokens (a partial last block) on random blocks."""
    per = seq // BS + 1
    nb = max(n_seqs * per + 64, 8192)
    cache = PagedKVCache(cfg(kv, layout, dtype, nb, dev))
    cache.buffer.random_(0, 256)
    if cache.params_buffer is not None:
        if kv == "int4b":
            w = torch.tensor([0.01, 0.5], dtype=torch.float16).view(torch.float32)
            cache.params_buffer.fill_(w.item())
        else:
            cache.params_buffer.uniform_(0.001, 0.02)
    tables = torch.randperm(nb, device=dev)[: n_seqs * per].reshape(n_seqs, per).to(torch.int32)
    kvl = torch.full((n_seqs,), seq - 1 - 5, dtype=torch.int32, device=dev)
    cu = torch.arange(n_seqs + 1, dtype=torch.int32, device=dev)
    return cache, tables, cache.plan(tables, cu, kvl, num_decode=n_seqs)


def _ceiling_us(cache, tables):
    """The same-condition ceiling of reading ``tables``' blocks (data and params): the faster of a contiguous and a
    same-blocks copy (:func:`kvcache.bench.ceiling.measure_ceiling`), as microseconds for the bytes read."""
    from kvcache.bench.ceiling import measure_ceiling

    pool, par = cache.pool(0), cache.params(0)
    srcs = [pool.reshape(pool.shape[0], -1), par.reshape(par.shape[0], -1)]
    c = measure_ceiling(srcs, tables.reshape(-1).long())
    read = tables.numel() * sum(x.shape[1] * x.element_size() for x in srcs)
    return read / (c.gbs * 1e3)


def speed(tiles, layouts=("NHD", "HND")):
    from kvcache.ops.attention import policy

    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    for layout in layouts:
        for n_seqs, seq in ((64, 1024), (64, 16384), (4, 16384), (256, 2048)):
            for qdt in (torch.float16, torch.bfloat16):
                row = []
                for kv in ("int4", "int4b", "k8v4"):
                    cache, tables, plan = _decode_cache(kv, layout, n_seqs, seq, qdt)
                    q = torch.randn(n_seqs, HQ, D, dtype=qdt, device=dev)
                    cache.attention(0, q, plan)
                    us = timed(lambda c=cache, q=q, p=plan: c.attention(0, q, p), flush)
                    extra = ""
                    if layout == "HND" and qdt == torch.float16 and kv != "k8v4":
                        extra = f" (ceiling {_ceiling_us(cache, tables):.1f})"
                    row.append(f"{kv} {us:.1f}{extra}")
                print("decode attention", layout, str(qdt)[6:], f"{n_seqs} x {seq}:", " | ".join(row), flush=True)
    if tiles:
        shipped = policy.BLOCK_KEYS_TILE
        for n_seqs, seq in ((64, 1024), (64, 16384)):
            cache, tables, plan = _decode_cache("int4b", "HND", n_seqs, seq)
            q = torch.randn(n_seqs, HQ, D, dtype=torch.float16, device=dev)
            row = []
            for tile in ((16, 2), (16, 3), (16, 4), (32, 2)):
                policy.BLOCK_KEYS_TILE = tile
                policy._choose_cached.cache_clear()
                p = plan.with_options()  # launches derived anew: the patched tile
                cache.attention(0, q, p)
                us = timed(lambda c=cache, q=q, p=p: c.attention(0, q, p), flush)
                row.append(f"{tile} {us:.1f}")
            print("int4b decode tiles HND", f"{n_seqs} x {seq}:", " | ".join(row), flush=True)
        policy.BLOCK_KEYS_TILE = shipped
        policy._choose_cached.cache_clear()
    # decode append: 256 sequences x 1 token, one layer; random lengths (about one row in 16 fills its block), rows
    # that leave their block partial, rows that fill it
    torch.manual_seed(0)
    for layout in layouts:
        nb = 256 * 130
        for name in ("random", "no fill", "all fill"):
            row = []
            for kv in ("int4", "int4b", "k8v4"):
                cache = PagedKVCache(cfg(kv, layout, torch.float16, nb, dev))
                tables = torch.randperm(nb, device=dev)[: 256 * 128].reshape(256, 128).to(torch.int32)
                if name == "random":
                    kvl = torch.randint(1, 2000, (256,), dtype=torch.int32, device=dev)
                else:
                    kvl = torch.full((256,), 50 * BS + (3 if name == "no fill" else BS - 1), dtype=torch.int32,
                                     device=dev)
                cu = torch.arange(257, dtype=torch.int32, device=dev)
                plan = cache.plan(tables, cu, kvl)
                k = torch.randn(256, H, D, dtype=torch.float16, device=dev)
                cache.append(0, k, k, plan)
                us = timed(lambda c=cache, k=k, p=plan: c.append(0, k, k, p), flush)
                row.append(f"{kv} {us:.2f}")
                del cache
            print(f"decode append 256 x 1 ({name})", layout, " | ".join(row), flush=True)
    # prefill append: 8 x 2048 tokens
    for layout in layouts:
        row = []
        for kv in ("int4", "int4b", "k8v4"):
            nb = 8 * 129 + 64
            cache = PagedKVCache(cfg(kv, layout, torch.float16, nb, dev))
            tables = torch.randperm(nb, device=dev)[: 8 * 129].reshape(8, 129).to(torch.int32)
            kvl = torch.zeros(8, dtype=torch.int32, device=dev)
            cu = torch.arange(9, dtype=torch.int32, device=dev) * 2048
            plan = cache.plan(tables, cu, kvl)
            k = torch.randn(8 * 2048, H, D, dtype=torch.float16, device=dev)
            cache.append(0, k, k, plan)
            us = timed(lambda c=cache, k=k, p=plan: c.append(0, k, k, p), flush)
            row.append(f"{kv} {us:.1f}")
        print("prefill append 8 x 2048", layout, " | ".join(row), flush=True)


def ratios(repeats=2):
    """int4b / int4 decode attention with both caches built at once and timed alternating in this process (HND, the
    shapes of ``speed`` and 96 x 768, the engine's decode batches at the fixed budget): the ratio without the spread
    between runs. Run it in several processes to see the rest of the spread."""
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    for n_seqs, seq in ((64, 1024), (64, 16384), (4, 16384), (256, 2048), (96, 768)):
        for qdt in (torch.float16, torch.bfloat16):
            runs = {}
            for kv in ("int4", "int4b"):
                cache, _, plan = _decode_cache(kv, "HND", n_seqs, seq, qdt)
                q = torch.randn(n_seqs, HQ, D, dtype=qdt, device=dev)
                cache.attention(0, q, plan)
                runs[kv] = lambda c=cache, q=q, p=plan: c.attention(0, q, p)
            for _ in range(repeats):
                a, b = timed(runs["int4"], flush), timed(runs["int4b"], flush)
                print(f"int4b / int4 HND {str(qdt)[6:]} {n_seqs} x {seq}: int4 {a:.1f} | int4b {b:.1f} | "
                      f"{b / a:.3f}", flush=True)
            del runs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--tiles", action="store_true", help="with --speed: int4b's one-warp decode tiles swept")
    ap.add_argument("--ratios", action="store_true", help="int4b / int4 decode attention timed alternating")
    ap.add_argument("--layouts", default="NHD,HND", help="the layouts checked and timed")
    args = ap.parse_args()
    t0 = time.time()
    if args.check:
        correctness(tuple(args.layouts.split(",")))
    if args.speed:
        speed(args.tiles, tuple(args.layouts.split(",")))
    if args.ratios:
        ratios()
    print(f"{time.time() - t0:.0f} s", flush=True)
