"""The append kernel's launch variants against the independent reference: one program per row, or one for each
row's K and one for its V (split), the sequence lookup's first guess (rows spread evenly over the sequences)
and its fallback search, the prepared launches of the cache, and the programmatic-dependent-launch switch.

Every format and RoPE on K, bit-exact where the format is (the reference's float32 formula), within the
derived bounds with RoPE. Both CPU backends; compiled on a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
import triton
import triton.language as tl

from kvcache.ops import paged as paged_ops
from kvcache.rope import RopeConfig

from . import paged_reference as pr

FORMATS = ["auto", "fp8", "int8", "int4"]

# (q_lens, kv_lens, padding rows): the guess hits (decode, equal prefills), misses (mixed), padding past cu_q
BATCHES = [
    pytest.param(([1] * 7, [3, 0, 9, 4, 1, 12, 6], 0), id="decode"),
    pytest.param(([6, 6, 6], [0, 5, 2], 0), id="equal-prefills"),
    pytest.param(([5, 0, 1, 7, 2], [0, 3, 9, 2, 14], 0), id="mixed"),
    pytest.param(([3, 1, 4], [2, 0, 7], 3), id="padding-rows"),
]


@pytest.fixture(params=[0, 1, 2], ids=["per-row", "split-kv", "split-kv-heads"])
def split(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """One program per row (K and V), two (K, V), or four (K, V x two groups of heads): the threshold of rows
    below which appends split, and the head groups of split launches."""
    monkeypatch.setattr(paged_ops, "_SPLIT_BELOW", 1 << 40 if request.param else 0)
    monkeypatch.setattr(paged_ops, "_SPLIT_HEAD_GROUPS", 2 if request.param == 2 else 1)
    monkeypatch.setattr(paged_ops, "_SLOT_ROPE_ROWS", False)  # split launches for every kind of row
    return request.param


@pytest.mark.parametrize("use_rope", [False, True], ids=["no-rope", "rope"])
@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("batch", BATCHES)
def test_ragged_launch_variants(device, split, batch, kv_dtype, use_rope):
    q_lens, kv_lens, pad = batch
    gen = pr.generator(7 * len(q_lens) + pad + split)
    c = _ragged_case(device, gen, batch, kv_dtype, RopeConfig(head_dim=16, base=10000.0) if use_rope else None)
    assert len(c.targets) == c.cu[-1]  # every token has a slot, padding rows none
    c.cache.append(0, c.k, c.v, block_tables=pr.i32(c.tables, device), cu_q_lens=pr.i32(c.cu, device),
                   kv_lens=pr.i32(kv_lens, device), rope=c.rope if use_rope else False)
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
def test_cu_k_lens_launch_variants(device, split, kv_dtype):
    """The same rows through cu_k_lens (the guess reads cumulative lengths) in the HND layout."""
    q_lens, kv_lens = [2, 1, 1, 5], [4, 0, 7, 1]
    H, D, bs, nb = 3, 8, 2, 40
    gen = pr.generator(31 + split)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype,
                              layout="HND")
    cu = pr.cumsum0(q_lens)
    totals = [a + b for a, b in zip(kv_lens, q_lens)]
    tables = pr.block_tables_for(gen, totals, block_size=bs, num_blocks=nb, extra=0)
    k = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    v = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    targets = pr.ragged_targets(cu[-1], tables, cu, cu_k_lens=pr.cumsum0(totals), block_size=bs, num_blocks=nb)
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="HND")
    cache.append(0, k, v, block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                 cu_k_lens=pr.i32(pr.cumsum0(totals), device))
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="HND")


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_slot_mapping_launch_variants(device, split, kv_dtype):
    H, D, bs, nb = 2, 16, 4, 8
    gen = pr.generator(53 + split)
    _check_slot_append(device, gen, kv_dtype, RopeConfig(head_dim=D), H=H, D=D, bs=bs, nb=nb, n=11, padding=(0, 7),
                       max_position=5000)


def _check_slot_append(device, gen, kv_dtype: str, rope: RopeConfig, *, H: int, D: int, bs: int, nb: int, n: int,  # type: ignore[no-untyped-def]
                       padding: tuple[int, ...], max_position: int) -> None:
    """n random rows appended by slot mapping (rows ``padding`` get -1) at positions below ``max_position``,
    with RoPE, into a sentinel cache, against the reference."""
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    k = pr.randn((n, H, D), torch.float16, gen, device)
    v = pr.randn((n, H, D), torch.float16, gen, device)
    slots = torch.randperm(nb * bs, generator=gen)[:n].tolist()
    for row in padding:
        slots[row] = -1
    positions = torch.randint(0, max_position, (n,), generator=gen).tolist()
    _append_slots_and_compare(cache, k, v, slots, positions, kv_dtype, rope, rope)


def _append_slots_and_compare(cache, k, v, slots: list[int], positions: list[int], kv_dtype: str,  # type: ignore[no-untyped-def]
                              rope: RopeConfig, rope_arg) -> None:
    """Append k / v at ``slots`` (``positions`` for RoPE; ``rope_arg``: what the append is given) into layer 0 of
    ``cache`` and compare pools and params with the reference's expectation for ``rope``."""
    bs, nb = cache.config.block_size, cache.config.num_blocks
    targets = pr.slot_targets(slots, block_size=bs, num_blocks=nb, positions=positions)
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="NHD",
                             rope=rope)
    cache.append(0, k, v, slot_mapping=torch.tensor(slots, device=k.device),
                 positions=torch.tensor(positions, device=k.device), rope=rope_arg)
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope)


def test_many_sequences_binary_search_fallback(device, split):
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
    cache.append(0, k, v, block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                 kv_lens=pr.i32(kv_lens, device))
    pr.assert_append_matches(cache.pool(0), None, exp, kv_dtype="auto", layout="NHD")


def test_pdl_needs_hopper(device):
    """pdl=True where programmatic dependent launch is unavailable raises and writes nothing."""
    if device.type == "cuda" and paged_ops._pdl_supported(device):
        pytest.skip("this GPU supports PDL (exercised in test_cuda_graph.py)")
    H, D, bs = 2, 8, 4
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs)
    before = cache.buffer.clone()
    k = torch.ones(1, H, D, dtype=torch.float16, device=device)
    if device.type != "cuda" and not paged_ops.use_triton(device):
        pytest.skip("the torch backend launches no kernel")
    with pytest.raises(ValueError, match="pdl"):
        paged_ops.append_paged_kv_launch(
            k, k, cache.pool(0), None, kv_dtype="auto", layout="NHD", block_tables=None, cu_q_lens=None,
            kv_lens=None, cu_k_lens=None, slot_mapping=torch.zeros(1, dtype=torch.int64, device=device),
            positions=None, rope=None, fp8_scales=None, cp_rank=0, cp_size=1, pdl=True)
    pr.assert_bits_equal(cache.buffer, before, "pool")


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_odd_strides_take_scalar_loads(device, split, kv_dtype):
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
    cache.append(0, k, v, slot_mapping=torch.tensor(slots, device=device))
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD")


@pytest.mark.parametrize("mode", ["ragged", "slots"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int4"])
def test_repeated_appends_reuse_prepared_launches(device, split, kv_dtype, mode):
    """Decode steps over several layers: after the first call of a kind, the cache launches a prepared
    plan (CUDA) with raw pointers. Every step, every layer against the reference, with K a view into a fused
    QKV tensor (strides unlike V's), block tables sliced from wider ones, padding rows, per-layer fp8 scales;
    the batch shrinks midway (a new plan), one step reads V from an unaligned view (the generic launch)."""
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
        for layer in range(L):
            qkv = pr.randn((n, 3 * H, D), torch.float16, gen, device)
            k = qkv[:, H:2 * H]
            v = pr.randn((n, H, D), torch.float16, gen, device)
            if step == 2 and layer == 1:
                spare = pr.randn((n * H * D + 1,), torch.float16, gen, device)
                v = spare[1:].view(n, H, D)  # 2 bytes past an aligned start
            targets = pr.ragged_targets(n, tables[:B], cu, kv_lens=kv, block_size=bs, num_blocks=nb)
            assert len(targets) == B
            exp = pr.append_expected(cache.pool(layer), cache.params(layer), k, v, targets, kv_dtype=kv_dtype,
                                     layout="NHD", rope=rope, fp8_scales=scales[layer])
            if mode == "ragged":
                cache.append(layer, k, v, block_tables=bt, cu_q_lens=pr.i32(cu, device), kv_lens=pr.i32(kv, device))
            else:
                slots = [t.block * bs + t.offset for t in targets] + [-1, -1]
                positions = [t.position for t in targets] + [0, 0]
                cache.append(layer, k, v, slot_mapping=torch.tensor(slots, device=device),
                             positions=torch.tensor(positions, dtype=torch.int32, device=device))
            pr.assert_append_matches(cache.pool(layer), cache.params(layer), exp, kv_dtype=kv_dtype, layout="NHD",
                                     rope=rope, fp8_scales=scales[layer], what=f"step {step} layer {layer}")
        lens = [x + 1 for x in lens]
    if device.type == "cuda":
        assert cache.prepared_launches >= 8, "the prepared launch path was not taken"
        if triton.__version__.startswith("3.6."):  # and it called the launcher's C entry point (see _c_launch)
            assert all(plan.prepared.direct for plan in cache._plans.values())


ROPES = {
    "default": dict(),
    "interleaved": dict(interleaved=True),
    "partial": dict(rotary_dim=8, base=500000.0),
    "partial-interleaved": dict(rotary_dim=6, interleaved=True),
}


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("rope_name", list(ROPES))
def test_rope_pairings_and_dtypes(device, split, rope_name, dtype, kv_dtype):
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
    cache.append(0, k, v, block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                 kv_lens=pr.i32(kv_lens, device), rope=rope)
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="HND", rope=rope)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int4"])
@pytest.mark.parametrize("rope_name", list(ROPES))
def test_rope_pairings_by_slot_mapping(device, split, rope_name, kv_dtype):
    """Every RoPE pairing by slot mapping, positions up to 9000 and padding rows; split launches of quantized
    formats rotate in K and V programs and keep V's row (ROPE_SELECT), fp16 ones branch."""
    H, D = 3, 16
    gen = pr.generator(640 + 4 * list(ROPES).index(rope_name) + split)
    _check_slot_append(device, gen, kv_dtype, RopeConfig(head_dim=D, **ROPES[rope_name]), H=H, D=D, bs=4, nb=16,
                       n=9, padding=(2,), max_position=9000)


class _FakePrepared:
    """Stands in for a compiled kernel's launcher: records what a prepared launch passes."""

    def __init__(self, log: list, launch_consts: dict | None = None) -> None:
        self.head, self.consts, self.log = ("fn", "packed", None, None, None), ("CONSTS",), log
        self.launch_consts = launch_consts or {}  # the generic launch's constexprs (which plan ran)

    def run(self, gx, gy, gz, stream, *rest):  # type: ignore[no-untyped-def]
        assert rest[:len(self.head)] == self.head
        self.log.append(("prepared", (gx, gy, gz), stream, rest[len(self.head):]))
        self.runs = getattr(self, "runs", 0) + 1


class _FakeKernel:
    """Stands in for ``_append_kernel``: records the generic launch's grid and arguments."""

    def __init__(self) -> None:
        self.log: list = []

    def launch(self, device, grid, *args, **consts):  # type: ignore[no-untyped-def]
        self.log.append(("generic", grid, args, consts))
        return _FakePrepared(self.log, consts)


def _raw(args: tuple) -> tuple:
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("use_rope", [False, True], ids=["no-rope", "rope"])
@pytest.mark.parametrize("mode", ["ragged", "slots"])
def test_prepared_launch_passes_what_the_generic_launch_passes(monkeypatch, mode, use_rope):
    """The cache's prepared path (CUDA only, simulated here on the CPU) hands the launcher exactly the generic
    launch's arguments as raw pointers, for new tensors of the same kind: a prefill with padding rows, K a
    view into a fused QKV projection, a block table sliced from a wider one, every layer. A call of another
    kind (other strides; in ragged mode another batch size) takes the generic launch."""
    from kvcache.paged import cache as cache_mod

    fake = _FakeKernel()
    monkeypatch.setattr(paged_ops, "_append_kernel", fake)
    monkeypatch.setattr(paged_ops, "use_triton", lambda device: True)
    monkeypatch.setattr(cache_mod, "_current_device", lambda: -1)  # the CPU cache's device id
    monkeypatch.setattr(cache_mod, "_current_stream", lambda index: 777)
    monkeypatch.setattr(cache_mod, "_hooks_active", lambda: False)
    H, D, bs, nb, L = 2, 16, 4, 64, 3
    rope = RopeConfig(head_dim=D)
    cache = pr.sentinel_cache("cpu", num_layers=L, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                              kv_dtype="int8", rope=rope)
    cache._direct = True
    gen = pr.generator(5)

    def batch(B):  # type: ignore[no-untyped-def]
        q_lens = [3] * B
        n = sum(q_lens) + 2  # two padding rows
        qkv = torch.randn(n, 3 * H + 1, D, generator=gen).to(torch.float16)
        k = qkv[:, 1:1 + H]  # strides ((3H + 1) D, D, 1)
        v = torch.randn(n, H, D, generator=gen).to(torch.float16)
        wide = torch.randint(0, nb, (B, 8), generator=gen, dtype=torch.int32)
        tables = wide[:, :4]  # row stride 8, width 4
        cu = torch.tensor(pr.cumsum0(q_lens), dtype=torch.int32)
        kvl = torch.randint(0, 4, (B,), generator=gen, dtype=torch.int32)
        slots = torch.randint(-1, nb * bs, (n,), generator=gen)
        pos = torch.randint(0, 9000, (n,), generator=gen)
        return k, v, tables, cu, kvl, slots, pos

    def call(layer, b):  # type: ignore[no-untyped-def]
        k, v, tables, cu, kvl, slots, pos = b
        if mode == "ragged":
            cache.append(layer, k, v, block_tables=tables, cu_q_lens=cu, kv_lens=kvl, rope=None if use_rope else False)
        else:
            cache.append(layer, k, v, slot_mapping=slots, positions=pos, rope=None if use_rope else False)

    def generic(layer, b):  # type: ignore[no-untyped-def]
        k, v, tables, cu, kvl, slots, pos = b
        ragged = mode == "ragged"
        paged_ops.append_paged_kv_launch(
            k, v, cache._pools[layer], cache._params[layer], kv_dtype="int8", layout="NHD",
            block_tables=tables if ragged else None, cu_q_lens=cu if ragged else None,
            kv_lens=kvl if ragged else None, cu_k_lens=None, slot_mapping=None if ragged else slots,
            positions=pos if (use_rope and not ragged) else None, rope=cache._rope_params if use_rope else None,
            fp8_scales=cache._scales[layer], cp_rank=0, cp_size=1)

    call(0, batch(3))  # the first call of this kind: the generic launch, which makes the plan
    assert [e[0] for e in fake.log] == ["generic"] and cache.prepared_launches == 0
    for layer in range(L):
        b = batch(3)  # new tensors, same kind
        fake.log.clear()
        call(layer, b)
        generic(layer, b)  # what the generic launch would pass for the same tensors
        (kind, grid, stream, raw), (gkind, ggrid, gargs, _) = fake.log
        assert (kind, gkind, stream) == ("prepared", "generic", 777)
        assert grid == (ggrid[0], 1, 1)
        assert raw == _raw(gargs) + ("CONSTS",), f"layer {layer}"
    assert cache.prepared_launches == L
    fake.log.clear()
    k, *rest = batch(3)
    call(1, (k.contiguous(), *rest))  # other k strides: another kind, the generic launch again
    if mode == "ragged":
        call(1, batch(2))  # another batch size: another kind (the lookup is specialised on it)
    assert [e[0] for e in fake.log] == ["generic"] * (2 if mode == "ragged" else 1)
    assert cache.prepared_launches == L


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
    the launcher object would forward to it; other versions (and KVCACHE_C_LAUNCH=0) call the object."""
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
    monkeypatch.setenv("KVCACHE_C_LAUNCH", "0")
    assert not _backend._prepare(launcher, "function", "packed", consts).direct
    monkeypatch.delenv("KVCACHE_C_LAUNCH")
    launcher.global_scratch_size = 64  # a kernel that needs scratch: the object allocates it
    assert not _backend._prepare(launcher, "function", "packed", consts).direct
    launcher.global_scratch_size = 0
    monkeypatch.setattr(_backend.triton, "__version__", "3.8.0")
    plain = _backend._prepare(launcher, "function", "packed", consts)
    assert not plain.direct and plain.run is launcher
    plain.run(7, 1, 1, 1234, *plain.head, 11, 22, *plain.consts)
    assert log[2] == log[0]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8", "int4"])
@pytest.mark.parametrize("base", [10000.0, 0.5], ids=["base1e4", "base0.5"])
@pytest.mark.parametrize("known_max", [True, False], ids=["max-known", "max-unknown"])
def test_rope_positions_on_both_sides_of_the_fast_trig_range(device, kv_dtype, base, known_max):
    """The append computes cos / sin with ``_sincos`` while a row's largest angle (position x
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
    limit = paged_ops._SINCOS_MAX.value / fmax
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
def test_head_groups_must_be_a_power_of_two_within_the_heads(head_groups):
    """The launcher's head_groups override: a power of two no larger than next_pow2(H) (H = 2 here), else a
    ValueError before anything runs."""
    cache = pr.sentinel_cache("cpu", num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8, kv_dtype="int8")
    before = pr.bits(cache.pool(0)).clone()
    k = torch.randn(3, 2, 16).half()
    with pytest.raises(ValueError, match="head_groups"):
        paged_ops.append_paged_kv_launch(
            k, k, cache.pool(0), cache.params(0), kv_dtype="int8", layout="NHD",
            block_tables=torch.tensor([[1, 2]], dtype=torch.int32), cu_q_lens=torch.tensor([0, 3], dtype=torch.int32),
            kv_lens=torch.tensor([0], dtype=torch.int32), cu_k_lens=None, slot_mapping=None, positions=None,
            rope=None, fp8_scales=cache.kv_scales[0], cp_rank=0, cp_size=1, split=True, head_groups=head_groups)
    assert torch.equal(pr.bits(cache.pool(0)), before)


def test_launch_carries_the_angle_bound(monkeypatch):
    """FMAX, the append's bound on a row's angles, is the params' max_inv_freq (RopeConfig.kernel_params fills
    it in), 0.0 when the params do not carry it or KVCACHE_FAST_TRIG=0 (full-range cos / sin everywhere)."""
    fake = _FakeKernel()
    monkeypatch.setattr(paged_ops, "_append_kernel", fake)
    monkeypatch.setattr(paged_ops, "use_triton", lambda device: True)
    cache = pr.sentinel_cache("cpu", num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8, kv_dtype="int8")
    k = torch.randn(3, 2, 16).half()
    params = RopeConfig(head_dim=16, base=0.5).kernel_params()
    assert params.max_inv_freq == float(params.inv_freq.max()) > 1.0

    def launch(rope):  # type: ignore[no-untyped-def]
        paged_ops.append_paged_kv_launch(
            k, k, cache.pool(0), cache.params(0), kv_dtype="int8", layout="NHD", block_tables=None, cu_q_lens=None,
            kv_lens=None, cu_k_lens=None, slot_mapping=torch.tensor([0, 1, 2]), positions=torch.tensor([0, 1, 2]),
            rope=rope, fp8_scales=cache.kv_scales[0], cp_rank=0, cp_size=1)
        return fake.log[-1][3]["FMAX"]

    assert launch(params) == params.max_inv_freq
    assert launch(params._replace(max_inv_freq=0.0)) == 0.0
    assert launch(None) == 0.0
    monkeypatch.setattr(paged_ops, "_FAST_TRIG", False)
    assert launch(params) == 0.0


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
        cache.append(0, k, k, slot_mapping=torch.tensor([0, 1, 2], device=device),
                     positions=torch.tensor([0, 1, 2], device=device), rope=params)
    assert torch.equal(pr.bits(cache.pool(0)), before)


def test_check_true_rejects_a_bound_below_the_frequencies(device):
    """max_inv_freq below max |inv_freq| would send out-of-range angles to the short polynomial: check=True
    (which syncs anyway) reports it and writes nothing."""
    cache = pr.sentinel_cache(device, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8)
    before = pr.bits(cache.pool(0)).clone()
    k = torch.randn(3, 2, 16).half().to(device)
    params = RopeConfig(head_dim=16).kernel_params(device=device)._replace(max_inv_freq=0.5)
    with pytest.raises(ValueError, match="max_inv_freq"):
        cache.append(0, k, k, slot_mapping=torch.tensor([0, 1, 2], device=device),
                     positions=torch.tensor([0, 1, 2], device=device), rope=params, check=True)
    assert torch.equal(pr.bits(cache.pool(0)), before)


@pytest.mark.parametrize("bad", [0, 8, 300, 40.0, True])
def test_max_registers_is_validated(bad):
    cache = pr.sentinel_cache("cpu", num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8)
    k = torch.randn(3, 2, 16).half()
    with pytest.raises(ValueError, match="max_registers"):
        paged_ops.append_paged_kv_launch(
            k, k, cache.pool(0), None, kv_dtype="auto", layout="NHD", block_tables=None, cu_q_lens=None,
            kv_lens=None, cu_k_lens=None, slot_mapping=torch.tensor([0, 1, 2]), positions=None, rope=None,
            fp8_scales=cache.kv_scales[0], cp_rank=0, cp_size=1, max_registers=bad)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4"])
@pytest.mark.parametrize("split_launch", [False, True], ids=["per-row", "split"])
@pytest.mark.parametrize("early", [False, True], ids=["late", "early"])
def test_early_override_in_both_launch_shapes(device, kv_dtype, split_launch, early):
    """The EARLY order (RoPE / quantization before the block-table wait) and the late one write the same rows in
    both launch shapes, defaults or not (the defaults pair EARLY with split launches only)."""
    if device.type == "cpu" and not paged_ops.use_triton(device):
        pytest.skip("the torch backend launches no kernel")
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
    paged_ops.append_paged_kv_launch(
        k, v, cache.pool(0), cache.params(0), kv_dtype=kv_dtype, layout="NHD", block_tables=pr.i32(tables, device),
        cu_q_lens=pr.i32(cu, device), kv_lens=pr.i32(kv_lens, device), cu_k_lens=None, slot_mapping=None,
        positions=None, rope=rope.kernel_params(device=device), fp8_scales=cache.kv_scales[0], cp_rank=0,
        cp_size=1, split=split_launch, early=early)
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope)


def _launch_consts(monkeypatch, kv_dtype: str, *, split: bool | None, slots: bool = True, rope: bool = False,  # type: ignore[no-untyped-def]
                   params=None, early: bool | None = None, pdl: bool | None = None, ready: bool = False,
                   rows: int = 3, heads: tuple[int, int] = (2, 16), rope_config: RopeConfig | None = None,
                   speculate: bool | None = None, rope_ready: bool = False, one_row_each: bool = False) -> dict:
    """The constexprs of one launch of the fake kernel (``rows`` rows of ``heads`` (H, D), a slot mapping or a
    ragged batch of one sequence, or with ``one_row_each`` of ``rows`` sequences of one row (a decode batch);
    ``ready``: metadata_ready; ``rope_config``: the RoPE, default rotate-half over the whole head)."""
    fake = _FakeKernel()
    monkeypatch.setattr(paged_ops, "_append_kernel", fake)
    monkeypatch.setattr(paged_ops, "use_triton", lambda device: True)
    H, D = heads
    cache = pr.sentinel_cache("cpu", num_kv_heads=H, head_dim=D, block_size=4, num_blocks=8, kv_dtype=kv_dtype)
    k = torch.randn(rows, H, D).half()
    index = (dict(block_tables=None, cu_q_lens=None, kv_lens=None, slot_mapping=torch.arange(rows) % 32,
                  positions=torch.arange(rows) if rope else None) if slots else
             dict(block_tables=pr.i32([[0, 1]] * rows, "cpu"), cu_q_lens=pr.i32(list(range(rows + 1)), "cpu"),
                  kv_lens=pr.i32([0] * rows, "cpu"), slot_mapping=None, positions=None) if one_row_each else
             dict(block_tables=pr.i32([[0, 1]], "cpu"), cu_q_lens=pr.i32([0, rows], "cpu"),
                  kv_lens=pr.i32([0], "cpu"), slot_mapping=None, positions=None))
    paged_ops.append_paged_kv_launch(
        k, k, cache.pool(0), cache.params(0) if params is None else params, kv_dtype=kv_dtype, layout="NHD",
        cu_k_lens=None, rope=(rope_config or RopeConfig(head_dim=D)).kernel_params() if rope else None,
        fp8_scales=cache.kv_scales[0], cp_rank=0, cp_size=1, split=split, early=early, pdl=pdl,
        metadata_ready=ready, speculate=speculate, rope_ready=rope_ready, **index)
    return fake.log[-1][3]


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_pair_store_needs_ptx_aligned_params_and_a_per_row_launch(monkeypatch, kv_dtype):
    """int8 / int4 (scale, zero) go out as one 8-byte inline-PTX store per head (PAIR_ASM) only in launches of
    one program per row (prefill-sized; split decode launches measured no faster), when the kernel is compiled
    from PTX and the params pool is 8-byte aligned; otherwise, and for fp16 / fp8 (no params), by tl.store.
    KVCACHE_PAIR_ASM=0 turns the PTX store off."""
    monkeypatch.setattr(paged_ops, "_PAIR_ASM", True)  # whatever KVCACHE_PAIR_ASM this run was started with
    quantized = kv_dtype in ("int8", "int4")
    assert _launch_consts(monkeypatch, kv_dtype, split=False)["PAIR_ASM"] is False  # the CPU: no PTX
    monkeypatch.setattr(paged_ops, "_ptx", lambda device: True)
    assert _launch_consts(monkeypatch, kv_dtype, split=False)["PAIR_ASM"] is quantized
    assert _launch_consts(monkeypatch, kv_dtype, split=False, slots=False)["PAIR_ASM"] is quantized
    assert _launch_consts(monkeypatch, kv_dtype, split=True)["PAIR_ASM"] is False
    if quantized:
        params = pr.sentinel_cache("cpu", num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8,
                                   kv_dtype=kv_dtype).params(0)
        flat = torch.empty(params.numel() + 1, dtype=params.dtype)
        shifted = flat[1:].view(params.shape)  # 4 bytes past an 8-byte boundary
        assert shifted.data_ptr() % 8 == 4
        assert _launch_consts(monkeypatch, kv_dtype, split=False, params=shifted)["PAIR_ASM"] is False
    monkeypatch.setattr(paged_ops, "_PAIR_ASM", False)
    assert _launch_consts(monkeypatch, kv_dtype, split=False)["PAIR_ASM"] is False


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_rope_select_only_for_quantized_split_slot_mapping(monkeypatch, kv_dtype):
    """K and V programs both rotate (ROPE_SELECT) only in split launches by slot mapping with RoPE, of a
    quantized format: where it was measured faster."""
    quantized = kv_dtype != "auto"
    assert _launch_consts(monkeypatch, kv_dtype, split=True, rope=True)["ROPE_SELECT"] is quantized
    assert _launch_consts(monkeypatch, kv_dtype, split=True, rope=False)["ROPE_SELECT"] is False
    assert _launch_consts(monkeypatch, kv_dtype, split=False, rope=True)["ROPE_SELECT"] is False
    assert _launch_consts(monkeypatch, kv_dtype, split=True, slots=False, rope=True)["ROPE_SELECT"] is False


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_masked_stores_for_early_launches_except_rope_select(monkeypatch, kv_dtype):
    """Split (EARLY) launches predicate their stores on the row's validity instead of branching on it (MASKED),
    except quantized slot-mapping launches with RoPE (ROPE_SELECT: measured slower); per-row launches branch.
    An explicit early=True on a per-row launch masks too; _MASKED_STORES=False turns it off."""
    quantized = kv_dtype != "auto"
    assert _launch_consts(monkeypatch, kv_dtype, split=True)["MASKED"] is True
    assert _launch_consts(monkeypatch, kv_dtype, split=True, slots=False, rope=True)["MASKED"] is True
    assert _launch_consts(monkeypatch, kv_dtype, split=True, rope=True)["MASKED"] is (not quantized)
    assert _launch_consts(monkeypatch, kv_dtype, split=False)["MASKED"] is False
    assert _launch_consts(monkeypatch, kv_dtype, split=False, early=True)["MASKED"] is True
    assert _launch_consts(monkeypatch, kv_dtype, split=True, early=False)["MASKED"] is False
    monkeypatch.setattr(paged_ops, "_MASKED_STORES", False)
    assert _launch_consts(monkeypatch, kv_dtype, split=True)["MASKED"] is False


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("hints", [False, True], ids=["plain", "streaming"])
@pytest.mark.parametrize("shape", [(3, 16, "NHD", None), (8, 128, "NHD", None), (8, 128, "HND", 8),
                                   (5, 80, "NHD", 1), (5, 80, "HND", 4)],
                         ids=["3x16", "8x128", "8x128-hnd-w8", "5x80-w1", "5x80-hnd-w4"])
def test_pair_store_and_tl_store_write_the_same_bytes(device, monkeypatch, kv_dtype, hints, shape):
    """On a GPU the (scale, zero) of each head go out by inline PTX in per-row launches: the same bytes as
    tl.store, with and without the streaming-store hint, in both layouts, for the benchmarked 8 x 128 heads
    (values held by several threads and warps: duplicate stores), and for head counts that leave masked heads
    in the tile (3 of 4, 5 of 8: they write nothing), at 1 to 8 warps; a params pool 4 bytes off an 8-byte
    boundary falls back to tl.store."""
    if not paged_ops._ptx(torch.device(device.type)):
        pytest.skip("inline PTX: NVIDIA GPUs only (tests/paged/test_append_launch.py checks the PTX on the CPU)")
    H, D, layout, warps = shape
    q_lens, kv_lens = [3, 1, 4], [2, 0, 7]
    bs, nb = 4, 32
    monkeypatch.setattr(paged_ops, "_HINTS", hints)
    gen = pr.generator(970 + hints + 2 * H)
    rope = RopeConfig(head_dim=D, base=10000.0)
    cu = pr.cumsum0(q_lens)
    tables = pr.block_tables_for(gen, [a + b for a, b in zip(kv_lens, q_lens)], block_size=bs, num_blocks=nb,
                                 extra=1)
    k = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    v = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    targets = pr.ragged_targets(cu[-1], tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=nb)

    def append(pair_asm: bool, shift: bool):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(paged_ops, "_PAIR_ASM", pair_asm)
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
        paged_ops.append_paged_kv_launch(
            k, v, cache.pool(0), params, kv_dtype=kv_dtype, layout=layout, block_tables=pr.i32(tables, device),
            cu_q_lens=pr.i32(cu, device), kv_lens=pr.i32(kv_lens, device), cu_k_lens=None, slot_mapping=None,
            positions=None, rope=rope.kernel_params(device=device), fp8_scales=cache.kv_scales[0], cp_rank=0,
            cp_size=1, split=False, num_warps=warps)
        pr.assert_append_matches(cache.pool(0), params, exp, kv_dtype=kv_dtype, layout=layout, rope=rope)
        return cache.pool(0).clone(), params.clone()

    pool_asm, params_asm = append(True, False)
    pool_st, params_st = append(False, False)
    assert torch.equal(pool_asm.view(torch.uint8), pool_st.view(torch.uint8))
    assert torch.equal(params_asm.view(torch.int32), params_st.view(torch.int32))
    pool_sh, params_sh = append(True, True)
    assert torch.equal(params_sh.view(torch.int32), params_st.view(torch.int32))


def test_ptx_means_an_nvidia_build():
    """Inline PTX only where kernels compile from PTX: CUDA devices of an NVIDIA build, not ROCm's "cuda"."""
    assert paged_ops._ptx(torch.device("cpu")) is False
    import unittest.mock

    with unittest.mock.patch.object(torch.version, "hip", None):
        assert paged_ops._ptx(torch.device("cuda")) is True
    with unittest.mock.patch.object(torch.version, "hip", "6.2"):
        assert paged_ops._ptx(torch.device("cuda")) is False


_PTX_SCRIPT = r"""
import json, re, sys
sys.path.insert(0, sys.argv[2])
import ptx_inspect as PI
from kvcache.ops import paged as P

cm = sys.argv[1]
ptrs = PI.append_ptrs(2)
pair = re.compile(r"@%p st\.global" + re.escape(cm) + r"\.v2\.b32 \[")  # _store_pair's unnumbered %p
out = {}
for pair_asm in (False, True):
    consts = PI.append_consts(2, True, FMAX=1.0, NUM_BLOCKS=64, LOAD_EV="evict_first" if cm else "", STORE_CM=cm,
                              PAIR_ASM=pair_asm)
    ptx = PI.compile_ptx(P._append_kernel, ptrs, {}, consts, 2)
    out[str(pair_asm)] = [len(pair.findall(ptx)), ptx.count("bar.sync")]
print(json.dumps(out))
"""


def _compile_in_subprocess(script: str, arg: str) -> object:
    """Run ``script`` (argv: ``arg``, the benchmarks directory) in a fresh process without TRITON_INTERPRET and
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
    res = subprocess.run([sys.executable, "-c", script, arg, os.path.join(root, "benchmarks")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("hints", [False, True], ids=["plain", "streaming"])
def test_pair_store_compiles_to_one_predicated_vector_store_per_head(hints):
    """The int8 append with RoPE compiled for sm_90 without a GPU by benchmarks/ptx_inspect.py (the PTX the
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


def test_guess_mul_is_exact_for_decode_and_equal_prefills():
    """The sequence lookup's first guess, (n * guess_mul) >> 30, is n for a decode batch (a row per sequence)
    and n // L for prefills of L rows each; for any batch it is floor(n * n_seqs / n_rows) or one more, and
    guess_mul fits an int32 argument."""
    shift = int(paged_ops._GUESS_SHIFT)
    for n_seqs in (1, 2, 7, 256, 1000, 4096):
        m = paged_ops._guess_mul(n_seqs, n_seqs)
        assert m == 1 << shift
        assert all((n * m) >> shift == n for n in range(n_seqs))
    for n_seqs, rows in ((8, 2048), (3, 6), (5, 1000), (64, 777), (1, 65536), (300, 3)):
        m = paged_ops._guess_mul(n_seqs, n_seqs * rows)
        assert all((n * m) >> shift == n // rows for n in range(n_seqs * rows))
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        n_seqs, n_rows = (int(x) for x in torch.randint(1, 1 << 20, (2,), generator=gen))
        m = paged_ops._guess_mul(n_seqs, n_rows)
        assert 0 <= m <= 1 << shift < 2**31
        for n in (0, n_rows // 3, n_rows - 1):
            exact = n * n_seqs // n_rows
            assert (n * m) >> shift in ((exact, exact + 1) if n_seqs <= n_rows else (n, n))
    assert paged_ops._guess_mul(5, 0) == 0
    assert paged_ops._GUESS_ONE == paged_ops._guess_mul(7, 7)  # the launch's shortcut for decode batches


_SASS_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import ptx_inspect as PI

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


# ----------------------------------------------------------------------------------------- metadata_ready


def _check_ragged_and_slots(device, c: _RaggedCase, kv_lens: list, kv_dtype: str, params, use_rope: bool,  # type: ignore[no-untyped-def]
                            over: dict) -> None:
    """The ragged case ``c`` (``kv_lens`` cached tokens per sequence) appended with the launch overrides ``over``,
    then the same rows by slot mapping into a fresh cache: the reference's bytes both times."""
    paged_ops.append_paged_kv_launch(
        c.k, c.v, c.cache.pool(0), c.cache.params(0), kv_dtype=kv_dtype, layout="NHD",
        block_tables=pr.i32(c.tables, device), cu_q_lens=pr.i32(c.cu, device), kv_lens=pr.i32(kv_lens, device),
        cu_k_lens=None, slot_mapping=None, positions=None, rope=params, fp8_scales=c.cache.kv_scales[0], cp_rank=0,
        cp_size=1, **over)
    pr.assert_append_matches(c.cache.pool(0), c.cache.params(0), c.exp, kv_dtype=kv_dtype, layout="NHD", rope=c.rope)
    # the same rows by slot mapping (their targets, -1 for padding rows), positions from the ragged batch
    _check_as_slot_mapping(device, c, kv_dtype, params, use_rope, over)


def _check_as_slot_mapping(device, c: _RaggedCase, kv_dtype: str, params, use_rope: bool, over: dict) -> None:  # type: ignore[no-untyped-def]
    """The rows of the ragged case ``c`` appended again by slot mapping (their targets, -1 for padding rows;
    positions from the ragged batch) into a fresh sentinel cache with the launch overrides ``over``: the
    reference's bytes."""
    H, D, bs, nb = 2, 16, 4, 32  # as _ragged_case
    cache2 = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    n = c.k.shape[0]
    slots = [-1] * n
    positions = [0] * n
    for t in c.targets:
        slots[t.row] = t.block * bs + t.offset
        positions[t.row] = t.position
    paged_ops.append_paged_kv_launch(
        c.k, c.v, cache2.pool(0), cache2.params(0), kv_dtype=kv_dtype, layout="NHD", block_tables=None,
        cu_q_lens=None, kv_lens=None, cu_k_lens=None, slot_mapping=torch.tensor(slots, device=device),
        positions=torch.tensor(positions, device=device) if use_rope else None, rope=params,
        fp8_scales=cache2.kv_scales[0], cp_rank=0, cp_size=1, **over)
    pr.assert_append_matches(cache2.pool(0), cache2.params(0), c.exp, kv_dtype=kv_dtype, layout="NHD", rope=c.rope)


@pytest.mark.parametrize("cs_first", [False, True], ids=["cs-after", "cs-first"])
@pytest.mark.parametrize("use_rope", [False, True], ids=["no-rope", "rope"])
@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("shape", ["split", "per-row"])
@pytest.mark.parametrize("batch", [BATCHES[0], BATCHES[2], BATCHES[3]])
def test_index_first_launches_match_the_reference(device, batch, shape, kv_dtype, use_rope, cs_first):
    """The lookup (and RoPE's cos / sin) before the wait for the previous kernel (``index_first``, what
    ``metadata_ready`` selects for decode-sized appends), in both launch shapes, with the decode / mixed /
    padded batches of the ragged tests and by slot mapping (with -1 rows): the reference's bytes (within the
    RoPE bounds). On a GPU with PDL the wait is real; on the CPU the order alone is exercised."""
    if device.type == "cpu" and not paged_ops.use_triton(device):
        pytest.skip("the torch backend launches no kernel")
    q_lens, kv_lens, pad = batch
    gen = pr.generator(11 * len(q_lens) + pad)
    c = _ragged_case(device, gen, batch, kv_dtype, RopeConfig(head_dim=16, base=10000.0) if use_rope else None)
    params = c.rope.kernel_params(device=device) if use_rope else None
    over = dict(split=shape == "split", index_first=True, cs_first=cs_first, early=True)
    _check_ragged_and_slots(device, c, kv_lens, kv_dtype, params, use_rope, over)


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_metadata_ready_selects_index_first_for_decode_with_pdl(monkeypatch, kv_dtype):
    """``metadata_ready`` changes only decode-sized launches with PDL: the lookup goes before the wait
    (INDEX_FIRST), with RoPE's cos / sin too except for fp8 (CS_FIRST), one program per row (of the per-row
    launch's warps) except fp8 (split), stores predicated (EARLY); without PDL, for prefill-sized appends and
    without the promise, nothing changes (speculation, the default without the promise, is off here: see
    test_speculation_is_the_default_for_decode_with_pdl_and_no_promise)."""
    monkeypatch.setattr(paged_ops, "_pdl_supported", lambda device: True)
    monkeypatch.setattr(paged_ops, "_SPECULATE", False)
    fp8 = kv_dtype == "fp8"
    for slots in (True, False):
        base = _launch_consts(monkeypatch, kv_dtype, split=None, slots=slots, rope=True, pdl=True)
        rows4 = slots and kv_dtype in ("int8", "int4")  # _SLOT_ROPE_ROWS
        assert (base["INDEX_FIRST"], base["CS_FIRST"], base["SPLIT"]) == (False, False, not rows4)
        ready = _launch_consts(monkeypatch, kv_dtype, split=None, slots=slots, rope=True, pdl=True, ready=True)
        assert ready["INDEX_FIRST"] is True and ready["EARLY"] is True
        assert ready["CS_FIRST"] is (not fp8) and ready["SPLIT"] is fp8
        shape = _launch_consts(monkeypatch, kv_dtype, split=fp8, slots=slots, rope=True, pdl=True, heads=(8, 128))
        big = _launch_consts(monkeypatch, kv_dtype, split=None, slots=slots, rope=True, pdl=True, ready=True,
                             heads=(8, 128))
        assert big["num_warps"] == shape["num_warps"] == (1 if fp8 else 4 if kv_dtype == "auto" else 2)
        no_rope = _launch_consts(monkeypatch, kv_dtype, split=None, slots=slots, pdl=True, ready=True)
        assert no_rope["INDEX_FIRST"] is True and no_rope["CS_FIRST"] is False
        for other in (dict(pdl=False), dict(pdl=True, rows=paged_ops._SPLIT_BELOW)):
            c = _launch_consts(monkeypatch, kv_dtype, split=None, slots=slots, rope=True, ready=True, **other)  # type: ignore[arg-type]
            assert c["INDEX_FIRST"] is False and c["CS_FIRST"] is False, other
            assert c["SPLIT"] is (other["pdl"] is False and not rows4), other


def test_metadata_ready_must_be_a_bool(device):
    cache = pr.sentinel_cache(device, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=4, kv_dtype="int8")
    k = torch.zeros(1, 2, 8, dtype=torch.float16, device=device)
    before = cache.pool(0).clone()
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="metadata_ready"):
            cache.append(0, k, k, slot_mapping=torch.tensor([0], device=device), metadata_ready=bad)
    assert torch.equal(cache.pool(0).view(torch.uint8), before.view(torch.uint8))


def test_prepared_launches_are_kept_apart_by_metadata_ready(monkeypatch):
    """The cache's prepared launches are keyed by ``metadata_ready``: a promise made once does not carry over to
    later calls without it (and back). (Speculation off: without the promise the launch then waits first.)"""
    from kvcache.paged import cache as cache_mod

    monkeypatch.setattr(paged_ops, "_SPECULATE", False)
    fake = _FakeKernel()
    monkeypatch.setattr(paged_ops, "_append_kernel", fake)
    monkeypatch.setattr(paged_ops, "use_triton", lambda device: True)
    monkeypatch.setattr(paged_ops, "_pdl_supported", lambda device: True)
    monkeypatch.setattr(paged_ops, "_PDL_ENV", True)
    monkeypatch.setattr(cache_mod, "_current_device", lambda: -1)
    monkeypatch.setattr(cache_mod, "_current_stream", lambda index: 1)
    monkeypatch.setattr(cache_mod, "_hooks_active", lambda: False)
    cache = pr.sentinel_cache("cpu", num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8, kv_dtype="int8")
    cache._direct = True
    k = torch.randn(2, 2, 16).half()
    slots = torch.tensor([0, 5])
    for ready in (True, False, True, False, True):
        cache.append(0, k, k, slot_mapping=slots, metadata_ready=ready)
    generic = [e[3] for e in fake.log if e[0] == "generic"]
    assert [c["INDEX_FIRST"] for c in generic] == [True, False]
    assert [e[0] for e in fake.log] == ["generic", "generic", "prepared", "prepared", "prepared"]
    plans = {p.prepared.launch_consts["INDEX_FIRST"]: p.prepared for p in cache._plans.values()}
    assert plans[True].runs == 2 and plans[False].runs == 1  # each call took its own kind's plan


@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("mode", ["ragged", "slots"])
def test_cache_append_with_metadata_ready(device, monkeypatch, mode, kv_dtype):
    """``PagedKVCache.append(..., metadata_ready=True)`` on a decode batch with the cache's RoPE (called twice: on
    a GPU the generic launch, then the prepared one), against the reference. Without PDL (the CPU, pre-Hopper
    GPUs) the promise would change nothing, so the gate is opened here: the launches take INDEX_FIRST
    everywhere (checked), and on the interpreter there is simply no wait."""
    real = paged_ops._ready_launch
    seen: list = []

    def gate_open(metadata_ready, pdl, n_tokens, quant):  # type: ignore[no-untyped-def]
        out = real(metadata_ready, True, n_tokens, quant)
        seen.append(out[0])
        return out

    monkeypatch.setattr(paged_ops, "_ready_launch", gate_open)
    H, D, bs, nb = 2, 16, 4, 32
    kv_lens = [3, 0, 9, 4, 1, 12, 6]
    gen = pr.generator(77)
    rope = RopeConfig(head_dim=D, base=10000.0)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype,
                              rope=rope)
    n = len(kv_lens)
    cu = list(range(n + 1))
    tables = pr.block_tables_for(gen, [x + 1 for x in kv_lens], block_size=bs, num_blocks=nb, extra=1)
    targets = pr.ragged_targets(n, tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=nb)
    for _ in range(2):
        k = pr.randn((n, H, D), torch.float16, gen, device)
        v = pr.randn((n, H, D), torch.float16, gen, device)
        exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="NHD",
                                 rope=rope)
        if mode == "ragged":
            cache.append(0, k, v, block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                         kv_lens=pr.i32(kv_lens, device), metadata_ready=True)
        else:
            cache.append(0, k, v, slot_mapping=torch.tensor([t.block * bs + t.offset for t in targets], device=device),
                         positions=torch.tensor([t.position for t in targets], device=device), metadata_ready=True)
        pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope)
    if paged_ops.use_triton(torch.device(device.type)):
        assert seen and all(seen)  # every launch that was not a prepared repeat took INDEX_FIRST


# The append's SASS in the decode launch shapes with RoPE (int8 one program per row, fp8 split programs; ragged
# and slot mapping), EARLY, stores predicated: for each, its opcodes, the index of the wait for the previous
# kernel (griddepcontrol.wait: ACQBULK) and the global loads up to the first store as (index, opcode)
# (libdevice's cos / sin fallback reads constant tables: not index tensors). Scripts for _compile_in_subprocess.
_SASS_HEAD = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import ptx_inspect as PI

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


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_quantized_slot_mapping_decode_with_rope_takes_four_warp_rows(monkeypatch, kv_dtype):
    """Decode-sized int8 / int4 appends by slot mapping with RoPE take one program per row of 4 warps, stores
    predicated (measured faster than split programs); ragged ones, fp16 / fp8, those without RoPE, prefill-sized
    ones and _SLOT_ROPE_ROWS=False split as before (or, prefill-sized, take the per-row default)."""
    rows4 = kv_dtype in ("int8", "int4")
    c = _launch_consts(monkeypatch, kv_dtype, split=None, rope=True)
    assert c["SPLIT"] is (not rows4)
    if rows4:
        assert c["EARLY"] is True and c["MASKED"] is True and c["ROPE_SELECT"] is False
        big_heads = _launch_consts(monkeypatch, kv_dtype, split=None, rope=True, heads=(8, 128))
        assert big_heads["SPLIT"] is False and big_heads["num_warps"] == 4  # 8 x 128 heads
    assert _launch_consts(monkeypatch, kv_dtype, split=None, rope=False)["SPLIT"] is True
    assert _launch_consts(monkeypatch, kv_dtype, split=None, slots=False, rope=True)["SPLIT"] is True
    big = _launch_consts(monkeypatch, kv_dtype, split=None, rope=True, rows=paged_ops._SPLIT_BELOW)
    assert big["SPLIT"] is False and big["EARLY"] is False
    monkeypatch.setattr(paged_ops, "_SLOT_ROPE_ROWS", False)
    assert _launch_consts(monkeypatch, kv_dtype, split=None, rope=True)["SPLIT"] is True


@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
@pytest.mark.parametrize("shape", ["split", "per-row"])
def test_index_first_with_context_parallel(device, shape, kv_dtype):
    """The lookup before the wait keeps context parallelism's rule: rank 1 of 2 stores only tokens at odd
    positions, at local position p // 2, and rotates them by their global position."""
    if device.type == "cpu" and not paged_ops.use_triton(device):
        pytest.skip("the torch backend launches no kernel")
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
    _ragged_index_first(cache, k, v, tables, cu, kv_lens, rope, "NHD", shape == "split", cp_rank=1, cp_size=2)
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope)


def _ragged_index_first(cache, k, v, tables, cu, kv_lens, rope: RopeConfig, layout: str, split: bool,  # type: ignore[no-untyped-def]
                        cp_rank: int = 0, cp_size: int = 1) -> None:
    """A ragged append into layer 0 of ``cache`` with the lookup (and cos / sin) before the wait."""
    dev = k.device
    paged_ops.append_paged_kv_launch(
        k, v, cache.pool(0), cache.params(0), kv_dtype=cache.config.kv_dtype, layout=layout,
        block_tables=pr.i32(tables, dev), cu_q_lens=pr.i32(cu, dev), kv_lens=pr.i32(kv_lens, dev), cu_k_lens=None,
        slot_mapping=None, positions=None, rope=rope.kernel_params(device=dev), fp8_scales=cache.kv_scales[0],
        cp_rank=cp_rank, cp_size=cp_size, split=split, index_first=True, cs_first=True, early=True)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("shape", ["split", "per-row"])
@pytest.mark.parametrize("rope_name", list(ROPES))
def test_index_first_with_every_rope_pairing_in_hnd(device, rope_name, shape, kv_dtype):
    """The lookup before the wait with every RoPE pairing (partial and interleaved ones re-read partner
    elements of K after the wait; cos / sin before it only for rotate-half over the whole head), positions past
    2048, the HND layout, bf16 rows."""
    if device.type == "cpu" and not paged_ops.use_triton(device):
        pytest.skip("the torch backend launches no kernel")
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
    _ragged_index_first(cache, k, v, tables, cu, kv_lens, rope, "HND", shape == "split")
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="HND", rope=rope)


def _ready_fake(monkeypatch):  # type: ignore[no-untyped-def]
    """A fake kernel and an open PDL gate (the CPU stands in for a Hopper GPU): what each launch would take."""
    fake = _FakeKernel()
    monkeypatch.setattr(paged_ops, "_append_kernel", fake)
    monkeypatch.setattr(paged_ops, "use_triton", lambda device: True)
    monkeypatch.setattr(paged_ops, "_pdl_supported", lambda device: True)
    monkeypatch.setattr(paged_ops, "_PDL_ENV", True)
    return fake


def _trusts(consts: dict) -> bool:
    """Whether a launch reads the index tensors before the wait and trusts them (the promise), rather than
    waiting first or checking them after the wait (speculation)."""
    return bool(consts["INDEX_FIRST"]) and not consts["SPECULATE"]


def test_the_public_op_passes_metadata_ready_on(monkeypatch):
    """``append_paged_kv(..., metadata_ready=True)`` (the validating op) reaches the launch; a non-bool is a
    TypeError that names the value, before anything is written."""
    fake = _ready_fake(monkeypatch)
    cache = pr.sentinel_cache("cpu", num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8, kv_dtype="int8")
    k = torch.randn(3, 2, 16).half()
    args = dict(kv_dtype="int8", slot_mapping=torch.tensor([0, 5, 9]), fp8_scales=None)
    for ready in (True, False):
        paged_ops.append_paged_kv(k, k, cache.pool(0), cache.params(0), metadata_ready=ready, **args)
        assert _trusts(fake.log[-1][3]) is ready
    n = len(fake.log)
    with pytest.raises(TypeError, match=r"metadata_ready: expected a bool, got 1 \(int\)"):
        paged_ops.append_paged_kv(k, k, cache.pool(0), cache.params(0), metadata_ready=1, **args)
    assert len(fake.log) == n


def test_rope_built_in_the_call_drops_the_promise(monkeypatch):
    """The cache's own RoPE parameters (built once) are covered by the promise; parameters built in the call (a
    RopeConfig given to append, dynamic scaling) may have their inv_freq written on the device just before the
    kernel, so those calls wait as without it."""
    fake = _ready_fake(monkeypatch)
    D = 16
    k = torch.randn(3, 2, D).half()
    index = dict(slot_mapping=torch.tensor([0, 5, 9]), positions=torch.tensor([1, 40, 200]))
    static = pr.sentinel_cache("cpu", num_kv_heads=2, head_dim=D, block_size=4, num_blocks=8, kv_dtype="int8",
                               rope=RopeConfig(head_dim=D))
    static.append(0, k, k, metadata_ready=True, **index)
    assert _trusts(fake.log[-1][3]) and fake.log[-1][3]["CS_FIRST"] is True
    static.append(0, k, k, metadata_ready=True, rope=static._rope_params, **index)  # the same params, given
    assert _trusts(fake.log[-1][3])
    static.append(0, k, k, metadata_ready=True, rope=RopeConfig(head_dim=D, base=5e5), **index)
    assert not _trusts(fake.log[-1][3]) and fake.log[-1][3]["SPECULATE"] is True  # checked after the wait
    dynamic = pr.sentinel_cache("cpu", num_kv_heads=2, head_dim=D, block_size=4, num_blocks=8, kv_dtype="int8",
                                rope=RopeConfig(head_dim=D, rope_type="dynamic", factor=2.0,
                                                max_position_embeddings=32))
    for seq_len in (16, 300):
        dynamic.append(0, k, k, metadata_ready=True, rope_seq_len=seq_len, **index)
        assert not _trusts(fake.log[-1][3]) and fake.log[-1][3]["ROPE"] is True


_LATE_WRITER = None


def _late_writer_kernel():  # type: ignore[no-untyped-def]
    """A Triton kernel launched with PDL that releases its dependents at once, then spins and only then writes
    ``dst`` (built on first use: GPU only)."""
    global _LATE_WRITER
    if _LATE_WRITER is None:
        import triton.language as tl
        from triton.language.extra.cuda import gdc_launch_dependents

        @triton.jit
        def late_writer(src, dst, n, SPIN: tl.constexpr, BLOCK: tl.constexpr):
            gdc_launch_dependents()  # the next kernel may start now, long before dst is written
            acc = tl.program_id(0).to(tl.float32)
            for _ in range(SPIN):
                acc = acc * 0.999 + 1.0
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(src + offs, mask=offs < n)
            tl.store(dst + offs, x + (acc * 0.0).to(x.dtype), mask=offs < n)

        @triton.jit
        def eager_copy(src, dst, n, BLOCK: tl.constexpr):  # no wait for the previous kernel: a control
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

        _LATE_WRITER = late_writer, eager_copy
    return _LATE_WRITER


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("mode", ["ragged", "slots"])
def test_metadata_ready_still_waits_for_k_and_v(device, mode, kv_dtype):
    """With the promise the append reads the index tensors before the wait for the previous kernel, but K / V
    after it: a PDL kernel that releases its dependents at once and writes K / V only after spinning must
    have its values stored, not the stale ones (which a K / V read before the wait would get). The spin (about
    1 ms) outlasts the host's gap between two launches by far; a control kernel that reads without waiting
    checks that the race is real."""
    if device.type != "cuda" or not paged_ops._pdl_default(device):
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
    writer, eager_copy = _late_writer_kernel()
    block = 1024
    grid = (triton.cdiv(fresh.numel(), block),)
    snap = torch.empty_like(kv)
    # warm-up: compile the three kernels first (a compile between two launches lets the writer finish before the
    # next one starts); the real append below overwrites every row this one writes
    writer[grid](fresh, kv, fresh.numel(), SPIN=500000, BLOCK=block, launch_pdl=True)
    eager_copy[grid](kv, snap, kv.numel(), BLOCK=block, launch_pdl=True)
    cache.append(0, kv[0], kv[1], metadata_ready=True, **index)
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
    cache.append(0, kv[0], kv[1], metadata_ready=True, **index)
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
    if device.type != "cuda" or not paged_ops._pdl_default(device):
        pytest.skip("programmatic dependent launch (in a CUDA graph) needs a CUDA GPU of compute capability >= 9.0")
    from kvcache import PagedConfig, PagedKVCache

    writer, _ = _late_writer_kernel()
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
            cache.append(layer, kv[layer, 0], kv[layer, 1], block_tables=tables, cu_q_lens=cu_q, kv_lens=kv_lens,
                         metadata_ready=ready)

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


# ----------------------------------------------------------------------------------------- speculation


_REAL_SPEC_SAME = paged_ops._spec_same


@triton.jit
def _never_same(n, cu_q, kv_info, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                MODE: tl.constexpr, ROPE: tl.constexpr):
    same = _REAL_SPEC_SAME(n, cu_q, kv_info, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                           MODE, ROPE)
    return same & (n < 0)


def _spec_never_same(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Make every speculative program find its values changed (as if the previous kernel had written them):
    the rows then go through the slow path after the wait. (The interpreter resolves the kernel's helpers at
    call time.)"""
    monkeypatch.setattr(paged_ops, "_spec_same", _never_same)


@pytest.mark.parametrize("changed", [False, True], ids=["unchanged", "changed"])
@pytest.mark.parametrize("use_rope", [False, True], ids=["no-rope", "rope"])
@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("shape", ["split", "per-row"])
@pytest.mark.parametrize("batch", [BATCHES[0], BATCHES[2], BATCHES[3]])
def test_speculative_launches_match_the_reference(device, monkeypatch, batch, shape, kv_dtype, use_rope, changed):
    """The speculative lookup (``speculate``, the default for decode-sized appends with PDL and no promise):
    the first guess (and cos / sin) before the wait, every value it read checked after it. Rows whose guess
    missed (mixed batches, padding) and, with ``changed``, every row (as if the previous kernel had written the
    index tensors) go through the slow path; ragged and by slot mapping, both launch shapes (per-row launches
    with ``rope_ready``: inv_freq and cos / sin before the wait; split ones read inv_freq after it): the
    reference's bytes (within the RoPE bounds)."""
    if not paged_ops.use_triton(device):
        pytest.skip("the torch backend launches no kernel")
    if changed:
        if device.type == "cuda":
            pytest.skip("the kernel's helper is replaced only under the interpreter")
        _spec_never_same(monkeypatch)
    q_lens, kv_lens, pad = batch
    gen = pr.generator(13 * len(q_lens) + pad)
    c = _ragged_case(device, gen, batch, kv_dtype, RopeConfig(head_dim=16, base=10000.0) if use_rope else None)
    params = c.rope.kernel_params(device=device) if use_rope else None
    over = dict(split=shape == "split", speculate=True, early=True, rope_ready=shape == "per-row",
                cs_first=use_rope and kv_dtype != "fp8" and shape == "per-row")
    _check_ragged_and_slots(device, c, kv_lens, kv_dtype, params, use_rope, over)


@triton.jit
def _always_same(n, cu_q, kv_info, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                 MODE: tl.constexpr, ROPE: tl.constexpr):
    same = _REAL_SPEC_SAME(n, cu_q, kv_info, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                           MODE, ROPE)
    return same | (n >= 0)


def test_speculation_check_is_what_keeps_missed_guesses_right(device, monkeypatch):
    """The check after the wait decides: with it replaced by one that always passes, a mixed batch (rows whose
    first guess misses) lands in the wrong slots, and the reference comparison catches it (so the speculative
    tests above exercise the slow path, not just the guess)."""
    if device.type != "cpu" or not paged_ops.use_triton(device):
        pytest.skip("the kernel's helper is replaced only under the interpreter")
    monkeypatch.setattr(paged_ops, "_spec_same", _always_same)
    with pytest.raises(AssertionError):
        test_speculative_launches_match_the_reference(device, monkeypatch, BATCHES[2].values[0], "split", "int8",
                                                      True, False)


# What a previous kernel could write between a speculative program's early reads and its wait, one value kind
# each (idempotent, so that K and V programs of a row agree): the program's cached length | 1 (even lengths: the
# same block, the next offset), its block-table entry | 16 (blocks < 16 move to another block), its slot's
# block | 16 (block size 4), its position | 1. Then the real check runs.
@triton.jit
def _lens_change(n, cu_q, kv_info, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                 MODE: tl.constexpr, ROPE: tl.constexpr):
    g = tl.minimum((n.to(tl.int64) * guess_mul) >> 30, n_seqs - 1)
    tl.store(kv_info + g, tl.load(kv_info + g) | 1)
    return _REAL_SPEC_SAME(n, cu_q, kv_info, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                           MODE, ROPE)


@triton.jit
def _table_change(n, cu_q, kv_info, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                  MODE: tl.constexpr, ROPE: tl.constexpr):
    tl.store(bt_ptr, tl.load(bt_ptr, mask=bt_mask, other=0) | 16, mask=bt_mask)
    return _REAL_SPEC_SAME(n, cu_q, kv_info, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                           MODE, ROPE)


@triton.jit
def _slot_change(n, cu_q, kv_info, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                 MODE: tl.constexpr, ROPE: tl.constexpr):
    sl = tl.load(slots + n)
    tl.store(slots + n, tl.where(sl >= 0, sl | 64, sl))
    return _REAL_SPEC_SAME(n, cu_q, kv_info, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                           MODE, ROPE)


@triton.jit
def _position_change(n, cu_q, kv_info, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
                     MODE: tl.constexpr, ROPE: tl.constexpr):
    tl.store(positions + n, tl.load(positions + n) | 1)
    return _REAL_SPEC_SAME(n, cu_q, kv_info, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw,
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
    if device.type != "cpu" or not paged_ops.use_triton(device):
        pytest.skip("the kernel's helper is replaced only under the interpreter")
    monkeypatch.setattr(paged_ops, "_spec_same", _CHANGES[what])
    H, D, bs, nb = 2, 16, 4, 32
    gen = pr.generator(1300 + len(what))
    rope = RopeConfig(head_dim=D, base=10000.0)
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
    over = dict(split=shape == "split", speculate=True, early=True, rope_ready=True)
    if what in ("lens", "table"):
        index = dict(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                     kv_lens=pr.i32(lens, device), slot_mapping=None, positions=None)
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
        index = dict(block_tables=None, cu_q_lens=None, kv_lens=None, slot_mapping=torch.tensor(slots, device=device),
                     positions=torch.tensor(pos, device=device))
    paged_ops.append_paged_kv_launch(
        k, v, cache.pool(0), cache.params(0), kv_dtype=kv_dtype, layout="NHD", cu_k_lens=None,
        rope=rope.kernel_params(device=device), fp8_scales=cache.kv_scales[0], cp_rank=0, cp_size=1, **index, **over)
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope)


@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
def test_speculative_lookup_with_cu_k_lens_and_context_parallel(device, monkeypatch, kv_dtype):
    """Speculation with cu_k_lens (the guess reads four values) and context parallelism (rank 1 of 2), values
    unchanged and changed, split launches."""
    if not paged_ops.use_triton(device):
        pytest.skip("the torch backend launches no kernel")
    q_lens, kv_lens = [1, 1, 1, 1, 1], [4, 0, 9, 5, 1]
    H, D, bs, nb = 2, 16, 4, 32
    gen = pr.generator(1235)
    rope = RopeConfig(head_dim=D, base=10000.0)
    cu = pr.cumsum0(q_lens)
    totals = [a + b for a, b in zip(kv_lens, q_lens)]
    local = [(t + 1) // 2 for t in totals]
    tables = pr.block_tables_for(gen, local, block_size=bs, num_blocks=nb, extra=0)
    k = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    v = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    targets = pr.ragged_targets(cu[-1], tables, cu, cu_k_lens=pr.cumsum0(totals), block_size=bs, num_blocks=nb,
                                cp_rank=1, cp_size=2)
    assert 0 < len(targets) < cu[-1]
    for changed in (False, True):
        if changed and device.type == "cuda":
            continue
        if changed:
            _spec_never_same(monkeypatch)
        cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
        exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="NHD",
                                 rope=rope)
        paged_ops.append_paged_kv_launch(
            k, v, cache.pool(0), cache.params(0), kv_dtype=kv_dtype, layout="NHD", block_tables=pr.i32(tables, device),
            cu_q_lens=pr.i32(cu, device), kv_lens=None, cu_k_lens=pr.i32(pr.cumsum0(totals), device),
            slot_mapping=None, positions=None, rope=rope.kernel_params(device=device), fp8_scales=cache.kv_scales[0],
            cp_rank=1, cp_size=2, split=True, speculate=True, cs_first=True, early=True, rope_ready=True)
        pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope)


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_speculation_is_the_default_for_decode_with_pdl_and_no_promise(monkeypatch, kv_dtype):
    """Decode-sized launches with PDL and without metadata_ready speculate where the first guess is exact: by
    slot mapping and for ragged batches of one row per sequence (SPECULATE, with the promise's launch shape:
    INDEX_FIRST, split only for fp8), without RoPE too; a mixed ragged batch waits first. inv_freq is read
    after the wait, with cos / sin (FREQS_LATE, no CS_FIRST), unless the caller says no running kernel writes
    it (rope_ready: then cos / sin before the wait except fp8, as with the promise). Not with the promise, not
    without PDL, not for prefill-sized appends, not with partial or interleaved RoPE and not with _SPECULATE
    off. speculate=True with such RoPE or with index_first=False, and cs_first=True where inv_freq is read
    late, are ValueErrors (on the torch backend too)."""
    monkeypatch.setattr(paged_ops, "_pdl_supported", lambda device: True)
    fp8 = kv_dtype == "fp8"
    for slots in (True, False):
        for rope in (True, False):
            each = dict(one_row_each=not slots)
            spec = _launch_consts(monkeypatch, kv_dtype, split=None, slots=slots, rope=rope, pdl=True, **each)
            assert spec["SPECULATE"] is True and spec["INDEX_FIRST"] is True and spec["EARLY"] is True
            assert spec["SPLIT"] is fp8 and spec["CS_FIRST"] is False and spec["FREQS_LATE"] is rope
            known = _launch_consts(monkeypatch, kv_dtype, split=None, slots=slots, rope=rope, pdl=True,
                                   rope_ready=True, **each)
            assert known["SPECULATE"] is True and known["FREQS_LATE"] is False
            ready = _launch_consts(monkeypatch, kv_dtype, split=None, slots=slots, rope=rope, pdl=True, ready=True,
                                   **each)
            assert ready["SPECULATE"] is False and ready["INDEX_FIRST"] is True and ready["FREQS_LATE"] is False
            assert ready["CS_FIRST"] is (rope and not fp8)
            assert {key: val for key, val in ready.items() if key != "SPECULATE"} == {
                key: val for key, val in known.items() if key != "SPECULATE"}
            for other in (dict(pdl=False), dict(pdl=True, rows=paged_ops._SPLIT_BELOW)):
                c = _launch_consts(monkeypatch, kv_dtype, split=None, slots=slots, rope=rope,  # type: ignore[arg-type]
                                   **each, **other)
                assert c["SPECULATE"] is False and c["INDEX_FIRST"] is False, other
        each = dict(one_row_each=not slots)
        partial = _launch_consts(monkeypatch, kv_dtype, split=None, slots=slots, rope=True, pdl=True,
                                 rope_config=RopeConfig(head_dim=16, rotary_dim=8), **each)
        assert partial["SPECULATE"] is False and partial["INDEX_FIRST"] is False
        monkeypatch.setattr(paged_ops, "_SPECULATE", False)
        off = _launch_consts(monkeypatch, kv_dtype, split=None, slots=slots, rope=True, pdl=True, **each)
        assert off["SPECULATE"] is False and off["INDEX_FIRST"] is False
        monkeypatch.setattr(paged_ops, "_SPECULATE", True)
        mixed = _launch_consts(monkeypatch, kv_dtype, split=None, slots=False, rope=True, pdl=True)
        assert mixed["SPECULATE"] is False and mixed["INDEX_FIRST"] is False  # 3 rows of one sequence
        forced = _launch_consts(monkeypatch, kv_dtype, split=None, slots=False, rope=True, pdl=True, speculate=True,
                                rope_ready=True)
        assert forced["SPECULATE"] is True and forced["INDEX_FIRST"] is True
    with pytest.raises(ValueError, match=pr.names("speculate")):
        _launch_consts(monkeypatch, kv_dtype, split=None, rope=True, pdl=True, speculate=True,
                       rope_config=RopeConfig(head_dim=16, interleaved=True))
    cache = pr.sentinel_cache("cpu", num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8, kv_dtype=kv_dtype)
    k = torch.zeros(3, 2, 16, dtype=torch.float16)
    whole = RopeConfig(head_dim=16).kernel_params()
    for name, bad in (("speculate", dict(speculate=True, index_first=False)),
                      ("speculate", dict(speculate=True, rope=RopeConfig(head_dim=16, rotary_dim=8).kernel_params())),
                      ("cs_first", dict(speculate=True, cs_first=True, rope=whole))):  # inv_freq after the wait
        with pytest.raises(ValueError, match=pr.names(name)):  # on the torch backend too
            paged_ops.append_paged_kv_launch(
                k, k, cache.pool(0), cache.params(0), kv_dtype=kv_dtype, layout="NHD", block_tables=None,
                cu_q_lens=None, kv_lens=None, cu_k_lens=None, slot_mapping=torch.arange(3), positions=torch.arange(3),
                fp8_scales=cache.kv_scales[0], cp_rank=0, cp_size=1, **{"rope": None, **bad})


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


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("mode", ["ragged", "slots"])
def test_speculation_sees_index_tensors_written_late(device, mode, kv_dtype):
    """Without the promise, the decode append reads the index tensors before the wait speculatively. A PDL
    kernel that releases its dependents at once and writes them (kv_lens, or the slot mapping and positions)
    only after spinning about 1 ms: the append must store the rows where the new values say, rotated by the
    new positions. A control append with ``metadata_ready=True`` (which trusts its early read) stores them where
    the stale values say: the race is real."""
    if device.type != "cuda" or not paged_ops._pdl_default(device):
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

    writer, _ = _late_writer_kernel()
    grid = (1,)
    t = fresh_targets[0]

    def run(ready: bool):  # type: ignore[no-untyped-def]
        cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                                  kv_dtype=kv_dtype, rope=rope)
        buf.copy_(stale)
        torch.cuda.synchronize()
        writer[grid](fresh, buf, fresh.numel(), SPIN=500000, BLOCK=32, launch_pdl=True)
        cache.append(0, k, v, metadata_ready=ready, **args)
        torch.cuda.synchronize()
        assert torch.equal(buf, fresh), "the writer did not run"
        return cache

    args = index()
    for ready in (False, True):  # warm-up: compile, and prepare the cache's launches (a compile between the two
        # launches would let the writer finish first)
        run(ready)
        run(ready)
    # control: trusting its early read, the promised append stores the rows where the stale values say (else
    # this test could not tell). On a GPU shared with other processes (the suite's workers) a time slice may let
    # the writer finish first: the control is tried up to 5 times
    for _ in range(5):
        control = run(True)
        if pr.is_all_sentinel(control.pool(0)[t.block, :, t.offset]):
            break
    else:
        pytest.fail("the index tensors were never written after the append read them, in 5 tries: no race to test")
    # speculation reads them early too, checks them after the wait and stores the rows where the new values say
    for _ in range(3):
        cache = run(False)
        pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope)
