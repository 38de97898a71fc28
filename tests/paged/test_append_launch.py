"""The append kernel's launch variants against the independent reference: one program per row, or one for each
row's K and one for its V (split), the sequence lookup's first guess (rows spread evenly over the sequences)
and its fallback search, the prepared launches of the cache, the lookup before the wait for the previous kernel
(``metadata_ready``), and programmatic dependent launch.

A variant is the policy's launch (:func:`kvcache.ops.paged.plan_append`) changed with ``dataclasses.replace``
and passed to the launcher as ``launch=`` (tests/paged/launches.py). Every format and RoPE on K, bit-exact
where the format is (the reference's float32 formula), within the derived bounds with RoPE. Both CPU backends;
compiled on a GPU. Which launch a kind of append gets: test_append_policy.py; speculation:
test_append_speculation.py; the compiled code: test_append_sass.py.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
import triton

from kvcache._backend import pdl_enabled, use_triton
from kvcache.ops.paged import PagedLayer, append_paged_kv, append_paged_kv_launch
from kvcache.ops.paged.kernels.lookup import _GUESS_ONE, _GUESS_SHIFT, _guess_mul
from kvcache.ops.paged.kernels.numerics import _SINCOS_MAX
from kvcache.ops.paged.launch import pdl_supported, ptx
from kvcache.rope import RopeConfig
from sweeps import each_value, named, pairwise

from . import launches as la
from . import paged_reference as pr

FORMATS = ["auto", "fp8", "int8", "int4", "k8v4", "fp8k"]

# (q_lens, kv_lens, padding rows): the guess hits (decode, equal prefills), misses (mixed), padding past cu_q
BATCHES = [
    pytest.param(([1] * 7, [3, 0, 9, 4, 1, 12, 6], 0), id="decode"),
    pytest.param(([6, 6, 6], [0, 5, 2], 0), id="equal-prefills"),
    pytest.param(([5, 0, 1, 7, 2], [0, 3, 9, 2, 14], 0), id="mixed"),
    pytest.param(([3, 1, 4], [2, 0, 7], 3), id="padding-rows"),
]


def pdl_on(device: torch.device) -> bool:
    """Appends on ``device`` launch with programmatic dependent launch (Hopper or later, KVCACHE_PDL not 0)."""
    return pdl_enabled() and pdl_supported(device)


def needs_kernel(device: torch.device) -> None:
    if not use_triton(device):
        pytest.skip("the torch backend launches no kernel")


@pytest.fixture(params=list(la.SHAPES))
def shape(request: pytest.FixtureRequest) -> str:
    """One program per row (K and V), two (K, V), or four (K, V x two groups of heads): see
    tests/paged/launches.py."""
    return request.param


@pytest.mark.parametrize(("shape", "batch", "kv_dtype", "use_rope"),
                         each_value(la.SHAPES, BATCHES, FORMATS, named([False, True], ["no-rope", "rope"])))
def test_ragged_launch_variants(device, shape, batch, kv_dtype, use_rope):
    q_lens, kv_lens, pad = batch
    gen = pr.generator(7 * len(q_lens) + pad + la.SHAPES.index(shape))
    c = _ragged_case(device, gen, batch, kv_dtype, RopeConfig(head_dim=16, base=10000.0) if use_rope else None)
    assert len(c.targets) == c.cu[-1]  # every token has a slot, padding rows none
    la.append_with(c.cache, 0, c.k, c.v, shape, block_tables=pr.i32(c.tables, device), cu_q_lens=pr.i32(c.cu, device),
                   kv_lens=pr.i32(kv_lens, device), rope=c.rope)
    pr.assert_append_matches(c.cache.pool(0), c.cache.params(0), c.exp, kv_dtype=kv_dtype, layout="NHD", rope=c.rope)


class _RaggedCase(NamedTuple):
    cache: object
    k: torch.Tensor
    v: torch.Tensor
    tables: list
    cu: list
    targets: list
    exp: object
    rope: RopeConfig | None


def _ragged_case(device, gen, batch, kv_dtype: str, rope: RopeConfig | None) -> _RaggedCase:  # type: ignore[no-untyped-def]
    """A sentinel cache of 2 heads x 16 (block 4, 32 blocks) and a ragged batch ``(q_lens, kv_lens, padding
    rows)`` of random fp16 rows, with its targets and the reference's expected pools for ``rope``."""
    q_lens, kv_lens, pad = batch
    H, D, bs, nb = 2, 16, 4, 32
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    cu = pr.cumsum0(q_lens)
    totals = [a + b for a, b in zip(kv_lens, q_lens)]
    tables = pr.block_tables_for(gen, totals, block_size=bs, num_blocks=nb, extra=1)
    n = cu[-1] + pad
    k = pr.randn((n, H, D), torch.float16, gen, device)
    v = pr.randn((n, H, D), torch.float16, gen, device)
    targets = pr.ragged_targets(n, tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=nb)
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="NHD",
                             rope=rope)
    return _RaggedCase(cache, k, v, tables, cu, targets, exp, rope)


@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
def test_cu_k_lens_launch_variants(device, shape, kv_dtype):
    """The same rows through cu_k_lens (the guess reads cumulative lengths) in the HND layout."""
    q_lens, kv_lens = [2, 1, 1, 5], [4, 0, 7, 1]
    H, D, bs, nb = 3, 8, 2, 40
    gen = pr.generator(31 + la.SHAPES.index(shape))
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype,
                              layout="HND")
    cu = pr.cumsum0(q_lens)
    totals = [a + b for a, b in zip(kv_lens, q_lens)]
    tables = pr.block_tables_for(gen, totals, block_size=bs, num_blocks=nb, extra=0)
    k = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    v = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    targets = pr.ragged_targets(cu[-1], tables, cu, cu_k_lens=pr.cumsum0(totals), block_size=bs, num_blocks=nb)
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="HND")
    la.append_with(cache, 0, k, v, shape, block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                   cu_k_lens=pr.i32(pr.cumsum0(totals), device))
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="HND")


@pytest.mark.parametrize(("shape", "kv_dtype"), each_value(la.SHAPES, FORMATS))
def test_slot_mapping_launch_variants(device, shape, kv_dtype):
    H, D, bs, nb = 2, 16, 4, 8
    gen = pr.generator(53 + la.SHAPES.index(shape))
    _check_slot_append(device, gen, kv_dtype, RopeConfig(head_dim=D), H=H, D=D, bs=bs, nb=nb, n=11, padding=(0, 7),
                       max_position=5000, shape=shape)


def _check_slot_append(device, gen, kv_dtype: str, rope: RopeConfig, *, H: int, D: int, bs: int, nb: int, n: int,  # type: ignore[no-untyped-def]
                       padding: tuple[int, ...], max_position: int, shape: str) -> None:
    """n random rows appended by slot mapping (rows ``padding`` get -1) at positions below ``max_position``,
    with RoPE, into a sentinel cache with the launch ``shape``, against the reference."""
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    k = pr.randn((n, H, D), torch.float16, gen, device)
    v = pr.randn((n, H, D), torch.float16, gen, device)
    slots = torch.randperm(nb * bs, generator=gen)[:n].tolist()
    for row in padding:
        slots[row] = -1
    positions = torch.randint(0, max_position, (n,), generator=gen).tolist()
    targets = pr.slot_targets(slots, block_size=bs, num_blocks=nb, positions=positions)
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="NHD",
                             rope=rope)
    la.append_with(cache, 0, k, v, shape, slot_mapping=torch.tensor(slots, device=device),
                   positions=torch.tensor(positions, device=device), rope=rope)
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope)


def _append_slots_and_compare(cache, k, v, slots: list[int], positions: list[int], kv_dtype: str,  # type: ignore[no-untyped-def]
                              rope: RopeConfig, rope_arg) -> None:
    """Append k / v at ``slots`` (``positions`` for RoPE; ``rope_arg``: what the append is given) into layer 0 of
    ``cache`` (PagedKVCache.append) and compare pools and params with the reference's expectation for ``rope``."""
    bs, nb = cache.config.block_size, cache.config.num_blocks
    targets = pr.slot_targets(slots, block_size=bs, num_blocks=nb, positions=positions)
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="NHD",
                             rope=rope)
    cache.append(0, k, v, cache.plan(slot_mapping=torch.tensor(slots, device=k.device),
                                     positions=torch.tensor(positions, device=k.device), rope=rope_arg))
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope)


# 1,100 sequences: 40-45 s a shape under the interpreter, so it runs compiled on a GPU (and with --run-slow)
@pytest.mark.slow
@pytest.mark.parametrize("shape", la.SHAPES)
def test_many_sequences_binary_search_fallback(device, shape):
    """More than 1024 sequences: the lookup's fallback is a binary search (the guess misses on ragged rows)."""
    B = 1100
    H, D, bs = 1, 4, 2
    gen = pr.generator(99)
    q_lens = [1 + (b % 3 == 0) for b in range(B)]  # uneven: the even-spread guess misses for most rows
    kv_lens = [b % 5 for b in range(B)]
    cu = pr.cumsum0(q_lens)
    totals = [a + b for a, b in zip(kv_lens, q_lens)]
    nb = sum(-(-t // bs) for t in totals) + 4
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb)
    tables = pr.block_tables_for(gen, totals, block_size=bs, num_blocks=nb, extra=0)
    k = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    v = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    targets = pr.ragged_targets(cu[-1], tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=nb)
    exp = pr.append_expected(cache.pool(0), None, k, v, targets, kv_dtype="auto", layout="NHD")
    la.append_with(cache, 0, k, v, shape, block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                   kv_lens=pr.i32(kv_lens, device))
    pr.assert_append_matches(cache.pool(0), None, exp, kv_dtype="auto", layout="NHD")


def test_pdl_needs_hopper(device):
    """A launch with pdl=True where programmatic dependent launch is unavailable raises before anything runs
    (on the torch backend too) and writes nothing."""
    if pdl_supported(device):
        pytest.skip("this GPU supports PDL (exercised in test_cuda_graph.py)")
    H, D, bs = 2, 8, 4
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs)
    before = cache.buffer.clone()
    k = torch.ones(1, H, D, dtype=torch.float16, device=device)
    plan = la.device_plan(k, kv_dtype="auto", n_seqs=None, rope=None)
    assert plan.pdl is False
    with pytest.raises(ValueError, match=pr.names("pdl")):
        la.append_with(cache, 0, k, k, dataclasses.replace(plan, pdl=True),
                       slot_mapping=torch.zeros(1, dtype=torch.int64, device=device))
    pr.assert_bits_equal(cache.buffer, before, "pool")


@pytest.mark.parametrize(("shape", "kv_dtype"), each_value(la.SHAPES, FORMATS))
def test_odd_strides_take_scalar_loads(device, shape, kv_dtype):
    """k / v rows whose strides are odd element counts (vector width 1) and rows at an odd element offset
    (unaligned pointer) are read correctly."""
    H, D, bs, nb, n = 2, 16, 4, 8, 5
    gen = pr.generator(77)
    big_k = pr.randn((n, H, D + 1), torch.float16, gen, device)
    big_v = pr.randn((n * H * D + 1,), torch.float16, gen, device)
    k = big_k[:, :, :D]  # strides (H * (D + 1), D + 1, 1)
    v = big_v[1:].view(n, H, D)  # contiguous, one element past an aligned start
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    slots = [3, 30, -1, 12, 7]
    targets = pr.slot_targets(slots, block_size=bs, num_blocks=nb)
    exp = pr.append_expected(cache.pool(0), cache.params(0), k.contiguous(), v.contiguous(), targets,
                             kv_dtype=kv_dtype, layout="NHD")
    la.append_with(cache, 0, k, v, shape, slot_mapping=torch.tensor(slots, device=device))
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD")


@pytest.mark.parametrize(("kv_dtype", "mode", "ready"), each_value(
    ["auto", "fp8", "int4"], ["ragged", "slots"], named([False, True], ["no-promise", "metadata-ready"])))
def test_repeated_appends_reuse_prepared_launches(device, kv_dtype, mode, ready):
    """Decode steps over several layers through PagedKVCache.append with one plan per step: after the plan's first
    append of a kind of layer, the others launch its prepared launch (CUDA) with raw pointers. Every step, every
    layer against the reference, with K a view into a fused QKV tensor (strides unlike V's), block tables sliced
    from wider ones, padding rows, per-layer fp8 scales; the batch shrinks midway, one step reads V from an
    unaligned view (the generic launch). With and without ``metadata_ready`` (with PDL: the promise's launch,
    speculation or a launch that waits first)."""
    H, D, bs, nb, L = 2, 16, 4, 64, 3
    rope = RopeConfig(head_dim=D, base=10000.0)
    cache = pr.sentinel_cache(device, num_layers=L, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                              kv_dtype=kv_dtype, rope=rope)
    scales = [(0.5 + 0.25 * layer, 1.5 - 0.25 * layer) for layer in range(L)]
    for layer in range(L):
        cache.kv_scales[layer] = torch.tensor(scales[layer], device=device)
    gen = pr.generator(404)
    lens = [3, 9, 1]
    tables = pr.block_tables_for(gen, [x + 6 for x in lens], block_size=bs, num_blocks=nb, extra=0)
    width = len(tables[0])
    for step in range(5):
        B = 3 if step < 3 else 2  # a smaller batch from step 3 on
        cu = list(range(B + 1))
        kv = lens[:B]
        n = B + 2  # two padding rows past cu_q_lens[-1]
        wide = torch.full((B, width + 3), -1, dtype=torch.int32)
        wide[:, :width] = torch.tensor(tables[:B], dtype=torch.int32)
        bt = wide.to(device)[:, :width]  # rows width + 3 apart
        targets = pr.ragged_targets(n, tables[:B], cu, kv_lens=kv, block_size=bs, num_blocks=nb)
        assert len(targets) == B
        if mode == "ragged":
            plan = cache.plan(bt, pr.i32(cu, device), pr.i32(kv, device), metadata_ready=ready)
        else:
            slots = [t.block * bs + t.offset for t in targets] + [-1, -1]
            positions = [t.position for t in targets] + [0, 0]
            plan = cache.plan(slot_mapping=torch.tensor(slots, device=device),
                              positions=torch.tensor(positions, dtype=torch.int32, device=device),
                              metadata_ready=ready)
        for layer in range(L):  # one plan per step, read by every layer
            qkv = pr.randn((n, 3 * H, D), torch.float16, gen, device)
            k = qkv[:, H:2 * H]
            v = pr.randn((n, H, D), torch.float16, gen, device)
            if step == 2 and layer == 1:
                spare = pr.randn((n * H * D + 1,), torch.float16, gen, device)
                v = spare[1:].view(n, H, D)  # 2 bytes past an aligned start
            exp = pr.append_expected(cache.pool(layer), cache.params(layer), k, v, targets, kv_dtype=kv_dtype,
                                     layout="NHD", rope=rope, fp8_scales=scales[layer])
            cache.append(layer, k, v, plan)
            pr.assert_append_matches(cache.pool(layer), cache.params(layer), exp, kv_dtype=kv_dtype, layout="NHD",
                                     rope=rope, fp8_scales=scales[layer], what=f"step {step} layer {layer}")
        lens = [x + 1 for x in lens]
    if device.type == "cuda":  # 2 of 3 layers per step, but for the unaligned V
        assert cache.prepared_launches >= 9, "the prepared launch path was not taken"


ROPES = {
    "default": dict(),
    "interleaved": dict(interleaved=True),
    "partial": dict(rotary_dim=8, base=500000.0),
    "partial-interleaved": dict(rotary_dim=6, interleaved=True),
}


@pytest.mark.parametrize(("shape", "rope_name", "dtype", "kv_dtype"), pairwise(
    la.SHAPES, list(ROPES), named([torch.float16, torch.bfloat16, torch.float32], ["fp16", "bf16", "fp32"]),
    ["auto", "int8"]))
def test_rope_pairings_and_dtypes(device, shape, rope_name, dtype, kv_dtype):
    """Every RoPE pairing (rotate-half, interleaved, partial) and model dtype, in the HND layout: V stays
    bit-exact where it passes through float32 (split programs)."""
    H, D, bs, nb = 3, 16, 4, 16
    rope = RopeConfig(head_dim=D, **ROPES[rope_name])
    gen = pr.generator(600 + len(rope_name))
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, dtype=dtype,
                              kv_dtype=kv_dtype, layout="HND")
    k, v, tables, cu, kv_lens = pr.long_position_batch(device, gen, H, D, bs, dtype, q_lens=(4, 1, 2),
                                                       kv_lens=(0, 2100, 5), num_blocks=nb)
    targets = pr.ragged_targets(cu[-1], tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=nb)
    assert len(targets) == cu[-1]
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="HND",
                             rope=rope)
    la.append_with(cache, 0, k, v, shape, block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                   kv_lens=pr.i32(kv_lens, device), rope=rope)
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="HND", rope=rope)


@pytest.mark.parametrize(("shape", "rope_name", "kv_dtype"), pairwise(la.SHAPES, list(ROPES), ["auto", "fp8", "int4"]))
def test_rope_pairings_by_slot_mapping(device, shape, rope_name, kv_dtype):
    """Every RoPE pairing by slot mapping, positions up to 9000 and padding rows; split launches of quantized
    formats rotate in K and V programs and keep V's row (rope_select), fp16 ones branch."""
    H, D = 3, 16
    gen = pr.generator(640 + 4 * list(ROPES).index(rope_name) + la.SHAPES.index(shape))
    _check_slot_append(device, gen, kv_dtype, RopeConfig(head_dim=D, **ROPES[rope_name]), H=H, D=D, bs=4, nb=16,
                       n=9, padding=(2,), max_position=9000, shape=shape)


class _Launcher36:
    """triton 3.6's CudaLauncher as far as a launch goes: ``__call__`` allocates no scratch (sizes 0) and
    forwards to its C module's ``launch`` with the cooperative-grid and PDL flags and two scratch pointers."""

    def __init__(self, log: list, pdl: bool) -> None:
        self.log = log
        self.launch_cooperative_grid, self.launch_pdl = False, pdl
        self.global_scratch_size = self.profile_scratch_size = 0
        self.global_scratch_align = self.profile_scratch_align = 1

    def launch(self, *args):  # type: ignore[no-untyped-def]
        self.log.append(args)

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):  # type: ignore[no-untyped-def]
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None,
                    *args)


@pytest.mark.parametrize("pdl", [False, True])
def test_c_entry_point_gets_what_the_launcher_object_forwards(monkeypatch, pdl):
    """A prepared launch on triton 3.6 calls the launcher's C entry point directly, with exactly the arguments
    the launcher object would forward to it; other versions, and kernels that need scratch memory, call the
    object. (A test of kvcache._backend's launch mechanism: triton's version is what is patched.)"""
    from kvcache import _backend

    log: list = []
    launcher = _Launcher36(log, pdl)
    monkeypatch.setattr(_backend.triton, "__version__", "3.6.0")
    consts = (8, True, "C")
    direct = _backend._prepare(launcher, "function", "packed", consts)
    assert direct.direct and direct.run == launcher.launch
    direct.run(7, 1, 1, 1234, *direct.head, 11, 22, *direct.consts)
    via_object = launcher(7, 1, 1, 1234, "function", "packed", None, None, None, 11, 22, *consts)  # noqa: F841
    assert len(log) == 2 and log[0] == log[1]
    launcher.global_scratch_size = 64  # a kernel that needs scratch: the object allocates it
    assert not _backend._prepare(launcher, "function", "packed", consts).direct
    launcher.global_scratch_size = 0
    monkeypatch.setattr(_backend.triton, "__version__", "3.8.0")
    plain = _backend._prepare(launcher, "function", "packed", consts)
    assert not plain.direct and plain.run is launcher
    plain.run(7, 1, 1, 1234, *plain.head, 11, 22, *plain.consts)
    assert log[2] == log[0]


@pytest.mark.parametrize(("kv_dtype", "base", "known_max"), pairwise(
    ["auto", "fp8", "int8", "int4"], named([10000.0, 0.5], ["base1e4", "base0.5"]),
    named([True, False], ["max-known", "max-unknown"])))
def test_rope_positions_on_both_sides_of_the_fast_trig_range(device, kv_dtype, base, known_max):
    """The append computes cos / sin with the short polynomial while a row's largest angle (position x
    ``RopeKernelParams.max_inv_freq``: above 1 when base < 1) is at most 1e5 radians, with the full-range
    functions past it, and everywhere when the params do not carry the maximum: rows on both sides of the
    switch, in one launch, against the reference."""
    H, D, bs, nb = 2, 32, 4, 64
    rope = RopeConfig(head_dim=D, base=base)
    params = rope.kernel_params(device=device)
    fmax = float(params.inv_freq.max())
    assert params.max_inv_freq == fmax
    if not known_max:
        params = params._replace(max_inv_freq=0.0)
    limit = _SINCOS_MAX.value / fmax
    positions = [0, 1, int(limit) - 1, int(limit), int(limit) + 1, int(limit) + 2, int(3 * limit), 2**24 - 1, -1,
                 -int(limit), -int(limit) - 2, -int(3 * limit)]
    n = len(positions)
    slots = list(range(0, 3 * n, 3))
    gen = pr.generator(901)
    k = pr.randn((n, H, D), torch.float16, gen, device) * 4
    v = pr.randn((n, H, D), torch.float16, gen, device)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    _append_slots_and_compare(cache, k, v, slots, positions, kv_dtype, rope, params)


@pytest.mark.parametrize("head_groups", [0, 3, 4])
def test_head_groups_must_be_a_power_of_two_within_the_heads(device, head_groups):
    """A split launch's head_groups: a power of two no larger than next_pow2(H) (H = 2 here), else a
    ValueError before anything runs (on the torch backend too)."""
    cache = pr.sentinel_cache(device, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8, kv_dtype="int8")
    before = pr.bits(cache.pool(0)).clone()
    k = torch.randn(3, 2, 16).half().to(device)
    plan = la.device_plan(k, kv_dtype="int8", n_seqs=1, rope=None)
    bad = dataclasses.replace(plan, split=True, head_groups=head_groups)
    with pytest.raises(ValueError, match=pr.names("head_groups")):
        la.append_with(cache, 0, k, k, bad, block_tables=pr.i32([[1, 2]], device), cu_q_lens=pr.i32([0, 3], device),
                       kv_lens=pr.i32([0], device))
    assert torch.equal(pr.bits(cache.pool(0)), before)


def test_grown_dynamic_base_keeps_a_known_bound():
    """A dynamic-NTK base grown past max_position_embeddings is computed on the positions' device and not
    read back; 1.0 still bounds its frequencies when base >= 1."""
    rope = RopeConfig(head_dim=16, rope_type="dynamic", factor=4.0, max_position_embeddings=64)
    params = rope.kernel_params(seq_len=1000)
    assert params.max_inv_freq == 1.0 >= float(params.inv_freq.max())


@pytest.mark.parametrize("bad", ["1.0", float("nan"), -1.0, True])
def test_bad_max_inv_freq_is_rejected(device, bad):
    cache = pr.sentinel_cache(device, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8)
    before = pr.bits(cache.pool(0)).clone()
    k = torch.randn(3, 2, 16).half().to(device)
    params = RopeConfig(head_dim=16).kernel_params(device=device)._replace(max_inv_freq=bad)
    with pytest.raises(ValueError, match="max_inv_freq"):
        cache.append(0, k, k, cache.plan(slot_mapping=torch.tensor([0, 1, 2], device=device),
                                         positions=torch.tensor([0, 1, 2], device=device), rope=params))
    assert torch.equal(pr.bits(cache.pool(0)), before)


def test_check_true_rejects_a_bound_below_the_frequencies(device):
    """max_inv_freq below max |inv_freq| would send out-of-range angles to the short polynomial: check=True
    (which syncs anyway) reports it and writes nothing."""
    cache = pr.sentinel_cache(device, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8)
    before = pr.bits(cache.pool(0)).clone()
    k = torch.randn(3, 2, 16).half().to(device)
    params = RopeConfig(head_dim=16).kernel_params(device=device)._replace(max_inv_freq=0.5)
    with pytest.raises(ValueError, match="max_inv_freq"):
        cache.append(0, k, k, cache.plan(slot_mapping=torch.tensor([0, 1, 2], device=device),
                                         positions=torch.tensor([0, 1, 2], device=device), rope=params, check=True))
    assert torch.equal(pr.bits(cache.pool(0)), before)


@pytest.mark.parametrize(("kv_dtype", "split_launch", "early"), pairwise(
    ["auto", "int8", "int4"], named([False, True], ["per-row", "split"]), named([False, True], ["late", "early"])))
def test_early_and_late_order_in_both_launch_shapes(device, kv_dtype, split_launch, early):
    """The early order (RoPE / quantization before the block-table load returns, stores predicated) and the
    late one write the same rows in both launch shapes, defaults or not (the policy pairs early with split
    launches only)."""
    needs_kernel(device)
    q_lens, kv_lens = [3, 1, 4], [2, 0, 7]
    H, D, bs, nb = 3, 16, 4, 32
    gen = pr.generator(950 + 2 * split_launch + early)
    rope = RopeConfig(head_dim=D, base=10000.0)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    cu = pr.cumsum0(q_lens)
    tables = pr.block_tables_for(gen, [a + b for a, b in zip(kv_lens, q_lens)], block_size=bs, num_blocks=nb,
                                 extra=1)
    k = pr.randn((cu[-1] + 1, H, D), torch.float16, gen, device)
    v = pr.randn((cu[-1] + 1, H, D), torch.float16, gen, device)
    targets = pr.ragged_targets(cu[-1] + 1, tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=nb)
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="NHD",
                             rope=rope)
    base = la.variant("split-kv" if split_launch else "per-row", k, kv_dtype=kv_dtype, n_seqs=len(q_lens),
                      rope=la.kernel_rope(rope, device))
    launch = dataclasses.replace(base, early=early, masked=early and not base.rope_select)
    la.append_with(cache, 0, k, v, launch, block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                   kv_lens=pr.i32(kv_lens, device), rope=rope)
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope)


@pytest.mark.parametrize(("kv_dtype", "masked"), each_value(
    ["auto", "fp8", "int8", "int4"], named([False, True], ["branch", "masked"])))
def test_masked_and_branching_stores_skip_the_same_rows(device, kv_dtype, masked):
    """Early launches store either predicated on the row's validity (masked) or behind a branch on it: rows
    past the block table, with block id -1 or past the pool, and padding rows write nothing either way."""
    needs_kernel(device)
    H, D, bs, nb = 2, 8, 4, 8
    gen = pr.generator(960 + masked)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    q_lens, kv_lens = [10, 6, 5], [0, 2, 0]
    cu = pr.cumsum0(q_lens)
    n = cu[-1] + 2
    k = pr.randn((n, H, D), torch.float16, gen, device)
    v = pr.randn((n, H, D), torch.float16, gen, device)
    tables = [[3, 5], [6, -1], [1, nb + 3]]
    targets = pr.ragged_targets(n, tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=nb)
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="NHD")
    launch = dataclasses.replace(la.variant("split-kv", k, kv_dtype=kv_dtype, n_seqs=3, rope=None), masked=masked)
    la.append_with(cache, 0, k, v, launch, block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                   kv_lens=pr.i32(kv_lens, device))
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD")


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_pair_store_falls_back_where_params_are_not_8_byte_aligned(device, kv_dtype):
    """A per-row launch asking for the inline-PTX (scale, zero) store takes it only where ``params`` is 8-byte
    aligned: a params pool 4 bytes off an 8-byte boundary is written by tl.store (which the interpreter runs,
    where inline PTX cannot run), the reference's bytes."""
    needs_kernel(device)
    H, D, bs, nb = 2, 16, 4, 8
    gen = pr.generator(965)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    flat = torch.empty(cache.params(0).numel() + 1, dtype=torch.float32, device=device)
    params = flat[1:].view(cache.params(0).shape)
    params.copy_(cache.params(0))
    assert params.data_ptr() % 8 == 4
    k = pr.randn((5, H, D), torch.float16, gen, device)
    v = pr.randn((5, H, D), torch.float16, gen, device)
    slots = [3, 30, -1, 12, 7]
    targets = pr.slot_targets(slots, block_size=bs, num_blocks=nb)
    exp = pr.append_expected(cache.pool(0), params, k, v, targets, kv_dtype=kv_dtype, layout="NHD")
    launch = dataclasses.replace(la.variant("per-row", k, kv_dtype=kv_dtype, n_seqs=None, rope=None), pair_asm=True)
    storage = PagedLayer(cache.pool(0), params, cache.kv_scales[0], kv_dtype, "NHD")
    append_paged_kv_launch(k, v, storage, cache.plan(slot_mapping=torch.tensor(slots, device=device)), launch)
    pr.assert_append_matches(cache.pool(0), params, exp, kv_dtype=kv_dtype, layout="NHD")


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("hints", [False, True], ids=["plain", "streaming"])
@pytest.mark.parametrize("heads", [(3, 16, "NHD", None), (8, 128, "NHD", None), (8, 128, "HND", 8),
                                   (5, 80, "NHD", 1), (5, 80, "HND", 4)],
                         ids=["3x16", "8x128", "8x128-hnd-w8", "5x80-w1", "5x80-hnd-w4"])
def test_pair_store_and_tl_store_write_the_same_bytes(device, kv_dtype, hints, heads):
    """On a GPU the (scale, zero) of each head go out by inline PTX in per-row launches: the same bytes as
    tl.store, with and without the streaming-store hint, in both layouts, for the benchmarked 8 x 128 heads
    (values held by several threads and warps: duplicate stores), and for head counts that leave masked heads
    in the tile (3 of 4, 5 of 8: they write nothing), at 1 to 8 warps; a params pool 4 bytes off an 8-byte
    boundary falls back to tl.store."""
    if not ptx(torch.device(device.type)):
        pytest.skip("inline PTX: NVIDIA GPUs only (test_append_sass.py checks the PTX on the CPU)")
    H, D, layout, warps = heads
    q_lens, kv_lens = [3, 1, 4], [2, 0, 7]
    bs, nb = 4, 32
    gen = pr.generator(970 + hints + 2 * H)
    rope = RopeConfig(head_dim=D, base=10000.0)
    cu = pr.cumsum0(q_lens)
    tables = pr.block_tables_for(gen, [a + b for a, b in zip(kv_lens, q_lens)], block_size=bs, num_blocks=nb,
                                 extra=1)
    k = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    v = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    targets = pr.ragged_targets(cu[-1], tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=nb)
    base = la.variant("per-row", k, kv_dtype=kv_dtype, n_seqs=len(q_lens), rope=la.kernel_rope(rope, device))

    def append(pair_asm: bool, shift: bool):  # type: ignore[no-untyped-def]
        launch = dataclasses.replace(base, pair_asm=pair_asm, hints=hints, num_warps=warps or base.num_warps)
        cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                                  kv_dtype=kv_dtype, layout=layout)
        params = cache.params(0)
        if shift:
            flat = torch.empty(params.numel() + 1, dtype=params.dtype, device=device)
            params = flat[1:].view(params.shape)
            params.copy_(cache.params(0))
            assert params.data_ptr() % 8 == 4
        exp = pr.append_expected(cache.pool(0), params, k, v, targets, kv_dtype=kv_dtype, layout=layout,
                                 rope=rope)
        plan = cache.plan(pr.i32(tables, device), pr.i32(cu, device), pr.i32(kv_lens, device),
                          rope=rope.kernel_params(device=device))
        storage = PagedLayer(cache.pool(0), params, cache.kv_scales[0], kv_dtype, layout)
        append_paged_kv_launch(k, v, storage, plan, launch)
        pr.assert_append_matches(cache.pool(0), params, exp, kv_dtype=kv_dtype, layout=layout, rope=rope)
        return cache.pool(0).clone(), params.clone()

    pool_asm, params_asm = append(True, False)
    pool_st, params_st = append(False, False)
    assert torch.equal(pool_asm.view(torch.uint8), pool_st.view(torch.uint8))
    assert torch.equal(params_asm.view(torch.int32), params_st.view(torch.int32))
    pool_sh, params_sh = append(True, True)
    assert torch.equal(params_sh.view(torch.int32), params_st.view(torch.int32))


def test_guess_mul_is_exact_for_decode_and_equal_prefills():
    """The sequence lookup's first guess, (n * guess_mul) >> 30, is n for a decode batch (a row per sequence)
    and n // L for prefills of L rows each; for any batch it is floor(n * n_seqs / n_rows) or one more, and
    guess_mul fits an int32 argument. (A unit test of the lookup's host-side helper.)"""
    shift = int(_GUESS_SHIFT)
    for n_seqs in (1, 2, 7, 256, 1000, 4096):
        m = _guess_mul(n_seqs, n_seqs)
        assert m == 1 << shift
        assert all((n * m) >> shift == n for n in range(n_seqs))
    for n_seqs, rows in ((8, 2048), (3, 6), (5, 1000), (64, 777), (1, 65536), (300, 3)):
        m = _guess_mul(n_seqs, n_seqs * rows)
        assert all((n * m) >> shift == n // rows for n in range(n_seqs * rows))
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        n_seqs, n_rows = (int(x) for x in torch.randint(1, 1 << 20, (2,), generator=gen))
        m = _guess_mul(n_seqs, n_rows)
        assert 0 <= m <= 1 << shift < 2**31
        for n in (0, n_rows // 3, n_rows - 1):
            exact = n * n_seqs // n_rows
            assert (n * m) >> shift in ((exact, exact + 1) if n_seqs <= n_rows else (n, n))
    assert _guess_mul(5, 0) == 0
    assert _GUESS_ONE == _guess_mul(7, 7)  # the launch's shortcut for decode batches


# ----------------------------------------------------------------------------------------- metadata_ready


def _check_ragged_and_slots(device, c: _RaggedCase, kv_lens: list, kv_dtype: str, params, use_rope: bool,  # type: ignore[no-untyped-def]
                            launch, **kw) -> None:
    """The ragged case ``c`` (``kv_lens`` cached tokens per sequence) appended with ``launch`` (a function of
    the number of sequences, None for a slot mapping), then the same rows by slot mapping into a fresh cache:
    the reference's bytes both times."""
    la.append_with(c.cache, 0, c.k, c.v, launch(len(kv_lens)), block_tables=pr.i32(c.tables, device),
                   cu_q_lens=pr.i32(c.cu, device), kv_lens=pr.i32(kv_lens, device), rope=params, **kw)
    pr.assert_append_matches(c.cache.pool(0), c.cache.params(0), c.exp, kv_dtype=kv_dtype, layout="NHD", rope=c.rope)
    # the same rows by slot mapping (their targets, -1 for padding rows), positions from the ragged batch
    _check_as_slot_mapping(device, c, kv_dtype, params, use_rope, launch(None), **kw)


def _check_as_slot_mapping(device, c: _RaggedCase, kv_dtype: str, params, use_rope: bool, launch, **kw) -> None:  # type: ignore[no-untyped-def]
    """The rows of the ragged case ``c`` appended again by slot mapping (their targets, -1 for padding rows;
    positions from the ragged batch) into a fresh sentinel cache with ``launch``: the reference's bytes."""
    H, D, bs, nb = 2, 16, 4, 32  # as _ragged_case
    cache2 = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    n = c.k.shape[0]
    slots = [-1] * n
    positions = [0] * n
    for t in c.targets:
        slots[t.row] = t.block * bs + t.offset
        positions[t.row] = t.position
    la.append_with(cache2, 0, c.k, c.v, launch, slot_mapping=torch.tensor(slots, device=device),
                   positions=torch.tensor(positions, device=device) if use_rope else None, rope=params, **kw)
    pr.assert_append_matches(cache2.pool(0), cache2.params(0), c.exp, kv_dtype=kv_dtype, layout="NHD", rope=c.rope)


def index_first_launch(k: torch.Tensor, *, kv_dtype: str, n_seqs: int | None, rope, split: bool,  # type: ignore[no-untyped-def]
                       cs_first: bool = True):
    """The launch of a decode-sized append whose caller promised ``metadata_ready`` on a device with PDL (the
    lookup, and with ``cs_first`` RoPE's cos / sin, before the wait), in the shape ``split``, launched without
    PDL where the device has none (the order alone is exercised there)."""
    plan = la.device_plan(k, kv_dtype=kv_dtype, n_seqs=n_seqs, rope=rope, n_rows=min(k.shape[0], 2047),
                          metadata_ready=True, pdl=True)
    assert plan.index_first and not plan.speculate
    if split:
        plan = la.as_split(plan, num_kv_heads=k.shape[1], head_dim=k.shape[2], kv_dtype=kv_dtype,
                           slots=n_seqs is None, rope=rope is not None)
    else:
        per_row_warps = k.shape[1] * k.shape[2] // (256 if kv_dtype == "auto" else 512)
        plan = dataclasses.replace(plan, split=False, rope_select=False, masked=True, hints=True,
                                   num_warps=max(1, min(8, per_row_warps)))
    return dataclasses.replace(plan, pdl=pdl_on(k.device), cs_first=cs_first and rope is not None)


@pytest.mark.parametrize(("batch", "split", "kv_dtype", "use_rope", "cs_first"), each_value(
    [BATCHES[0], BATCHES[2], BATCHES[3]], named([True, False], ["split", "per-row"]), FORMATS,
    named([False, True], ["no-rope", "rope"]), named([False, True], ["cs-after", "cs-first"])))
def test_index_first_launches_match_the_reference(device, batch, split, kv_dtype, use_rope, cs_first):
    """The lookup (and RoPE's cos / sin) before the wait for the previous kernel (``index_first``, what
    ``metadata_ready`` selects for decode-sized appends), in both launch shapes, with the decode / mixed /
    padded batches of the ragged tests and by slot mapping (with -1 rows): the reference's bytes (within the
    RoPE bounds). On a GPU with PDL the wait is real; elsewhere the order alone is exercised."""
    needs_kernel(device)
    q_lens, kv_lens, pad = batch
    gen = pr.generator(11 * len(q_lens) + pad)
    c = _ragged_case(device, gen, batch, kv_dtype, RopeConfig(head_dim=16, base=10000.0) if use_rope else None)
    params = c.rope.kernel_params(device=device) if use_rope else None

    def launch(n_seqs):  # type: ignore[no-untyped-def]
        return index_first_launch(c.k, kv_dtype=kv_dtype, n_seqs=n_seqs, rope=params, split=split, cs_first=cs_first)

    _check_ragged_and_slots(device, c, kv_lens, kv_dtype, params, use_rope, launch)


def test_metadata_ready_must_be_a_bool(device):
    cache = pr.sentinel_cache(device, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=4, kv_dtype="int8")
    k = torch.zeros(1, 2, 8, dtype=torch.float16, device=device)
    before = cache.pool(0).clone()
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="metadata_ready"):
            cache.append(0, k, k, cache.plan(slot_mapping=torch.tensor([0], device=device), metadata_ready=bad))
    with pytest.raises(TypeError, match=r"metadata_ready: expected a bool, got 1 \(int\)"):
        append_paged_kv(k, k, cache.pool(0), cache.params(0), kv_dtype="int8",
                        slot_mapping=torch.tensor([0], device=device), metadata_ready=1)
    assert torch.equal(cache.pool(0).view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize(("mode", "kv_dtype"), each_value(["ragged", "slots"], FORMATS))
def test_cache_append_with_metadata_ready(device, mode, kv_dtype):
    """``metadata_ready=True`` on a decode batch with the cache's RoPE, against the reference, twice (on a GPU
    the generic launch, then the prepared one). Through ``PagedKVCache.append`` (on a GPU with PDL: the
    promise's launch), and through the public op ``append_paged_kv``; where there is no PDL the promise
    changes nothing there, so the promise's launch (as on a GPU with PDL, launched without it) is also run
    through the launcher."""
    H, D, bs, nb = 2, 16, 4, 32
    kv_lens = [3, 0, 9, 4, 1, 12, 6]
    gen = pr.generator(77)
    rope = RopeConfig(head_dim=D, base=10000.0)
    n = len(kv_lens)
    cu = list(range(n + 1))
    tables = pr.block_tables_for(gen, [x + 1 for x in kv_lens], block_size=bs, num_blocks=nb, extra=1)
    targets = pr.ragged_targets(n, tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=nb)
    if mode == "ragged":
        index = dict(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                     kv_lens=pr.i32(kv_lens, device))
    else:
        index = dict(slot_mapping=torch.tensor([t.block * bs + t.offset for t in targets], device=device),
                     positions=torch.tensor([t.position for t in targets], device=device))
    params = rope.kernel_params(device=device)
    ways = ["cache", "op"] + (["launcher"] if use_triton(device) and not pdl_on(device) else [])
    for way in ways:
        cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                                  kv_dtype=kv_dtype, rope=rope)
        for _ in range(2):
            k = pr.randn((n, H, D), torch.float16, gen, device)
            v = pr.randn((n, H, D), torch.float16, gen, device)
            exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype,
                                     layout="NHD", rope=rope)
            if way == "cache":
                cache.append(0, k, v, cache.plan(metadata_ready=True, **index))
            elif way == "op":
                append_paged_kv(k, v, cache.pool(0), cache.params(0), kv_dtype=kv_dtype, rope=params,
                                fp8_scales=cache.kv_scales[0], metadata_ready=True, **index)
            else:
                launch = index_first_launch(k, kv_dtype=kv_dtype, n_seqs=None if mode == "slots" else n,
                                            rope=params, split=kv_dtype == "fp8", cs_first=kv_dtype != "fp8")
                la.append_with(cache, 0, k, v, launch, rope=params, metadata_ready=True, **index)
            pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope,
                                     what=way)


@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "per-row"])
def test_index_first_with_context_parallel(device, split, kv_dtype):
    """The lookup before the wait keeps context parallelism's rule: rank 1 of 2 stores only tokens at odd
    positions, at local position p // 2, and rotates them by their global position."""
    needs_kernel(device)
    q_lens, kv_lens = [1, 3, 1, 2], [4, 0, 9, 5]
    H, D, bs, nb = 2, 16, 4, 32
    gen = pr.generator(1234)
    rope = RopeConfig(head_dim=D, base=10000.0)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    cu = pr.cumsum0(q_lens)
    local = [(a + b + 1) // 2 for a, b in zip(kv_lens, q_lens)]
    tables = pr.block_tables_for(gen, local, block_size=bs, num_blocks=nb, extra=0)
    k = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    v = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    targets = pr.ragged_targets(cu[-1], tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=nb, cp_rank=1,
                                cp_size=2)
    assert 0 < len(targets) < cu[-1]
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="NHD",
                             rope=rope)
    _ragged_index_first(cache, k, v, tables, cu, kv_lens, rope, split, cp_rank=1, cp_size=2)
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope)


def _ragged_index_first(cache, k, v, tables, cu, kv_lens, rope: RopeConfig, split: bool,  # type: ignore[no-untyped-def]
                        cp_rank: int = 0, cp_size: int = 1) -> None:
    """A ragged append into layer 0 of ``cache`` with the lookup (and cos / sin) before the wait."""
    dev = k.device
    params = rope.kernel_params(device=dev)
    launch = index_first_launch(k, kv_dtype=cache.config.kv_dtype, n_seqs=len(kv_lens), rope=params, split=split)
    la.append_with(cache, 0, k, v, launch, block_tables=pr.i32(tables, dev), cu_q_lens=pr.i32(cu, dev),
                   kv_lens=pr.i32(kv_lens, dev), rope=params, cp_rank=cp_rank, cp_size=cp_size)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "per-row"])
@pytest.mark.parametrize("rope_name", list(ROPES))
def test_index_first_with_every_rope_pairing_in_hnd(device, rope_name, split, kv_dtype):
    """The lookup before the wait with every RoPE pairing (partial and interleaved ones re-read partner
    elements of K after the wait; cos / sin before it only for rotate-half over the whole head), positions past
    2048, the HND layout, bf16 rows."""
    needs_kernel(device)
    H, D, bs, nb = 3, 16, 4, 16
    rope = RopeConfig(head_dim=D, **ROPES[rope_name])
    gen = pr.generator(700 + len(rope_name))
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, dtype=torch.bfloat16,
                              kv_dtype=kv_dtype, layout="HND")
    k, v, tables, cu, kv_lens = pr.long_position_batch(device, gen, H, D, bs, torch.bfloat16, q_lens=(1, 1, 2),
                                                       kv_lens=(0, 2100, 5), num_blocks=nb)
    targets = pr.ragged_targets(cu[-1], tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=nb)
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="HND",
                             rope=rope)
    _ragged_index_first(cache, k, v, tables, cu, kv_lens, rope, split)
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="HND", rope=rope)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("mode", ["ragged", "slots"])
def test_metadata_ready_still_waits_for_k_and_v(device, mode, kv_dtype):
    """With the promise the append reads the index tensors before the wait for the previous kernel, but K / V
    after it: a PDL kernel that releases its dependents at once and writes K / V only after spinning must
    have its values stored, not the stale ones (which a K / V read before the wait would get). The spin (about
    1 ms) outlasts the host's gap between two launches by far; a control kernel that reads without waiting
    checks that the race is real."""
    if device.type != "cuda" or not pdl_on(device):
        pytest.skip("programmatic dependent launch needs a CUDA GPU of compute capability >= 9.0")
    H, D, bs, nb = 8, 128, 16, 64
    gen = pr.generator(31)
    rope = RopeConfig(head_dim=D, base=10000.0)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype,
                              rope=rope)
    kv_lens = [5, 17, 0, 40, 33, 2, 60, 11]
    n = len(kv_lens)
    cu = list(range(n + 1))
    tables = pr.block_tables_for(gen, [x + 1 for x in kv_lens], block_size=bs, num_blocks=nb, extra=0)
    targets = pr.ragged_targets(n, tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=nb)
    fresh = pr.randn((2, n, H, D), torch.float16, gen, device)
    kv = torch.zeros_like(fresh)  # stale values, overwritten late by the writer
    exp = pr.append_expected(cache.pool(0), cache.params(0), fresh[0], fresh[1], targets, kv_dtype=kv_dtype,
                             layout="NHD", rope=rope)
    index = (dict(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device), kv_lens=pr.i32(kv_lens, device))
             if mode == "ragged" else
             dict(slot_mapping=torch.tensor([t.block * bs + t.offset for t in targets], device=device),
                  positions=torch.tensor([t.position for t in targets], device=device)))
    writer, eager_copy = la.late_writer_kernels()
    block = 1024
    grid = (triton.cdiv(fresh.numel(), block),)
    snap = torch.empty_like(kv)
    # warm-up: compile the three kernels first (a compile between two launches lets the writer finish before the
    # next one starts); the real append below overwrites every row this one writes
    writer[grid](fresh, kv, fresh.numel(), SPIN=500000, BLOCK=block, launch_pdl=True)
    eager_copy[grid](kv, snap, kv.numel(), BLOCK=block, launch_pdl=True)
    cache.append(0, kv[0], kv[1], cache.plan(metadata_ready=True, **index))
    torch.cuda.synchronize()
    kv.zero_()
    # control: a PDL kernel that reads without waiting sees the stale K / V (else this test could not tell). On a
    # GPU shared with other processes (the test suite's workers) a time slice may let the writer finish first:
    # the control is tried up to 5 times
    for _ in range(5):
        kv.zero_()
        snap.fill_(1.0)
        torch.cuda.synchronize()
        writer[grid](fresh, kv, fresh.numel(), SPIN=500000, BLOCK=block, launch_pdl=True)
        eager_copy[grid](kv, snap, kv.numel(), BLOCK=block, launch_pdl=True)
        torch.cuda.synchronize()
        assert torch.equal(kv, fresh), "the writer did not run"
        if bool((snap == 0).any()):
            break
    else:
        pytest.fail("the writer never wrote after the next kernel read, in 5 tries: no race to test")
    kv.zero_()
    torch.cuda.synchronize()
    writer[grid](fresh, kv, fresh.numel(), SPIN=500000, BLOCK=block, launch_pdl=True)
    cache.append(0, kv[0], kv[1], cache.plan(metadata_ready=True, **index))
    torch.cuda.synchronize()
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope)


@pytest.mark.parametrize("ready", [True, False], ids=["metadata-ready", "speculative"])
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_decode_graph_with_metadata_ready(device, kv_dtype, ready):
    """A captured 2-layer decode step in which each layer's K / V come from a PDL kernel that releases its
    dependents at once and writes them only after spinning, then the append with ``metadata_ready=True`` (or
    without it: speculation). Replayed on new K / V and new lengths (copied into the captured buffers before
    each replay): it stores the same bytes as the same step run eagerly, and the new rows (not the stale
    ones)."""
    if device.type != "cuda" or not pdl_on(device):
        pytest.skip("programmatic dependent launch (in a CUDA graph) needs a CUDA GPU of compute capability >= 9.0")
    from kvcache import PagedConfig, PagedKVCache

    writer, _ = la.late_writer_kernels()
    L, n, H, D, bs = 2, 8, 4, 64, 16
    cfg = PagedConfig(num_layers=L, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=64, kv_dtype=kv_dtype,
                      device=device)
    graphed, eager = PagedKVCache(cfg, rope=RopeConfig(head_dim=D)), PagedKVCache(cfg, rope=RopeConfig(head_dim=D))
    src = torch.randn(L, 2, n, H, D, device=device).half()  # what each layer's producer writes
    kv = torch.zeros_like(src)  # each layer's K / V, written late by its producer
    cu_q = torch.arange(n + 1, dtype=torch.int32, device=device)
    kv_lens = torch.zeros(n, dtype=torch.int32, device=device)
    tables = torch.arange(n * 4, dtype=torch.int32, device=device).view(n, 4)
    grid = (triton.cdiv(2 * n * H * D, 1024),)

    def step(cache: PagedKVCache) -> None:
        for layer in range(L):
            writer[grid](src[layer], kv[layer], 2 * n * H * D, SPIN=20000, BLOCK=1024, launch_pdl=True)
            cache.append(layer, kv[layer, 0], kv[layer, 1], cache.plan(block_tables=tables, cu_q_lens=cu_q,
                                                                       kv_lens=kv_lens, metadata_ready=ready))

    step(graphed)  # compiles, prepares the plans
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graphed)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        src.copy_(torch.randn(src.shape, generator=gen).to(src.dtype))
        kv_lens.copy_(torch.randint(0, 63, (n,), generator=gen, dtype=torch.int32))
        kv.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kv, src)  # the producers ran
        kv.zero_()
        step(eager)
        torch.cuda.synchronize()
        # every row the step wrote holds the same bytes in both caches
        lens = kv_lens.tolist()
        for layer in range(L):
            for b in range(n):
                blk, off = int(tables[b, lens[b] // bs]), lens[b] % bs
                got, want = graphed.pool(layer)[blk, :, off], eager.pool(layer)[blk, :, off]
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                if graphed.params(layer) is not None:
                    assert torch.equal(graphed.params(layer)[blk, :, off], eager.params(layer)[blk, :, off])
                if kv_dtype == "auto":  # V stored as given: the new rows, not the stale zeros
                    assert torch.equal(got[1], src[layer, 1, b])
