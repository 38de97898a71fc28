"""Compile the attention kernels for sm_90 on a machine without a GPU (frontend + ptxas): catches errors the
interpreter does not."""
import sys, time, itertools
import torch, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from kvcache.ops.attention._kernel import _attention_kernel, _combine_kernel, _merge_kernel

target = GPUTarget("cuda", 90, 32)
ints = set(_attention_kernel._int_pos)

def sig_of(kern, ptr_types):
    import inspect
    names = list(inspect.signature(kern.fn).parameters)
    sig = {}
    for i, n in enumerate(names[:len(names) - len(kern._const_names)]):
        sig[n] = "i32" if i in kern._int_pos else ptr_types.get(n, "*fp32")
    return sig

def comp(kern, ptr_types, consts, opts):
    sig = sig_of(kern, ptr_types)
    for k, v in consts.items():
        sig[k] = "constexpr"
    src = ASTSource(fn=kern.compiled, signature=sig, constexprs={k: v for k, v in consts.items()})
    t = time.time()
    ck = triton.compile(src, target=target, options=opts)
    return ck, time.time() - t

def attn(qdt, quant, d, g, block_q, block_n, bs, splits, layout="NHD", linear=False, window=True, sinks=True,
         softcap=0.0, warps=4, stages=3):
    h = 8
    r = d // 2 if quant == 3 else d
    pool_t = {0: qdt, 1: "*u8", 2: "*u8", 3: "*u8"}[quant]
    ptr = dict(q=qdt, out=qdt, lse="*fp32", ws_out="*fp32", ws_lse="*fp32", pool=pool_t, params="*fp32",
               kv_scales="*fp32", sinks="*fp32", block_tables="*i32", cu_q="*i32", kv_lens="*i32")
    if layout == "NHD":
        s_tok, s_head = h * r, r
    else:
        s_tok, s_head = r, bs * r
    h1 = (d + 1) // 2
    half_p = max(16, triton.next_power_of_2(h1))
    consts = dict(SM_SCALE=0.088, SOFTCAP=softcap, D=d, H1=h1, HALF_P=half_p, HQ=h * g, G=g,
                  G_P=triton.next_power_of_2(g), BLOCK_Q=block_q, BLOCK_N=block_n, BS=bs, S_BLK=2 * bs * h * r,
                  S_KV=bs * h * r, S_TOK=s_tok, S_HEAD=s_head, P_BLK=2 * bs * h * 2, P_KV=bs * h * 2,
                  P_TOK=h * 2 if layout == "NHD" else 2, P_HEAD=2 if layout == "NHD" else bs * 2, QUANT=quant,
                  FP8_SCALED=quant == 1, LINEAR=linear, LOG_B=7, NUM_SPLITS=splits, HAS_WINDOW=window,
                  HAS_SINKS=sinks, HAS_LSE=True, PRECISION="ieee" if qdt == "*fp32" else "tf32", DOT_F32=False)
    return comp(_attention_kernel, ptr, consts, dict(num_warps=warps, num_stages=stages))

ok = True
cases = []
for qdt in ("*fp16", "*bf16"):
    for quant in (0, 1, 2, 3):
        cases.append(dict(qdt=qdt, quant=quant, d=128, g=4, block_q=4, block_n=64, bs=16, splits=1))
cases += [
    dict(qdt="*fp16", quant=0, d=128, g=4, block_q=32, block_n=64, bs=64, splits=1, warps=8, stages=2),
    dict(qdt="*fp16", quant=2, d=80, g=3, block_q=4, block_n=64, bs=32, splits=4, layout="HND", softcap=30.0),
    dict(qdt="*fp32", quant=0, d=64, g=1, block_q=16, block_n=64, bs=16, splits=1),
    dict(qdt="*fp16", quant=1, d=256, g=8, block_q=2, block_n=32, bs=16, splits=2, linear=True),
]
for c in cases:
    try:
        ck, dt = attn(**c)
        print("ok", c, f"{dt:.1f}s", "regs", ck.n_regs if hasattr(ck, "n_regs") else "?", flush=True)
    except Exception as e:
        ok = False
        print("FAIL", c, repr(e)[-1500:], flush=True)
try:
    ptr = dict(ws_out="*fp32", ws_lse="*fp32", out="*fp16", lse="*fp32", cu_q="*i32")
    comp(_combine_kernel, ptr, dict(D=128, D_P=128, HQ=32, NUM_SPLITS=5, SPLITS_P=8, LINEAR=False, HAS_LSE=True),
         dict(num_warps=4))
    ptr = dict(out_a="*fp16", lse_a="*fp32", out_b="*fp16", lse_b="*fp32", out="*fp16", lse="*fp32")
    comp(_merge_kernel, ptr, dict(D=128, D_P=128, BLOCK_R=32), dict(num_warps=4))
    print("ok combine / merge")
except Exception as e:
    ok = False
    print("FAIL combine/merge", repr(e)[-1500:])
sys.exit(0 if ok else 1)
