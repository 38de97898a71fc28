"""The launch policy of the paged ops, called directly: :func:`kvcache.ops.paged.plan_append` (which launch a kind
of append gets), :func:`~kvcache.ops.paged.policy.check_launch` (which variants the kernel cannot run) and
:func:`kvcache.ops.paged.plan_gather`. Pure functions of their inputs: no GPU needed, every device's choice is
checked here (``pdl`` / ``ptx`` given explicitly). That each launch writes the right bytes is tested in
test_append_launch.py and test_append_speculation.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import unittest.mock

import pytest
import torch

from kvcache.ops.paged import (
    AppendLaunch,
    GatherLaunch,
    PagedLayer,
    append_paged_kv_launch,
    plan_append,
    plan_gather,
)
from kvcache.ops.paged.format import KV_FORMAT_TABLE
from kvcache.ops.paged.launch import default_append_launch, pdl_supported, ptx, rope_kind
from kvcache.ops.paged.policy import GATHER_WIDE_FROM, SPLIT_BELOW, check_launch
from kvcache.rope import RopeConfig

from . import paged_reference as pr

FORMATS = ["auto", "fp8", "int8", "int4"]
ROPE_KINDS = ["none", "full", "partial"]


def plan(kv_dtype: str = "int8", *, rows: int = 3, seqs: int | None = None, rope: str = "full", pdl: bool = False,
         ptx: bool = False, ready: bool = False, rope_ready: bool = False,
         heads: tuple[int, int] = (2, 16)) -> AppendLaunch:
    """plan_append of ``rows`` rows of ``heads`` (H, D): by slot mapping (``seqs`` None) or a ragged batch of
    ``seqs`` sequences; ``ready``: metadata_ready."""
    return plan_append(n_rows=rows, n_seqs=seqs, num_kv_heads=heads[0], head_dim=heads[1], kv_dtype=kv_dtype,
                       rope=rope, pdl=pdl, ptx=ptx, metadata_ready=ready, rope_ready=rope_ready)  # type: ignore[arg-type]


def test_every_plan_is_a_runnable_consistent_launch():
    """Over every kind of append (sizes on both sides of the split threshold, slot mapping, decode and mixed
    ragged batches, formats, RoPE kinds, PDL, PTX, the promise, rope_ready): the launch passes check_launch,
    is hashable and equal for equal inputs, and keeps the rules that tie its fields together."""
    seen = set()
    for rows, seqs, kv_dtype, rope, pdl_, ptx_, ready, rope_ready in itertools.product(
            (1, 7, SPLIT_BELOW - 1, SPLIT_BELOW, 5000), ("slots", "each", "one"), FORMATS, ROPE_KINDS,
            (False, True), (False, True), (False, True), (False, True)):
        n_seqs = None if seqs == "slots" else rows if seqs == "each" else 1
        p = plan(kv_dtype, rows=rows, seqs=n_seqs, rope=rope, pdl=pdl_, ptx=ptx_, ready=ready, rope_ready=rope_ready)
        what = (rows, seqs, kv_dtype, rope, pdl_, ptx_, ready, rope_ready)
        check_launch(p, num_kv_heads=2, rope=rope, pdl_supported=pdl_)  # type: ignore[arg-type]
        assert p == plan(kv_dtype, rows=rows, seqs=n_seqs, rope=rope, pdl=pdl_, ptx=ptx_, ready=ready,
                         rope_ready=rope_ready) and hash(p) is not None, what
        seen.add(p)
        quant = KV_FORMAT_TABLE[kv_dtype].code
        decode = rows < SPLIT_BELOW
        assert p.pdl is pdl_ and p.head_groups == 1, what
        assert p.hints is (not p.split), what
        assert p.pair_asm is (ptx_ and not p.split and quant >= 2), what
        assert p.rope_select is (p.split and rope != "none" and quant >= 1 and n_seqs is None), what
        assert p.masked is (p.early and not p.rope_select), what
        assert p.index_first is ((ready or p.speculate) and pdl_ and decode), what
        assert not p.speculate or (p.index_first and rope != "partial" and not ready), what
        assert not p.cs_first or (p.index_first and rope == "full" and quant != 1 and not p.freqs_late), what
        assert p.freqs_late is (p.speculate and rope == "full" and not rope_ready), what
        assert p.num_warps in (1, 2, 4, 8), what
        if not decode:  # prefill-sized: one program per row, loads and stores in order, no lookup before the wait
            assert not (p.split or p.early or p.index_first or p.speculate), what
    assert len(seen) > 20  # the inputs do select different launches


def test_launch_descriptions_are_frozen_and_hashable():
    p = plan()
    assert {p: 1}[dataclasses.replace(p)] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.split = not p.split  # type: ignore[misc]
    g = GatherLaunch(tok=1, num_warps=2, wide=False)
    assert hash(g) == hash(GatherLaunch(1, 2, False))
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.tok = 2  # type: ignore[misc]


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_decode_sized_appends_split_and_prefill_sized_ones_take_a_program_per_row(kv_dtype):
    """Fewer than SPLIT_BELOW rows: K and V programs of their own (one warp per KiB of row), stores predicated
    and issued early; SPLIT_BELOW rows or more: one program per row, loads evict-first and stores streaming.
    (Without PDL; int8 / int4 by slot mapping with RoPE: see the four-warp rows below.)"""
    for seqs in (None, 1, 3):
        decode = plan(kv_dtype, rows=3, seqs=seqs, rope="none", heads=(8, 128))
        assert (decode.split, decode.early, decode.masked, decode.hints) == (True, True, True, False)
        assert decode.num_warps == 1  # 8 x 128 heads: 1 KiB of fp16 per row
        prefill = plan(kv_dtype, rows=SPLIT_BELOW, seqs=seqs, rope="full", heads=(8, 128))
        assert (prefill.split, prefill.early, prefill.masked, prefill.hints) == (False, False, False, True)
        assert prefill.num_warps == (4 if kv_dtype == "auto" else 2)
    assert plan(kv_dtype, rows=SPLIT_BELOW - 1, rope="none").split is True


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_pair_store_needs_ptx_and_a_per_row_launch(kv_dtype):
    """int8 / int4 (scale, zero) go out as one 8-byte inline-PTX store per head (pair_asm) only in launches of
    one program per row, where the kernel is compiled from PTX; never for fp16 / fp8 (no params), never in split
    launches (measured no faster). (The launcher also needs 8-byte aligned params: see
    test_append_launch.py's fallback test.)"""
    quantized = kv_dtype in ("int8", "int4")
    for seqs in (None, 1):
        assert plan(kv_dtype, rows=SPLIT_BELOW, seqs=seqs, ptx=False).pair_asm is False  # the CPU: no PTX
        assert plan(kv_dtype, rows=SPLIT_BELOW, seqs=seqs, ptx=True).pair_asm is quantized
        assert plan(kv_dtype, rows=3, seqs=seqs, rope="none", ptx=True).pair_asm is False  # split
    # a per-row decode launch: the promise's (fp16 / int8 / int4) and the four-warp slot-mapping rows
    assert plan(kv_dtype, seqs=3, pdl=True, ptx=True, ready=True).pair_asm is quantized
    assert plan(kv_dtype, ptx=True).pair_asm is quantized


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_rope_select_only_for_quantized_split_slot_mapping(kv_dtype):
    """K and V programs both rotate (rope_select) only in split launches by slot mapping with RoPE of a
    quantized format (where it was measured faster): fp8 (int8 / int4 take four-warp rows there)."""
    assert plan(kv_dtype, rope="full").rope_select is (kv_dtype == "fp8")
    assert plan(kv_dtype, rope="partial").rope_select is (kv_dtype == "fp8")
    assert plan(kv_dtype, rope="none").rope_select is False
    assert plan(kv_dtype, seqs=3, rope="full").rope_select is False
    assert plan(kv_dtype, rows=SPLIT_BELOW, rope="full").rope_select is False
    fp8_ready = plan(kv_dtype, pdl=True, ready=True)  # the promise's launch: split for fp8 only
    assert fp8_ready.rope_select is (kv_dtype == "fp8")


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_masked_stores_for_early_launches_except_rope_select(kv_dtype):
    """Split (early) launches predicate their stores on the row's validity instead of branching on it (masked),
    except quantized slot-mapping launches with RoPE that rotate in both programs (rope_select: measured
    slower); per-row prefill launches branch; the four-warp rows and the promise's per-row launches are early
    and masked."""
    assert plan(kv_dtype, rope="none").masked is True
    assert plan(kv_dtype, seqs=3, rope="full").masked is True
    assert plan("fp8", rope="full").masked is False  # rope_select
    assert plan(kv_dtype, rows=SPLIT_BELOW).masked is False
    rows4 = plan(kv_dtype, rope="full")
    if kv_dtype in ("int8", "int4"):
        assert (rows4.split, rows4.early, rows4.masked) == (False, True, True)
    ready = plan(kv_dtype, seqs=3, pdl=True, ready=True)
    assert ready.early is True and ready.masked is True


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_quantized_slot_mapping_decode_with_rope_takes_four_warp_rows(kv_dtype):
    """Decode-sized int8 / int4 appends by slot mapping with RoPE take one program per row of H * D / 256 warps
    (4 at 8 x 128 heads), stores predicated (measured faster than split programs); ragged ones, fp16 / fp8,
    those without RoPE split; prefill-sized ones take the per-row default."""
    rows4 = kv_dtype in ("int8", "int4")
    c = plan(kv_dtype, rope="full")
    assert c.split is (not rows4)
    if rows4:
        assert c.early is True and c.masked is True and c.rope_select is False
        big_heads = plan(kv_dtype, rope="full", heads=(8, 128))
        assert big_heads.split is False and big_heads.num_warps == 4
    assert plan(kv_dtype, rope="none").split is True
    assert plan(kv_dtype, seqs=1, rope="full").split is True
    big = plan(kv_dtype, rows=SPLIT_BELOW, rope="full")
    assert big.split is False and big.early is False


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_metadata_ready_selects_index_first_for_decode_with_pdl(kv_dtype):
    """``metadata_ready`` changes only decode-sized launches with PDL: the lookup goes before the wait
    (index_first), with RoPE's cos / sin too except for fp8 (cs_first), one program per row (of the per-row
    launch's warps) except fp8 (split), stores early and predicated; without PDL and for prefill-sized appends
    nothing changes. (Batches whose first guess misses, so that the default without the promise waits first.)"""
    fp8 = kv_dtype == "fp8"
    for seqs in (None, 1):
        # without the promise: slot mappings speculate (test_speculation_is_the_default_...), one-sequence
        # batches of 3 rows wait first; partial RoPE never speculates
        base = plan(kv_dtype, seqs=seqs, rope="partial" if seqs is None else "full", pdl=True)
        rows4 = seqs is None and kv_dtype in ("int8", "int4")
        assert (base.index_first, base.cs_first, base.speculate, base.split) == (False, False, False, not rows4)
        ready = plan(kv_dtype, seqs=seqs, rope="full", pdl=True, ready=True)
        assert ready.index_first is True and ready.early is True and ready.speculate is False
        assert ready.cs_first is (not fp8) and ready.split is fp8
        per_row = plan(kv_dtype, rows=SPLIT_BELOW, seqs=seqs, rope="full", heads=(8, 128))
        big = plan(kv_dtype, seqs=seqs, rope="full", pdl=True, ready=True, heads=(8, 128))
        assert big.num_warps == (1 if fp8 else per_row.num_warps) == (1 if fp8 else 4 if kv_dtype == "auto" else 2)
        no_rope = plan(kv_dtype, seqs=seqs, rope="none", pdl=True, ready=True)
        assert no_rope.index_first is True and no_rope.cs_first is False
        partial = plan(kv_dtype, seqs=seqs, rope="partial", pdl=True, ready=True)
        assert partial.index_first is True and partial.cs_first is False
        for other in (dict(pdl=False), dict(pdl=True, rows=SPLIT_BELOW)):
            c = plan(kv_dtype, seqs=seqs, rope="full", ready=True, **other)  # type: ignore[arg-type]
            assert c.index_first is False and c.cs_first is False, other
            assert c.split is (other["pdl"] is False and not rows4), other


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_speculation_is_the_default_for_decode_with_pdl_and_no_promise(kv_dtype):
    """Decode-sized launches with PDL and without metadata_ready speculate where the first guess is exact: by
    slot mapping and for ragged batches of one row per sequence (speculate, with the promise's launch shape:
    index_first, split only for fp8), without RoPE too; a mixed ragged batch waits first. inv_freq is read
    after the wait, with cos / sin (freqs_late, no cs_first), unless no running kernel writes it (rope_ready:
    then cos / sin before the wait except fp8, as with the promise). Not with the promise, not without PDL,
    not for prefill-sized appends, not with partial or interleaved RoPE."""
    fp8 = kv_dtype == "fp8"
    for seqs in (None, 3):  # a slot mapping, or 3 sequences of one row each
        for rope in ("full", "none"):
            spec = plan(kv_dtype, seqs=seqs, rope=rope, pdl=True)
            assert spec.speculate is True and spec.index_first is True and spec.early is True
            assert spec.split is fp8 and spec.cs_first is False and spec.freqs_late is (rope == "full")
            known = plan(kv_dtype, seqs=seqs, rope=rope, pdl=True, rope_ready=True)
            assert known.speculate is True and known.freqs_late is False
            ready = plan(kv_dtype, seqs=seqs, rope=rope, pdl=True, ready=True)
            assert ready.speculate is False and ready.index_first is True and ready.freqs_late is False
            assert ready.cs_first is (rope == "full" and not fp8)
            assert ready == dataclasses.replace(known, speculate=False)  # the same launch but for the check
            assert plan(kv_dtype, seqs=seqs, rope=rope).speculate is False  # no PDL
            for prefill_seqs in (None, SPLIT_BELOW):
                c = plan(kv_dtype, rows=SPLIT_BELOW, seqs=prefill_seqs, rope=rope, pdl=True)
                assert c.speculate is False and c.index_first is False
        partial = plan(kv_dtype, seqs=seqs, rope="partial", pdl=True)
        assert partial.speculate is False and partial.index_first is False
    mixed = plan(kv_dtype, seqs=1, rope="full", pdl=True)  # 3 rows of one sequence: the guess misses
    assert mixed.speculate is False and mixed.index_first is False
    assert plan(kv_dtype, rows=5, seqs=3, rope="full", pdl=True).speculate is False


def test_plan_append_example():
    assert plan_append(n_rows=256, n_seqs=256, num_kv_heads=8, head_dim=128, kv_dtype="int8", rope="full",
                       pdl=True, ptx=True).speculate is True


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_check_launch_rejects_what_the_kernel_cannot_run(kv_dtype):
    """Variants built with ``dataclasses.replace`` that the kernel cannot run correctly: speculation with
    partial / interleaved RoPE or without the lookup first, cos / sin before the wait with frequencies read
    after it, head groups that are not a power of two within the heads, warps that are not a power of two up
    to 32, PDL where unsupported: ValueError naming the field. A non-launch: TypeError."""
    spec = plan(kv_dtype, rope="full", pdl=True)
    assert spec.speculate and spec.freqs_late
    check_launch(spec, num_kv_heads=2, rope="full", pdl_supported=True)
    bad = [
        ("speculate", spec, dict(rope="partial")),
        ("speculate", dataclasses.replace(spec, index_first=False), {}),
        ("cs_first", dataclasses.replace(spec, cs_first=True), {}),
        ("pdl", spec, dict(pdl_supported=False)),
    ]
    split = plan(kv_dtype, seqs=1, rope="none")
    for hg in (0, 3, 4, 2.0, True):
        bad.append(("head_groups", dataclasses.replace(split, head_groups=hg), dict(rope="none")))
    for warps in (0, 3, 64, 2.0):
        bad.append(("num_warps", dataclasses.replace(split, num_warps=warps), dict(rope="none")))
    for name, launch, kw in bad:
        args = {**dict(num_kv_heads=2, rope="full", pdl_supported=True), **kw}
        with pytest.raises(ValueError, match=pr.names(name)):
            check_launch(launch, **args)  # type: ignore[arg-type]
    for hg in (1, 2):
        check_launch(dataclasses.replace(split, head_groups=hg), num_kv_heads=2, rope="none", pdl_supported=False)
    check_launch(dataclasses.replace(split, head_groups=4), num_kv_heads=3, rope="none", pdl_supported=False)
    check_launch(dataclasses.replace(spec, speculate=False, freqs_late=False, cs_first=True), num_kv_heads=2,
                 rope="full", pdl_supported=True)
    with pytest.raises(TypeError, match=pr.names("launch")):
        check_launch(dataclasses.asdict(split), num_kv_heads=2, rope="none", pdl_supported=False)  # type: ignore[arg-type]


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_the_launcher_checks_a_launch_before_anything_runs(kv_dtype):
    """An impossible launch given to the launcher is a ValueError before anything is written, on the torch
    backend too (which runs the reference and no kernel)."""
    cache = pr.sentinel_cache("cpu", num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8, kv_dtype=kv_dtype)
    before = pr.bits(cache.buffer).clone()
    k = torch.zeros(3, 2, 16, dtype=torch.float16)
    whole = RopeConfig(head_dim=16).kernel_params()
    spec = plan(kv_dtype, seqs=None, rope="full", pdl=True)
    for name, launch, rope in (
        ("speculate", dataclasses.replace(spec, pdl=False, index_first=False), None),
        ("speculate", dataclasses.replace(spec, pdl=False), RopeConfig(head_dim=16, rotary_dim=8).kernel_params()),
        ("cs_first", dataclasses.replace(spec, pdl=False, cs_first=True), whole),  # inv_freq after the wait
        ("pdl", spec, whole),
    ):
        with pytest.raises(ValueError, match=pr.names(name)):
            plan_ = cache.plan(slot_mapping=torch.arange(3), positions=torch.arange(3),
                               rope=rope if rope is not None else False)
            storage = PagedLayer(cache.pool(0), cache.params(0), cache.kv_scales[0], kv_dtype, "NHD")
            append_paged_kv_launch(k, k, storage, plan_, launch)
    assert torch.equal(pr.bits(cache.buffer), before)


def test_default_append_launch_is_the_policy_on_the_pools_device():
    """The launcher's default: plan_append with what the pool's device offers (the CPU: no PDL, no PTX), the
    plan's RoPE kind, sequences and promises."""
    cache = pr.sentinel_cache("cpu", num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8, kv_dtype="int8")
    k = torch.zeros(5, 2, 16, dtype=torch.float16)
    assert not pdl_supported(torch.device("cpu")) and not ptx(torch.device("cpu"))
    for rope, kind in ((None, "none"), (RopeConfig(head_dim=16), "full"),
                       (RopeConfig(head_dim=16, interleaved=True), "partial"),
                       (RopeConfig(head_dim=16, rotary_dim=8), "partial")):
        params = rope.kernel_params() if rope is not None else None
        assert rope_kind(params, 16) == kind
        storage = PagedLayer(cache.pool(0), cache.params(0), None, "int8", "NHD")
        for seqs, ready in ((None, False), (5, True), (2, False)):
            if seqs is None:
                index = dict(slot_mapping=torch.arange(5), positions=torch.arange(5))
            else:
                index = dict(block_tables=torch.zeros(seqs, 2, dtype=torch.int32),
                             cu_q_lens=torch.tensor([0] * seqs + [5], dtype=torch.int32),
                             kv_lens=torch.zeros(seqs, dtype=torch.int32))
            step = cache.plan(rope=params if params is not None else False, metadata_ready=ready, **index)
            got = default_append_launch(k.shape[0], storage, step)
            assert got == plan_append(n_rows=5, n_seqs=seqs, num_kv_heads=2, head_dim=16, kv_dtype="int8", rope=kind,
                                      pdl=False, ptx=False, metadata_ready=ready)
            ready_rope = dataclasses.replace(step, rope_ready=True)
            assert default_append_launch(5, storage, ready_rope) == plan_append(
                n_rows=5, n_seqs=seqs, num_kv_heads=2, head_dim=16, kv_dtype="int8", rope=kind, pdl=False, ptx=False,
                metadata_ready=ready, rope_ready=True)


def test_ptx_means_an_nvidia_build():
    """Inline PTX only where kernels compile from PTX: CUDA devices of an NVIDIA build, not ROCm's "cuda"."""
    assert ptx(torch.device("cpu")) is False
    with unittest.mock.patch.object(torch.version, "hip", None):
        assert ptx(torch.device("cuda")) is True
    with unittest.mock.patch.object(torch.version, "hip", "6.2"):
        assert ptx(torch.device("cuda")) is False


def test_plan_gather_one_token_per_program_and_wide_offsets_past_2_pow_31():
    """The gather's launch: one token per program, H * D / 512 warps (1 to 8), 64-bit output offsets exactly
    where an output spans 2**31 elements or more (its largest offset + 1: strides as they are, padded or
    permuted)."""
    out = torch.empty(2, 8, 64, 128, dtype=torch.float16, device="meta")
    assert plan_gather(out, out, num_kv_heads=8, head_dim=128) == GatherLaunch(tok=1, num_warps=2, wide=False)
    assert plan_gather(out, out, num_kv_heads=1, head_dim=64).num_warps == 1
    assert plan_gather(out, out, num_kv_heads=64, head_dim=128).num_warps == 8
    assert GATHER_WIDE_FROM == 2**31
    B, H, S, D = 1, 2, 4, 128
    for head_stride, wide in ((2**31 - 1 - S * D, False), (2**31 - S * D, True)):  # spans 2**31 - 1, 2**31
        big = torch.empty(0, dtype=torch.float16, device="meta").as_strided((B, H, S, D), (H * head_stride, head_stride,
                                                                                         D, 1))
        span = (H - 1) * head_stride + (S - 1) * D + (D - 1) + 1
        assert (span >= 2**31) is wide
        assert plan_gather(big, out, num_kv_heads=H, head_dim=D).wide is wide  # either output decides
        assert plan_gather(out, big, num_kv_heads=H, head_dim=D).wide is wide
