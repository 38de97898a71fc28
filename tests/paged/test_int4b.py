"""kv_dtype="int4b" through the public API (CPU backend): a full block's keys as int4 codes with an fp16 (scale, zero)
per (block, head, channel), the partial last block's keys as int8 rows split over its own and the next block's key
plane, values as int4 rows (the byte format of :mod:`kvcache.ops.paged.block_keys`).

Checked: the stored bytes of a full and of a partial block against encodings computed here, the documented bound
(half a step of the channel's scale; of the row's scale for int8 rows), a block that fills over several appends
(int8 rows, then int4 per channel from them), prefill chunks and decodes against the float keys, attention over the
pool against attention over the gathered K / V, NaN rows, both layouts, bytes per (token, head), the Triton kernels
(interpreter) against the torch path, rows whose next block is missing (counted, refused by the debug check, dropped
by attention), and the refusals: a block size over head_dim / 2, slot mappings, context parallelism.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvcache import PagedConfig, PagedKVCache, RopeConfig, cache_block_bytes
from kvcache._backend import force_interpreter
from kvcache.ops.paged.block_keys import blocks_for_tokens
from sweeps import each_value, named

H, D, BS, NB = 2, 32, 8, 12
LAYOUTS = ["NHD", "HND"]


def _cache(layout: str, dtype: torch.dtype = torch.float32) -> PagedKVCache:
    return PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=NB,
                                    dtype=dtype, kv_dtype="int4b", layout=layout, device="cpu"))


def _heads(t: torch.Tensor, blk: int, plane: int, layout: str) -> torch.Tensor:
    """``[H, BS, ...]`` of one block's plane, either layout."""
    x = t[blk, plane]
    return x.transpose(0, 1) if layout == "NHD" else x


def _append(cache: PagedKVCache, table: list[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    plan = cache.plan(torch.tensor([table], dtype=torch.int32), torch.tensor([0, k.shape[0]], dtype=torch.int32),
                      torch.tensor([start], dtype=torch.int32))
    cache.append(0, k, v, plan)


def _gather(cache: PagedKVCache, table: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    plan = cache.plan(torch.tensor([table], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32))
    k, v = cache.gather(0, plan)
    return k[0, :, :n].transpose(0, 1), v[0, :, :n].transpose(0, 1)  # [n, H, D]


def _keys(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, H, D, generator=g) * torch.linspace(0.2, 8.0, D) + torch.linspace(-3, 3, D)
    return k, torch.randn(n, H, D, generator=g)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_full_block_stores_int4_codes_per_channel_with_fp16_scale_and_zero(layout):
    cache = _cache(layout)
    k, v = _keys(BS)
    _append(cache, [4, 7], 0, k, v)  # one whole block: quantized per channel at once
    codes = _heads(cache.pool(0), 4, 0, layout)  # [H, BS, D / 2]
    words = _heads(cache.params(0), 4, 0, layout)[..., 2:].reshape(H, -1)[:, :D]  # [H, D] words
    halves = words.contiguous().view(torch.float16).float()  # [H, 2 D]: the channels' scales, then their zeros
    x = k.transpose(0, 1)  # [H, BS, D]
    scale = ((x.amax(1) - x.amin(1)) / 15).half().float()
    zero = x.amin(1).half().float()
    assert torch.equal(halves[:, :D], scale) and torch.equal(halves[:, D:], zero)
    q = torch.round((x - zero[:, None]) * (1 / scale)[:, None]).clamp(0, 15).to(torch.int32)
    assert torch.equal(codes, (q[..., : D // 2] | (q[..., D // 2:] << 4)).to(torch.uint8))
    kg, _ = _gather(cache, [4, 7], BS)
    # half a step, and fp16's rounding of the stored (scale, zero) (2^-11 of |zero| and of the 15 steps' span)
    assert ((kg - k).abs() <= scale / 2 + 2**-10 * (zero.abs() + 15 * scale) + 1e-6).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_partial_block_stores_int8_rows_split_over_its_own_and_the_next_blocks_key_plane(layout):
    cache = _cache(layout)
    k, v = _keys(3)
    _append(cache, [5, 9], 0, k, v)
    x = k.float()
    mn, mx = x.amin(-1), x.amax(-1)  # [3, H]
    scale = (mx - mn) / 255
    q = torch.round((x - mn[..., None]) * (1 / scale)[..., None]).clamp(0, 255).to(torch.uint8)  # [3, H, D]
    assert torch.equal(_heads(cache.pool(0), 5, 0, layout)[:, :3], q[..., : D // 2].transpose(0, 1))
    assert torch.equal(_heads(cache.pool(0), 9, 0, layout)[:, :3], q[..., D // 2:].transpose(0, 1))
    sz = _heads(cache.params(0), 5, 0, layout)[..., 2:].reshape(H, -1)[:, :6].reshape(H, 3, 2)
    assert torch.equal(sz[..., 0], scale.T) and torch.equal(sz[..., 1], mn.T)
    kg, _ = _gather(cache, [5, 9], 3)
    assert ((kg - k).abs() <= scale[..., None] / 2 + 1e-5).all()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunks", [[BS], [1] * BS, [3, 1, 4], [5, 2 * BS + 1, 1, 6]])
def test_appends_in_any_chunks_read_back_within_the_bound_of_the_form_each_block_has(layout, chunks):
    cache = _cache(layout)
    n = sum(chunks)
    k, v = _keys(n, seed=len(chunks))
    table = [3, 8, 1, 10, 6, 2][: max(blocks_for_tokens(m, BS) for m in range(n + 1))]  # what each append needs
    pos = 0
    for c in chunks:
        _append(cache, table, pos, k[pos: pos + c], v[pos: pos + c])
        pos += c
        kg, vg = _gather(cache, table, pos)
        full = pos // BS * BS
        # the full blocks: int4 per channel, from the block's int8 rows where it filled over several appends: half a
        # channel step, plus the int8 rows' error (half a row step, which also widens the channel's range), plus
        # fp16's rounding of (scale, zero)
        x = k[:full].reshape(-1, BS, H, D)
        step = ((x.amax(1) - x.amin(1)) / 15)[:, None]  # [blocks, 1, H, D]
        row8 = ((x.amax(-1) - x.amin(-1)) / 255).amax(1)[:, None, :, None]  # the block's widest int8 row step
        bound = step / 2 + row8 + 2**-10 * (x.abs().amax(1, keepdim=True) + 15 * step) + 1e-5
        assert ((kg[:full] - k[:full]).reshape(x.shape).abs() <= bound).all()
        rows = k[full:pos]  # the partial block: int8 rows
        rstep = ((rows.amax(-1) - rows.amin(-1)) / 255)[..., None]
        assert ((kg[full:pos] - rows).abs() <= rstep / 2 + 1e-5).all()
        vstep = ((v[:pos].amax(-1) - v[:pos].amin(-1)) / 15)[..., None]
        assert ((vg - v[:pos]).abs() <= vstep / 2 + 1e-5).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_over_the_pool_equals_attention_over_the_gathered_keys_and_values(layout):
    cache = _cache(layout)
    k, v = _keys(2 * BS + 3, seed=3)
    table = [0, 4, 2, 9]
    _append(cache, table, 0, k[:BS + 2], v[:BS + 2])
    _append(cache, table, BS + 2, k[BS + 2:], v[BS + 2:])
    n = k.shape[0]
    q = torch.randn(1, 2 * H, D, generator=torch.Generator().manual_seed(5))
    plan = cache.plan(torch.tensor([table], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                      torch.tensor([n - 1], dtype=torch.int32))
    out = cache.attention(0, q, plan)
    kg, vg = _gather(cache, table, n)
    kk, vv = kg.repeat_interleave(2, dim=1), vg.repeat_interleave(2, dim=1)  # [n, 2H, D]
    p = torch.softmax(torch.einsum("hd,nhd->hn", q[0], kk) / D**0.5, dim=-1)
    torch.testing.assert_close(out[0], torch.einsum("hn,nhd->hd", p, vv), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [0, BS - 1])
def test_a_nan_key_row_reads_back_nan_in_its_block_and_head_and_nowhere_else(split):
    cache = _cache("NHD")
    k, v = _keys(2 * BS)
    k[2, 1, 5] = float("nan")
    table = [1, 2, 3]
    if split:  # the row waits as an int8 row (all NaN, int8's rule) until the block fills
        _append(cache, table, 0, k[:split], v[:split])
        kg, _ = _gather(cache, table, split)
        nan = kg.isnan()
        assert nan[2, 1].all() and nan.sum() == D
    _append(cache, table, split, k[split:], v[split:])
    kg, _ = _gather(cache, table, 2 * BS)
    nan = kg.isnan()
    # its channel over the block's keys of head 1 (every channel, from an all-NaN int8 row); nothing else
    assert nan[:BS, 1, 5].all() and nan.sum() == BS * (D if split else 1)


def test_bytes_per_token_and_head_count_the_block_key_area():
    # codes D / 2 + D / 2, value (scale, zero) 8 bytes, key area ceil(D / BS) words
    assert cache_block_bytes(1, 1, 128, 16, torch.bfloat16, "int4b") == 16 * (64 + 64 + 4 * (2 + 8))
    assert cache_block_bytes(1, 1, D, BS, torch.float16, "int4b") == BS * (D + 4 * (2 + D // BS))


def test_refusals():
    with pytest.raises(ValueError, match="^kv: kv_dtype 'int4b' stores key rows in two planes"):
        _cache("NHD").kv(0)
    with pytest.raises(ValueError, match="^block_size: expected at most head_dim / 2"):
        PagedConfig(num_layers=1, num_kv_heads=1, head_dim=32, block_size=32, num_blocks=2, kv_dtype="int4b")
    cache = _cache("NHD")
    k, v = _keys(2)
    with pytest.raises(ValueError, match="slot_mapping"):
        cache.append(0, k, v, cache.plan(slot_mapping=torch.tensor([0, 1]), positions=torch.tensor([0, 1])))
    with pytest.raises(ValueError, match="context parallelism"):
        cache.append(0, k, v, cache.plan(torch.tensor([[0, 1]], dtype=torch.int32),
                                         torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                                         cp_rank=0, cp_size=2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the refusal is of the CUDA kernels: needs a GPU")
def test_a_cuda_config_refuses_a_block_size_that_is_not_a_power_of_two():
    with pytest.raises(NotImplementedError, match="power-of-two block_size, got 12"):
        PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=12, num_blocks=4, kv_dtype="int4b",
                    device="cuda")
    PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=12, num_blocks=4, kv_dtype="int4b", device="cpu")


def test_blocks_for_keeps_the_block_after_a_partial_one():
    cfg = PagedConfig(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, num_blocks=8, kv_dtype="int4b")
    assert [cfg.blocks_for(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 2, 2, 1, 3, 2, 4]
    assert [blocks_for_tokens(n, 4) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 2, 2, 1, 3, 2, 4]
    assert PagedConfig(1, 1, 8, 4, 8, kv_dtype="int4").blocks_for(5) == 2
    with pytest.raises(ValueError, match="^num_tokens: expected"):
        cfg.blocks_for(-1)


def _stored(layout: str, chunks: list[int], interpret: bool, rope: RopeConfig | None = None,
            dtype: torch.dtype = torch.float32, nan: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=NB,
                                     dtype=dtype, kv_dtype="int4b", layout=layout, device="cpu"), rope=rope)
    n = sum(chunks)
    k, v = _keys(n, seed=7)
    if nan:
        k[1, 0, 3], v[2, 1, 0] = float("nan"), float("inf")
    k, v = k.to(dtype), v.to(dtype)
    table = torch.tensor([[3, 8, 1, 10, 6, 2]], dtype=torch.int32)
    _append_chunks(cache, table, chunks, k, v, interpret, rope is not None)
    return cache.pool(0).clone(), cache.params(0).view(torch.int32).clone()


def _append_chunks(cache: PagedKVCache, table: torch.Tensor, chunks: list[int], k: torch.Tensor, v: torch.Tensor,
                   interpret: bool, rope: bool) -> int:
    """Append ``k`` / ``v`` chunk by chunk into one sequence (torch path, or the Triton kernel interpreted)."""
    pos = 0
    for c in chunks:
        plan = cache.plan(table, torch.tensor([0, c], dtype=torch.int32), torch.tensor([pos], dtype=torch.int32),
                          rope=rope)
        if interpret:
            with force_interpreter():
                cache.append(0, k[pos: pos + c], v[pos: pos + c], plan)
        else:
            cache.append(0, k[pos: pos + c], v[pos: pos + c], plan)
        pos += c
    return pos


@pytest.mark.parametrize(("layout", "chunks"), each_value(LAYOUTS, named(
    [[BS], [1] * (BS + 1), [3, 1, 4], [5, 2 * BS + 1, 1, 6]], ["one-block", "decode", "small", "mixed"])))
def test_the_triton_append_writes_the_bytes_of_the_torch_path(layout, chunks):
    for dtype, nan in ((torch.float32, False), (torch.bfloat16, True)):
        ref = _stored(layout, chunks, False, dtype=dtype, nan=nan)
        got = _stored(layout, chunks, True, dtype=dtype, nan=nan)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (dtype, nan)


def _batch_bytes(tables: torch.Tensor, rows: list[int], starts: list[int], num_decode: int, seed: int,
                 interpret: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool and params (as int32) after one append of ``rows[b]`` rows to each sequence ``b`` of ``tables``, which
    held ``starts[b]`` rows before it (written first, one sequence at a time); torch path or the Triton kernel
    interpreted."""
    cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=16,
                                     dtype=torch.float32, kv_dtype="int4b", device="cpu"))
    first = torch.randn(BS, H, D, generator=torch.Generator().manual_seed(seed))
    for b, st in enumerate(starts):
        if st:
            pre = cache.plan(tables[b: b + 1], torch.tensor([0, st], dtype=torch.int32),
                             torch.zeros(1, dtype=torch.int32))
            cache.append(0, first[:st], first[:st], pre)
    k, v = _keys(sum(rows), seed=seed + 8)
    cu = torch.tensor([0] + rows, dtype=torch.int32).cumsum(0).to(torch.int32)
    plan = cache.plan(tables, cu, torch.tensor(starts, dtype=torch.int32), num_decode=num_decode)
    if interpret:
        with force_interpreter():
            cache.append(0, k, v, plan)
    else:
        cache.append(0, k, v, plan)
    return cache.pool(0).clone(), cache.params(0).view(torch.int32).clone()


def test_the_triton_append_of_a_skewed_batch_with_a_wrong_decode_hint_writes_the_bytes_of_the_torch_path():
    # 30 sequences: two "decode" rows by the hint, of which one holds 3 rows and fills a block; 27 without rows; one
    # of 43 rows from position 5 over six blocks (more than the launch's programs per sequence: they loop)
    rows = [1, 3] + [0] * 27 + [5 * BS + 3]
    starts = [3, BS - 2] + [0] * 27 + [5]
    tables = torch.zeros(30, 8, dtype=torch.int32)
    tables[0, :2] = torch.tensor([1, 2])
    tables[1, :3] = torch.tensor([3, 4, 13])
    tables[29] = torch.arange(5, 13)
    ref = _batch_bytes(tables, rows, starts, 2, 3, False)
    got = _batch_bytes(tables, rows, starts, 2, 3, True)
    assert ref[0].any()
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("num_decode", [0, 2])
def test_a_decode_sized_batch_of_fills_partial_rows_and_a_two_row_sequence_writes_the_bytes_of_the_torch_path(
        num_decode):
    # as many rows as sequences: a sequence of two rows over a block boundary, one without rows, one row that fills
    # its block, one that leaves it partial, and one at a block's first slot; in one launch, or split by the decode
    # hint after the second sequence (whose "decode" part then holds a two-row and an empty sequence)
    rows, starts = [2, 0, 1, 1, 1], [BS - 1, 4, BS - 1, 5, BS]
    tables = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], [13, 14, 15]], dtype=torch.int32)
    ref = _batch_bytes(tables, rows, starts, num_decode, 5, False)
    got = _batch_bytes(tables, rows, starts, num_decode, 5, True)
    assert ref[0].any()
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("heads,block", [(5, 4), (3, 8)])
def test_decode_rows_of_more_heads_than_one_program_writes_store_the_bytes_of_the_torch_path(heads, block):
    # a decode row that leaves its block partial is written up to block_size heads a program: 5 heads over blocks of
    # 4 take two programs (heads 0-3, then 4 with three masked lanes), 3 heads over 8 one (one masked lane)
    out = []
    for interpret in (False, True):
        cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=heads, head_dim=16, block_size=block,
                                         num_blocks=12, dtype=torch.float32, kv_dtype="int4b", device="cpu"))
        g = torch.Generator().manual_seed(heads)
        k, v = torch.randn(11, heads, 16, generator=g) * 3, torch.randn(11, heads, 16, generator=g)
        _append_chunks(cache, torch.tensor([[6, 2, 9, 4]], dtype=torch.int32), [1] * 11, k, v, interpret, False)
        out.append((cache.pool(0).clone(), cache.params(0).view(torch.int32).clone()))
    assert out[0][0].any()
    assert torch.equal(out[1][0], out[0][0]) and torch.equal(out[1][1], out[0][1])


def test_an_odd_number_of_key_area_words_per_slot_puts_a_rows_zero_in_the_next_slot_in_every_path():
    # head_dim 80, block 16: 5 words per slot, so row 2's (scale, zero) are words 4 (slot 0) and 5 (slot 1)
    out = []
    for interpret in (False, True):
        cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=80, block_size=16, num_blocks=8,
                                         dtype=torch.float32, kv_dtype="int4b", device="cpu"))
        g = torch.Generator().manual_seed(0)
        k, v = torch.randn(21, H, 80, generator=g) * 3, torch.randn(21, H, 80, generator=g)
        _append_chunks(cache, torch.tensor([[3, 5, 1]], dtype=torch.int32), [5, 9, 7], k, v, interpret, False)
        out.append((cache.pool(0).clone(), cache.params(0).view(torch.int32).clone()))
        gp = cache.plan(torch.tensor([[3, 5, 1]], dtype=torch.int32), seq_lens=torch.tensor([21], dtype=torch.int32))
        with force_interpreter():
            got = cache.gather(0, gp)
        ref = cache.gather(0, gp)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert torch.equal(out[1][0], out[0][0]) and torch.equal(out[1][1], out[0][1])


def test_the_triton_append_with_rope_reads_back_as_the_torch_path_within_rope_rounding():
    rope = RopeConfig(head_dim=D, max_position_embeddings=64)
    table = [3, 8, 1, 10, 6, 2]
    out = []
    for interpret in (False, True):
        cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=NB,
                                         dtype=torch.float32, kv_dtype="int4b", device="cpu"), rope=rope)
        k, v = _keys(2 * BS + 3, seed=9)
        pos = _append_chunks(cache, torch.tensor([table], dtype=torch.int32), [BS + 2, 1, BS], k, v, interpret, True)
        out.append(_gather(cache, table, pos))
    # a key rounded differently by the two RoPEs may take the neighbouring code: one step of its channel or row
    step = (out[0][0].amax(0) - out[0][0].amin(0)) / 15
    assert ((out[1][0] - out[0][0]).abs() <= step + 1e-4).all()
    torch.testing.assert_close(out[1][1], out[0][1], rtol=0, atol=0)


@pytest.mark.parametrize(("layout", "opts"), each_value(LAYOUTS, named(
    [{}, {"window": 7}, {"softcap": 5.0}, {"num_splits": 3}, {"sinks": True}],
    ["plain", "window", "softcap", "splits", "sinks"])))
def test_the_triton_attention_equals_the_torch_path(layout, opts):
    opts = dict(opts)
    hq = 2 * H
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(1)) if opts.pop("sinks", False) else None
    cache = _cache(layout)
    tables = torch.tensor([[3, 9, 4, 11], [5, 6, 7, 8]], dtype=torch.int32)
    lens = [0, 0]
    g = torch.Generator().manual_seed(2)
    for step in ([2 * BS + 3, BS - 2], [1, 1], [1, 1]):  # prefill chunks, then decode rows (V folded per token)
        cu = torch.tensor([0, step[0], sum(step)], dtype=torch.int32)
        n = sum(step)
        k = torch.randn(n, H, D, generator=g) * torch.linspace(0.3, 6, D)
        plan = cache.plan(tables, cu, torch.tensor(lens, dtype=torch.int32), **opts)
        cache.append(0, k, torch.randn(n, H, D, generator=g), plan)
        q = torch.randn(n, hq, D, generator=g)
        ref = cache.attention(0, q, plan, sinks=sinks)
        with force_interpreter():
            got = cache.attention(0, q, plan, sinks=sinks)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        lens = [a + b for a, b in zip(lens, step)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_triton_gather_is_bit_exact_with_the_torch_path(layout):
    rope = RopeConfig(head_dim=D, max_position_embeddings=64)
    for r in (None, rope):
        cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=NB,
                                         dtype=torch.float32, kv_dtype="int4b", layout=layout, device="cpu"), rope=r)
        tables = torch.tensor([[3, 9, 4, 11], [5, 6, 7, 8]], dtype=torch.int32)
        k, v = _keys(2 * BS + 5)
        plan = cache.plan(tables, torch.tensor([0, 2 * BS + 1, 2 * BS + 5], dtype=torch.int32),
                          torch.tensor([0, 0], dtype=torch.int32), rope=r is not None)
        cache.append(0, k, v, plan)
        g = cache.plan(tables, seq_lens=torch.tensor([2 * BS + 1, 4], dtype=torch.int32), rope=r is not None)
        ref = cache.gather(0, g)
        with force_interpreter():
            got = cache.gather(0, g)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_a_short_gather_reads_full_blocks_as_full():
    cache = _cache("NHD")
    k, v = _keys(2 * BS)
    _append(cache, [1, 2, 3], 0, k, v)
    whole, _ = _gather(cache, [1, 2, 3], 2 * BS)
    plan = cache.plan(torch.tensor([[1, 2, 3]], dtype=torch.int32), seq_lens=torch.tensor([2 * BS], dtype=torch.int32))
    part, _ = cache.gather(0, plan, max_len=BS + 3)  # rows of a full block, not int8 rows
    assert torch.equal(part[0, :, : BS + 3].transpose(0, 1), whole[: BS + 3])


def test_rows_without_the_next_block_are_counted_unwritable_and_refused_by_the_check():
    cache = _cache("NHD")
    k, v = _keys(BS + 1)
    one = torch.tensor([[3]], dtype=torch.int32)
    plan = cache.plan(one, torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))
    assert int(plan.unwritable_rows(3)) == 3  # a partial block without the block after it
    with pytest.raises(ValueError, match="^block_tables: sequence 0 needs 2 blocks"):
        cache.append(0, k[:3], v[:3], cache.plan(one, torch.tensor([0, 3], dtype=torch.int32),
                                                 torch.tensor([0], dtype=torch.int32), check=True))
    assert not cache.pool(0).any()  # nothing written
    two = torch.tensor([[3, 4]], dtype=torch.int32)
    _append(cache, [3, 4], 0, k[:3], v[:3])
    # filling block 0 from its int8 rows reads their second halves in block 4: it must be in the table
    fill = cache.plan(one, torch.tensor([0, BS - 3], dtype=torch.int32), torch.tensor([3], dtype=torch.int32))
    assert int(fill.unwritable_rows(BS - 3)) == BS - 3
    fill = cache.plan(two, torch.tensor([0, BS - 3], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                      check=True)
    assert int(fill.unwritable_rows(BS - 3)) == 0
    cache.append(0, k[3:BS], v[3:BS], fill)


def test_the_loose_ops_refuse_an_int4b_block_over_half_the_head_dim():
    from kvcache.ops import append_paged_kv

    pool = torch.zeros((2, 2, D, H, D // 2), dtype=torch.uint8)  # block_size D > D / 2
    params = torch.zeros((2, 1, D, H, 3), dtype=torch.float32)
    k = torch.zeros(1, H, D)
    with pytest.raises(ValueError, match="^block_size: expected at most head_dim / 2"):
        append_paged_kv(k, k, pool, params, kv_dtype="int4b", block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
                        cu_q_lens=torch.tensor([0, 1], dtype=torch.int32), kv_lens=torch.tensor([0], dtype=torch.int32))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_drops_partial_keys_whose_next_block_is_past_the_table_as_the_torch_path(layout):
    cache = _cache(layout)
    k, v = _keys(BS + 3)
    _append(cache, [2, 5, 7], 0, k, v)  # block 5 partial, its rows' halves in 7
    q = torch.randn(1, 2 * H, D, generator=torch.Generator().manual_seed(4))
    plan = cache.plan(torch.tensor([[2, 5]], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                      torch.tensor([BS + 2], dtype=torch.int32))  # a table without block 7
    ref = cache.attention(0, q, plan)
    with force_interpreter():
        got = cache.attention(0, q, plan)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    full = cache.attention(0, q, cache.plan(torch.tensor([[2, 5, 7]], dtype=torch.int32),
                                            torch.tensor([0, 1], dtype=torch.int32),
                                            torch.tensor([BS + 2], dtype=torch.int32)))
    assert not torch.allclose(full, ref)  # the partial block's keys do count when they can be read


@pytest.mark.parametrize("dtype,opts,case", [
    (torch.float16, {}, "rows"), (torch.float16, {}, "hole"), (torch.bfloat16, {"softcap": 5.0}, ""),
    (torch.float16, {"num_splits": 3}, ""), (torch.bfloat16, {"window": 40}, ""), (torch.bfloat16, {}, "tiny")])
def test_decode_over_many_full_blocks_equals_the_torch_path_within_four_ulps(dtype, opts, case):
    # head_dim 128, GQA 4, 16-bit queries, block 16: one-warp decode tiles of one block per tile index, whose full
    # blocks the kernel takes two at a time (one online-softmax step a pair), the rest one by one: sequences with an
    # odd and an even number of full blocks, none, a length of whole blocks, and partial last blocks. "rows": a
    # sequence decoding 3 rows (causal inside the tile); "hole": a block id outside the pool among a sequence's full
    # blocks (its keys dropped, as the torch path drops them); "tiny": bfloat16 values of 1e-36 (V scales far below
    # 2^-64)
    h, hq, d, bs, nb = 2, 8, 128, 16, 48
    cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=h, head_dim=d, block_size=bs, num_blocks=nb,
                                     dtype=dtype, kv_dtype="int4b", layout="HND", device="cpu"))
    g = torch.Generator().manual_seed(11)
    tables = torch.randperm(nb, generator=g)[:45].view(5, 9).to(torch.int32)
    lens = [7 * bs + 4, 4 * bs - 1, 3 * bs - 2, 9, 6 * bs]
    vmul = 1e-36 if case == "tiny" else 1.0
    kmul = 0.01 if case == "hole" else 1.0  # scores near 0: a block of zero keys would weigh as much as any
    n = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    plan = cache.plan(tables, cu, torch.zeros(5, dtype=torch.int32))
    cache.append(0, (torch.randn(n, h, d, generator=g) * torch.linspace(0.3, 6, d) * kmul).to(dtype),
                 (torch.randn(n, h, d, generator=g) * vmul).to(dtype), plan)
    rows = [1, 3, 1, 1, 1] if case == "rows" else [1] * 5
    if case == "hole":
        tables[0, 1] = -1
    cu = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    plan = cache.plan(tables, cu, torch.tensor(lens, dtype=torch.int32), **opts)
    m = sum(rows)
    k, v = torch.randn(m, h, d, generator=g) * 3 * kmul, torch.randn(m, h, d, generator=g) * vmul
    cache.append(0, k.to(dtype), v.to(dtype), plan)
    q = torch.randn(m, hq, d, generator=g).to(dtype)
    ref = cache.attention(0, q, plan).float()
    with force_interpreter():
        got = cache.attention(0, q, plan).float()
    assert torch.isfinite(ref).all()
    bits = 7 if dtype == torch.bfloat16 else 10
    ulp = 2.0 ** (math.floor(math.log2(ref.abs().max().item())) - bits)
    assert (got - ref).abs().max().item() <= 4 * ulp


def test_a_decode_row_whose_next_block_is_missing_is_written_as_the_torch_path_writes_it():
    # the one-row append of a block that stays partial: with the next block in the table, and without it (the row
    # is not written, by either path)
    out = []
    for interpret in (False, True):
        cache = _cache("HND")
        k, v = _keys(BS + 5, seed=3)
        _append(cache, [3, 1, 4], 0, k[:BS + 3], v[:BS + 3])
        for table, start in (([3, 1], BS + 3), ([3, 1, -1], BS + 4), ([3, 1, 4], BS + 4)):
            plan = cache.plan(torch.tensor([table], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                              torch.tensor([start], dtype=torch.int32))
            if interpret:
                with force_interpreter():
                    cache.append(0, k[start:start + 1], v[start:start + 1], plan)
            else:
                cache.append(0, k[start:start + 1], v[start:start + 1], plan)
        out.append((cache.pool(0).clone(), cache.params(0).view(torch.int32).clone()))
    assert torch.equal(out[1][0], out[0][0]) and torch.equal(out[1][1], out[0][1])
