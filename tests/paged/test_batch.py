"""PagedBatch: one step's batch, built once, taken by every layer's append and gather (ops and cache), with the
same bytes as the keyword form; misuse is a clear error before anything is written."""

from __future__ import annotations

import pytest
import torch

from kvcache import PagedBatch, PagedConfig, PagedKVCache, RopeConfig, ops


def _i32(x: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=device)


def _cache(device: torch.device, kv_dtype: str, layers: int = 2) -> PagedKVCache:
    cfg = PagedConfig(num_layers=layers, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=16,
                      dtype=torch.float16, kv_dtype=kv_dtype, device=device)
    return PagedKVCache(cfg, rope=RopeConfig(head_dim=8))


@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
@pytest.mark.parametrize("form", ["kv_lens", "cu_k_lens"])
def test_batch_appends_and_gathers_what_the_keywords_do(device, kv_dtype, form):
    gen = torch.Generator().manual_seed(0)
    tables = _i32([[3, 9, 1], [12, 5, 0], [7, 2, 8]], device)
    cu_q = _i32([0, 1, 6, 6], device)  # a decode row, a 5-token chunk across a block boundary, an idle sequence
    before = [6, 2, 4]
    q_lens = [1, 5, 0]
    if form == "kv_lens":
        lens = dict(kv_lens=_i32(before, device))
        batch = PagedBatch.ragged(tables, cu_q, lens["kv_lens"])
    else:
        totals = [b + q for b, q in zip(before, q_lens)]
        lens = dict(cu_k_lens=_i32([0, totals[0], totals[0] + totals[1], sum(totals)], device))
        batch = PagedBatch.ragged(tables, cu_q, cu_k_lens=lens["cu_k_lens"])
    assert batch.seq_lens.tolist() == [7, 7, 4]
    k = torch.randn(6, 2, 8, generator=gen).to(torch.float16).to(device)
    v = torch.randn(6, 2, 8, generator=gen).to(torch.float16).to(device)
    by_batch, by_kw = _cache(device, kv_dtype), _cache(device, kv_dtype)
    for layer in range(2):
        by_batch.append(layer, k, v, batch=batch)
        by_kw.append(layer, k, v, block_tables=tables, cu_q_lens=cu_q, **lens)
    assert torch.equal(by_batch.buffer, by_kw.buffer)
    if by_kw.params_buffer is not None:
        assert torch.equal(by_batch.params_buffer, by_kw.params_buffer)
    got = by_batch.gather(1, batch=batch)
    want = by_kw.gather(1, tables, kv_lens=_i32([7, 7, 4], device))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    op = ops.gather_paged_kv(by_batch.pool(1), by_batch.params(1), kv_dtype=kv_dtype, batch=batch,
                             dtype=torch.float16)
    assert all(torch.equal(a, b) for a, b in zip(op, want))


def test_slot_batch_is_the_slot_mapping(device):
    cache, ref = _cache(device, "int8"), _cache(device, "int8")
    k = torch.randn(3, 2, 8).to(torch.float16).to(device)
    slots = torch.tensor([5, -1, 17], dtype=torch.int64, device=device)
    pos = torch.tensor([5, 0, 9], dtype=torch.int64, device=device)
    batch = PagedBatch.slots(slots, pos)
    assert not batch.is_ragged and batch.num_seqs == 0
    rope = RopeConfig(head_dim=8).kernel_params(device=device)
    ops.append_paged_kv(k, k, cache.pool(0), cache.params(0), kv_dtype="int8", batch=batch, rope=rope)
    ops.append_paged_kv(k, k, ref.pool(0), ref.params(0), kv_dtype="int8", slot_mapping=slots, positions=pos,
                        rope=rope)
    assert torch.equal(cache.buffer[0], ref.buffer[0]) and torch.equal(cache.params_buffer[0], ref.params_buffer[0])
    with pytest.raises(ValueError, match="^seq_lens"):
        _ = batch.seq_lens


def test_context_parallel_batch_writes_the_ranks_share(device):
    tables = _i32([[0, 1]], device)
    cu_q = _i32([0, 6], device)
    k = torch.randn(6, 2, 8).to(torch.float16).to(device)
    for rank in range(2):
        c, ref = _cache(device, "auto", 1), _cache(device, "auto", 1)
        c.append(0, k, k, batch=PagedBatch.ragged(tables, cu_q, _i32([0], device), cp_rank=rank, cp_size=2))
        ref.append(0, k, k, block_tables=tables, cu_q_lens=cu_q, kv_lens=_i32([0], device), cp_rank=rank, cp_size=2)
        assert torch.equal(c.buffer, ref.buffer)


def test_bad_batches_are_refused_before_any_write(device):
    tables = _i32([[0, 1]], device)
    cu_q = _i32([0, 2], device)
    kv = _i32([0], device)
    with pytest.raises(ValueError, match="^kv_lens: expected exactly one"):
        PagedBatch.ragged(tables, cu_q)
    with pytest.raises(ValueError, match="^block_tables"):
        PagedBatch.ragged(tables.long(), cu_q, kv)
    with pytest.raises(ValueError, match="^kv_lens"):
        PagedBatch.ragged(tables, cu_q, _i32([0, 0], device))
    with pytest.raises(ValueError, match="^cp_rank"):
        PagedBatch.ragged(tables, cu_q, kv, cp_rank=2, cp_size=2)
    with pytest.raises(ValueError, match="^positions"):
        PagedBatch.slots(torch.zeros(3, dtype=torch.int64, device=device), torch.zeros(2, dtype=torch.int64,
                                                                                    device=device))
    with pytest.raises(TypeError, match="^slot_mapping"):
        PagedBatch.slots([0, 1])  # type: ignore[arg-type]
    cache = _cache(device, "auto", 1)
    batch = PagedBatch.ragged(tables, cu_q, kv)
    k = torch.randn(2, 2, 8).to(torch.float16).to(device)
    before = cache.buffer.clone()
    with pytest.raises(ValueError, match="^batch: expected alone"):
        cache.append(0, k, k, batch=batch, kv_lens=kv)
    with pytest.raises(TypeError, match="^batch"):
        cache.append(0, k, k, batch=(tables, cu_q, kv))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^batch"):
        cache.gather(0, batch=PagedBatch.slots(torch.zeros(2, dtype=torch.int64, device=device)))
    with pytest.raises(ValueError, match="^batch: expected alone"):
        ops.append_paged_kv(k, k, cache.pool(0), batch=batch, cp_size=2)
    assert torch.equal(cache.buffer, before)


@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
def test_cache_attention_reads_the_batch_as_it_stands_after_the_step(device, kv_dtype):
    """PagedKVCache.attention(layer, q, batch=) is ops.paged_attention over the layer's pools with the batch's
    tables and its lengths after the step (seq_lens), bit for bit."""
    gen = torch.Generator().manual_seed(5)
    cache = _cache(device, kv_dtype)
    tables = _i32([[3, 9, 1], [12, 5, 0]], device)
    batch = PagedBatch.ragged(tables, _i32([0, 1, 6], device), _i32([6, 2], device))
    k = torch.randn(6, 2, 8, generator=gen).to(torch.float16).to(device)
    q = torch.randn(6, 4, 8, generator=gen).to(torch.float16).to(device)
    cache.append(1, k, k, batch=batch)
    lse = torch.empty(6, 4, dtype=torch.float32, device=device)
    got = cache.attention(1, q, batch=batch, lse=lse)
    want_lse = torch.empty_like(lse)
    want = ops.paged_attention(q, cache.pool(1), cache.params(1), cache.kv_scales[1], kv_dtype=kv_dtype,
                               layout="NHD", block_tables=tables, cu_q_lens=batch.cu_q_lens,
                               kv_lens=_i32([7, 7], device), lse=want_lse)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    with pytest.raises(TypeError, match="^batch"):
        cache.attention(1, q, batch=PagedBatch.slots(torch.zeros(6, dtype=torch.int64, device=device)))
