"""Compile the paged append kernel for sm_90 on a machine without a GPU (triton's bundled ptxas) and
disassemble it (bundled nvdisasm): the tools of the compile-and-scan tests in test_append_sass.py, which run
them in a fresh process without TRITON_INTERPRET (where it is set, kernels are interpreted functions, which do
not compile).

The constexprs are those the launcher passes for 8 x 128 fp16 heads, a pool of 2000 blocks of 16 tokens (NHD)
and a ragged batch of 8 sequences (or a slot mapping), RoPE over the whole head; ``sass_consts`` adds a
launch's choices on an H100 (PDL; split launches: stores early and predicated; per-row launches: cache hints
and the (scale, zero) PTX store).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvcache.ops.paged.kernels.append import _append_kernel

TARGET = GPUTarget("cuda", 90, 32)
STORE = {0: "*fp16", 1: "*fp8e4nv", 2: "*u8", 3: "*u8"}  # the pool's pointer type by QUANT


def compile_kernel(kern, ptrs: dict[str, str], consts: dict, num_warps: int):  # type: ignore[no-untyped-def]
    """``triton.compile`` of a :class:`kvcache._backend.Kernel` for sm_90 (PTX and cubin, no GPU needed):
    pointers 16-byte aligned, other runtime arguments int32."""
    fn = kern.compiled
    sig = {}
    attrs = {}
    for idx, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
            attrs[(idx,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps})


def append_ptrs(quant: int) -> dict[str, str]:
    """Pointer types of the append kernel's arguments (fp16 model dtype)."""
    return dict(k="*fp16", v="*fp16", pool=STORE[quant], qparams="*fp32", block_tables="*i32", cu_q="*i32",
                k_lens="*i32", slots="*i64", positions="*i64", inv_freq="*fp32", fp8_scales="*fp32")


def append_consts(quant: int, rope: bool, **kw):  # type: ignore[no-untyped-def]
    """The append's constexprs (a per-row launch without PDL, cache hints on), ``kw`` overriding."""
    H, D, bs = 8, 128, 16
    dp = D // 2 if quant == 3 else D
    c = dict(MODE=0, QUANT=quant, ROPE=rope, ROT=D, INTERLEAVED=False, ATTN_SCALE=1.0, H=H, D=D, DP=dp,
             BLOCK_SIZE=bs, NUM_BLOCKS=2000, S_TOK=H * dp, S_HEAD=dp, P_TOK=H * 2, P_HEAD=2, CP_RANK=0, CP_SIZE=1,
             SEARCH=8, LOG_B=3, STRIDE_KH=D, STRIDE_VH=D, VEC=8, BLOCK_H=H, BLOCK_HF=D // 2, LIBDEVICE=True,
             SPLIT=False, PDL=False, FMAX=0.0, EARLY=False, LOAD_EV="evict_first", STORE_CM=".cs", HG=1,
             PAIR_ASM=quant >= 2, ROPE_SELECT=False, MASKED=False, CS_FIRST=False, INDEX_FIRST=False,
             SPECULATE=False, FREQS_LATE=False)
    c.update(kw)
    return c


def compile_ptx(consts: dict, num_warps: int, quant: int) -> str:
    """The append's PTX for ``consts``."""
    return compile_kernel(_append_kernel, append_ptrs(quant), consts, num_warps).asm["ptx"]


def sass_ops(consts: dict, num_warps: int, quant: int) -> list[str]:
    """The append's SASS instructions (opcode with modifiers, then operands; predicates dropped), in program
    order: compiled for sm_90 by triton (with the ptxas it picks) and disassembled by the bundled nvdisasm."""
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cubin = compile_kernel(_append_kernel, append_ptrs(quant), consts, num_warps).asm["cubin"]
    with tempfile.TemporaryDirectory() as d:  # triton's own ptxas made the cubin (its PTX version may need it)
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", path], capture_output=True, text=True,
                              check=True).stdout
    return re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][^;]*?)\s*;", sass, re.M)


def sass_consts(quant: int, split: bool, slots: bool, select: bool = False):  # type: ignore[no-untyped-def]
    """The constexprs of the append with RoPE, and its warps, with a launch's choices on an H100 for 8 x 128
    heads: PDL; split: stores early and predicated (unless ``select``: K and V programs both rotate), no cache
    hints, no PTX (scale, zero) store, one warp; per-row: 4 warps for fp16, else 2."""
    extra: dict = dict(PDL=True)
    if split:
        extra.update(SPLIT=True, EARLY=True, LOAD_EV="", STORE_CM="", PAIR_ASM=False, MASKED=not select)
    warps = 1 if split else (4 if quant == 0 else 2)
    return append_consts(quant, True, FMAX=1.0, MODE=2 if slots else 0, ROPE_SELECT=select, **extra), warps
