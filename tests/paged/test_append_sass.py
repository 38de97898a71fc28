"""The append kernel's compiled code, scanned: compiled for sm_90 by triton without a GPU (tests/paged/sass_tools.py,
in a fresh process without TRITON_INTERPRET) and disassembled, the order of its loads, waits and stores in the
launch shapes the policy picks: the (scale, zero) PTX store, the lookup's guess, search call and predicated
stores, the lookup before the wait (metadata_ready) and speculation's re-reads from L2 after it.
"""

from __future__ import annotations

import pytest

_PTX_SCRIPT = r"""
import json, re, sys
sys.path.insert(0, sys.argv[2])
import sass_tools as PI

cm = sys.argv[1]
pair = re.compile(r"@%p st\.global" + re.escape(cm) + r"\.v2\.b32 \[")  # _store_pair's unnumbered %p
out = {}
for pair_asm in (False, True):
    consts = PI.append_consts(2, True, FMAX=1.0, NUM_BLOCKS=64, LOAD_EV="evict_first" if cm else "", STORE_CM=cm,
                              PAIR_ASM=pair_asm)
    ptx = PI.compile_ptx(consts, 2, 2)
    out[str(pair_asm)] = [len(pair.findall(ptx)), ptx.count("bar.sync")]
print(json.dumps(out))
"""


def _compile_in_subprocess(script: str, arg: str) -> object:
    """Run ``script`` (argv: ``arg``, the directory of sass_tools.py) in a fresh process without TRITON_INTERPRET and
    return the JSON of its last line. Where TRITON_INTERPRET is set (the CPU CI), this process's kernels are
    interpreted functions, which do not compile."""
    pytest.importorskip("triton.backends.nvidia")
    import json
    import os
    import subprocess
    import sys

    env = {key: val for key, val in os.environ.items() if key not in ("TRITON_INTERPRET", "KVCACHE_TRITON_INTERPRET")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.path.join(root, "src") + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", script, arg, os.path.dirname(os.path.abspath(__file__))],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("hints", [False, True], ids=["plain", "streaming"])
def test_pair_store_compiles_to_one_predicated_vector_store_per_head(hints):
    """The int8 append with RoPE compiled for sm_90 without a GPU by tests/paged/sass_tools.py (the PTX the
    driver gets; 8 x 128 heads, 2 warps): with PAIR_ASM, (scale, zero) leave as _store_pair's predicated
    8-byte stores (streaming where asked), and tl.store's shared-memory round trips are gone (fewer
    barriers); without it, no such store.
    Compiled in a fresh process without TRITON_INTERPRET: where it is set (the CPU CI), this process's kernels
    are interpreted functions, which do not compile."""
    counts = _compile_in_subprocess(_PTX_SCRIPT, ".cs" if hints else "")
    (pairs_plain, bars_plain), (pairs_asm, bars_asm) = counts["False"], counts["True"]
    assert pairs_asm >= 2  # K's and V's (scale, zero)
    assert pairs_plain == 0
    assert bars_asm < bars_plain


_SASS_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import sass_tools as PI

ins = PI.sass_ops(*PI.sass_consts(2, False, slots=False), 2)
ops = [i.split()[0] for i in ins]
branch = next(j for j, o in enumerate(ops) if o.startswith("BRA"))
call = next(j for j, i in enumerate(ins) if i.startswith("CALL") and "_find_seq" in i)
row_loads = [j for j, o in enumerate(ops) if o.startswith("LDG") and o.endswith(".128")]
split = {}
for masked in (False, True):  # int8 split (decode) launch without RoPE, ragged: the first exit against the first store
    consts, warps = PI.sass_consts(2, True, slots=False)
    consts.update(ROPE=False, MASKED=masked)
    o = [i.split()[0] for i in PI.sass_ops(consts, warps, 2)]
    first_exit = next(j for j, x in enumerate(o) if x == "EXIT")
    split[str(masked)] = [first_exit, next(j for j, x in enumerate(o) if x.startswith("STG"))]
print(json.dumps([branch, call, row_loads, split]))
"""


def test_search_call_and_masked_stores_in_sass():
    """The ragged int8 append in SASS (compiled by triton for sm_90, no GPU needed):

    * per-row (prefill-sized) launch with RoPE: the K / V row loads (16-byte vectors, one per thread and half row
      of K and of V) are all issued before the first branch (the check of the lookup's guess), and the fallback
      search is a call (`_find_seq_call`) behind it;
    * split (decode-sized) launch: with MASKED the first exit comes after the first store (the row's validity
      predicates the stores: nothing waits on the block table before the codes are done); with a branch on the
      validity, an exit for invalid rows comes before any store (ptxas hoists it above the quantization)."""
    branch, call, row_loads, split = _compile_in_subprocess(_SASS_SCRIPT, "")  # type: ignore[misc]
    assert len(row_loads) == 4
    assert max(row_loads) < branch < call
    exit_masked, store_masked = split["True"]
    exit_branch, store_branch = split["False"]
    assert exit_masked > store_masked
    assert exit_branch < store_branch


# The append's SASS in the decode launch shapes with RoPE (int8 one program per row, fp8 split programs; ragged
# and slot mapping), EARLY, stores predicated: for each, its opcodes, the index of the wait for the previous
# kernel (griddepcontrol.wait: ACQBULK) and the global loads up to the first store as (index, opcode)
# (libdevice's cos / sin fallback reads constant tables: not index tensors). Scripts for _compile_in_subprocess.
_SASS_HEAD = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import sass_tools as PI

SHAPES = [(quant, split, slots) for quant, split in ((2, False), (1, True)) for slots in (False, True)]


def compiled(quant, split, slots, **update):
    consts, warps = PI.sass_consts(quant, split, slots=slots)
    consts.update(EARLY=True, MASKED=True, ROPE_SELECT=False, **update)
    ops = [i.split()[0] for i in PI.sass_ops(consts, warps, quant)]
    wait = ops.index("ACQBULK")
    store = next(j for j, o in enumerate(ops) if o.startswith("STG"))
    loads = [(j, o) for j, o in enumerate(ops[:store]) if o.startswith("LDG") and ".CONSTANT" not in o]
    return ops, wait, loads


out = {}
"""

# metadata_ready's launches: INDEX_FIRST off and on (cos / sin first with it, except fp8)
_SASS_INDEX_FIRST = _SASS_HEAD + r"""
for quant, split, slots in SHAPES:
    for first in (False, True):
        ops, wait, loads = compiled(quant, split, slots, INDEX_FIRST=first, CS_FIRST=first and quant != 1)
        fp = sum(o.startswith(("FFMA", "FMUL")) for o in ops[:wait])
        out[f"{quant}-{int(split)}-{int(slots)}-{int(first)}"] = [wait, [(j, o.endswith(".128")) for j, o in loads],
                                                                   fp]
print(json.dumps(out))
"""


def test_index_first_puts_the_lookup_before_the_wait_in_sass():
    """metadata_ready's launches in SASS (compiled by triton for sm_90 without a GPU), int8 per row and fp8
    split, ragged and by slot mapping: with INDEX_FIRST every index load (the lookup, the block table or slot,
    the position, inv_freq) comes before the wait for the previous kernel (griddepcontrol.wait: ACQBULK) and
    after it, up to the first store, only the K / V row loads (16-byte vectors; fp8 also reads its scale);
    with CS_FIRST the cos / sin polynomial is before the wait too. Without INDEX_FIRST the wait comes first."""
    out = _compile_in_subprocess(_SASS_INDEX_FIRST, "")
    for key, (wait, loads, fp) in out.items():  # type: ignore[union-attr]
        quant, split, slots, first = (int(x) for x in key.split("-"))
        index = [j for j, wide in loads if not wide]
        rows = [j for j, wide in loads if wide]
        assert len(rows) == 4, key  # 16 bytes of K and V per thread and half row (per row), or of one (split)
        if not first:
            assert wait < min(j for j, _ in loads), key
            continue
        after = [j for j in index if j > wait]
        assert len(after) == (1 if quant == 1 else 0), key  # fp8's k / v scale: not an index tensor
        assert len(index) - len(after) >= (2 if slots else 4), key  # slot (+ position); guess, length, table
        assert min(rows) > wait, key
        if quant != 1:
            assert fp >= 20, key  # cos / sin (Cody-Waite reduction and the polynomials)


# the speculative launches: inv_freq read before the wait (rope_ready: cos / sin there too, except fp8) or after it
_SASS_SPECULATE = _SASS_HEAD + r"""
for quant, split, slots in SHAPES:
    for late in (False, True):
        ops, wait, loads = compiled(quant, split, slots, INDEX_FIRST=True, CS_FIRST=quant != 1 and not late,
                                    SPECULATE=True, FREQS_LATE=late)
        out[f"{quant}-{int(split)}-{int(slots)}-{int(late)}"] = [[o for j, o in loads if j < wait],
                                                                 [o for j, o in loads if j > wait]]
print(json.dumps(out))
"""


def test_speculation_rereads_past_l1_after_the_wait_in_sass():
    """The speculative launches in SASS (sm_90, compiled without a GPU): the index loads come before the wait
    for the previous kernel (inv_freq too, unless it may be written by that kernel: then after it); after the
    wait, besides the K / V rows (16-byte vectors), inv_freq where it is read late and fp8's scale, every load is
    a strong GPU-scope one (``ld.global.cg``: from L2, never a line this SM's L1 kept from before the wait), one
    for each index load before the wait."""
    out = _compile_in_subprocess(_SASS_SPECULATE, "")
    for key, (before, after) in out.items():  # type: ignore[union-attr]
        quant, split, slots, late = (int(x) for x in key.split("-"))
        assert before and not any(o.endswith(".128") for o in before), key
        rows = [o for o in after if o.endswith(".128")]
        assert len(rows) == 4, key
        checks = [o for o in after if not o.endswith(".128")]
        plain = [o for o in checks if ".STRONG.GPU" not in o]
        assert len(plain) == (quant == 1) + late, (key, plain)  # fp8's k / v scale, inv_freq read late
        index_before = len(before) - (not late)  # inv_freq read before the wait
        assert index_before >= (2 if slots else 4), (key, before)
        assert len(checks) - len(plain) == index_before, (key, before, checks)
