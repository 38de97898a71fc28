"""The append kernel's launch variants against the independent reference: one program per row, or one for each
row's K and one for its V (split), the sequence lookup's first guess (rows spread evenly over the sequences)
and its fallback search, the prepared launches of the cache, and the programmatic-dependent-launch switch.

Every format and RoPE on K, bit-exact where the format is (the reference's float32 formula), within the
derived bounds with RoPE. Both CPU backends; compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch

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


@pytest.fixture(params=[False, True], ids=["per-row", "split-kv"])
def split(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """One program per row (K and V), or two (K, V): the threshold of rows below which appends split."""
    monkeypatch.setattr(paged_ops, "_SPLIT_BELOW", 1 << 40 if request.param else 0)
    return request.param


@pytest.mark.parametrize("use_rope", [False, True], ids=["no-rope", "rope"])
@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("batch", BATCHES)
def test_ragged_launch_variants(device, split, batch, kv_dtype, use_rope):
    q_lens, kv_lens, pad = batch
    H, D, bs, nb = 2, 16, 4, 32
    gen = pr.generator(7 * len(q_lens) + pad + split)
    rope = RopeConfig(head_dim=D, base=10000.0) if use_rope else None
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    cu = pr.cumsum0(q_lens)
    totals = [a + b for a, b in zip(kv_lens, q_lens)]
    tables = pr.block_tables_for(gen, totals, block_size=bs, num_blocks=nb, extra=1)
    n = cu[-1] + pad
    k = pr.randn((n, H, D), torch.float16, gen, device)
    v = pr.randn((n, H, D), torch.float16, gen, device)
    targets = pr.ragged_targets(n, tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=nb)
    assert len(targets) == cu[-1]  # every token has a slot, padding rows none
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="NHD",
                             rope=rope)
    cache.append(0, k, v, block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                 kv_lens=pr.i32(kv_lens, device), rope=rope if use_rope else False)
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope)


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
    rope = RopeConfig(head_dim=D)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    n = 11
    k = pr.randn((n, H, D), torch.float16, gen, device)
    v = pr.randn((n, H, D), torch.float16, gen, device)
    slots = torch.randperm(nb * bs, generator=gen)[:n].tolist()
    slots[0] = slots[7] = -1
    positions = torch.randint(0, 5000, (n,), generator=gen).tolist()
    targets = pr.slot_targets(slots, block_size=bs, num_blocks=nb, positions=positions)
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="NHD",
                             rope=rope)
    cache.append(0, k, v, slot_mapping=torch.tensor(slots, device=device),
                 positions=torch.tensor(positions, device=device), rope=rope)
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
    plan (CUDA) with raw pointers. Every step, every layer against the reference; the batch shrinks midway
    (a new plan), one step reads K from an unaligned view (the generic launch), RoPE from the cache."""
    H, D, bs, nb, L = 2, 16, 4, 64, 3
    rope = RopeConfig(head_dim=D, base=10000.0)
    cache = pr.sentinel_cache(device, num_layers=L, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                              kv_dtype=kv_dtype, rope=rope)
    gen = pr.generator(404)
    lens = [3, 9, 1]
    tables = pr.block_tables_for(gen, [x + 6 for x in lens], block_size=bs, num_blocks=nb, extra=0)
    for step in range(5):
        B = 3 if step < 3 else 2  # a smaller batch from step 3 on
        cu = list(range(B + 1))
        kv = lens[:B]
        spare = pr.randn((B * H * D + 1,), torch.float16, gen, device)
        for layer in range(L):
            k = pr.randn((B, H, D), torch.float16, gen, device)
            if step == 2 and layer == 1:
                k = spare[1:].view(B, H, D)  # 2 bytes past an aligned start
            v = pr.randn((B, H, D), torch.float16, gen, device)
            targets = pr.ragged_targets(B, [tables[b] for b in range(B)], cu, kv_lens=kv, block_size=bs,
                                        num_blocks=nb)
            assert len(targets) == B
            exp = pr.append_expected(cache.pool(layer), cache.params(layer), k, v, targets, kv_dtype=kv_dtype,
                                     layout="NHD", rope=rope)
            if mode == "ragged":
                cache.append(layer, k, v, block_tables=pr.i32([tables[b] for b in range(B)], device),
                             cu_q_lens=pr.i32(cu, device), kv_lens=pr.i32(kv, device))
            else:
                slots = [t.block * bs + t.offset for t in targets]
                cache.append(layer, k, v, slot_mapping=torch.tensor(slots, device=device),
                             positions=torch.tensor([t.position for t in targets], dtype=torch.int32, device=device))
            pr.assert_append_matches(cache.pool(layer), cache.params(layer), exp, kv_dtype=kv_dtype, layout="NHD",
                                     rope=rope, what=f"step {step} layer {layer}")
        lens = [x + 1 for x in lens]
    if device.type == "cuda":
        assert cache._plans, "the prepared launch path was never taken"


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
    q_lens, kv_lens = [4, 1, 2], [0, 2100, 5]
    cu = pr.cumsum0(q_lens)
    totals = [a + b for a, b in zip(kv_lens, q_lens)]
    width = -(-max(totals) // bs)
    perm = torch.randperm(nb, generator=gen).tolist()
    tables = [[-1] * width for _ in totals]
    for b, (first, total) in enumerate(zip(kv_lens, totals)):
        for j in range(first // bs, -(-total // bs)):
            tables[b][j] = perm.pop()
    k = pr.randn((cu[-1], H, D), dtype, gen, device)
    v = pr.randn((cu[-1], H, D), dtype, gen, device)
    targets = pr.ragged_targets(cu[-1], tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=nb)
    assert len(targets) == cu[-1]
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="HND",
                             rope=rope)
    cache.append(0, k, v, block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                 kv_lens=pr.i32(kv_lens, device), rope=rope)
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="HND", rope=rope)
