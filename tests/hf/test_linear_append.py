"""LinearKVCache.append / KVCacheManager.append: writes at each sequence's current length (equal and ragged
lengths), every storage dtype bit-exact, bounds and argument checks before any byte is written; float32 caches
through the slot kernels (evict, save / restore) on both backends."""

from __future__ import annotations

import pytest
import torch

from kvcache import CacheConfig, KVCacheManager, KVLayerConfig, LinearKVCache, ManagerConfig

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


def _cache(dtype: torch.dtype, B: int = 3, S: int = 12, H: int = 2, D: int = 8, L: int = 2) -> LinearKVCache:
    cache = LinearKVCache(CacheConfig(num_layers=L, max_batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D,
                                      dtype=dtype, device="cpu"))
    cache.buffer.view(torch.uint8).fill_(0x5A)  # sentinel: untouched bytes stay 0x5A
    return cache


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths", [[2, 2, 2], [0, 5, 3]], ids=["equal", "ragged"])
def test_append_writes_at_lengths(dtype, lengths):
    cache = _cache(dtype)
    before = cache.buffer.clone()
    cache.reset_for_new_sequences(lengths)
    T = 4
    k, v = _rand((3, 2, T, 8), dtype, 1), _rand((3, 2, T, 8), dtype, 2)
    cache.append(1, k, v)
    assert cache.lengths.tolist() == lengths  # append does not commit
    expect = before.clone()
    for b, n in enumerate(lengths):
        expect[1, b, 0, :, n : n + T] = k[b]
        expect[1, b, 1, :, n : n + T] = v[b]
    assert torch.equal(_bits(cache.buffer), _bits(expect))


def test_append_takes_strided_views_and_then_commit():
    cache = _cache(torch.float32, B=2)
    cache.reset_for_new_sequences([0, 0])
    kv = _rand((2, 3, 2, 8), torch.float32, 3)  # [B, T, H, D] -> the HF layout by transpose
    cache.append(0, kv.transpose(1, 2), kv.transpose(1, 2))
    cache.commit(3)
    k, _ = cache.kv(0)
    assert torch.equal(k[:2, :, :3], kv.transpose(1, 2))
    assert cache.lengths.tolist() == [3, 3]


def test_append_past_max_seq_len_writes_nothing():
    cache = _cache(torch.float16, S=8)
    cache.reset_for_new_sequences([4, 6, 0])
    before = cache.buffer.clone()
    k = _rand((3, 2, 3, 8), torch.float16, 4)
    with pytest.raises(ValueError, match="sequence 1 holds 6 tokens.*max_seq_len=8"):
        cache.append(0, k, k)
    assert torch.equal(_bits(cache.buffer), _bits(before))


@pytest.mark.parametrize(("k_shape", "dtype", "match"), [
    ((2, 2, 3, 8), torch.float16, "active_batch_size"),  # 2 rows, 3 active
    ((3, 1, 3, 8), torch.float16, "k: expected shape"),
    ((3, 2, 3, 4), torch.float16, "k: expected shape"),
    ((3, 2, 8), torch.float16, "4-d"),
    ((3, 2, 3, 8), torch.float32, "dtype"),
])
def test_append_rejects_bad_arguments(k_shape, dtype, match):
    cache = _cache(torch.float16)
    cache.reset_for_new_sequences([0, 0, 0])
    before = cache.buffer.clone()
    k = torch.zeros(k_shape, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        cache.append(0, k, k)
    assert torch.equal(_bits(cache.buffer), _bits(before))


def test_append_rejects_mismatched_v_layer_and_type():
    cache = _cache(torch.float16)
    cache.reset_for_new_sequences([0, 0, 0])
    k = torch.zeros(3, 2, 2, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="v: expected shape"):
        cache.append(0, k, k[:, :, :1])
    with pytest.raises(ValueError, match="i"):
        cache.append(2, k, k)
    with pytest.raises(TypeError, match="k"):
        cache.append(0, k.tolist(), k)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device"):
        cache.append(0, k.to("meta"), k.to("meta"))


def test_manager_append_per_layer_shapes():
    cfg = ManagerConfig(max_batch_size=2, max_seq_len=10, layers=[KVLayerConfig(2, 8), KVLayerConfig(1, 16)],
                        dtype=torch.bfloat16, device="cpu")
    m = KVCacheManager(cfg)
    m.reset_for_new_sequences([1, 4])
    k = _rand((2, 1, 5, 16), torch.bfloat16, 5)
    m.append(1, k, -k)
    m.commit(5)
    kc, vc = m.kv(1)
    assert torch.equal(kc[0, :, 1:6], k[0]) and torch.equal(vc[1, :, 4:9], -k[1])
    with pytest.raises(ValueError, match="k: expected shape"):
        m.append(0, k, k)  # layer 0 is [*, 2, *, 8]
    with pytest.raises(ValueError, match="max_seq_len=10"):
        m.append(1, k, k)  # 9 + 5 > 10


def test_float32_cache_slot_ops(device):
    """float32 caches move 4-byte words through save / restore and eviction (kernels on both backends)."""
    cache = LinearKVCache(CacheConfig(num_layers=2, max_batch_size=3, max_seq_len=8, num_kv_heads=2, head_dim=6,
                                      dtype=torch.float32, device=device))
    cache.buffer.copy_(_rand(tuple(cache.buffer.shape), torch.float32, 6).to(device))
    ref = cache.buffer.clone()
    cache.reset_for_new_sequences([3, 5, 7])
    snap = cache.save(2, 7)
    assert torch.equal(snap.layers[1], ref[1, 2, :, :, :7])
    cache.evict([True, False, False])
    assert cache.lengths.tolist() == [5, 7]
    assert torch.equal(cache.buffer[:, 0, :, :, :5], ref[:, 1, :, :, :5])
    assert torch.equal(cache.buffer[:, 1, :, :, :7], ref[:, 2, :, :, :7])
    cache.restore(snap, 0)
    assert torch.equal(cache.buffer[:, 0, :, :, :7], ref[:, 2, :, :, :7])
