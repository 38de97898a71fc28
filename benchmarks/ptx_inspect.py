"""Compile the paged kernels for sm_90 on a machine without a GPU and count their global memory instructions
by width (a development tool: checks that loads and stores are vectorised before spending GPU time).

    PYTHONPATH=src python benchmarks/ptx_inspect.py
    PYTHONPATH=src python benchmarks/ptx_inspect.py gather
    PYTHONPATH=src python benchmarks/ptx_inspect.py sass [split] [slots]

``sass`` disassembles the append (bundled ptxas + nvdisasm) for every format with RoPE and counts SASS
opcodes: static counts (both sides of every branch), and the order of the global loads up to the first
conversion of K / V (HADD2.F32, which waits for them): loads listed after it are issued only once K / V
have arrived. ``slots``: slot mapping, and for split launches with ROPE_SELECT off and on.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvcache.ops import paged as P

TARGET = GPUTarget("cuda", 90, 32)


def compile_ptx(kern, ptrs: dict[str, str], ints: dict[str, str], consts: dict, num_warps: int) -> str:  # type: ignore[no-untyped-def]
    return compile_kernel(kern, ptrs, ints, consts, num_warps).asm["ptx"]


def compile_kernel(kern, ptrs: dict[str, str], ints: dict[str, str], consts: dict, num_warps: int):  # type: ignore[no-untyped-def]
    """``triton.compile`` of a :class:`kvcache._backend.Kernel` for sm_90 (PTX and cubin, no GPU needed)."""
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
            sig[name] = ints.get(name, "i32")
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps})


def registers(ptx: str) -> str:
    """Registers per thread and spills, from a bundled ptxas (-v): ``ptxas``, or ``ptxas-blackwell`` where the
    PTX is newer than ``ptxas`` reads (triton 3.9 emits PTX 9.x)."""
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    out = ""
    for tool in ("ptxas", "ptxas-blackwell"):
        ptxas = os.path.join(bindir, tool)
        if not os.path.exists(ptxas):
            continue
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.ptx")
            with open(path, "w") as f:
                f.write(ptx)
            res = subprocess.run([ptxas, "-arch=sm_90a", "-v", "--warn-on-spills", path, "-o",
                                  os.path.join(d, "k.cubin")], capture_output=True, text=True)
        out = res.stdout + res.stderr
        if res.returncode == 0:
            break
    m = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return f"{m.group(1) if m else '?'} regs, {spill.group(1) if spill else '?'} B spilled"


def summary(ptx: str) -> str:
    c = collections.Counter(re.findall(r"\b((?:ld|st)\.global(?:\.\w+)*)", ptx))
    return ", ".join(f"{k}: {v}" for k, v in sorted(c.items()))


STORE = {0: "*fp16", 1: "*fp8e4nv", 2: "*u8", 3: "*u8"}  # the pool's pointer type by QUANT


def append_ptrs(quant: int) -> dict[str, str]:
    """Pointer types of the append kernel's arguments (fp16 model dtype)."""
    return dict(k="*fp16", v="*fp16", pool=STORE[quant], qparams="*fp32", block_tables="*i32", cu_q="*i32",
                kv_info="*i32", slots="*i64", positions="*i64", inv_freq="*fp32", fp8_scales="*fp32")


def append_consts(quant: int, rope: bool, **kw):  # type: ignore[no-untyped-def]
    c = dict(MODE=0, QUANT=quant, ROPE=rope, ROT=128, INTERLEAVED=False, ATTN_SCALE=1.0, H=8, D=128,
             DP=64 if quant == 3 else 128, BLOCK_SIZE=16, NUM_BLOCKS=2000, CP_RANK=0, CP_SIZE=1,
             SEARCH=8, LOG_B=3, STRIDE_KH=128, STRIDE_VH=128, VEC=8, BLOCK_H=8, BLOCK_HF=64, LIBDEVICE=True,
             SPLIT=False, PDL=False, FMAX=0.0, EARLY=False, LOAD_EV="evict_first", STORE_CM=".cs", HG=1,
             PAIR_ASM=quant >= 2, ROPE_SELECT=False, MASKED=False, CS_FIRST=False, INDEX_FIRST=False,
             SPECULATE=False, FREQS_LATE=False)
    c.update(P._block_strides(False, 8, c["DP"], 16))
    c.update(kw)
    return c


def main() -> None:
    for quant in (0, 1, 2, 3):
        for rope in (False, True):
            ptrs = append_ptrs(quant)
            consts = append_consts(quant, rope)
            extra = {k: v for k, v in consts.items() if k.startswith("VEC")}
            ptx = compile_ptx(P._append_kernel, ptrs, {}, consts, 4 if quant == 0 else 2)
            print(f"append quant={quant} rope={rope}: {registers(ptx)} | {summary(ptx)} {extra}")
    sys.stdout.flush()


def sass_main(split: bool, slots: bool) -> None:
    for quant in (0, 1, 2, 3):
        for select in ((False, True) if split and slots else (False,)):
            sass_one(quant, split, slots, select)


def sass_ops(consts: dict, num_warps: int, quant: int) -> list[str]:
    """The append's SASS instructions (opcode with modifiers, then operands; predicates dropped), in program
    order: compiled for sm_90 by triton (with the ptxas it picks) and disassembled by the bundled nvdisasm."""
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cubin = compile_kernel(P._append_kernel, append_ptrs(quant), {}, consts, num_warps).asm["cubin"]
    with tempfile.TemporaryDirectory() as d:  # triton's own ptxas made the cubin (its PTX version may need it)
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", path], capture_output=True, text=True,
                              check=True).stdout
    return re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][^;]*?)\s*;", sass, re.M)


def sass_consts(quant: int, split: bool, slots: bool, select: bool = False):  # type: ignore[no-untyped-def]
    """The constexprs of the append with RoPE, and its warps, with the launch's choices on an H100 for 8 x 128
    heads (PDL; split: EARLY, MASKED; per-row: cache hints, the (scale, zero) store; warps); the pool size and
    the lookup's SEARCH width are fixed (2000 blocks, 8 sequences)."""
    extra: dict = dict(PDL=True)
    if split:
        extra.update(SPLIT=True, EARLY=True, LOAD_EV="", STORE_CM="", PAIR_ASM=False, MASKED=not select)
    warps = 1 if split else (4 if quant == 0 else 2)
    return append_consts(quant, True, FMAX=1.0, MODE=2 if slots else 0, ROPE_SELECT=select, **extra), warps


def sass_one(quant: int, split: bool, slots: bool, select: bool) -> None:
    ops = [ins.split()[0] for ins in sass_ops(*sass_consts(quant, split, slots, select), quant)]
    counts = collections.Counter(o.split(".")[0] for o in ops)
    first_use = next((j for j, o in enumerate(ops) if o.startswith("HADD2.F32")), len(ops))
    before = [o for o in ops[:first_use] if o.startswith("LDG")]
    after = [o for o in ops[first_use:] if o.startswith("LDG")][:3]
    branch = next((j for j, o in enumerate(ops) if o.startswith("BRA")), len(ops))
    print(f"append quant={quant} rope {'split' if split else 'per-row'}{' slots' if slots else ''}"
          f"{' ROPE_SELECT' if select else ''}: {len(ops)} instructions, BAR {counts['BAR']}, SHFL "
          f"{counts['SHFL']}; loads before the K/V wait: {len(before)}, before the first branch: "
          f"{sum(o.startswith('LDG') for o in ops[:branch])}; next ones after the wait: {' '.join(after)}")


if __name__ == "__main__" and "sass" in sys.argv:
    sass_main("split" in sys.argv, "slots" in sys.argv)
elif __name__ == "__main__" and "gather" not in sys.argv:
    main()


def gather_main() -> None:
    for quant in (0, 1, 2, 3):
        ptrs = dict(k_out="*fp16", v_out="*fp16", pool=STORE[quant], qparams="*fp32", block_tables="*i32",
                    kv_info="*i32", inv_freq="*fp32", fp8_scales="*fp32")
        consts = dict(MODE=0, QUANT=quant, ROPE=False, ROT=128, INTERLEAVED=False, ATTN_SCALE=1.0, H=8, D=128,
                      DP=64 if quant == 3 else 128, BLOCK_SIZE=16, NUM_BLOCKS=2000, CP_RANK=0, CP_SIZE=1,
                      TOK=2, BLOCK_H=8, BLOCK_D=128, LIBDEVICE=True)
        consts.update({k: v for k, v in GATHER_EXTRA.items() if k in P._gather_kernel.compiled.arg_names})
        consts.update(P._block_strides(False, 8, consts["DP"], 16))
        ptx = compile_ptx(P._gather_kernel, ptrs, {}, consts, 2)
        print(f"gather quant={quant}: {registers(ptx)} | {summary(ptx)}")


GATHER_EXTRA = {"VEC": 8, "WIDE": False}

if __name__ == "__main__" and "gather" in sys.argv:
    gather_main()
