"""StepPlan: one step's batch, built and validated once by PagedKVCache.plan, read by every layer's append,
attention and gather, with the same bytes as the loose keyword ops; its launches derived once; misuse a clear
error before anything is written."""

from __future__ import annotations

import dataclasses
import unittest.mock

import pytest
import torch

from kvcache import PagedConfig, PagedKVCache, RopeConfig, StepPlan, ops
from kvcache.ops.attention import paged as attention_paged
from kvcache.ops.paged import launch as paged_launch


def _i32(x: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=device)


def _cache(device: torch.device, kv_dtype: str, layers: int = 2, **kw) -> PagedKVCache:  # type: ignore[no-untyped-def]
    cfg = PagedConfig(num_layers=layers, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=16,
                      dtype=torch.float16, kv_dtype=kv_dtype, device=device)
    return PagedKVCache(cfg, rope=RopeConfig(head_dim=8), **kw)


def _kv(n: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 2, 8, generator=gen).to(torch.float16).to(device),
            torch.randn(n, 2, 8, generator=gen).to(torch.float16).to(device))


@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
@pytest.mark.parametrize("form", ["kv_lens", "cu_k_lens"])
def test_plan_appends_and_gathers_what_the_ops_do(device, kv_dtype, form):
    tables = _i32([[3, 9, 1], [12, 5, 0], [7, 2, 8]], device)
    cu_q = _i32([0, 1, 6, 6], device)  # a decode row, a 5-token chunk across a block boundary, an idle sequence
    before = [6, 2, 4]
    q_lens = [1, 5, 0]
    if form == "kv_lens":
        lens = dict(kv_lens=_i32(before, device))
    else:
        totals = [b + q for b, q in zip(before, q_lens)]
        lens = dict(cu_k_lens=_i32([0, totals[0], totals[0] + totals[1], sum(totals)], device))
    cache, ref = _cache(device, kv_dtype), _cache(device, kv_dtype)
    plan = cache.plan(tables, cu_q, **lens)
    assert isinstance(plan, StepPlan) and plan.is_ragged and plan.num_seqs == 3
    assert plan.seq_lens.tolist() == [7, 7, 4]
    k, v = _kv(6, device)
    rope = RopeConfig(head_dim=8).kernel_params(device=device)
    for layer in range(2):
        cache.append(layer, k, v, plan)
        ops.append_paged_kv(k, v, ref.pool(layer), ref.params(layer), kv_dtype=kv_dtype, block_tables=tables,
                            cu_q_lens=cu_q, rope=rope, fp8_scales=ref.kv_scales[layer], **lens)
    assert torch.equal(cache.buffer, ref.buffer)
    if ref.params_buffer is not None:
        assert torch.equal(cache.params_buffer, ref.params_buffer)
    got = cache.gather(1, plan)
    want = ops.gather_paged_kv(ref.pool(1), ref.params(1), kv_dtype=kv_dtype, block_tables=tables,
                               kv_lens=_i32([7, 7, 4], device), dtype=torch.float16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    only = cache.gather(1, cache.plan(tables, seq_lens=_i32([7, 7, 4], device)))  # a plan for gathers only
    assert all(torch.equal(a, b) for a, b in zip(only, want))


def test_slot_plan_is_the_slot_mapping(device):
    cache, ref = _cache(device, "int8"), _cache(device, "int8")
    k, _ = _kv(3, device)
    slots = torch.tensor([5, -1, 17], dtype=torch.int64, device=device)
    pos = torch.tensor([5, 0, 9], dtype=torch.int64, device=device)
    plan = cache.plan(slot_mapping=slots, positions=pos)
    assert not plan.is_ragged and plan.num_seqs == 0
    cache.append(0, k, k, plan)
    rope = RopeConfig(head_dim=8).kernel_params(device=device)
    ops.append_paged_kv(k, k, ref.pool(0), ref.params(0), kv_dtype="int8", slot_mapping=slots, positions=pos,
                        rope=rope)
    assert torch.equal(cache.buffer[0], ref.buffer[0])
    # the cache's own RoPE frequencies (which no kernel writes) let a compiled decode launch evaluate cos / sin
    # before waiting for the previous kernel; its float32 rotation may round the (token, head) scale 1 ulp apart
    # from the loose op's launch: scales agree to 2 ulp (2 ** -22 relative), the codes bit for bit
    torch.testing.assert_close(cache.params_buffer[0], ref.params_buffer[0], rtol=2**-22, atol=0)
    with pytest.raises(ValueError, match="^seq_lens"):
        _ = plan.seq_lens
    for call in (lambda: cache.gather(0, plan), lambda: cache.attention(0, torch.zeros(3, 4, 8), plan)):
        with pytest.raises(TypeError, match="^plan: .* needs a ragged plan"):
            call()


def test_context_parallel_plan_writes_the_ranks_share(device):
    tables = _i32([[0, 1]], device)
    cu_q = _i32([0, 6], device)
    k, _ = _kv(6, device)
    for rank in range(2):
        c, ref = _cache(device, "auto", 1), _cache(device, "auto", 1)
        c.append(0, k, k, c.plan(tables, cu_q, _i32([0], device), cp_rank=rank, cp_size=2))
        ops.append_paged_kv(k, k, ref.pool(0), block_tables=tables, cu_q_lens=cu_q, kv_lens=_i32([0], device),
                            rope=RopeConfig(head_dim=8).kernel_params(device=device), cp_rank=rank, cp_size=2)
        assert torch.equal(c.buffer, ref.buffer)


def test_bad_plans_are_refused_before_any_write(device):
    cache = _cache(device, "auto", 1)
    tables = _i32([[0, 1]], device)
    cu_q = _i32([0, 2], device)
    kv = _i32([0], device)
    zeros = torch.zeros(3, dtype=torch.int64, device=device)
    cases = [
        (lambda: cache.plan(tables, cu_q), ValueError, "cu_q_lens: expected block_tables, cu_q_lens and exactly one"),
        (lambda: cache.plan(tables, cu_q, kv, cu_k_lens=_i32([0, 2], device)), ValueError, "kv_lens: expected exactly"),
        (lambda: cache.plan(tables.long(), cu_q, kv), ValueError, "block_tables"),
        (lambda: cache.plan(tables, cu_q, _i32([0, 0], device)), ValueError, "kv_lens"),
        (lambda: cache.plan(tables, cu_q, kv, cp_rank=2, cp_size=2), ValueError, "cp_rank"),
        (lambda: cache.plan(slot_mapping=zeros, positions=zeros[:2]), ValueError, "positions"),
        (lambda: cache.plan(slot_mapping=[0, 1]), TypeError, "slot_mapping"),  # type: ignore[arg-type]
        (lambda: cache.plan(slot_mapping=zeros, block_tables=tables), ValueError, "slot_mapping: expected alone"),
        (lambda: cache.plan(tables, seq_lens=kv, kv_lens=kv), ValueError, "cu_q_lens: expected with kv_lens"),
        (lambda: cache.plan(), TypeError, "block_tables"),
        (lambda: cache.plan(tables, cu_q, kv, window=0), ValueError, "window"),
        (lambda: cache.plan(tables, cu_q, kv, scale=float("nan")), ValueError, "scale"),
        (lambda: cache.plan(tables, cu_q, kv, softcap="1"), TypeError, "softcap"),
        (lambda: cache.plan(tables, cu_q, kv, num_decode=2), ValueError, "num_decode"),
        (lambda: cache.plan(tables, cu_q, kv, num_splits=0), ValueError, "num_splits"),
        (lambda: cache.plan(tables, cu_q, kv, max_kv_len=-1), ValueError, "max_kv_len"),
        (lambda: cache.plan(tables, cu_q, kv, metadata_ready=1), TypeError, "metadata_ready"),
        (lambda: cache.plan(tables, cu_q, kv, workspace=torch.zeros(4, dtype=torch.float16, device=device)),
         ValueError, "workspace"),
        (lambda: cache.plan(tables, cu_q, kv, q_rope=torch.zeros(4, 8)), TypeError, "q_rope"),
        (lambda: cache.plan(tables, cu_q, kv, q_rope=(torch.zeros(4, 6, device=device),) * 2), ValueError,
         "q_rope cos"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match="^" + match):
            fn()
    k, _ = _kv(2, device)
    plan = cache.plan(tables, cu_q, kv)
    other = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=2, head_dim=8, block_size=8, num_blocks=16,
                                     dtype=torch.float16, device=device))
    before = cache.buffer.clone()
    with pytest.raises(TypeError, match="^plan: expected a StepPlan"):
        cache.append(0, k, k, (tables, cu_q, kv))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^plan: built for pools"):
        other.append(0, k, k, plan)
    with pytest.raises(TypeError, match="^plan: append needs the step's rows"):
        cache.append(0, k, k, cache.plan(tables, seq_lens=kv))
    with pytest.raises(TypeError, match="^plan: append needs kv_lens or cu_k_lens"):
        cache.append(0, k, k, cache.plan(tables, cu_q, seq_lens=_i32([2], device)))
    with pytest.raises(ValueError, match="^k: expected dtype torch.float16"):
        cache.append(0, k.float(), k.float(), plan)
    assert torch.equal(cache.buffer, before)


@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
def test_cache_attention_reads_the_plan_as_it_stands_after_the_step(device, kv_dtype):
    """PagedKVCache.attention(layer, q, plan) is ops.paged_attention over the layer's pools with the plan's tables,
    its lengths after the step (seq_lens) and its options, bit for bit."""
    cache = _cache(device, kv_dtype)
    tables = _i32([[3, 9, 1], [12, 5, 0]], device)
    cu_q = _i32([0, 1, 6], device)
    plan = cache.plan(tables, cu_q, _i32([6, 2], device), window=5, softcap=20.0, scale=0.3)
    k, _ = _kv(6, device, 3)
    q = torch.randn(6, 4, 8, generator=torch.Generator().manual_seed(4)).to(torch.float16).to(device)
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0], device=device)
    cache.append(1, k, k, plan)
    lse = torch.empty(6, 4, dtype=torch.float32, device=device)
    got = cache.attention(1, q, plan, sinks=sinks, lse=lse)
    want_lse = torch.empty_like(lse)
    want = ops.paged_attention(q, cache.pool(1), cache.params(1), cache.kv_scales[1], kv_dtype=kv_dtype,
                               layout="NHD", block_tables=tables, cu_q_lens=cu_q, kv_lens=_i32([7, 7], device),
                               window=5, softcap=20.0, scale=0.3, sinks=sinks, lse=want_lse)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    wide = plan.with_options(window=None)  # a layer of its own window: same tensors, its own launches
    assert wide.block_tables is plan.block_tables and wide.window is None and plan.window == 5
    got = cache.attention(1, q, wide, sinks=sinks)
    want = ops.paged_attention(q, cache.pool(1), cache.params(1), kv_dtype=kv_dtype, layout="NHD",
                               block_tables=tables, cu_q_lens=cu_q, kv_lens=_i32([7, 7], device), softcap=20.0,
                               scale=0.3, sinks=sinks)
    assert torch.equal(got, want)
    with pytest.raises(TypeError, match="^block_tables: not a query-side option"):
        plan.with_options(block_tables=tables)


def test_cache_attention_rotates_queries_with_the_plans_q_rope(device):
    """q_rope on the plan: the cache's attention rotates the queries in the kernel, as ops.paged_attention(q_rope=)
    does, and equals rotating them first."""
    cache = _cache(device, "int8", layers=1)
    tables = _i32([[3, 9], [12, 5]], device)
    cu_q = _i32([0, 3, 5], device)
    kv = _i32([1, 0], device)
    rope = RopeConfig(head_dim=8)
    inv = rope.kernel_params().inv_freq
    ang = torch.arange(16, dtype=torch.float32)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(torch.float16).to(device)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(torch.float16).to(device)
    plan = cache.plan(tables, cu_q, kv, q_rope=(cos, sin))
    k, _ = _kv(5, device, 8)
    cache.append(0, k, k, plan)
    q = torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(9)).to(torch.float16).to(device)
    got = cache.attention(0, q, plan)
    want = ops.paged_attention(q, cache.pool(0), cache.params(0), kv_dtype="int8", layout="NHD", block_tables=tables,
                               cu_q_lens=cu_q, kv_lens=plan.seq_lens, q_rope=(cos, sin))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="^q_rope cos: expected dtype torch.float32"):
        cache.attention(0, q.float(), plan)


def test_launches_are_derived_once_per_plan(device):
    """Every layer's append and attention reuse the launch description and the attention plan the first layer
    derived; a later plan of the same kind (rows, sequences, index kinds) reuses the appends' launches of the
    earlier one, with its own tensors; a plan of another kind derives its own."""
    cache = _cache(device, "int8", layers=3)
    tables = _i32([[3, 9], [12, 5]], device)
    cu_q = _i32([0, 1, 2], device)
    plan = cache.plan(tables, cu_q, _i32([4, 0], device))
    k, _ = _kv(2, device, 5)
    q = torch.randn(2, 4, 8).to(torch.float16).to(device)
    with unittest.mock.patch.object(paged_launch, "plan_append", wraps=paged_launch.plan_append) as policy, \
            unittest.mock.patch.object(attention_paged, "attention_plan", wraps=attention_paged.attention_plan) as attn:
        for layer in range(3):
            cache.append(layer, k, k, plan)
            cache.attention(layer, q, plan)
        assert policy.call_count == 1 and attn.call_count == 1
        prepared = cache.prepared_launches
        # the next decode step: other tables and lengths, the same kind
        tables2, kv2 = _i32([[7, 1], [2, 6]], device), _i32([5, 1], device)
        plan2 = cache.plan(tables2, cu_q, kv2)
        for layer in range(3):
            cache.append(layer, k, k, plan2)
        assert policy.call_count == 1
        if device.type == "cuda":  # every append of the second step repeated a compiled launch
            assert cache.prepared_launches == prepared + 3
        cache.append(0, k[:1], k[:1], cache.plan(tables[:1], cu_q[:2], _i32([6], device)))  # other rows
        assert policy.call_count == 2
        cu_k = _i32([0, 6, 8], device)  # the same rows by cumulative lengths: another index kind
        cache.append(0, k, k, cache.plan(tables2, cu_q, cu_k_lens=cu_k))
        assert policy.call_count == 3
    # the reused launches wrote where each plan says: the same bytes as launches derived afresh for each step
    ref = _cache(device, "int8", layers=3)
    for t, lens in ((tables, _i32([4, 0], device)), (tables2, kv2)):
        fresh = dataclasses.replace(ref.plan(t, cu_q, lens), launch_store=None)
        for layer in range(3):
            ref.append(layer, k, k, fresh)
    assert torch.equal(cache.buffer[1:], ref.buffer[1:])
    assert torch.equal(cache.params_buffer[1:], ref.params_buffer[1:])


def test_debug_cache_plans_check_every_append(device):
    cache = _cache(device, "auto", 1, debug=True)
    plan = cache.plan(_i32([[0]], device), _i32([0, 2], device), _i32([3], device))
    assert plan.check
    k, _ = _kv(2, device)
    with pytest.raises(ValueError, match="^block_tables: sequence 0 needs 2 blocks"):
        cache.append(0, k, k, plan)
    assert not cache.buffer.any()
    ok = dataclasses.replace(plan, block_tables=_i32([[0, 1]], device), append_memo=None)
    cache.append(0, k, k, ok)
    assert cache.buffer.any()
