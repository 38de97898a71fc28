"""append_paged_kv / PagedKVCache.append (kv_dtype "auto"): which token goes where, bit-exact against the
independent reference (tests/paged/paged_reference.py) on sentinel-filled pools, and fused RoPE within the
derived float32 bound. Both backends (pure torch, Triton interpreter; compiled Triton on a GPU).

Quantized pools (int8 / int4 / fp8) are in test_quant.py; gather in test_gather.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvcache.ops import append_paged_kv
from kvcache.rope import RopeConfig, apply_rope_reference
from sweeps import each_value, named, pairwise

from . import launches as la
from . import paged_reference as pr

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DTYPE_IDS = ["fp16", "bf16", "fp32"]

# (H, D, block_size, q_lens, kv_lens): prefill chunks and decode tokens mixed, some q_len 0
RAGGED = [
    pytest.param((2, 8, 4, [5, 0, 1, 7], [0, 3, 9, 2]), id="mixed-qlen0"),
    pytest.param((3, 80, 4, [6, 1], [2, 13]), id="h3-d80"),
    pytest.param((2, 8, 1, [3, 1, 0, 2], [0, 4, 2, 1]), id="bs1"),
    pytest.param((1, 64, 16, [20, 1], [10, 31]), id="bs16-cross"),
    pytest.param((3, 96, 4, [1], [0]), id="one-token"),
]


def _ragged_case(device, gen, H, D, bs, q_lens, kv_lens, dtype, *, nb=16, extra=1):  # type: ignore[no-untyped-def]
    n = sum(q_lens)
    k = pr.randn((n, H, D), dtype, gen, device)
    v = pr.randn((n, H, D), dtype, gen, device)
    totals = [a + b for a, b in zip(kv_lens, q_lens)]
    tables = pr.block_tables_for(gen, totals, block_size=bs, num_blocks=nb, extra=extra)
    return k, v, tables, pr.cumsum0(q_lens), totals


# ---------------------------------------------------------------------------------------------------------
# ragged batches


@pytest.mark.parametrize(("case", "layout", "dtype"), pairwise(RAGGED, ["NHD", "HND"], named(DTYPES, DTYPE_IDS)))
def test_ragged_append_bit_exact(device, case, layout, dtype):
    H, D, bs, q_lens, kv_lens = case
    gen = pr.generator(sum(q_lens) * 31 + D)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, dtype=dtype, layout=layout)
    k, v, tables, cu, _ = _ragged_case(device, gen, H, D, bs, q_lens, kv_lens, dtype)
    k0, v0 = k.clone(), v.clone()
    targets = pr.ragged_targets(k.shape[0], tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=16)
    assert len(targets) == k.shape[0]  # every new token has a slot
    exp = pr.append_expected(cache.pool(0), None, k, v, targets, kv_dtype="auto", layout=layout)
    cache.append(0, k, v, cache.plan(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                                     kv_lens=pr.i32(kv_lens, device)))
    pr.assert_append_matches(cache.pool(0), None, exp, kv_dtype="auto", layout=layout)
    pr.assert_bits_equal(k, k0, "k (input must not be written)")
    pr.assert_bits_equal(v, v0, "v (input must not be written)")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_op_directly_on_a_pool(device, layout):
    """The public op on a bare pool tensor (no cache object), with the default (auto) format."""
    H, D, bs, nb = 2, 8, 4, 6
    gen = pr.generator(3)
    shape = (nb, 2, bs, H, D) if layout == "NHD" else (nb, 2, H, bs, D)
    pool = pr.fill_sentinel(torch.empty(shape, dtype=torch.float16, device=device))
    k, v, tables, cu, _ = _ragged_case(device, gen, H, D, bs, [4, 3], [1, 6], torch.float16, nb=nb)
    targets = pr.ragged_targets(7, tables, cu, kv_lens=[1, 6], block_size=bs, num_blocks=nb)
    exp = pr.append_expected(pool, None, k, v, targets, kv_dtype="auto", layout=layout)
    append_paged_kv(k, v, pool, layout=layout, block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                    kv_lens=pr.i32([1, 6], device))
    pr.assert_append_matches(pool, None, exp, kv_dtype="auto", layout=layout)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_kv_lens_and_cu_k_lens_agree(device, layout):
    H, D, bs = 2, 80, 4
    q_lens, kv_lens = [4, 0, 1, 6], [3, 5, 8, 0]
    gen = pr.generator(5)
    k, v, tables, cu, totals = _ragged_case(device, gen, H, D, bs, q_lens, kv_lens, torch.float16)
    caches = [pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, layout=layout) for _ in range(2)]
    bt, cu_t = pr.i32(tables, device), pr.i32(cu, device)
    caches[0].append(0, k, v, caches[0].plan(block_tables=bt, cu_q_lens=cu_t, kv_lens=pr.i32(kv_lens, device)))
    caches[1].append(0, k, v, caches[1].plan(block_tables=bt, cu_q_lens=cu_t, cu_k_lens=pr.i32(pr.cumsum0(totals),
                                                                                               device)))
    pr.assert_bits_equal(caches[1].buffer, caches[0].buffer, "cu_k_lens pool vs kv_lens pool")
    targets = pr.ragged_targets(k.shape[0], tables, cu, cu_k_lens=pr.cumsum0(totals), block_size=bs, num_blocks=16)
    fresh = pr.fill_sentinel(torch.empty_like(caches[1].pool(0)))
    exp = pr.append_expected(fresh, None, k, v, targets, kv_dtype="auto", layout=layout)
    pr.assert_append_matches(caches[1].pool(0), None, exp, kv_dtype="auto", layout=layout)


def test_prefill_then_decode_steps(device):
    """Successive appends (a prefill, then decode steps crossing block boundaries) build the sequence."""
    H, D, bs = 2, 8, 4
    gen = pr.generator(6)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs)
    tables = pr.block_tables_for(gen, [11, 6], block_size=bs, num_blocks=16)
    bt = pr.i32(tables, device)
    expected = pr.fill_sentinel(torch.empty_like(cache.pool(0))).cpu()
    lens = [0, 0]
    for q_lens in ([7, 3], [1, 1], [1, 0], [1, 1], [1, 1]):
        cu = pr.cumsum0(q_lens)
        k = pr.randn((cu[-1], H, D), torch.float16, gen, device)
        v = pr.randn((cu[-1], H, D), torch.float16, gen, device)
        targets = pr.ragged_targets(cu[-1], tables, cu, kv_lens=lens, block_size=bs, num_blocks=16)
        expected = pr.append_expected(expected, None, k, v, targets, kv_dtype="auto", layout="NHD").pool
        cache.append(0, k, v, cache.plan(block_tables=bt, cu_q_lens=pr.i32(cu, device), kv_lens=pr.i32(lens, device)))
        lens = [a + b for a, b in zip(lens, q_lens)]
    pr.assert_bits_equal(cache.pool(0), expected, "pool after five steps")
    assert lens == [11, 6]


def test_padding_rows_past_cu_q_lens_are_skipped(device):
    H, D, bs = 2, 8, 4
    gen = pr.generator(7)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs)
    q_lens, kv_lens = [3, 2], [1, 4]
    cu = pr.cumsum0(q_lens)
    n = cu[-1] + 6  # six padding rows of random data (a CUDA graph's fixed-size batch)
    k = pr.randn((n, H, D), torch.float16, gen, device)
    v = pr.randn((n, H, D), torch.float16, gen, device)
    # the padding rows' would-be slots: give the table room so that only cu_q_lens stops them
    tables = pr.block_tables_for(gen, [16, 16], block_size=bs, num_blocks=16)
    targets = pr.ragged_targets(n, tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=16)
    assert [t.row for t in targets] == list(range(cu[-1]))
    exp = pr.append_expected(cache.pool(0), None, k, v, targets, kv_dtype="auto", layout="NHD")
    cache.append(0, k, v, cache.plan(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                                     kv_lens=pr.i32(kv_lens, device)))
    pr.assert_append_matches(cache.pool(0), None, exp, kv_dtype="auto", layout="NHD")


_ZERO_SEQUENCES = """
import sys, torch
from kvcache.paged import PagedConfig, PagedKVCache
dev = torch.device(sys.argv[1])
cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=4, device=dev))
cache.buffer.view(torch.uint8).fill_(0x5A)
before = cache.buffer.clone()
k = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0)).half().to(dev)
cache.append(0, k, k.clone(), cache.plan(torch.zeros((0, 2), dtype=torch.int32, device=dev),
                                         torch.zeros(1, dtype=torch.int32, device=dev),
                                         torch.zeros(0, dtype=torch.int32, device=dev)))
if dev.type == "cuda":
    torch.cuda.synchronize()
print("unchanged" if torch.equal(cache.buffer.view(torch.int16), before.view(torch.int16)) else "written")
"""


def test_zero_sequences_all_rows_padding(device):
    """B = 0 (cu_q_lens == [0], empty kv_lens and block table): every row is padding, nothing is written.
    Run in a subprocess: a kernel that reads past the empty tensors crashes the process (or, on a GPU,
    leaves the CUDA context unusable for every later test)."""
    proc = subprocess.run([sys.executable, "-c", _ZERO_SEQUENCES, str(device)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, (
        f"append with zero sequences (3 padding rows) exited with {proc.returncode}: {proc.stderr[-2000:]}"
    )
    assert proc.stdout.strip().endswith("unchanged"), proc.stdout


def test_no_tokens_is_a_no_op(device):
    cache = pr.sentinel_cache(device)
    before = cache.buffer.clone()
    empty = torch.empty((0, 2, 8), dtype=torch.float16, device=device)
    cache.append(0, empty, empty, cache.plan(block_tables=pr.i32([[0]], device), cu_q_lens=pr.i32([0, 0], device),
                                             kv_lens=pr.i32([3], device)))
    cache.append(0, empty, empty, cache.plan(slot_mapping=torch.empty(0, dtype=torch.int64, device=device)))
    pr.assert_bits_equal(cache.buffer, before, "pool")


@pytest.mark.parametrize(("split", "kv_dtype"), each_value(
    named([False, True], ["per-row", "split"]), ["auto", "fp8", "int8", "int4", "k8v4", "fp8k"]))
def test_rows_outside_the_block_table_are_skipped_without_check(device, split, kv_dtype):
    """Without check=True, rows whose block index is past the table, or whose block id is -1 or past the
    pool, are skipped on the device; the other rows are written. Both launch shapes: one program per row
    (stores behind a branch on the row's validity) and split (stores predicated on it), every format (data
    and scale / zero)."""
    H, D, bs, nb = 2, 8, 4, 8
    gen = pr.generator(9)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    q_lens, kv_lens = [10, 6, 5], [0, 2, 0]
    cu = pr.cumsum0(q_lens)
    k = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    v = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    # seq 0 needs 3 blocks, the table holds 2; seq 1 has block id -1 at index 1; seq 2 has id nb + 3 at index 1
    tables = [[3, 5], [6, -1], [1, nb + 3]]
    targets = pr.ragged_targets(cu[-1], tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=nb)
    assert len(targets) == 8 + 2 + 4
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="NHD")
    la.append_with(cache, 0, k, v, "split-kv" if split else "per-row", block_tables=pr.i32(tables, device),
                   cu_q_lens=pr.i32(cu, device), kv_lens=pr.i32(kv_lens, device))
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD")


def test_only_the_given_layer_is_written(device):
    H, D, bs = 2, 8, 4
    gen = pr.generator(10)
    cache = pr.sentinel_cache(device, num_layers=3, num_kv_heads=H, head_dim=D, block_size=bs)
    k, v, tables, cu, _ = _ragged_case(device, gen, H, D, bs, [5, 2], [0, 7], torch.float16)
    targets = pr.ragged_targets(7, tables, cu, kv_lens=[0, 7], block_size=bs, num_blocks=16)
    exp = pr.append_expected(cache.pool(1), None, k, v, targets, kv_dtype="auto", layout="NHD")
    cache.append(1, k, v, cache.plan(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                                     kv_lens=pr.i32([0, 7], device)))
    pr.assert_append_matches(cache.pool(1), None, exp, kv_dtype="auto", layout="NHD")
    for layer in (0, 2):
        pr.assert_bits_equal(cache.pool(layer), pr.fill_sentinel(torch.empty_like(cache.pool(layer))),
                             f"layer {layer} (not appended to)")


# ---------------------------------------------------------------------------------------------------------
# slot mapping


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_slot_mapping_with_padding(device, layout, slot_dtype):
    H, D, bs, nb = 3, 80, 4, 8
    gen = pr.generator(11)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, layout=layout)
    n = 12
    k = pr.randn((n, H, D), torch.float16, gen, device)
    v = pr.randn((n, H, D), torch.float16, gen, device)
    slots = torch.randperm(nb * bs, generator=gen)[:n].tolist()
    for i in (0, 5, 6, 11):
        slots[i] = -1
    slots[3] = nb * bs - 1  # the last slot of the pool
    targets = pr.slot_targets(slots, block_size=bs, num_blocks=nb)
    assert len(targets) == n - 4
    exp = pr.append_expected(cache.pool(0), None, k, v, targets, kv_dtype="auto", layout=layout)
    cache.append(0, k, v, cache.plan(slot_mapping=torch.tensor(slots, dtype=slot_dtype, device=device)))
    pr.assert_append_matches(cache.pool(0), None, exp, kv_dtype="auto", layout=layout)


@pytest.mark.parametrize(("split", "kv_dtype", "use_rope"), pairwise(
    named([False, True], ["per-row", "split"]), ["auto", "fp8", "int8", "int4", "k8v4", "fp8k"],
    named([False, True], ["no-rope", "rope"])))
def test_slot_mapping_past_the_pool_is_skipped_without_check(device, split, kv_dtype, use_rope):
    """Slots -1 and past the pool write nothing, in both launch shapes and every format (see above), with RoPE
    too (quantized split launches with RoPE keep the branch on the row's validity: rope_select)."""
    H, D, bs, nb = 2, 8, 4, 4
    gen = pr.generator(12)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    k = pr.randn((4, H, D), torch.float16, gen, device)
    v = pr.randn((4, H, D), torch.float16, gen, device)
    slots, positions = [2, nb * bs, -1, nb * bs + 7], [5, 1, 0, 9]
    rope = RopeConfig(head_dim=D, base=10000.0) if use_rope else None
    targets = pr.slot_targets(slots, block_size=bs, num_blocks=nb, positions=positions)
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="NHD",
                             rope=rope)
    la.append_with(cache, 0, k, v, "split-kv" if split else "per-row",
                   slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                   positions=torch.tensor(positions, device=device) if use_rope else None, rope=rope)
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope)


# ---------------------------------------------------------------------------------------------------------
# context parallel


@pytest.mark.parametrize("cp_size", [2, 3])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_context_parallel_ranks_write_their_tokens(device, cp_size, layout):
    """Token p lives on rank p % cp_size at local position p // cp_size: each rank writes only its tokens, and
    the union over ranks holds the whole sequence."""
    H, D, bs = 2, 8, 2
    q_lens, kv_lens = [7, 1, 0, 4], [0, 9, 3, 5]
    gen = pr.generator(13 + cp_size)
    n = sum(q_lens)
    k = pr.randn((n, H, D), torch.float16, gen, device)
    v = pr.randn((n, H, D), torch.float16, gen, device)
    cu = pr.cumsum0(q_lens)
    totals = [a + b for a, b in zip(kv_lens, q_lens)]
    caches, tables = [], []
    for rank in range(cp_size):
        cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, layout=layout)
        tab = pr.block_tables_for(gen, totals, block_size=bs, num_blocks=16, cp_size=cp_size)
        targets = pr.ragged_targets(n, tab, cu, kv_lens=kv_lens, block_size=bs, num_blocks=16, cp_rank=rank,
                                    cp_size=cp_size)
        exp = pr.append_expected(cache.pool(0), None, k, v, targets, kv_dtype="auto", layout=layout)
        cache.append(0, k, v, cache.plan(block_tables=pr.i32(tab, device), cu_q_lens=pr.i32(cu, device),
                                         kv_lens=pr.i32(kv_lens, device), cp_rank=rank, cp_size=cp_size))
        pr.assert_append_matches(cache.pool(0), None, exp, kv_dtype="auto", layout=layout, what=f"rank {rank}")
        caches.append(cache)
        tables.append(tab)
    # union: every new token of every sequence is found on its rank, nowhere else twice
    for b in range(len(q_lens)):
        for i in range(q_lens[b]):
            p = kv_lens[b] + i
            rank, local = p % cp_size, p // cp_size
            blk, off = tables[rank][b][local // bs], local % bs
            for kv, src in ((0, k), (1, v)):
                for h in range(H):
                    got = caches[rank].pool(0)[pr.row_index(layout, blk, kv, off, h)]
                    pr.assert_bits_equal(got, src[cu[b] + i, h], f"seq {b} position {p} on rank {rank}")


# ---------------------------------------------------------------------------------------------------------
# non-contiguous inputs


def test_kv_slices_of_a_fused_qkv_tensor(device):
    Hq, Hkv, D, bs = 4, 2, 80, 4
    gen = pr.generator(14)
    n = 9
    qkv = pr.randn((n, Hq + 2 * Hkv, D), torch.float16, gen, device)
    qkv0 = qkv.clone()
    k, v = qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]
    assert not k.is_contiguous() and k.stride(0) == (Hq + 2 * Hkv) * D
    cache = pr.sentinel_cache(device, num_kv_heads=Hkv, head_dim=D, block_size=bs)
    q_lens, kv_lens = [6, 3], [3, 0]
    cu = pr.cumsum0(q_lens)
    tables = pr.block_tables_for(gen, [9, 3], block_size=bs, num_blocks=16)
    targets = pr.ragged_targets(n, tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=16)
    exp = pr.append_expected(cache.pool(0), None, k.contiguous(), v.contiguous(), targets, kv_dtype="auto",
                             layout="NHD")
    cache.append(0, k, v, cache.plan(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                                     kv_lens=pr.i32(kv_lens, device)))
    pr.assert_append_matches(cache.pool(0), None, exp, kv_dtype="auto", layout="NHD")
    pr.assert_bits_equal(qkv, qkv0, "qkv (input must not be written)")


@pytest.mark.parametrize("view", ["every-other-token", "padded-head-stride", "negative-free-transpose"])
def test_strided_kv_views(device, view):
    H, D, bs, n = 2, 8, 4, 6
    gen = pr.generator(15)
    if view == "every-other-token":
        big_k = pr.randn((2 * n, H, D), torch.float16, gen, device)
        big_v = pr.randn((2 * n, H, D), torch.float16, gen, device)
        k, v = big_k[::2], big_v[1::2]
    elif view == "padded-head-stride":
        big_k = pr.randn((n, H, D + 24), torch.float16, gen, device)
        big_v = pr.randn((n, H + 1, D), torch.float16, gen, device)
        k, v = big_k[:, :, 3:3 + D], big_v[:, 1:]
    else:  # heads outer in memory: [H, n, D] storage seen as [n, H, D]
        k = pr.randn((H, n, D), torch.float16, gen, device).transpose(0, 1)
        v = pr.randn((H, n, D), torch.float16, gen, device).transpose(0, 1)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs)
    slots = [5, 0, 17, -1, 9, 63]
    targets = pr.slot_targets(slots, block_size=bs, num_blocks=16)
    exp = pr.append_expected(cache.pool(0), None, k.contiguous(), v.contiguous(), targets, kv_dtype="auto",
                             layout="NHD")
    cache.append(0, k, v, cache.plan(slot_mapping=torch.tensor(slots, device=device)))
    pr.assert_append_matches(cache.pool(0), None, exp, kv_dtype="auto", layout="NHD")


# ---------------------------------------------------------------------------------------------------------
# fused RoPE


def _rope(name: str, D: int) -> tuple[RopeConfig, int | None]:
    """(RopeConfig, rope_seq_len) by case name."""
    if name == "default":
        return RopeConfig(head_dim=D), None
    if name == "interleaved":
        return RopeConfig(head_dim=D, interleaved=True), None
    if name == "partial":
        return RopeConfig(head_dim=D, rotary_dim=D // 2, base=500000.0), None
    if name == "partial-interleaved":
        return RopeConfig(head_dim=D, rotary_dim=D // 4 * 2 - 2 if D > 8 else 4, interleaved=True), None
    if name == "linear":
        return RopeConfig(head_dim=D, rope_type="linear", factor=4.0), None
    if name == "llama3":
        return RopeConfig(head_dim=D, base=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64), None
    if name == "yarn":
        return RopeConfig(head_dim=D, rope_type="yarn", factor=4.0, original_max_position_embeddings=64), None
    if name == "yarn-mscale":
        return RopeConfig(head_dim=D, rope_type="yarn", factor=40.0, original_max_position_embeddings=64,
                          mscale=1.0, mscale_all_dim=0.8), None
    if name == "dynamic":  # length past max_position_embeddings: the grown base
        return RopeConfig(head_dim=D, rope_type="dynamic", factor=2.0, max_position_embeddings=32), 3100
    raise KeyError(name)


ROPE_CASES = ["default", "interleaved", "partial", "partial-interleaved", "linear", "llama3", "yarn", "yarn-mscale",
              "dynamic"]


@pytest.mark.parametrize(("D", "rope_case"), each_value([64, 80], ROPE_CASES))
def test_append_with_rope(device, rope_case, D):
    H, bs = 2, 4
    rope, seq_len = _rope(rope_case, D)
    gen = pr.generator(16 + D)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs)
    k, v, tables, cu, kv_lens = pr.long_position_batch(device, gen, H, D, bs, torch.float16)
    targets = pr.ragged_targets(k.shape[0], tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=16)
    assert len(targets) == k.shape[0]
    exp = pr.append_expected(cache.pool(0), None, k, v, targets, kv_dtype="auto", layout="NHD", rope=rope,
                             rope_seq_len=seq_len)
    cache.append(0, k, v, cache.plan(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                                     kv_lens=pr.i32(kv_lens, device), rope=rope, rope_seq_len=seq_len))
    pr.assert_append_matches(cache.pool(0), None, exp, kv_dtype="auto", layout="NHD", rope=rope)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_with_rope_dtypes_and_layouts(device, layout, dtype):
    H, D, bs = 3, 96, 4
    rope, _ = _rope("partial-interleaved", D)
    gen = pr.generator(17)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, dtype=dtype, layout=layout)
    k, v, tables, cu, kv_lens = pr.long_position_batch(device, gen, H, D, bs, dtype)
    targets = pr.ragged_targets(k.shape[0], tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=16)
    exp = pr.append_expected(cache.pool(0), None, k, v, targets, kv_dtype="auto", layout=layout, rope=rope)
    cache.append(0, k, v, cache.plan(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                                     kv_lens=pr.i32(kv_lens, device), rope=rope))
    pr.assert_append_matches(cache.pool(0), None, exp, kv_dtype="auto", layout=layout, rope=rope)


def test_cache_default_rope_and_overrides(device):
    """PagedKVCache(rope=...) rotates by default; rope=False stores keys as given; a per-call RopeConfig or
    RopeKernelParams overrides the default."""
    H, D, bs = 2, 64, 4
    default, _ = _rope("default", D)
    other, _ = _rope("interleaved", D)
    gen = pr.generator(18)
    k = pr.randn((3, H, D), torch.float16, gen, device)
    v = pr.randn((3, H, D), torch.float16, gen, device)
    slots, positions = [7, 2, 12], [7, 2, 12]
    targets = pr.slot_targets(slots, block_size=bs, num_blocks=16, positions=positions)
    sm = torch.tensor(slots, device=device)
    pos = torch.tensor(positions, device=device)
    for how, rope_arg, expected_rope in [
        ("default", None, default),
        ("rope=True", True, default),
        ("rope=False", False, None),
        ("override", other, other),
        ("kernel params", other.kernel_params(device=device), other),
    ]:
        cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, rope=default)
        exp = pr.append_expected(cache.pool(0), None, k, v, targets, kv_dtype="auto", layout="NHD",
                                 rope=expected_rope)
        cache.append(0, k, v, cache.plan(slot_mapping=sm, positions=pos, rope=rope_arg))
        pr.assert_append_matches(cache.pool(0), None, exp, kv_dtype="auto", layout="NHD", rope=expected_rope,
                                 what=how)


@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_rope_in_slot_mapping_mode_uses_positions(device, pos_dtype):
    H, D, bs = 2, 80, 4
    rope, _ = _rope("yarn", D)
    gen = pr.generator(19)
    k = pr.randn((5, H, D), torch.float16, gen, device)
    v = pr.randn((5, H, D), torch.float16, gen, device)
    slots, positions = [3, -1, 40, 41, 0], [9, 100, 4095, 17, 0]
    targets = pr.slot_targets(slots, block_size=bs, num_blocks=16, positions=positions)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs)
    exp = pr.append_expected(cache.pool(0), None, k, v, targets, kv_dtype="auto", layout="NHD", rope=rope)
    cache.append(0, k, v, cache.plan(slot_mapping=torch.tensor(slots, device=device),
                                     positions=torch.tensor(positions, dtype=pos_dtype, device=device), rope=rope))
    pr.assert_append_matches(cache.pool(0), None, exp, kv_dtype="auto", layout="NHD", rope=rope)


@pytest.mark.parametrize("cp_size", [2, 3])
def test_rope_with_context_parallel_uses_global_positions(device, cp_size):
    H, D, bs = 2, 64, 2
    rope, _ = _rope("default", D)
    q_lens, kv_lens = [6, 1], [0, 13]
    gen = pr.generator(20)
    n = sum(q_lens)
    k = pr.randn((n, H, D), torch.float16, gen, device)
    v = pr.randn((n, H, D), torch.float16, gen, device)
    cu = pr.cumsum0(q_lens)
    totals = [a + b for a, b in zip(kv_lens, q_lens)]
    tables = pr.block_tables_for(gen, totals, block_size=bs, num_blocks=16, cp_size=cp_size)
    for rank in range(cp_size):
        cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs)
        targets = pr.ragged_targets(n, tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=16, cp_rank=rank,
                                    cp_size=cp_size)
        assert all(t.position % cp_size == rank for t in targets)
        exp = pr.append_expected(cache.pool(0), None, k, v, targets, kv_dtype="auto", layout="NHD", rope=rope)
        cache.append(0, k, v, cache.plan(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                                         kv_lens=pr.i32(kv_lens, device), rope=rope, cp_rank=rank, cp_size=cp_size))
        pr.assert_append_matches(cache.pool(0), None, exp, kv_dtype="auto", layout="NHD", rope=rope,
                                 what=f"rank {rank}")


def test_rope_matches_transformers_llama(device):
    """The fused rotation against transformers' own Llama rotary module and apply_rotary_pos_emb (float32
    model dtype: the only rounding is float32's), llama3 scaling."""
    pytest.importorskip("transformers")
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    H, D, bs = 2, 64, 4
    params = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=64, rope_theta=500000.0)
    config = transformers.LlamaConfig(hidden_size=D * 4, num_attention_heads=4, head_dim=D,
                                      max_position_embeddings=1024, rope_parameters=params)
    rope = RopeConfig.from_hf(config)
    module = LlamaRotaryEmbedding(config)
    gen = pr.generator(21)
    positions = [0, 1, 63, 64, 500, 1023]
    k = pr.randn((len(positions), H, D), torch.float32, gen, device)
    v = pr.randn((len(positions), H, D), torch.float32, gen, device)
    slots = list(range(len(positions)))
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, dtype=torch.float32)
    cache.append(0, k, v, cache.plan(slot_mapping=torch.tensor(slots, device=device),
                                     positions=torch.tensor(positions, device=device), rope=rope))
    pos = torch.tensor(positions)[None]
    cos, sin = module(k.cpu()[None], pos)
    kt = k.cpu().transpose(0, 1)[None]  # [1, H, n, D]
    hf_k, _ = apply_rotary_pos_emb(kt, kt, cos, sin)
    want = hf_k[0].transpose(0, 1)  # [n, H, D]
    got = torch.stack([cache.pool(0)[s // bs, 0, s % bs] for s in slots]).cpu()
    tol = pr.ulp(torch.maximum(got.abs(), want.abs()), torch.float32) + pr.rope_slack(want, rope)
    pr.assert_close(got, want, tol, "keys vs transformers")
    # and the reference used everywhere else agrees with transformers exactly on the CPU
    assert torch.equal(apply_rope_reference(k.cpu(), torch.tensor(positions), rope), want)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("rope_case", [None, "default", "partial-interleaved", "yarn"])
def test_append_sweep_large(device, layout, rope_case):
    """GPU-sized: 8 heads, head_dim 128, 64 sequences, block 16, positions into the thousands."""
    H, D, bs, nb = 8, 128, 16, 512
    gen = pr.generator(22)
    rope = _rope(rope_case, D)[0] if rope_case else None
    q_lens = torch.randint(0, 40, (64,), generator=gen).tolist()
    kv_lens = torch.randint(0, 60, (64,), generator=gen).tolist()
    kv_lens[0] = 3000
    totals = [a + b for a, b in zip(kv_lens, q_lens)]
    width = -(-max(totals) // bs)
    perm = torch.randperm(nb, generator=gen).tolist()
    tables = []
    for first, total in zip(kv_lens, totals):
        row = [-1] * width
        for j in range(first // bs, -(-total // bs)):
            row[j] = perm.pop()
        tables.append(row)
    cu = pr.cumsum0(q_lens)
    k = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    v = pr.randn((cu[-1], H, D), torch.float16, gen, device)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, layout=layout)
    targets = pr.ragged_targets(cu[-1], tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=nb)
    exp = pr.append_expected(cache.pool(0), None, k, v, targets, kv_dtype="auto", layout=layout, rope=rope)
    cache.append(0, k, v, cache.plan(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                                     kv_lens=pr.i32(kv_lens, device), rope=rope))
    pr.assert_append_matches(cache.pool(0), None, exp, kv_dtype="auto", layout=layout, rope=rope)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a pool past 2^31 elements: GPU memory")
@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
def test_offsets_past_2_31_elements(kv_dtype):
    """Block ids whose element offset passes 2^31 (program offsets widened to int64): append into the last
    blocks of a 4 GiB pool and gather them back."""
    device = torch.device("cuda")
    H, D, bs = 8, 128, 16
    dp = D // 2 if kv_dtype == "int4" else D
    per_block = 2 * bs * H * dp  # elements of one block
    nb = 2**31 // per_block + 4
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    assert (nb - 1) * per_block > 2**31
    gen = pr.generator(23)
    n = 2 * bs + 3
    k = pr.randn((n, H, D), torch.float16, gen, device)
    v = pr.randn((n, H, D), torch.float16, gen, device)
    tables = [[nb - 1, nb - 3, 0]]
    cache.append(0, k, v, cache.plan(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32([0, n], device),
                                     kv_lens=pr.i32([0], device)))
    for blk in (nb - 2, nb - 4, 1):
        assert pr.is_all_sentinel(cache.pool(0)[blk]), f"block {blk} was written"
    small_pool = torch.stack([cache.pool(0)[b] for b in (nb - 1, nb - 3, 0)])
    small_par = None if cache.params(0) is None else torch.stack([cache.params(0)[b] for b in (nb - 1, nb - 3, 0)])
    targets = pr.ragged_targets(n, [[0, 1, 2]], [0, n], kv_lens=[0], block_size=bs, num_blocks=3)
    fresh = pr.fill_sentinel(torch.empty_like(small_pool))
    fresh_par = None if small_par is None else pr.fill_sentinel(torch.empty_like(small_par))
    exp = pr.append_expected(fresh, fresh_par, k, v, targets, kv_dtype=kv_dtype, layout="NHD")
    pr.assert_append_matches(small_pool, small_par, exp, kv_dtype=kv_dtype, layout="NHD")
    k_out, v_out = cache.gather(0, cache.plan(pr.i32(tables, device), seq_lens=pr.i32([n], device)))
    gexp = pr.gather_expected(small_pool, small_par, [[0, 1, 2]], [n], kv_dtype=kv_dtype, layout="NHD", s_out=n,
                              dtype=torch.float16)
    pr.assert_gather_matches(k_out, v_out, gexp, kv_dtype=kv_dtype)
