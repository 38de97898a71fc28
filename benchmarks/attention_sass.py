"""The attention kernel's decode tile compiled for sm_90 without a GPU (Triton's bundled ptxas and nvdisasm): its
SASS instruction mix, local-memory traffic (register spills: LDL / STL) and shared memory, per stored format and
tile. A static view to set beside timings: instructions per key, where the conversions go, whether a tile spills.

    python benchmarks/attention_sass.py --tile int4:64:2 --tile int4b:16:3 --tile int4b:32:3

Shape: 32 / 8 heads x 128 (GQA 4, 16-row decode tiles with V folded per token, one warp), block 16, HND pools, fp16
queries; ``--save DIR`` writes each tile's SASS and TTGIR there.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, "src")
from kvcache.ops.attention._kernel import _attention_kernel  # noqa: E402
from kvcache.ops.paged.format import KV_FORMAT_TABLE, block_key_words  # noqa: E402

H, HQ, D, BS = 8, 32, 128, 16
PTRS = dict(q="*fp16", out="*fp16", lse="*fp32", ws_out="*fp32", ws_lse="*fp32", pool="*u8", qparams="*fp32",
            kv_scales="*fp32", sinks="*fp32", block_tables="*i32", cu_q="*i32", kv_lens="*i32", rope_cos="*fp16",
            rope_sin="*fp16")


def constexprs(kv_dtype: str, block_n: int) -> dict:
    """The launcher's constexprs for a decode tile over an int8 / int4 / k8v4 / int4b HND pool (4-bit rows: D / 2
    bytes; int8: D)."""
    quant = KV_FORMAT_TABLE[kv_dtype].code
    dp = D // 2 if quant in (3, 6) else D
    if quant == 6:
        wk = block_key_words(D, BS)
        p = dict(P_BLK=H * BS * (2 + wk), P_KV=0, P_TOK=2 + wk, P_HEAD=BS * (2 + wk), WK=wk)
    else:
        p = dict(P_BLK=2 * H * BS * 2, P_KV=H * BS * 2, P_TOK=2, P_HEAD=BS * 2, WK=0)
    planes = 3 if quant == 4 else 2
    return dict(SM_SCALE=D ** -0.5, SOFTCAP=0.0, D=D, H1=D // 2, HALF_P=D // 2, HQ=HQ, G=HQ // H, G_P=HQ // H,
                BLOCK_Q=16 // (HQ // H), BLOCK_N=block_n, BS=BS, S_BLK=planes * H * BS * dp, S_KV=H * BS * dp,
                S_TOK=dp, S_HEAD=BS * dp, QUANT=quant, FP8_SCALED=False, LINEAR=False, LOG_B=8, HAS_WINDOW=False,
                HAS_SINKS=False, HAS_LSE=False, PRECISION=None, DOT_F32=False, V_FOLD=True, Q_RESCALE=False,
                WARPS_K=1, HEADS_INNER=True, MIN_SPLIT_TILES=1, INTERP=False, PDL=False, Q_ROPE=False, **p)


def compile_tile(kv_dtype: str, block_n: int, stages: int) -> tuple[str, str, int]:
    """(SASS, TTGIR, shared bytes) of one decode tile."""
    c = constexprs(kv_dtype, block_n)
    fn = _attention_kernel.compiled
    sig = {n: "constexpr" if n in c else PTRS.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in PTRS}
    k = triton.compile(ASTSource(fn, sig, constexprs=c, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 1, "num_stages": stages})
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
    return sass, k.asm["ttgir"], k.metadata.shared


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tile", action="append", required=True, metavar="KV_DTYPE:KEYS:STAGES")
    ap.add_argument("--top", type=int, default=16, help="opcodes listed per tile")
    ap.add_argument("--save", default=None, help="a folder for each tile's SASS and TTGIR")
    args = ap.parse_args()
    for spec in args.tile:
        kv_dtype, keys, stages = spec.split(":")
        sass, ttgir, shared = compile_tile(kv_dtype, int(keys), int(stages))
        ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M)
        count = collections.Counter(ops)
        mma = count["HMMA"]
        print(f"{spec}: {len(ops)} instructions, {mma} HMMA, {len(ops) / max(mma, 1):.1f} instructions per HMMA, "
              f"spills LDL {count['LDL']} / STL {count['STL']}, shared {shared} bytes")
        print("   " + ", ".join(f"{o} {n}" for o, n in count.most_common(args.top)))
        if args.save:
            os.makedirs(args.save, exist_ok=True)
            for ext, text in (("sass", sass), ("ttgir", ttgir)):
                with open(os.path.join(args.save, f"{kv_dtype}_{keys}_{stages}.{ext}"), "w") as f:
                    f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
