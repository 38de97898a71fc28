"""linear_attention over LinearKVCache / KVCacheManager layers against the independent float64 reference: the
lengths convention (tokens cached before the new rows), causal new rows, every layer dtype, GQA, window, softcap,
sinks, split-KV, lengths at capacity, slots past the active batch never read.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvcache
from kvcache.ops import linear_attention

from .attn_reference import assert_attn_close, dense_attention, i32


def _cache(device, dtype, B=3, H=2, S=40, D=64, seed=0):  # type: ignore[no-untyped-def]
    cache = kvcache.LinearKVCache(kvcache.CacheConfig(num_layers=1, max_batch_size=B, max_seq_len=S, num_kv_heads=H,
                                                      head_dim=D, dtype=dtype, device=device))
    vals = torch.randn(cache.layer(0).shape, generator=torch.Generator().manual_seed(seed))
    cache.layer(0).copy_(vals.to(dtype).to(device))
    return cache


def _expected(q, layer, lengths, *, scale, kv_scales=(1.0, 1.0), **kw):  # type: ignore[no-untyped-def]
    """float64 (out [B, Hq, q_len, D], lse [B, Hq, q_len]) of each slot from the layer's first lengths + q_len
    tokens; the new row i is at position lengths[b] + i."""
    bsz, hq, q_len, d = q.shape
    out = torch.zeros((bsz, hq, q_len, d), dtype=torch.float64)
    lse = torch.zeros((bsz, hq, q_len), dtype=torch.float64)
    for b, n0 in enumerate(lengths):
        n = n0 + q_len
        k = layer[b, 0, :, :n].float().cpu().transpose(0, 1) * kv_scales[0]
        v = layer[b, 1, :, :n].float().cpu().transpose(0, 1) * kv_scales[1]
        o, l_ = dense_attention(q[b].transpose(0, 1).cpu(), k, v, list(range(n0, n)), list(range(n)), scale=scale,
                                **kw)
        out[b], lse[b] = o.transpose(0, 1), l_.transpose(0, 1)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float32],
                         ids=["fp16", "bf16", "fp8", "fp32"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_dtypes_and_lengths(device, dtype, q_len):
    H, hq, D = 2, 4, 64
    cache = _cache(device, dtype, H=H, D=D)
    qdt = torch.float16 if dtype == torch.float8_e4m3fn else dtype
    lengths = [5, 0, 40 - q_len]  # slot 2: the new rows end exactly at max_seq_len
    q = torch.randn((3, hq, q_len, D), generator=torch.Generator().manual_seed(1)).to(qdt).to(device)
    out = torch.full_like(q, 7.0)
    lse = torch.full((3, hq, q_len), 7.0, device=device)
    res = linear_attention(q, cache.layer(0), i32(lengths, device), out=out, lse=lse)
    assert res is out
    eo, el = _expected(q, cache.layer(0), lengths, scale=1 / math.sqrt(D))
    assert_attn_close(out, lse, eo, el, qdt, what=str(dtype))


def test_options_and_splits(device):
    """Window, softcap and sinks, with and without a KV split, on a subset of the slots (active batch 2 of 3)."""
    H, hq, D = 1, 4, 80
    cache = _cache(device, torch.float16, H=H, D=D, S=80)
    lengths = [70, 11]
    q = torch.randn((2, hq, 2, D), generator=torch.Generator().manual_seed(2)).half().to(device) * 3
    sinks = torch.tensor([1.0, -2.0, 0.0, 4.0], device=device)
    eo, el = _expected(q, cache.layer(0), lengths, scale=0.1, window=9, softcap=4.0, sinks=sinks)
    for splits in (1, 3):
        lse = torch.empty((2, hq, 2), device=device)
        out = linear_attention(q, cache.layer(0), i32(lengths, device), scale=0.1, window=9, softcap=4.0, sinks=sinks,
                               lse=lse, num_splits=splits)
        assert_attn_close(out, lse, eo, el, torch.float16, what=f"splits {splits}")


def test_fp8_scales_and_manager(device):
    """A float8 KVCacheManager layer with (k_scale, v_scale): K = stored * k_scale, V = stored * v_scale."""
    H, hq, D, S = 2, 2, 64, 24
    mgr = kvcache.KVCacheManager(kvcache.ManagerConfig(max_batch_size=2, max_seq_len=S,
                                                       layers=[kvcache.KVLayerConfig(H, D)],
                                                       dtype=torch.float8_e4m3fn, device=device))
    vals = torch.randn(mgr.layer(0).shape, generator=torch.Generator().manual_seed(4))
    mgr.layer(0).copy_(vals.to(torch.float8_e4m3fn).to(device))
    scales = torch.tensor([0.25, 3.0], device=device)
    q = torch.randn((2, hq, 1, D), generator=torch.Generator().manual_seed(5)).half().to(device)
    lse = torch.empty((2, hq, 1), device=device)
    out = linear_attention(q, mgr.layer(0), i32([7, 23], device), kv_scales=scales, lse=lse)
    eo, el = _expected(q, mgr.layer(0), [7, 23], scale=1 / math.sqrt(D), kv_scales=(0.25, 3.0))
    assert_attn_close(out, lse, eo, el, torch.float16)


def test_lengths_convention_changes_result(device):
    """lengths counts tokens *before* the new rows: one more cached token is one more key for every row."""
    cache = _cache(device, torch.float16, B=1, H=1, D=64)
    q = torch.randn((1, 1, 2, 64), generator=torch.Generator().manual_seed(6)).half().to(device)
    a = linear_attention(q, cache.layer(0), i32([4], device))
    b = linear_attention(q, cache.layer(0), i32([5], device))
    assert not torch.equal(a, b)
    eo, _ = _expected(q, cache.layer(0), [4], scale=1 / 8)
    assert_attn_close(a, None, eo, None, torch.float16)
