"""Compile the attention kernels for sm_90 (Hopper) on a machine without a GPU: triton's frontend, its
optimisation passes and ptxas all run, so errors the interpreter cannot see (type mismatches between returns,
non-constexpr globals, layout conversions) show up here. A script, not a test (about 40 s):

    python tests/ops/attention/compile_sm90.py
"""

from __future__ import annotations

import inspect
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvcache.ops.attention._combine import _combine_kernel, _merge_kernel
from kvcache.ops.attention._kernel import _attention_kernel

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(kern, ptr_types, consts, opts):  # type: ignore[no-untyped-def]
    names = list(inspect.signature(kern.fn).parameters)
    sig = {}
    for i, n in enumerate(names[: len(names) - len(kern._const_names)]):
        sig[n] = "i32" if i in kern._int_pos else ptr_types.get(n, "*fp32")
    # pointers 16-byte aligned, as the launcher specialises them (torch allocations are)
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    sig.update({k: "constexpr" for k in consts})
    return triton.compile(ASTSource(fn=kern.compiled, signature=sig, constexprs=dict(consts), attrs=attrs),
                          target=TARGET, options=opts)


def attention(qdt, quant, d, g, block_q, block_n, bs, splits, layout="NHD", linear=False, softcap=0.0, warps=4,
              stages=3, window=True, warps_k=1, q_rope=False):  # type: ignore[no-untyped-def]
    h = 8
    r = d // 2 if quant == 3 else d
    ptr = dict(q=qdt, out=qdt, pool=qdt if quant == 0 else "*u8", block_tables="*i32", cu_q="*i32", kv_lens="*i32",
               rope_cos=qdt, rope_sin=qdt)
    s_tok, s_head = (h * r, r) if layout == "NHD" else (r, bs * r)
    h1 = (d + 1) // 2
    consts = dict(SM_SCALE=0.088, SOFTCAP=softcap, D=d, H1=h1, HALF_P=max(16, triton.next_power_of_2(h1)),
                  HQ=h * g, G=g, G_P=triton.next_power_of_2(g), BLOCK_Q=block_q, BLOCK_N=block_n, BS=bs,
                  S_BLK=2 * bs * h * r, S_KV=bs * h * r, S_TOK=s_tok, S_HEAD=s_head, P_BLK=2 * bs * h * 2,
                  P_KV=bs * h * 2, P_TOK=h * 2 if layout == "NHD" else 2, P_HEAD=2 if layout == "NHD" else bs * 2,
                  QUANT=quant, FP8_SCALED=quant == 1, LINEAR=linear, LOG_B=7, HAS_WINDOW=window,
                  HAS_SINKS=True, HAS_LSE=True, PRECISION="ieee" if qdt == "*fp32" else None, DOT_F32=False,
                  V_FOLD=quant >= 2 and (block_q * triton.next_power_of_2(g) <= 16 or warps_k > 1),
                  Q_RESCALE=quant == 2 and qdt == "*bf16" and block_q * triton.next_power_of_2(g) <= 16,
                  WARPS_K=warps_k, HEADS_INNER=block_q * triton.next_power_of_2(g) <= 16,
                  MIN_SPLIT_TILES=max(1, 512 // block_n) if splits > 1 else 1, INTERP=False, PDL=True,
                  Q_ROPE=q_rope)
    return compile_kernel(_attention_kernel, ptr, consts, dict(num_warps=warps, num_stages=stages))


CASES = [dict(qdt=qdt, quant=quant, d=128, g=4, block_q=4, block_n=64, bs=16, splits=1)
         for qdt in ("*fp16", "*bf16") for quant in (0, 1, 2, 3)] + [
    dict(qdt="*fp16", quant=0, d=128, g=4, block_q=32, block_n=128, bs=64, splits=1, warps=8, stages=2),
    dict(qdt="*bf16", quant=2, d=128, g=4, block_q=32, block_n=128, bs=16, splits=1, warps=8, stages=2),
    dict(qdt="*fp16", quant=3, d=128, g=4, block_q=32, block_n=128, bs=16, splits=1, warps=8, stages=2),
    # quantized prefill tiles at head_dim 64 (packed 16-bit dequantization): bf16 int8, fp16 int4 with softcap,
    # and float32 queries (float32 dequantization)
    dict(qdt="*bf16", quant=2, d=64, g=4, block_q=32, block_n=64, bs=16, splits=1, warps=4, stages=2),
    dict(qdt="*fp16", quant=3, d=64, g=4, block_q=32, block_n=64, bs=16, splits=1, warps=4, stages=2, softcap=30.0),
    dict(qdt="*fp32", quant=2, d=64, g=4, block_q=32, block_n=64, bs=16, splits=1, warps=4, stages=2),
    dict(qdt="*fp16", quant=3, d=128, g=4, block_q=4, block_n=64, bs=64, splits=1, window=False),
    # warp-split decode tiles (int8 / int4; a window, softcap, splits, bf16 queries)
    dict(qdt="*fp16", quant=3, d=128, g=4, block_q=4, block_n=128, bs=16, splits=1, warps_k=4),
    dict(qdt="*bf16", quant=2, d=64, g=4, block_q=4, block_n=64, bs=16, splits=2, warps_k=4, stages=2),
    dict(qdt="*bf16", quant=3, d=80, g=3, block_q=4, block_n=64, bs=32, splits=1, layout="HND", softcap=30.0,
         warps_k=4),
    dict(qdt="*fp16", quant=2, d=80, g=3, block_q=4, block_n=64, bs=32, splits=4, layout="HND", softcap=30.0),
    dict(qdt="*fp32", quant=0, d=64, g=1, block_q=16, block_n=64, bs=16, splits=1),
    dict(qdt="*fp32", quant=0, d=128, g=4, block_q=32, block_n=64, bs=16, splits=1, warps=8, stages=2),
    dict(qdt="*fp16", quant=1, d=256, g=8, block_q=2, block_n=32, bs=16, splits=2, linear=True),
    # one-warp decode tiles: int8 (its float16 V operand as magic numbers), int4, fp8 for few sequences
    dict(qdt="*bf16", quant=2, d=128, g=4, block_q=4, block_n=32, bs=16, splits=8, warps=1, stages=3),
    dict(qdt="*fp16", quant=3, d=96, g=4, block_q=4, block_n=64, bs=16, splits=8, warps=1, stages=2),
    dict(qdt="*bf16", quant=1, d=128, g=4, block_q=4, block_n=32, bs=16, splits=64, warps=1, stages=5),
    # the engine's tiles (head_dim 64, bf16) rotating their queries: decode, int8 decode, prefill
    dict(qdt="*bf16", quant=0, d=64, g=4, block_q=4, block_n=64, bs=16, splits=1, stages=2, q_rope=True),
    dict(qdt="*bf16", quant=2, d=64, g=4, block_q=4, block_n=64, bs=16, splits=1, stages=2, q_rope=True),
    dict(qdt="*bf16", quant=0, d=64, g=4, block_q=32, block_n=64, bs=16, splits=1, warps=4, stages=2, q_rope=True),
]


def main() -> int:
    ok = True
    for case in CASES:
        t = time.time()
        try:
            attention(**case)
            print(f"ok   {case} ({time.time() - t:.1f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failing configuration
            ok = False
            print(f"FAIL {case}: {str(e)[-1500:]}", flush=True)
    try:
        compile_kernel(_combine_kernel, dict(out="*fp16", cu_q="*i32"),
                       dict(D=128, D_P=128, HQ=32, SPLITS_P=8, LINEAR=False, HAS_LSE=True),
                       dict(num_warps=4))
        compile_kernel(_merge_kernel, dict(out_a="*fp16", out_b="*fp16", out="*fp16"), dict(D=128, D_P=128,
                       BLOCK_R=32), dict(num_warps=4))
        print("ok   combine / merge")
    except Exception as e:  # noqa: BLE001
        ok = False
        print(f"FAIL combine / merge: {str(e)[-1500:]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
