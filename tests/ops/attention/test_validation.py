"""Bad arguments to paged_attention / linear_attention raise ValueError / TypeError naming the argument before
anything is written; the launch policy is a pure function of shapes."""

from __future__ import annotations

import pytest
import torch

import kvcache
from kvcache.ops import linear_attention, paged_attention
from kvcache.ops.attention import attention_plan, attention_workspace_size

from .attn_reference import i32, make_paged


def _setup(device, kv_dtype="auto"):  # type: ignore[no-untyped-def]
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="NHD", H=2, D=64, bs=16, lens=[5, 3])
    q = torch.randn(2, 4, 64, dtype=torch.float16, device=device)
    kw = dict(kv_dtype=kv_dtype, layout="NHD", block_tables=bt, cu_q_lens=i32([0, 1, 2], device),
              kv_lens=i32([5, 3], device))
    return cache, q, kw


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(q=torch.zeros(2, 4, 64, dtype=torch.int32)), ValueError, "q: expected dtype"),
        (dict(q=torch.zeros(2, 3, 64, dtype=torch.float16)), ValueError, "q: expected num_q_heads"),
        (dict(q=torch.zeros(2, 4, 32, dtype=torch.float16)), ValueError, "pool: expected rows of 32"),
        (dict(q=torch.zeros(2, 4, 64, dtype=torch.bfloat16)), ValueError, "pool: expected dtype torch.bfloat16"),
        (dict(kv_dtype="int2"), ValueError, "kv_dtype: expected one of"),
        (dict(layout="NDH"), ValueError, "layout: expected one of"),
        (dict(cu_q_lens="x"), TypeError, "cu_q_lens: expected a torch.Tensor"),
        (dict(kv_lens=torch.zeros(3, dtype=torch.int32)), ValueError, r"kv_lens: expected shape \[2\]"),
        (dict(cu_q_lens=torch.zeros(3, dtype=torch.int64)), ValueError, "cu_q_lens: expected dtype torch.int32"),
        (dict(block_tables=torch.zeros(2, 4, dtype=torch.int32).t()), ValueError, "block_tables: expected"),
        (dict(scale=0.0), ValueError, "scale: expected a finite float > 0"),
        (dict(scale="a"), TypeError, "scale: expected a float"),
        (dict(window=0), ValueError, "window: expected an int >= 1"),
        (dict(softcap=-1.0), ValueError, "softcap: expected a finite float > 0"),
        (dict(sinks=torch.zeros(3)), ValueError, r"sinks: expected a contiguous float32 \[4\]"),
        (dict(lse=torch.zeros(2, 4, dtype=torch.float16)), ValueError, "lse: expected dtype torch.float32"),
        (dict(lse=torch.zeros(2, 5)), ValueError, r"lse: expected shape \[2, 4\]"),
        (dict(out=torch.zeros(2, 4, 64)), ValueError, "out: expected dtype torch.float16"),
        (dict(cp_rank=2, cp_size=2), ValueError, "cp_rank: expected 0 <= cp_rank < cp_size=2, got 2"),
        (dict(num_splits=0), ValueError, "num_splits: expected an int >= 1"),
        (dict(params=torch.zeros(1)), ValueError, "params: expected None"),
    ],
)
def test_paged_errors(device, change, exc, match):
    cache, q, kw = _setup(device)
    args = dict(q=q, pool=cache.pool(0), **kw)
    for key, val in change.items():
        args[key] = val.to(device) if isinstance(val, torch.Tensor) else val
    before = cache.pool(0).clone()
    with pytest.raises(exc, match=match):
        paged_attention(**args)
    assert torch.equal(cache.pool(0), before)


def test_quantized_pools_need_their_parameters(device):
    cache, q, kw = _setup(device, "int8")
    with pytest.raises(ValueError, match="params: expected"):
        paged_attention(q, cache.pool(0), None, **kw)
    cache, q, kw = _setup(device, "fp8")
    with pytest.raises(ValueError, match="kv_scales: expected float32 \\[2\\]"):
        paged_attention(q, cache.pool(0), **kw)
    with pytest.raises(ValueError, match="kv_scales: expected a contiguous float32 \\[2\\]"):
        paged_attention(q, cache.pool(0), kv_scales=torch.ones(3, device=device), **kw)


def test_kv_scales_ignored_for_other_formats(device):
    """PagedKVCache.kv_scales[layer] can be passed for every format, as to the append: only fp8 reads it."""
    cache, q, kw = _setup(device, "int8")
    a = paged_attention(q, cache.pool(0), cache.params(0), **kw)
    b = paged_attention(q, cache.pool(0), cache.params(0), torch.full((2,), 3.0, device=device), **kw)
    assert torch.equal(a, b)


def test_workspace_too_small(device):
    cache, q, kw = _setup(device)
    with pytest.raises(ValueError, match="workspace: expected a contiguous float32 tensor of at least"):
        paged_attention(q, cache.pool(0), num_splits=2, workspace=torch.empty(10, device=device), **kw)


def test_linear_errors(device):
    cache = kvcache.LinearKVCache(kvcache.CacheConfig(num_layers=1, max_batch_size=2, max_seq_len=8, num_kv_heads=2,
                                                      head_dim=16, dtype=torch.float16, device=device))
    q = torch.zeros(2, 4, 1, 16, dtype=torch.float16, device=device)
    lengths = i32([1, 2], device)
    with pytest.raises(ValueError, match="layer: expected"):
        linear_attention(torch.zeros(3, 4, 1, 16, dtype=torch.float16, device=device), cache.layer(0), i32([1, 2, 3],
                         device))
    with pytest.raises(ValueError, match=r"lengths: expected shape \[2\]"):
        linear_attention(q, cache.layer(0), i32([1], device))
    with pytest.raises(ValueError, match="layer: expected dtype torch.float32"):
        linear_attention(q.float(), cache.layer(0), lengths)
    with pytest.raises(ValueError, match="kv_scales: expected None"):
        linear_attention(q, cache.layer(0), lengths, kv_scales=torch.ones(2, device=device))
    with pytest.raises(ValueError, match="lse: expected a 3-d tensor"):
        linear_attention(q, cache.layer(0), lengths, lse=torch.zeros(2, 4, device=device))
    with pytest.raises(ValueError, match=r"lse: expected shape \[2, 4, 1\]"):
        linear_attention(q, cache.layer(0), lengths, lse=torch.zeros(2, 4, 2, device=device))


def test_plan_warp_split_and_quantized_splits():
    """Warp-split decode tiles only where they were measured faster (int4, head_dim 65..128, block tables of
    WARP_SPLIT_MIN_KV+ tokens, GQA groups of at most 16); fp8 / int8 / int4 at head_dim > 64 split few long
    sequences for two programs per SM (over 32k+ token tables with 16-bit queries: one-warp tiles, four per SM),
    16-bit caches for four."""
    kw = dict(num_q_heads=32, num_kv_heads=8, n_tokens=16, num_seqs=16)  # 128 programs: 4-warp tiles
    assert attention_plan(**kw, head_dim=128, max_kv_len=4096, kv_dtype="int4").warp_split
    assert not attention_plan(**kw, head_dim=128, max_kv_len=2048, kv_dtype="int4").warp_split
    assert not attention_plan(**kw, head_dim=64, max_kv_len=16384, kv_dtype="int4").warp_split
    assert not attention_plan(**kw, head_dim=256, max_kv_len=16384, kv_dtype="int4").warp_split
    for fmt in ("auto", "fp8", "int8"):
        assert not attention_plan(**kw, head_dim=128, max_kv_len=16384, kv_dtype=fmt).warp_split
    assert not attention_plan(num_q_heads=64, num_kv_heads=2, n_tokens=2, num_seqs=2, head_dim=128,
                              max_kv_len=16384, kv_dtype="int4").warp_split  # 32 q heads per KV head: 32 rows
    assert not attention_plan(num_q_heads=32, num_kv_heads=8, n_tokens=8192, num_seqs=4, head_dim=128,
                              max_kv_len=16384, kv_dtype="int4").warp_split  # prefill tiles
    one = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, n_tokens=1, num_seqs=1, max_kv_len=131072, num_sms=132)
    assert attention_plan(**one).num_splits == 64  # ceil(4 * 132 / 8) = 66, capped at 64
    # fp8 over a 32k+ table: one-warp tiles, split for four programs per SM like int8 / int4; fp32 queries keep the
    # 4-warp tile, split for two
    assert attention_plan(**one, kv_dtype="fp8").num_splits == 64
    assert attention_plan(**one, kv_dtype="fp8", q_bytes=4).num_splits == 33  # ceil(2 * 132 / 8)
    short = dict(one, max_kv_len=16384, n_tokens=16, num_seqs=16)  # 128 programs, a 16k table: 4-warp tiles
    for fmt in ("fp8", "int8", "int4"):
        assert attention_plan(**short, kv_dtype=fmt).num_splits == 3  # ceil(2 * 132 / 128)


def test_plan_quantized_prefill_and_small_decode_tiles():
    """Prefill of fp8 / int4 caches at head_dim 65..128 with 16-bit queries and GQA groups up to 64: 64-row tiles
    of 4 warps (16-bit and int8 caches, and fp32 queries, keep 128 rows of 8 warps); at head_dim 64, int8 / int4
    prefill takes 3 stages; decode at head_dim <= 64: int4 128-key tiles, int8 one-warp 64-key tiles. Every plan: at
    least one token and 16 rows per tile."""
    pf = dict(num_q_heads=32, num_kv_heads=8, n_tokens=16384, num_seqs=8, max_kv_len=2048)
    for fmt, stages in (("fp8", 2), ("int4", 3)):
        plan = attention_plan(**pf, head_dim=128, kv_dtype=fmt)
        assert (plan.block_m(32, 8), plan.block_n, plan.num_warps, plan.num_stages) == (64, 128, 4, stages)
        plan = attention_plan(**pf, head_dim=80, kv_dtype=fmt, q_bytes=4)  # fp32 queries: not this tile
        assert (plan.block_m(32, 8), plan.block_n) == (128, 64)
    for fmt in ("auto", "int8"):
        plan = attention_plan(**pf, head_dim=128, kv_dtype=fmt)
        assert (plan.block_m(32, 8), plan.block_n, plan.num_warps) == (128, 128, 8)
    for fmt, stages in (("auto", 2), ("fp8", 2), ("int8", 3), ("int4", 3)):  # head_dim 64: 128 rows, stages per format
        plan = attention_plan(**pf, head_dim=64, kv_dtype=fmt)
        assert (plan.block_m(32, 8), plan.block_n, plan.num_stages) == (128, 64, stages)
    assert attention_plan(**pf, head_dim=64, kv_dtype="int8", q_bytes=4).num_stages == 2
    big = attention_plan(num_q_heads=128, num_kv_heads=1, head_dim=128, n_tokens=4096, num_seqs=2, max_kv_len=4096,
                         kv_dtype="int8")  # a 128-head group: the 128-row, 8-warp tile (64 rows cannot hold it)
    assert (big.block_m(128, 1), big.num_warps) == (128, 8)
    for g in (1, 2, 3, 4, 8, 16, 32, 128):
        for d in (64, 80, 96, 128, 256):
            for fmt in ("auto", "fp8", "int8", "int4"):
                for qb in (2, 4):
                    for n_tok, seqs in ((8, 8), (4096, 2)):
                        plan = attention_plan(num_q_heads=8 * g, num_kv_heads=8, head_dim=d, n_tokens=n_tok,
                                              num_seqs=seqs, max_kv_len=4096, kv_dtype=fmt, q_bytes=qb)
                        assert plan.block_q >= 1 and plan.block_m(8 * g, 8) >= 16 and plan.block_n >= 16
    dec = dict(num_q_heads=32, num_kv_heads=8, head_dim=64, n_tokens=64, num_seqs=64, max_kv_len=640)
    assert attention_plan(**dec, kv_dtype="int4").block_n == 128
    plan = attention_plan(**dec, kv_dtype="int8")
    assert (plan.block_n, plan.num_warps, plan.num_stages, plan.num_splits) == (64, 1, 3, 1)


def test_plan_long_context_one_warp_tiles():
    """int8 / int4 / k8v4 decode at head_dim 65..128: one-warp tiles in batches with two programs per SM or more
    (past four per SM, and int4 always: every KV range split LONG_SPLITS ways over block tables of LONG_MIN_KV+
    tokens; int8 / k8v4 at two to four per SM: five stages, unsplit) and, with fp8 / fp8k, for few sequences over
    FEW_MIN_KV+ tokens; few sequences over shorter tables, fp8 / fp8k batches, 16-bit caches, float32 queries,
    head_dim 64 or 256 and prefill keep their tiles."""
    kw = dict(num_q_heads=32, num_kv_heads=8, n_tokens=80, num_seqs=80, num_sms=132)  # 640 programs: 4.8 per SM
    for fmt, keys, stages in (("int8", 32, 3), ("int4", 64, 2), ("k8v4", 32, 3)):
        plan = attention_plan(**kw, head_dim=128, max_kv_len=16384, kv_dtype=fmt)
        assert (plan.block_n, plan.num_warps, plan.num_stages, plan.num_splits, plan.warp_split) == (
            keys, 1, stages, 8, False)
        assert attention_plan(**kw, head_dim=80, max_kv_len=4096, kv_dtype=fmt).num_warps == 1
        short = attention_plan(**kw, head_dim=128, max_kv_len=2048, kv_dtype=fmt)  # below LONG_MIN_KV: unsplit
        assert (short.num_warps, short.num_splits) == (1, 1)
        assert attention_plan(**kw, head_dim=256, max_kv_len=16384, kv_dtype=fmt).num_warps == 4
        one = attention_plan(num_q_heads=32, num_kv_heads=8, n_tokens=1, num_seqs=1, head_dim=128, max_kv_len=131072,
                             kv_dtype=fmt, num_sms=132)  # few programs, a 128k table: one-warp 32-key tiles, 64 splits
        assert (one.num_warps, one.block_n, one.num_stages, one.num_splits) == (1, 32, 5, 64)
        assert attention_plan(**kw, head_dim=64, max_kv_len=16384, kv_dtype=fmt).num_splits == 1
        few = attention_plan(num_q_heads=32, num_kv_heads=8, n_tokens=16, num_seqs=16, head_dim=128,
                             max_kv_len=16384, kv_dtype=fmt, num_sms=132)  # 128 programs < 2 per SM
        assert few.num_warps == 4
        pre = attention_plan(num_q_heads=32, num_kv_heads=8, n_tokens=8192, num_seqs=4, head_dim=128,
                             max_kv_len=16384, kv_dtype=fmt)  # prefill tiles
        assert pre.num_warps >= 4 and pre.block_m(32, 8) >= 64
    for fmt in ("auto", "fp8", "fp8k"):
        assert attention_plan(**kw, head_dim=128, max_kv_len=16384, kv_dtype=fmt).num_warps == 4
    # int4b: one block per one-warp tile (16 keys at block_size 16), two stages, int4's splits for full batches and
    # four programs an SM for the others, never a warp split, at every batch size where one warp holds the tile;
    # float32 queries keep int4's 4-warp tiles
    plan = attention_plan(**kw, head_dim=128, max_kv_len=16384, kv_dtype="int4b")
    assert (plan.block_n, plan.num_warps, plan.num_stages, plan.num_splits, plan.warp_split) == (16, 1, 2, 8, False)
    few = attention_plan(num_q_heads=32, num_kv_heads=8, n_tokens=4, num_seqs=4, head_dim=128, max_kv_len=16384,
                         kv_dtype="int4b", num_sms=132)
    assert (few.block_n, few.num_warps, few.warp_split) == (16, 1, False)
    assert few.num_splits == 17  # ceil(4 * 132 / 32 programs)
    assert attention_plan(num_q_heads=32, num_kv_heads=8, n_tokens=4, num_seqs=4, head_dim=128, max_kv_len=16384,
                          kv_dtype="int4", num_sms=132).num_splits == 9  # int4: two an SM
    assert attention_plan(**kw, head_dim=128, max_kv_len=16384, kv_dtype="int4b", q_bytes=4).num_warps == 4
    # 2..4 programs per SM: int8 / k8v4 take five-stage 32-key tiles, unsplit at every length; int4 its long tiles;
    # fp8 / fp8k their 4-warp tiles
    wave = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, num_sms=132)
    for seqs in (33, 64, 66):
        for kv_len in (512, 4096, 16384):
            for fmt in ("int8", "k8v4"):
                plan = attention_plan(**wave, n_tokens=seqs, num_seqs=seqs, max_kv_len=kv_len, kv_dtype=fmt)
                assert (plan.block_n, plan.num_warps, plan.num_stages, plan.num_splits, plan.warp_split) == (
                    32, 1, 5, 1, False)
            plan = attention_plan(**wave, n_tokens=seqs, num_seqs=seqs, max_kv_len=kv_len, kv_dtype="int4")
            assert (plan.block_n, plan.num_warps, plan.num_stages) == (64, 1, 2)
            for fmt in ("fp8", "fp8k"):
                plan = attention_plan(**wave, n_tokens=seqs, num_seqs=seqs, max_kv_len=kv_len, kv_dtype=fmt)
                assert (plan.block_n, plan.num_warps) == (128, 4)
    assert attention_plan(**wave, n_tokens=67, num_seqs=67, max_kv_len=1024, kv_dtype="int8").num_stages == 3
    assert attention_plan(**wave, n_tokens=32, num_seqs=32, max_kv_len=1024, kv_dtype="int8").num_warps == 4
    # few sequences: fp8 takes the one-warp tiles over long tables only; 16-bit caches never
    fp8 = attention_plan(num_q_heads=32, num_kv_heads=8, n_tokens=2, num_seqs=2, head_dim=128, max_kv_len=40960,
                         kv_dtype="fp8", num_sms=132)
    assert (fp8.num_warps, fp8.block_n, fp8.num_stages, fp8.num_splits) == (1, 32, 5, 33)
    assert attention_plan(num_q_heads=32, num_kv_heads=8, n_tokens=1, num_seqs=1, head_dim=128, max_kv_len=131072,
                          kv_dtype="auto", num_sms=132).num_warps == 4
    for d in (64, 128):  # float32 queries: four warps (one warp's registers cannot hold their tiles)
        assert attention_plan(**kw, head_dim=d, max_kv_len=16384, kv_dtype="int8", q_bytes=4).num_warps == 4
    for d in (64, 128):  # a GQA group of 64 (64 rows): four warps
        assert attention_plan(num_q_heads=64, num_kv_heads=1, n_tokens=64, num_seqs=64, head_dim=d,
                              max_kv_len=16384, kv_dtype="int8").num_warps == 4


def test_plan_is_pure_and_splits_long_decode():
    kw = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
    long1 = attention_plan(**kw, n_tokens=1, num_seqs=1, max_kv_len=131072)
    assert long1 == attention_plan(**kw, n_tokens=1, num_seqs=1, max_kv_len=131072)
    assert long1.num_splits > 8
    assert attention_plan(**kw, n_tokens=64, num_seqs=64, max_kv_len=16384).num_splits == 1
    pre = attention_plan(**kw, n_tokens=16384, num_seqs=8, max_kv_len=6144)
    assert pre.num_splits == 1 and pre.block_m(32, 8) == 128
    assert attention_plan(**kw, n_tokens=1, num_seqs=1, max_kv_len=100).num_splits == 1
    assert attention_plan(**kw, n_tokens=1, num_seqs=1, max_kv_len=10**6, num_splits=3).num_splits == 3
    assert attention_workspace_size(4, 8, 64, 1) == 0
    assert attention_workspace_size(4, 8, 64, 3) == 3 * 4 * 8 * 65


@pytest.mark.parametrize("bad", [[32], True, 32.0])
def test_plan_names_a_bad_argument_whatever_its_type(bad):
    # the plan is memoised: an unhashable argument, and a bool equal to an int, still get the named error
    kw = dict(num_kv_heads=8, head_dim=128, n_tokens=1, num_seqs=1, max_kv_len=4096)
    attention_plan(num_q_heads=32, **kw)
    with pytest.raises(TypeError, match="^num_q_heads: expected an int"):
        attention_plan(num_q_heads=bad, **kw)
