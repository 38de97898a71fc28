"""Bit-exact check of the append's decode-sized launch orderings against the one that waits before its lookup
(``speculate=False``): the lookup before the wait for the previous kernel (``index_first``), with and without
RoPE's cos / sin there too (``cs_first``, also alone), speculation (the default), split and per-row, every
format, ragged and slot mapping, with and without RoPE (a development
tool, run on the GPU before timing them: the orderings must store the same bytes, or say by how much they
differ).

    PYTHONPATH=src python3 benchmarks/variant_check.py
"""

from __future__ import annotations

import itertools

import torch

from kvcache.bench.paged import D, H, decode_batch
from kvcache.ops import paged as P
from kvcache.paged import PagedConfig, PagedKVCache
from kvcache.rope import RopeConfig


def main() -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rope = RopeConfig(head_dim=D, base=500000.0).kernel_params(device=dev)
    b = decode_batch(dev, torch.Generator().manual_seed(1), 16, n_seqs=256 if dev.type == "cuda" else 8)
    bad = strict = 0
    for kv_dtype, ragged, use_rope in itertools.product(("auto", "fp8", "int8", "int4"), (True, False),
                                                        (False, True)):
        c = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=16,
                                     num_blocks=b.num_blocks, kv_dtype=kv_dtype, device=dev))
        outs = []
        no = {"speculate": False}  # the launch that waits before its lookup: the baseline
        for over in (no, {**no, "index_first": True, "cs_first": False}, {**no, "index_first": True, "cs_first": True},
                     {"metadata_ready": True}, {**no, "split": False},
                     {**no, "split": False, "index_first": True, "cs_first": True, "num_warps": 2},
                     {**no, "split": False, "index_first": True, "cs_first": False, "early": True},
                     {**no, "cs_first": True}, {**no, "split": False, "cs_first": True},
                     {}, {"speculate": True, "cs_first": False}, {"speculate": True, "split": True, "cs_first": False}):
            c.pool(0).view(torch.uint8).fill_(0xA5)
            if c.params(0) is not None:
                c.params(0).fill_(float("nan"))
            P.append_paged_kv_launch(
                b.k, b.v, c.pool(0), c.params(0), kv_dtype=kv_dtype, layout="NHD",
                block_tables=b.tables if ragged else None, cu_q_lens=b.cu_q if ragged else None,
                kv_lens=b.kv_lens if ragged else None, cu_k_lens=None, slot_mapping=None if ragged else b.slots,
                positions=None if ragged or not use_rope else b.positions, rope=rope if use_rope else None,
                fp8_scales=c.kv_scales[0], cp_rank=0, cp_size=1, **over)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            pp = c.params(0)
            outs.append((over, c.pool(0).clone(), None if pp is None else pp.clone()))
        for over, pool, par in outs[1:]:
            p0, q0 = outs[0][1], outs[0][2]
            same = torch.equal(pool.view(torch.uint8), p0.view(torch.uint8)) and (
                par is None or torch.equal(par.view(torch.int32), q0.view(torch.int32)))
            what = "identical"
            # cos / sin right after the lookup (cs_first; the promise's and speculation's default except fp8) may
            # move rotated values by an ulp (the compiler contracts the angle product differently)
            cs = over.get("cs_first") or over.get("metadata_ready") or over == {}
            exact = not use_rope or kv_dtype == "fp8" or not cs
            if not same:
                bad += 1
                strict += exact  # orderings that change no arithmetic must store the same bytes
                nbytes = int((pool.view(torch.uint8) != p0.view(torch.uint8)).sum())
                if kv_dtype == "int4":
                    lo = lambda x: (x.view(torch.uint8) & 15).int()
                    hi = lambda x: (x.view(torch.uint8) >> 4).int()
                    code = max(int((lo(pool) - lo(p0)).abs().max()), int((hi(pool) - hi(p0)).abs().max()))
                elif kv_dtype == "int8":
                    code = int((pool.view(torch.uint8).int() - p0.view(torch.uint8).int()).abs().max())
                else:
                    fin = torch.isfinite(p0.float())
                    code = float((pool.float() - p0.float())[fin].abs().max())
                rel = ""
                if par is not None:
                    rel = f", params max rel diff {float(((par - q0) / q0).nan_to_num().abs().max()):.2e}"
                what = f"DIFFERENT: {nbytes} bytes, max code / value diff {code}{rel}"
            print(f"{kv_dtype} {'ragged' if ragged else 'slots'} rope={use_rope} {over}: {what}", flush=True)
    print("variant check:", "all identical" if bad == 0 else f"{bad} different ({strict} that must not be)")
    raise SystemExit(1 if strict else 0)


if __name__ == "__main__":
    main()
