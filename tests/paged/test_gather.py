"""gather_paged_kv / PagedKVCache.gather: blocks back to contiguous [B, H, S_out, D] K / V against the
independent reference; append -> gather round trips (bit-exact for auto pools); padded tails zero-filled in
sentinel-filled (also non-contiguous) outputs; RoPE applied at gather time; context parallel; a hypothesis
test of random ragged batches. Quantized gathers are also in test_quant.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache.ops import gather_paged_kv
from kvcache.rope import RopeConfig, apply_rope_reference
from sweeps import each_value, named

from . import paged_reference as pr


def _sequences(device, gen, H, D, lens, dtype=torch.float16):  # type: ignore[no-untyped-def]
    """Full random sequences (list of [len, H, D] k and v, on the CPU)."""
    ks = [pr.randn((n, H, D), dtype, gen, "cpu") for n in lens]
    vs = [pr.randn((n, H, D), dtype, gen, "cpu") for n in lens]
    return ks, vs


def _append_in_steps(cache, ks, vs, tables, device, steps=2, layer=0, **kw):  # type: ignore[no-untyped-def]
    """Append whole sequences as a prefill chunk then decode-sized chunks (mixed ragged batches)."""
    lens = [k.shape[0] for k in ks]
    done = [0] * len(lens)
    bt = pr.i32(tables, device)
    for step in range(steps):
        if step == steps - 1:
            take = [n - d for n, d in zip(lens, done)]
        else:
            take = [max(0, (n - d) // 2) if step == 0 else min(1, n - d) for n, d in zip(lens, done)]
        rows_k = torch.cat([k[d:d + t] for k, d, t in zip(ks, done, take)])
        rows_v = torch.cat([v[d:d + t] for v, d, t in zip(vs, done, take)])
        plan = cache.plan(bt, pr.i32(pr.cumsum0(take), device), pr.i32(done, device), **kw)
        cache.append(layer, rows_k.to(device), rows_v.to(device), plan)
        done = [d + t for d, t in zip(done, take)]
    assert done == lens


def _seq_out(base, permuted: bool):  # type: ignore[no-untyped-def]
    """[B, H, S, D] output views: plain, or a permuted view of a [B, S, H, D] buffer."""
    return base.permute(0, 2, 1, 3) if permuted else base


# ---------------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize(("D", "layout", "dtype", "permuted"), each_value(
    [8, 80], ["NHD", "HND"], named([torch.float16, torch.bfloat16], ["fp16", "bf16"]),
    named([False, True], ["contiguous-out", "permuted-out"])))
def test_auto_round_trip_bit_exact(device, D, layout, dtype, permuted):
    H, bs = 3, 4
    lens = [9, 1, 0, 14]
    gen = pr.generator(200 + D)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, dtype=dtype, layout=layout)
    ks, vs = _sequences(device, gen, H, D, lens, dtype)
    tables = pr.block_tables_for(gen, lens, block_size=bs, num_blocks=16, extra=1)
    _append_in_steps(cache, ks, vs, tables, device, steps=3)
    s_out = 16  # > the longest: a padded tail everywhere
    B = len(lens)
    # outputs inside a sentinel-filled buffer with a spare token row on each side
    shape = (2, B, s_out + 2, H, D) if permuted else (2, B, H, s_out + 2, D)
    buf = pr.fill_sentinel(torch.empty(shape, dtype=dtype, device=device))
    if permuted:
        k_out, v_out = buf[0, :, 1:-1].permute(0, 2, 1, 3), buf[1, :, 1:-1].permute(0, 2, 1, 3)
    else:
        k_out, v_out = buf[0, :, :, 1:-1], buf[1, :, :, 1:-1]
    assert not k_out.is_contiguous()
    rk, rv = cache.gather(0, cache.plan(pr.i32(tables, device), seq_lens=pr.i32(lens, device)), k_out=k_out,
                          v_out=v_out)
    assert rk.data_ptr() == k_out.data_ptr() and rv.data_ptr() == v_out.data_ptr()
    exp = pr.gather_expected(cache.pool(0), None, tables, lens, kv_dtype="auto", layout=layout, s_out=s_out,
                             dtype=dtype)
    pr.assert_gather_matches(k_out, v_out, exp, kv_dtype="auto")
    for b, n in enumerate(lens):  # the round trip itself
        pr.assert_bits_equal(k_out[b, :, :n].transpose(0, 1), ks[b], f"sequence {b} keys")
        pr.assert_bits_equal(v_out[b, :, :n].transpose(0, 1), vs[b], f"sequence {b} values")
    spare = (buf[:, :, 0], buf[:, :, -1]) if permuted else (buf[:, :, :, 0], buf[:, :, :, -1])
    assert all(pr.is_all_sentinel(t) for t in spare), "gather wrote outside k_out / v_out"


def test_gather_allocates_with_max_len_from_lengths(device):
    """Without outputs: new tensors [B, H, max(kv_lens), D] of the model dtype (max_len read from kv_lens)."""
    H, D, bs = 2, 8, 4
    lens = [5, 11, 3]
    gen = pr.generator(201)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, dtype=torch.bfloat16)
    ks, vs = _sequences(device, gen, H, D, lens, torch.bfloat16)
    tables = pr.block_tables_for(gen, lens, block_size=bs, num_blocks=16)
    _append_in_steps(cache, ks, vs, tables, device)
    k_out, v_out = cache.gather(0, cache.plan(pr.i32(tables, device), seq_lens=pr.i32(lens, device)))
    assert k_out.shape == v_out.shape == (3, H, 11, D)
    assert k_out.dtype == torch.bfloat16 and k_out.device.type == torch.device(device).type
    exp = pr.gather_expected(cache.pool(0), None, tables, lens, kv_dtype="auto", layout="NHD", s_out=11,
                             dtype=torch.bfloat16)
    pr.assert_gather_matches(k_out, v_out, exp, kv_dtype="auto")
    # max_len given: longer (zero tail) and shorter (the first tokens only)
    for max_len in (13, 4):
        k2, v2 = cache.gather(0, cache.plan(pr.i32(tables, device), seq_lens=pr.i32(lens, device)), max_len=max_len)
        assert k2.shape == (3, H, max_len, D)
        exp = pr.gather_expected(cache.pool(0), None, tables, lens, kv_dtype="auto", layout="NHD", s_out=max_len,
                                 dtype=torch.bfloat16)
        pr.assert_gather_matches(k2, v2, exp, kv_dtype="auto", what=f"max_len {max_len}")


def test_gather_op_on_a_bare_pool(device):
    """The public op: default dtype is the pool's for auto; quantized pools need dtype= when allocating."""
    H, D, bs, nb = 2, 8, 2, 6
    gen = pr.generator(202)
    pool = pr.randn((nb, 2, bs, H, D), torch.float16, gen, device)
    tables, lens = [[4, 1, 3], [0, 5, -1]], [6, 3]
    k_out, v_out = gather_paged_kv(pool, block_tables=pr.i32(tables, device), kv_lens=pr.i32(lens, device))
    assert k_out.shape == (2, H, 6, D) and k_out.dtype == torch.float16
    exp = pr.gather_expected(pool, None, tables, lens, kv_dtype="auto", layout="NHD", s_out=6, dtype=torch.float16)
    pr.assert_gather_matches(k_out, v_out, exp, kv_dtype="auto")


def test_cu_k_lens_mode_equals_kv_lens(device):
    H, D, bs = 2, 80, 4
    lens = [7, 0, 12]
    gen = pr.generator(203)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, kv_dtype="int8")
    ks, vs = _sequences(device, gen, H, D, lens)
    tables = pr.block_tables_for(gen, lens, block_size=bs, num_blocks=16)
    _append_in_steps(cache, ks, vs, tables, device)
    bt = pr.i32(tables, device)
    a = cache.gather(0, cache.plan(bt, seq_lens=pr.i32(lens, device)), max_len=12)
    b = cache.gather(0, cache.plan(bt, cu_k_lens=pr.i32(pr.cumsum0(lens), device)), max_len=12)
    c = cache.gather(0, cache.plan(bt, cu_k_lens=pr.i32(pr.cumsum0(lens), device)))  # max_len from the lengths
    for x, y, z, name in zip(a, b, c, "kv"):
        pr.assert_bits_equal(y, x, f"{name}: cu_k_lens vs kv_lens")
        pr.assert_bits_equal(z, x, f"{name}: cu_k_lens, default max_len")
    exp = pr.gather_expected(cache.pool(0), cache.params(0), tables, lens, kv_dtype="int8", layout="NHD", s_out=12,
                             dtype=torch.float16)
    pr.assert_gather_matches(b[0], b[1], exp, kv_dtype="int8")


def test_zero_length_sequences_gather_zeros(device):
    H, D = 2, 8
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D)
    base = pr.fill_sentinel(torch.empty((2, 2, H, 5, D), dtype=torch.float16, device=device))
    cache.gather(0, cache.plan(pr.i32([[3], [-1]], device), seq_lens=pr.i32([0, 0], device)), k_out=base[0],
                 v_out=base[1])
    assert not base.any(), "zero-length sequences must gather as zeros"


# ---------------------------------------------------------------------------------------------------------
# RoPE at gather time


GATHER_ROPES = {
    "default": (RopeConfig(head_dim=64), None),
    "partial-interleaved": (RopeConfig(head_dim=64, rotary_dim=22, interleaved=True), None),
    "yarn": (RopeConfig(head_dim=64, rope_type="yarn", factor=8.0, original_max_position_embeddings=16), None),
    "dynamic": (RopeConfig(head_dim=64, rope_type="dynamic", factor=2.0, max_position_embeddings=8), 40),
}


@pytest.mark.parametrize(("kv_dtype", "rope_case"), each_value(["auto", "int8"], list(GATHER_ROPES)))
def test_gather_applies_rope_to_unrotated_keys(device, kv_dtype, rope_case):
    """Keys appended without RoPE and gathered with rope=...: equal apply_rope_reference of the stored keys at
    positions 0..len-1 (within one ulp + the float32 RoPE slack); values untouched by RoPE."""
    rope, seq_len = GATHER_ROPES[rope_case]
    H, D, bs = 2, 64, 4
    lens = [10, 3]
    gen = pr.generator(204)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, kv_dtype=kv_dtype)
    ks, vs = _sequences(device, gen, H, D, lens)
    tables = pr.block_tables_for(gen, lens, block_size=bs, num_blocks=16)
    _append_in_steps(cache, ks, vs, tables, device, rope=False)
    k_out, v_out = cache.gather(0, cache.plan(pr.i32(tables, device), seq_lens=pr.i32(lens, device),
                                              rope_seq_len=seq_len), rope=rope)
    exp = pr.gather_expected(cache.pool(0), cache.params(0), tables, lens, kv_dtype=kv_dtype, layout="NHD",
                             s_out=10, dtype=torch.float16, rope=rope, rope_seq_len=seq_len, device=device)
    pr.assert_gather_matches(k_out, v_out, exp, kv_dtype=kv_dtype, rope=rope)
    if kv_dtype == "auto":  # directly against the appended keys, rotated by the reference
        for b, n in enumerate(lens):
            want = apply_rope_reference(ks[b].to(device), torch.arange(n, device=device), rope, seq_len).cpu()
            got = k_out[b, :, :n].transpose(0, 1).cpu()
            tol = pr.ulp(torch.maximum(got.double().abs(), want.double().abs()), torch.float16) + pr.rope_slack(
                ks[b].float(), rope)
            pr.assert_close(got, want, tol, f"sequence {b} keys vs apply_rope_reference")


def test_append_with_rope_then_gather_round_trip(device):
    """Keys rotated at append, gathered without RoPE: the rotated keys come back bit for bit."""
    H, D, bs = 2, 80, 4
    rope = RopeConfig(head_dim=D, rotary_dim=48)
    lens = [6, 9]
    gen = pr.generator(205)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, rope=rope)
    ks, vs = _sequences(device, gen, H, D, lens)
    tables = pr.block_tables_for(gen, lens, block_size=bs, num_blocks=16)
    _append_in_steps(cache, ks, vs, tables, device)
    k_out, v_out = cache.gather(0, cache.plan(pr.i32(tables, device), seq_lens=pr.i32(lens,
                                                                                      device)))  # rope off by default
    exp = pr.gather_expected(cache.pool(0), None, tables, lens, kv_dtype="auto", layout="NHD", s_out=9,
                             dtype=torch.float16)
    pr.assert_gather_matches(k_out, v_out, exp, kv_dtype="auto")
    for b, n in enumerate(lens):
        want = apply_rope_reference(ks[b].to(device), torch.arange(n, device=device), rope).cpu()
        got = k_out[b, :, :n].transpose(0, 1).cpu()
        tol = pr.ulp(torch.maximum(got.double().abs(), want.double().abs()), torch.float16) + pr.rope_slack(
            ks[b].float(), rope)
        pr.assert_close(got, want, tol, f"sequence {b}: rotated at append")
        pr.assert_bits_equal(v_out[b, :, :n].transpose(0, 1), vs[b], f"sequence {b} values")


# ---------------------------------------------------------------------------------------------------------
# context parallel


@pytest.mark.parametrize(("cp_size", "use_rope"), each_value([2, 3], named([False, True], ["no-rope", "rope"])))
def test_context_parallel_gather_reconstructs_sequences(device, cp_size, use_rope):
    """Each rank gathers its local tokens (ceil((len - rank) / cp_size) of them); interleaving the ranks'
    outputs (token p from rank p % cp_size, index p // cp_size) gives the whole sequence. With rope=..., the
    keys of local token t are rotated at global position t * cp_size + rank."""
    H, D, bs = 2, 64, 2
    lens = [7, 1, 5]
    rope = RopeConfig(head_dim=D, interleaved=True) if use_rope else None
    gen = pr.generator(206 + cp_size)
    ks, vs = _sequences(device, gen, H, D, lens)
    gathered = []
    for rank in range(cp_size):
        cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs)
        tables = pr.block_tables_for(gen, lens, block_size=bs, num_blocks=16, cp_size=cp_size)
        _append_in_steps(cache, ks, vs, tables, device, cp_rank=rank, cp_size=cp_size)
        s_out = pr.local_len(max(lens), rank, cp_size) + 1
        base = pr.fill_sentinel(torch.empty((2, len(lens), H, s_out, D), dtype=torch.float16, device=device))
        cache.gather(0, cache.plan(pr.i32(tables, device), seq_lens=pr.i32(lens, device), cp_rank=rank,
                                   cp_size=cp_size), k_out=base[0], v_out=base[1], rope=rope)
        exp = pr.gather_expected(cache.pool(0), None, tables, lens, kv_dtype="auto", layout="NHD", s_out=s_out,
                                 dtype=torch.float16, rope=rope, cp_rank=rank, cp_size=cp_size, device=device)
        pr.assert_gather_matches(base[0], base[1], exp, kv_dtype="auto", rope=rope, what=f"rank {rank}")
        # default max_len on this rank: its longest local length
        k_def, _ = cache.gather(0, cache.plan(pr.i32(tables, device), seq_lens=pr.i32(lens, device), cp_rank=rank,
                                              cp_size=cp_size))
        assert k_def.shape[2] == pr.local_len(max(lens), rank, cp_size)
        gathered.append(base.cpu())
    for b, n in enumerate(lens):
        k_full = torch.stack([gathered[p % cp_size][0, b, :, p // cp_size] for p in range(n)])
        v_full = torch.stack([gathered[p % cp_size][1, b, :, p // cp_size] for p in range(n)])
        pr.assert_bits_equal(v_full, vs[b], f"sequence {b} values from {cp_size} ranks")
        if rope is None:
            pr.assert_bits_equal(k_full, ks[b], f"sequence {b} keys from {cp_size} ranks")
        else:
            want = apply_rope_reference(ks[b].to(device), torch.arange(n, device=device), rope).cpu()
            tol = pr.ulp(torch.maximum(k_full.double().abs(), want.double().abs()), torch.float16) + pr.rope_slack(
                ks[b].float(), rope)
            pr.assert_close(k_full, want, tol, f"sequence {b} keys (global positions)")


# ---------------------------------------------------------------------------------------------------------
# hypothesis: random ragged batches, append then gather


@st.composite
def _ragged_batches(draw):  # type: ignore[no-untyped-def]
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    n_seqs = draw(st.integers(1, 3))
    kv_lens = [draw(st.integers(0, 9)) for _ in range(n_seqs)]
    q_lens = [draw(st.integers(0, 5)) for _ in range(n_seqs)]
    layout = draw(st.sampled_from(["NHD", "HND"]))
    heads = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([8, 12, 80]))
    padding = draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**31 - 1))
    return bs, kv_lens, q_lens, layout, heads, head_dim, padding, seed


# 25 random batches where the kernels are compiled, 4 on the CPU (each takes seconds under Triton's interpreter)
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@settings(max_examples=25 if torch.cuda.is_available() else 4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_ragged_batches())
def test_random_ragged_append_then_gather(device, kv_dtype, case):
    bs, kv_lens, q_lens, layout, H, D, padding, seed = case
    gen = pr.generator(seed)
    totals = [a + b for a, b in zip(kv_lens, q_lens)]
    nb = sum(-(-t // bs) for t in totals) + 3
    tables = pr.block_tables_for(gen, totals, block_size=bs, num_blocks=nb, extra=seed % 2)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype,
                              layout=layout)
    # the tokens already cached: written by a first append (a prefill of kv_lens tokens)
    old_k = pr.randn((sum(kv_lens), H, D), torch.float16, gen, device)
    old_v = pr.randn((sum(kv_lens), H, D), torch.float16, gen, device)
    bt = pr.i32(tables, device)
    zeros = [0] * len(kv_lens)
    t0 = pr.ragged_targets(sum(kv_lens), tables, pr.cumsum0(kv_lens), kv_lens=zeros, block_size=bs, num_blocks=nb)
    exp = pr.append_expected(cache.pool(0), cache.params(0), old_k, old_v, t0, kv_dtype=kv_dtype, layout=layout)
    cache.append(0, old_k, old_v, cache.plan(block_tables=bt, cu_q_lens=pr.i32(pr.cumsum0(kv_lens), device),
                                             kv_lens=pr.i32(zeros, device)))
    # the new tokens: mixed prefill / decode, padding rows at the end
    cu = pr.cumsum0(q_lens)
    k = pr.randn((cu[-1] + padding, H, D), torch.float16, gen, device)
    v = pr.randn((cu[-1] + padding, H, D), torch.float16, gen, device)
    t1 = pr.ragged_targets(k.shape[0], tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=nb)
    assert len(t0) == sum(kv_lens) and len(t1) == cu[-1]
    exp = pr.append_expected(exp.pool, exp.params, k, v, t1, kv_dtype=kv_dtype, layout=layout)
    cache.append(0, k, v, cache.plan(block_tables=bt, cu_q_lens=pr.i32(cu, device), kv_lens=pr.i32(kv_lens, device)))
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout=layout)
    s_out = max(totals) + 1
    base = pr.fill_sentinel(torch.empty((2, len(totals), H, s_out, D), dtype=torch.float16, device=device))
    cache.gather(0, cache.plan(bt, seq_lens=pr.i32(totals, device)), k_out=base[0], v_out=base[1])
    gexp = pr.gather_expected(exp.pool, exp.params, tables, totals, kv_dtype=kv_dtype, layout=layout, s_out=s_out,
                              dtype=torch.float16)
    pr.assert_gather_matches(base[0], base[1], gexp, kv_dtype=kv_dtype)
    if kv_dtype == "auto":  # the whole sequences come back
        for b in range(len(totals)):
            old = slice(sum(kv_lens[:b]), sum(kv_lens[:b + 1]))
            want = torch.cat([old_k[old], k[cu[b]:cu[b + 1]]]).cpu()
            pr.assert_bits_equal(base[0, b, :, :totals[b]].transpose(0, 1), want, f"sequence {b} keys")


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8", "int4", "k8v4", "fp8k"])
def test_gather_sweep_large(device, kv_dtype):
    """GPU-sized: 16 sequences up to 300 tokens, 8 heads, head_dim 128, block 16, with and without RoPE."""
    H, D, bs, nb = 8, 128, 16, 400
    gen = pr.generator(207)
    lens = torch.randint(1, 300, (16,), generator=gen).tolist()
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, kv_dtype=kv_dtype)
    ks, vs = _sequences(device, gen, H, D, lens)
    tables = pr.block_tables_for(gen, lens, block_size=bs, num_blocks=nb, extra=2)
    _append_in_steps(cache, ks, vs, tables, device, rope=False)
    rope = RopeConfig(head_dim=D, rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    for r in (None, rope):
        k_out, v_out = cache.gather(0, cache.plan(pr.i32(tables, device), seq_lens=pr.i32(lens, device)),
                                    rope=r or False)
        exp = pr.gather_expected(cache.pool(0), cache.params(0), tables, lens, kv_dtype=kv_dtype, layout="NHD",
                                 s_out=max(lens), dtype=torch.float16, rope=r, device=device)
        pr.assert_gather_matches(k_out, v_out, exp, kv_dtype=kv_dtype, rope=r)


def _filled_cache(device, seed: int, H: int, D: int, bs: int, lens: list, kv_dtype: str):  # type: ignore[no-untyped-def]
    """A sentinel cache (16 blocks) holding random sequences of ``lens`` tokens, appended in two steps, and their
    block tables."""
    gen = pr.generator(seed)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, kv_dtype=kv_dtype)
    ks, vs = _sequences(device, gen, H, D, lens)
    tables = pr.block_tables_for(gen, lens, block_size=bs, num_blocks=16, extra=1)
    _append_in_steps(cache, ks, vs, tables, device, steps=2)
    return cache, tables


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8", "int4", "k8v4", "fp8k"])
def test_gather_into_odd_strided_outputs(device, kv_dtype):
    """Outputs whose token stride is an odd element count (vector width 1), one of them at an odd element
    offset: every row lands where the strides say, the bytes around stay untouched."""
    H, D, bs = 2, 16, 4
    lens = [6, 3]
    cache, tables = _filled_cache(device, 321, H, D, bs, lens, kv_dtype)
    s_out = 7
    buf = pr.fill_sentinel(torch.empty((2, len(lens), H, s_out, D + 1), dtype=torch.float16, device=device))
    k_out, v_out = buf[0, ..., :D], buf[1, ..., 1:]
    assert k_out.stride(2) == D + 1
    cache.gather(0, cache.plan(pr.i32(tables, device), seq_lens=pr.i32(lens, device)), k_out=k_out, v_out=v_out)
    exp = pr.gather_expected(cache.pool(0), cache.params(0), tables, lens, kv_dtype=kv_dtype, layout="NHD",
                             s_out=s_out, dtype=torch.float16)
    pr.assert_gather_matches(k_out, v_out, exp, kv_dtype=kv_dtype)
    pr.assert_bits_equal(buf[0, ..., D], pr.fill_sentinel(torch.empty_like(buf[0, ..., D])), "k spare column")
    pr.assert_bits_equal(buf[1, ..., 0], pr.fill_sentinel(torch.empty_like(buf[1, ..., 0])), "v spare column")


@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
def test_gather_with_64bit_output_offsets(device, kv_dtype):
    """Outputs spanning 2**31 elements or more take 64-bit address arithmetic (the launch's ``wide``, chosen by
    plan_gather: tests/paged/test_append_policy.py); forced on here for small outputs, that code path writes
    what the 32-bit one does, into strided outputs (a padded head stride and a permuted view)."""
    from kvcache.ops.paged import PagedLayer, gather_paged_kv_launch, plan_gather

    H, D, bs = 3, 16, 4
    lens = [7, 2]
    cache, tables = _filled_cache(device, 331, H, D, bs, lens, kv_dtype)
    s_out = 9
    outs = {}
    for wide in (False, True):
        kb = pr.fill_sentinel(torch.empty((len(lens), H, s_out + 3, D), dtype=torch.float16, device=device))
        vb = pr.fill_sentinel(torch.empty((len(lens), s_out, H, D), dtype=torch.float16, device=device))
        k_out, v_out = kb[:, :, 3:], vb.permute(0, 2, 1, 3)
        launch = plan_gather(k_out, v_out, num_kv_heads=H, head_dim=D)
        assert launch.wide is False
        storage = PagedLayer(cache.pool(0), cache.params(0), cache.kv_scales[0], kv_dtype, "NHD")
        plan = cache.plan(pr.i32(tables, device), seq_lens=pr.i32(lens, device))
        gather_paged_kv_launch(k_out, v_out, storage, plan, None, dataclasses.replace(launch, wide=wide))
        outs[wide] = (kb, vb)
    exp = pr.gather_expected(cache.pool(0), cache.params(0), tables, lens, kv_dtype=kv_dtype, layout="NHD",
                             s_out=s_out, dtype=torch.float16)
    pr.assert_gather_matches(outs[True][0][:, :, 3:], outs[True][1].permute(0, 2, 1, 3), exp, kv_dtype=kv_dtype)
    for i in range(2):
        pr.assert_bits_equal(outs[True][i], outs[False][i], "64-bit against 32-bit offsets")


@pytest.mark.slow
def test_gather_output_past_2_pow_31_elements(device):
    """A gather whose output holds 2**31 elements or more per tensor (a head's offset alone passes int32):
    every row lands at its own place, with 64-bit offsets. GPU-sized: 8 GiB of outputs; skipped where the
    memory is not there."""
    if device.type != "cuda":
        pytest.skip("needs a CUDA GPU: 8 GiB of outputs")
    if torch.cuda.mem_get_info(device)[0] < 12 * 2**30:
        pytest.skip("needs 12 GiB of free GPU memory")
    H, D, bs = 2, 128, 4
    head_stride = 1 << 31  # head 1 starts at element 2**31 of each output
    gen = pr.generator(332)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=4)
    k = pr.randn((3, H, D), torch.float16, gen, device)
    v = pr.randn((3, H, D), torch.float16, gen, device)
    cache.append(0, k, v, cache.plan(block_tables=pr.i32([[2]], device), cu_q_lens=pr.i32([0, 3], device),
                                     kv_lens=pr.i32([0], device)))
    bufs = [torch.full((head_stride + 4 * D,), 7.0, dtype=torch.float16, device=device) for _ in range(2)]
    k_out, v_out = (b.as_strided((1, H, 4, D), (head_stride + 4 * D, head_stride, D, 1)) for b in bufs)
    cache.gather(0, cache.plan(pr.i32([[2]], device), seq_lens=pr.i32([3], device)), k_out=k_out, v_out=v_out)
    for got, want in ((k_out, k), (v_out, v)):
        assert torch.equal(got[0, :, :3], want.transpose(0, 1))
        assert torch.equal(got[0, :, 3], torch.zeros_like(got[0, :, 3]))  # past the sequence: zeros
    for b in bufs:  # nothing between the two heads' rows was written
        assert bool((b[4 * D:head_stride] == 7.0).all())
        del b
