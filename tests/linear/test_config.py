"""CacheConfig, KVLayerConfig, ManagerConfig: validation at construction, derived shapes, device resolution."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcache import CacheConfig, KVCacheManager, KVLayerConfig, LinearKVCache, ManagerConfig

from . import KV_DTYPES

CACHE_KW = dict(num_layers=2, max_batch_size=3, max_seq_len=8, num_kv_heads=2, head_dim=16, device="cpu")
INT_FIELDS = ["num_layers", "max_batch_size", "max_seq_len", "num_kv_heads", "head_dim"]


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------------------------------- CacheConfig


def test_cache_config_shapes_and_defaults():
    cfg = CacheConfig(num_layers=3, max_batch_size=5, max_seq_len=7, num_kv_heads=2, head_dim=80, device="cpu")
    assert cfg.dtype == torch.float16
    assert cfg.layer_shape == (5, 2, 2, 7, 80)
    assert cfg.shape == (3, 5, 2, 2, 7, 80)
    assert cfg.nbytes == 3 * 5 * 2 * 2 * 7 * 80 * 2
    assert cfg.device == torch.device("cpu")


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_cache_config_accepts_kv_dtypes(dtype):
    cfg = CacheConfig(**{**CACHE_KW, "dtype": dtype})
    assert cfg.dtype == dtype
    assert cfg.nbytes == 2 * 3 * 2 * 2 * 8 * 16 * torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("bad", [2.0, "2", True, None, torch.tensor(2)])
def test_cache_config_wrong_int_type(field, bad):
    with pytest.raises(TypeError, match=field):
        CacheConfig(**{**CACHE_KW, field: bad})


@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("bad", [0, -1, -100])
def test_cache_config_nonpositive(field, bad):
    with pytest.raises(ValueError, match=field):
        CacheConfig(**{**CACHE_KW, field: bad})


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.float64, torch.float8_e5m2])
def test_cache_config_unknown_dtype(dtype):
    with pytest.raises(ValueError, match="dtype"):
        CacheConfig(**{**CACHE_KW, "dtype": dtype})


@pytest.mark.parametrize("dtype", ["float16", None, 16])
def test_cache_config_dtype_wrong_type(dtype):
    with pytest.raises(TypeError, match="dtype"):
        CacheConfig(**{**CACHE_KW, "dtype": dtype})


@pytest.mark.parametrize("device", ["bogus", "cuda:99", "meta", "cpu:x"])
def test_cache_config_bad_device(device):
    with pytest.raises(ValueError, match="device"):
        CacheConfig(**{**CACHE_KW, "device": device})


@pytest.mark.parametrize("device", [object(), 1.5, [0]])
def test_cache_config_device_wrong_type(device):
    with pytest.raises(TypeError, match="device"):
        CacheConfig(**{**CACHE_KW, "device": device})


def test_cache_config_device_none_resolves():
    cfg = CacheConfig(**{**CACHE_KW, "device": None})
    assert isinstance(cfg.device, torch.device)
    assert cfg.device == _default_device()
    if not torch.cuda.is_available():
        assert cfg.device == torch.device("cpu")


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_cache_config_device_normalised(device):
    cfg = CacheConfig(**{**CACHE_KW, "device": device})
    assert cfg.device == torch.device("cpu")
    assert isinstance(cfg.device, torch.device)


def test_cache_config_is_frozen():
    cfg = CacheConfig(**CACHE_KW)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_seq_len = 9  # type: ignore[misc]


def test_cache_config_keyword_names():
    # The names are a contract (DESIGN.md "Public API"): callers use keyword arguments.
    cfg = CacheConfig(num_layers=1, max_batch_size=1, max_seq_len=1, num_kv_heads=1, head_dim=1,
                      dtype=torch.bfloat16, device="cpu")
    assert (cfg.num_layers, cfg.max_batch_size, cfg.max_seq_len, cfg.num_kv_heads, cfg.head_dim) == (1, 1, 1, 1, 1)
    assert cfg.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------- KVLayerConfig


def test_kv_layer_config():
    lc = KVLayerConfig(num_kv_heads=3, head_dim=80)
    assert (lc.num_kv_heads, lc.head_dim) == (3, 80)
    assert lc == KVLayerConfig(3, 80)


@pytest.mark.parametrize("kw,exc", [
    (dict(num_kv_heads=0, head_dim=8), ValueError),
    (dict(num_kv_heads=2, head_dim=0), ValueError),
    (dict(num_kv_heads=-2, head_dim=8), ValueError),
    (dict(num_kv_heads=2, head_dim=-8), ValueError),
    (dict(num_kv_heads=2.0, head_dim=8), TypeError),
    (dict(num_kv_heads=2, head_dim="8"), TypeError),
    (dict(num_kv_heads=True, head_dim=8), TypeError),
])
def test_kv_layer_config_invalid(kw, exc):
    with pytest.raises(exc):
        KVLayerConfig(**kw)


# ------------------------------------------------------------------------------------------- ManagerConfig

LAYERS = [KVLayerConfig(2, 8), KVLayerConfig(3, 80), KVLayerConfig(1, 96)]


def test_manager_config_shapes():
    cfg = ManagerConfig(max_batch_size=4, max_seq_len=6, layers=list(LAYERS), dtype=torch.bfloat16, device="cpu")
    assert isinstance(cfg.layers, tuple)
    assert cfg.layers == tuple(LAYERS)
    assert cfg.num_layers == 3
    assert cfg.layer_shape(0) == (4, 2, 2, 6, 8)
    assert cfg.layer_shape(1) == (4, 2, 3, 6, 80)
    assert cfg.layer_shape(2) == (4, 2, 1, 6, 96)
    assert cfg.nbytes == 4 * 2 * 6 * (2 * 8 + 3 * 80 + 1 * 96) * 2
    assert cfg.device == torch.device("cpu")


def test_manager_config_layers_copied():
    layers = list(LAYERS)
    cfg = ManagerConfig(max_batch_size=2, max_seq_len=4, layers=layers, device="cpu")
    layers.append(KVLayerConfig(5, 5))
    assert cfg.num_layers == 3


def test_manager_config_device_none_resolves():
    cfg = ManagerConfig(max_batch_size=2, max_seq_len=4, layers=LAYERS)
    assert cfg.device == _default_device()


@pytest.mark.parametrize("kw,exc,name", [
    (dict(max_batch_size=0), ValueError, "max_batch_size"),
    (dict(max_batch_size=-1), ValueError, "max_batch_size"),
    (dict(max_seq_len=0), ValueError, "max_seq_len"),
    (dict(max_batch_size=2.0), TypeError, "max_batch_size"),
    (dict(max_seq_len="4"), TypeError, "max_seq_len"),
    (dict(layers=[]), ValueError, "layers"),
    (dict(layers=KVLayerConfig(2, 8)), TypeError, "layers"),
    (dict(layers="abc"), TypeError, "layers"),
    (dict(layers=[(2, 8)]), TypeError, "layers"),
    (dict(layers=[KVLayerConfig(2, 8), None]), TypeError, "layers"),
    (dict(dtype=torch.float64), ValueError, "dtype"),
    (dict(dtype="float16"), TypeError, "dtype"),
    (dict(device="bogus"), ValueError, "device"),
    (dict(device="cuda:99"), ValueError, "device"),
    (dict(device=object()), TypeError, "device"),
])
def test_manager_config_invalid(kw, exc, name):
    base = dict(max_batch_size=2, max_seq_len=4, layers=LAYERS, device="cpu")
    with pytest.raises(exc, match=name):
        ManagerConfig(**{**base, **kw})


# ------------------------------------------------------------------------------------------- cache constructors


def test_cache_constructors_reject_wrong_config_type():
    mcfg = ManagerConfig(max_batch_size=2, max_seq_len=4, layers=LAYERS, device="cpu")
    ccfg = CacheConfig(**CACHE_KW)
    with pytest.raises(TypeError, match="config"):
        LinearKVCache(mcfg)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config"):
        KVCacheManager(ccfg)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config"):
        LinearKVCache(dict(CACHE_KW))  # type: ignore[arg-type]
