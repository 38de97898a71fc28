"""Speculation: without ``metadata_ready``, decode-sized appends with PDL look their rows up (first guess) before
the wait for the previous kernel, then re-read every index value they used after it and redo the rows whose
values changed or whose guess missed. Against the reference, in both launch shapes, ragged and by slot
mapping, with values unchanged and changed between the early read and the check; on a GPU, with index tensors
really written late by a running kernel.

Under the interpreter nothing runs concurrently, so a change between the early read and the check is made by
swapping the kernel's check (``_spec_same``, a jit helper of kvcache/ops/paged/kernels/lookup.py called by the
append kernel) for one that changes the values first, or reports them changed, then runs the real check
(:func:`swap_check`). These are tests of that mechanism, and the only place where the tests replace a private
name: there is no public way to write an index tensor between two loads of one kernel.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from kvcache._backend import use_triton
from kvcache.ops.paged import append_paged_kv
from kvcache.ops.paged.kernels import append as append_kernel_module
from kvcache.ops.paged.kernels.lookup import _spec_same
from kvcache.rope import RopeConfig
from sweeps import each_value, named

from . import launches as la
from . import paged_reference as pr
from .test_append_launch import BATCHES, FORMATS, _check_ragged_and_slots, _ragged_case, index_first_launch, pdl_on


def speculative_launch(k: torch.Tensor, *, kv_dtype: str, n_seqs: int | None, rope, split: bool,  # type: ignore[no-untyped-def]
                       rope_ready: bool, cs_first: bool = False):
    """A speculative launch (the lookup first, checked after the wait) in the shape ``split``, whatever the
    batch (the policy speculates only where the first guess is exact: here mixed batches speculate too, their
    missed rows taking the slow path); inv_freq read after the wait unless ``rope_ready``."""
    launch = index_first_launch(k, kv_dtype=kv_dtype, n_seqs=n_seqs, rope=rope, split=split, cs_first=cs_first)
    full = rope is not None and not rope.interleaved and int(rope.rotary_dim) == k.shape[2]
    return dataclasses.replace(launch, speculate=True, freqs_late=full and not rope_ready,
                               cs_first=launch.cs_first and rope_ready)


def swap_check(monkeypatch, check) -> None:  # type: ignore[no-untyped-def]
    """Replace the append kernel's speculation check by ``check`` (a jit function of the same arguments). The
    interpreter resolves the kernel's helpers at call time; compiled kernels are not affected."""
    monkeypatch.setattr(append_kernel_module, "_spec_same", check)


def needs_interpreter(device: torch.device) -> None:
    if device.type != "cpu" or not use_triton(device):
        pytest.skip("the kernel's helper is replaced only under the interpreter")


@triton.jit
def _never_same(n, cu_q, k_lens, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                MODE: tl.constexpr, ROPE: tl.constexpr):
    # every program finds its values changed (as if the previous kernel had written them): the slow path
    same = _spec_same(n, cu_q, k_lens, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                      MODE, ROPE)
    return same & (n < 0)


@triton.jit
def _always_same(n, cu_q, k_lens, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                 MODE: tl.constexpr, ROPE: tl.constexpr):
    same = _spec_same(n, cu_q, k_lens, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                      MODE, ROPE)
    return same | (n >= 0)


@pytest.mark.parametrize(("batch", "shape", "kv_dtype", "use_rope", "changed"), each_value(
    [BATCHES[0], BATCHES[2], BATCHES[3]], ["split", "per-row"], FORMATS, named([False, True], ["no-rope", "rope"]),
    named([False, True], ["unchanged", "changed"])))
def test_speculative_launches_match_the_reference(device, monkeypatch, batch, shape, kv_dtype, use_rope, changed):
    """The speculative lookup (``speculate``, the default for decode-sized appends with PDL and no promise):
    the first guess (and cos / sin) before the wait, every value it read checked after it. Rows whose guess
    missed (mixed batches, padding) and, with ``changed``, every row (as if the previous kernel had written the
    index tensors) go through the slow path; ragged and by slot mapping, both launch shapes (per-row launches
    with ``rope_ready``: inv_freq and cos / sin before the wait; split ones read inv_freq after it): the
    reference's bytes (within the RoPE bounds)."""
    if not use_triton(device):
        pytest.skip("the torch backend launches no kernel")
    if changed:
        needs_interpreter(device)
        swap_check(monkeypatch, _never_same)
    q_lens, kv_lens, pad = batch
    gen = pr.generator(13 * len(q_lens) + pad)
    c = _ragged_case(device, gen, batch, kv_dtype, RopeConfig(head_dim=16, base=10000.0) if use_rope else None)
    params = c.rope.kernel_params(device=device) if use_rope else None
    per_row = shape == "per-row"

    def launch(n_seqs):  # type: ignore[no-untyped-def]
        return speculative_launch(c.k, kv_dtype=kv_dtype, n_seqs=n_seqs, rope=params, split=not per_row,
                                  rope_ready=per_row, cs_first=use_rope and kv_dtype != "fp8" and per_row)

    _check_ragged_and_slots(device, c, kv_lens, kv_dtype, params, use_rope, launch)


def test_speculation_check_is_what_keeps_missed_guesses_right(device, monkeypatch):
    """The check after the wait decides: with it replaced by one that always passes, a mixed batch (rows whose
    first guess misses) lands in the wrong slots, and the reference comparison catches it (so the speculative
    tests above exercise the slow path, not just the guess)."""
    needs_interpreter(device)
    swap_check(monkeypatch, _always_same)
    with pytest.raises(AssertionError):
        test_speculative_launches_match_the_reference(device, monkeypatch, BATCHES[2].values[0], "split", "int8",
                                                      True, False)


# What a previous kernel could write between a speculative program's early reads and its wait, one value kind
# each (idempotent, so that K and V programs of a row agree): the program's cached length | 1 (even lengths: the
# same block, the next offset), its block-table entry | 16 (blocks < 16 move to another block), its slot's
# block | 16 (block size 4), its position | 1. Then the real check runs.
@triton.jit
def _lens_change(n, cu_q, k_lens, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                 MODE: tl.constexpr, ROPE: tl.constexpr):
    g = tl.minimum((n.to(tl.int64) * guess_mul) >> 30, n_seqs - 1)
    tl.store(k_lens + g, tl.load(k_lens + g) | 1)
    return _spec_same(n, cu_q, k_lens, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                      MODE, ROPE)


@triton.jit
def _table_change(n, cu_q, k_lens, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                  MODE: tl.constexpr, ROPE: tl.constexpr):
    tl.store(bt_ptr, tl.load(bt_ptr, mask=bt_mask, other=0) | 16, mask=bt_mask)
    return _spec_same(n, cu_q, k_lens, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                      MODE, ROPE)


@triton.jit
def _slot_change(n, cu_q, k_lens, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                 MODE: tl.constexpr, ROPE: tl.constexpr):
    sl = tl.load(slots + n)
    tl.store(slots + n, tl.where(sl >= 0, sl | 64, sl))
    return _spec_same(n, cu_q, k_lens, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                      MODE, ROPE)


@triton.jit
def _position_change(n, cu_q, k_lens, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                     MODE: tl.constexpr, ROPE: tl.constexpr):
    tl.store(positions + n, tl.load(positions + n) | 1)
    return _spec_same(n, cu_q, k_lens, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                      MODE, ROPE)


_CHANGES = {"lens": _lens_change, "table": _table_change, "slots": _slot_change, "positions": _position_change}


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("shape", ["split", "per-row"])
@pytest.mark.parametrize("what", list(_CHANGES))
def test_speculation_stores_values_written_after_its_early_read(device, monkeypatch, what, shape, kv_dtype):
    """Each index value a speculative program reads before the wait, changed in memory between that read and
    the check (as a previous kernel still running could): the lengths, a block-table entry, a slot, a
    position. The rows must land where the new values say, rotated by the new positions: each comparison of
    the check is needed (dropping one stores the stale target)."""
    needs_interpreter(device)
    swap_check(monkeypatch, _CHANGES[what])
    H, D, bs, nb = 2, 16, 4, 32
    gen = pr.generator(1300 + len(what))
    rope = RopeConfig(head_dim=D, base=10000.0)
    params = rope.kernel_params(device=device)
    lens = [2, 0, 6, 4, 6, 2]  # even: | 1 keeps each row in its block (of 2 per sequence)
    n = len(lens)
    cu = list(range(n + 1))
    perm = torch.randperm(16, generator=gen).tolist()  # blocks < 16: | 16 moves every entry
    tables = [perm[2 * i:2 * i + 2] for i in range(n)]
    k = pr.randn((n, H, D), torch.float16, gen, device)
    v = pr.randn((n, H, D), torch.float16, gen, device)
    new_lens = [x | 1 for x in lens] if what == "lens" else lens
    new_tables = [[b | 16 for b in row] for row in tables] if what == "table" else tables
    targets = pr.ragged_targets(n, new_tables, cu, kv_lens=new_lens, block_size=bs, num_blocks=nb)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="NHD",
                             rope=rope)
    if what in ("lens", "table"):
        index = dict(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device), kv_lens=pr.i32(lens, device))
    else:
        old = pr.ragged_targets(n, tables, cu, kv_lens=lens, block_size=bs, num_blocks=nb)
        slots = [t.block * bs + t.offset for t in old]
        pos = [t.position for t in old]
        if what == "slots":  # slot | 64: the same offset in block | 16
            moved = [dataclasses.replace(t, block=t.block | 16) for t in old]
        else:
            moved = [dataclasses.replace(t, position=t.position | 1) for t in old]
        exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, moved, kv_dtype=kv_dtype, layout="NHD",
                                 rope=rope)
        index = dict(slot_mapping=torch.tensor(slots, device=device), positions=torch.tensor(pos, device=device))
    launch = speculative_launch(k, kv_dtype=kv_dtype, n_seqs=None if "slot_mapping" in index else n, rope=params,
                                split=shape == "split", rope_ready=True)
    la.append_with(cache, 0, k, v, launch, rope=params, **index)
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope)


@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
def test_speculative_lookup_with_cu_k_lens_and_context_parallel(device, monkeypatch, kv_dtype):
    """Speculation with cu_k_lens (the guess reads four values) and context parallelism (rank 1 of 2), values
    unchanged and changed, split launches."""
    if not use_triton(device):
        pytest.skip("the torch backend launches no kernel")
    q_lens, kv_lens = [1, 1, 1, 1, 1], [4, 0, 9, 5, 1]
    H, D, bs, nb = 2, 16, 4, 32
    gen = pr.generator(1235)
    rope = RopeConfig(head_dim=D, base=10000.0)
    params = rope.kernel_params(device=device)
    cu = pr.cumsum0(q_lens)
    totals = [a + b for a, b in zip(kv_lens, q_lens)]
    local = [(t + 1) // 2 for t in totals]
    tables = pr.block_tables_for(gen, local, block_size=bs, num_blocks=nb, extra=0)
    k = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    v = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    targets = pr.ragged_targets(cu[-1], tables, cu, cu_k_lens=pr.cumsum0(totals), block_size=bs, num_blocks=nb,
                                cp_rank=1, cp_size=2)
    assert 0 < len(targets) < cu[-1]
    launch = speculative_launch(k, kv_dtype=kv_dtype, n_seqs=len(q_lens), rope=params, split=True, rope_ready=True,
                                cs_first=True)
    assert launch.cs_first and not launch.freqs_late
    for changed in (False, True):
        if changed and device.type == "cuda":
            continue
        if changed:
            swap_check(monkeypatch, _never_same)
        cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
        exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="NHD",
                                 rope=rope)
        la.append_with(cache, 0, k, v, launch, block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                       cu_k_lens=pr.i32(pr.cumsum0(totals), device), rope=params, cp_rank=1, cp_size=2)
        pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("mode", ["ragged", "slots"])
def test_speculation_sees_index_tensors_written_late(device, mode, kv_dtype):
    """Without the promise, the decode append reads the index tensors before the wait speculatively. A PDL
    kernel that releases its dependents at once and writes them (kv_lens, or the slot mapping and positions)
    only after spinning about 1 ms: the append must store the rows where the new values say, rotated by the
    new positions. A control append with ``metadata_ready=True`` (which trusts its early read) stores them where
    the stale values say: the race is real. A cache whose calls alternate with and without the promise keeps
    their prepared launches apart."""
    if device.type != "cuda" or not pdl_on(device):
        pytest.skip("programmatic dependent launch needs a CUDA GPU of compute capability >= 9.0")
    H, D, bs, nb = 8, 128, 16, 64
    gen = pr.generator(41)
    rope = RopeConfig(head_dim=D, base=10000.0)
    n = 8
    cu = list(range(n + 1))
    stale_lens, fresh_lens = [5, 17, 0, 40, 33, 2, 60, 11], [9, 3, 30, 1, 47, 20, 14, 58]
    tables = [list(range(4 * s, 4 * s + 4)) for s in range(n)]  # 4 blocks per sequence, distinct
    k = pr.randn((n, H, D), torch.float16, gen, device)
    v = pr.randn((n, H, D), torch.float16, gen, device)

    def expected(lens):  # type: ignore[no-untyped-def]
        cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                                  kv_dtype=kv_dtype, rope=rope)
        targets = pr.ragged_targets(n, tables, cu, kv_lens=lens, block_size=bs, num_blocks=nb)
        return targets, pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype,
                                           layout="NHD", rope=rope)

    fresh_targets, exp = expected(fresh_lens)
    stale_targets, _ = expected(stale_lens)
    if mode == "ragged":
        stale = pr.i32(stale_lens, device)
        fresh = pr.i32(fresh_lens, device)
    else:
        def slot_rows(targets):  # type: ignore[no-untyped-def]
            return [[t.block * bs + t.offset for t in targets], [t.position for t in targets]]
        stale = torch.tensor(slot_rows(stale_targets), device=device)
        fresh = torch.tensor(slot_rows(fresh_targets), device=device)
    buf = stale.clone()

    def index() -> dict:
        if mode == "ragged":
            return dict(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device), kv_lens=buf)
        return dict(slot_mapping=buf[0], positions=buf[1])

    writer, _ = la.late_writer_kernels()
    grid = (1,)
    t = fresh_targets[0]

    params = rope.kernel_params(device=device)  # built once: covered by the promise

    def run(ready: bool, cache=None, op: bool = False):  # type: ignore[no-untyped-def]
        """The late writer, then the append (PagedKVCache.append, or with ``op`` the public append_paged_kv)
        into ``cache`` (refilled with sentinels), or a new sentinel cache."""
        if cache is None:
            cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                                      kv_dtype=kv_dtype, rope=rope)
        else:
            for pools in (cache.buffer, cache.params_buffer):
                if pools is not None:
                    pr.fill_sentinel(pools)
        buf.copy_(stale)
        torch.cuda.synchronize()
        writer[grid](fresh, buf, fresh.numel(), SPIN=500000, BLOCK=32, launch_pdl=True)
        if op:
            append_paged_kv(k, v, cache.pool(0), cache.params(0), kv_dtype=kv_dtype, rope=params,
                            fp8_scales=cache.kv_scales[0], metadata_ready=ready, **args)
        else:
            cache.append(0, k, v, cache.plan(metadata_ready=ready, **args))
        torch.cuda.synchronize()
        assert torch.equal(buf, fresh), "the writer did not run"
        return cache

    args = index()
    for ready in (False, True):  # warm-up: compile, and prepare the cache's launches (a compile between the two
        # launches would let the writer finish first)
        for op in (False, True):
            run(ready, op=op)
            run(ready, op=op)
    # control: trusting its early read, the promised append stores the rows where the stale values say (else
    # this test could not tell), through the cache and through the public op (which passes the promise on).
    # On a GPU shared with other processes (the suite's workers) a time slice may let the writer finish first:
    # each control is tried up to 5 times
    for op in (False, True):
        for _ in range(5):
            control = run(True, op=op)
            if pr.is_all_sentinel(control.pool(0)[t.block, :, t.offset]):
                break
        else:
            pytest.fail(f"the index tensors were never written after the append {'op' if op else 'cache'} read "
                        "them, in 5 tries: no race to test")
    # speculation reads them early too, checks them after the wait and stores the rows where the new values say
    for op in (False, True):
        for _ in range(3):
            cache = run(False, op=op)
            pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope,
                                     what="op" if op else "cache")
    # the cache's prepared launches are kept apart by metadata_ready: a promise made by earlier calls (whose
    # launch the cache has prepared) does not carry over to a call without it
    shared = run(True)
    run(True, shared)
    for _ in range(3):
        run(False, shared)
        pr.assert_append_matches(shared.pool(0), shared.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope,
                                 what="a call without the promise after calls with it")
        run(True, shared)
