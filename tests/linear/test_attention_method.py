"""LinearKVCache.attention / KVCacheManager.attention: the new rows attend over each slot's valid prefix and
themselves, through ops.linear_attention with the cache's own lengths (no mask built by the caller)."""

from __future__ import annotations

import math

import pytest
import torch

from kvcache import CacheConfig, KVCacheManager, KVLayerConfig, LinearKVCache, ManagerConfig, ops


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """fp32 causal attention of q [Hq, T, D] at positions start.. over k, v [H, start + T, D]."""
    hq, t, d = q.shape
    rep = hq // k.shape[0]
    kk, vv = k.repeat_interleave(rep, 0).float(), v.repeat_interleave(rep, 0).float()
    s = q.float() @ kk.transpose(-1, -2) / math.sqrt(d)
    pos = torch.arange(start, start + t)[:, None]
    s = s.masked_fill(torch.arange(k.shape[1])[None, :] > pos, float("-inf"))
    return s.softmax(-1) @ vv


@pytest.mark.parametrize("kind", ["linear", "manager"])
def test_cache_attention_over_prefix_and_new_rows(kind):
    gen = torch.Generator().manual_seed(0)
    if kind == "linear":
        cache = LinearKVCache(CacheConfig(2, 3, 32, 2, 8, dtype=torch.float32, device="cpu"))
    else:
        cache = KVCacheManager(ManagerConfig(3, 32, [KVLayerConfig(2, 8), KVLayerConfig(1, 16)],
                                             dtype=torch.float32, device="cpu"))
    cache.reset_for_new_sequences([0, 0])
    h, d = (1, 16) if kind == "manager" else (2, 8)
    layer = 1
    prefix = torch.randn(2, h, 5, d, generator=gen)
    cache.append(layer, prefix, prefix)
    cache.commit(5)
    new = torch.randn(2, h, 3, d, generator=gen)
    cache.append(layer, new, new)
    q = torch.randn(2, 2 * h, 3, d, generator=gen)
    out = cache.attention(layer, q)
    want = ops.linear_attention(q, cache.layer(layer), cache.lengths)
    assert torch.equal(out, want)
    for b in range(2):
        kv = torch.cat([prefix[b], new[b]], dim=1)
        torch.testing.assert_close(out[b], _dense(q[b], kv, kv, 5), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="^i"):
        cache.attention(7, q)
