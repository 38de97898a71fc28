"""PagedConfig / PagedKVCache layout: pool, kv and params shapes and dtypes for every kv_dtype and layout, views
sharing memory with the one allocation, FlashInfer's NHD / HND page conventions and FlashAttention's k_cache
view (checked by flat byte offsets computed here), cache_block_bytes against the allocation and against the
byte format computed independently, and config validation.
"""

from __future__ import annotations

import pytest
import torch

from kvcache.paged import PagedConfig, PagedKVCache, cache_block_bytes
from kvcache.rope import RopeConfig

from . import paged_reference as pr

KV_DTYPES = ["auto", "fp8", "int8", "int4", "fp8k"]  # k8v4 (no single K view): its own test
MODEL_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
MODEL_IDS = ["fp16", "bf16", "fp32"]
# (L, H, D, block_size, num_blocks): odd shapes included
SHAPES = [
    pytest.param((1, 1, 8, 1, 1), id="tiny"),
    pytest.param((3, 5, 80, 4, 7), id="h5-d80"),
    pytest.param((2, 3, 96, 16, 3), id="d96-bs16"),
    pytest.param((2, 2, 576, 3, 2), id="d576-bs3"),
    pytest.param((1, 8, 128, 64, 2), id="d128-bs64"),
]


def _stored_dtype(dtype: torch.dtype, kv_dtype: str) -> torch.dtype:
    return {"auto": dtype, "fp8": torch.float8_e4m3fn, "int8": torch.uint8, "int4": torch.uint8,
            "fp8k": torch.float8_e4m3fn}[kv_dtype]


def _token_head_bytes(D: int, dtype: torch.dtype, kv_dtype: str) -> int:
    """Bytes of one (token, head) over K and V, parameters included, from the byte-format docstring."""
    if kv_dtype == "fp8k":
        return 2 * D + 4  # fp8 K and V, one float32 scale of the key
    return 2 * _row_bytes(D, dtype, kv_dtype)


def _row_bytes(D: int, dtype: torch.dtype, kv_dtype: str) -> int:
    """Bytes of one stored (token, head) row, parameters included, from the byte-format docstring."""
    if kv_dtype == "auto":
        return D * torch.empty((), dtype=dtype).element_size()
    if kv_dtype == "fp8":
        return D
    data = D if kv_dtype == "int8" else D // 2
    return data + 2 * 4  # float32 scale and zero


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_pool_shapes_dtypes_and_bytes(device, shape, kv_dtype, layout):
    L, H, D, bs, nb = shape
    for dtype in MODEL_DTYPES:
        cfg = PagedConfig(num_layers=L, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, dtype=dtype,
                          kv_dtype=kv_dtype, layout=layout, device=device)
        cache = PagedKVCache(cfg)
        dp = D // 2 if kv_dtype == "int4" else D
        want = (nb, 2, bs, H, dp) if layout == "NHD" else (nb, 2, H, bs, dp)
        assert cache.buffer.shape == (L, *want) and cache.buffer.is_contiguous()
        assert cache.buffer.dtype == _stored_dtype(dtype, kv_dtype)
        assert cache.buffer.device.type == torch.device(device).type
        assert not bits_any(cache.buffer), "pools are zero-initialised"
        assert cache.kv_scales.shape == (L, 2) and cache.kv_scales.dtype == torch.float32
        assert torch.equal(cache.kv_scales.cpu(), torch.ones(L, 2))
        for layer in range(L):
            pool = cache.pool(layer)
            assert pool.shape == want and pool.dtype == cache.buffer.dtype and pool.is_contiguous()
            assert pool.data_ptr() == cache.buffer[layer].data_ptr()
            k, v = cache.kv(layer)
            kv_shape = (nb, bs, H, dp) if layout == "NHD" else (nb, H, bs, dp)
            assert k.shape == v.shape == kv_shape
            assert k.data_ptr() == pool[:, 0].data_ptr() and v.data_ptr() == pool[:, 1].data_ptr()
            par = cache.params(layer)
            if kv_dtype in ("int8", "int4", "fp8k"):
                p, w = (1, 1) if kv_dtype == "fp8k" else (2, 2)  # fp8k: one plane, a scale per key row
                pshape = (nb, p, bs, H, w) if layout == "NHD" else (nb, p, H, bs, w)
                assert par.shape == pshape and par.dtype == torch.float32 and par.is_contiguous()
                assert par.data_ptr() == cache.params_buffer[layer].data_ptr()
                assert cfg.has_params and cfg.params_shape() == pshape
                assert cfg.quantized == (kv_dtype != "fp8k")  # (scale, zero) pairs: the integer formats only
            else:
                assert par is None and cache.params_buffer is None and not cfg.has_params
        assert cfg.pool_shape() == want
        # bytes: the allocation, cache_block_bytes, the config's block_bytes, and the format computed here
        per_block = cache_block_bytes(L, H, D, bs, dtype, kv_dtype)
        assert per_block * nb == cache.nbytes, (per_block, nb, cache.nbytes)
        assert cfg.block_bytes == per_block
        assert per_block == L * bs * H * _token_head_bytes(D, dtype, kv_dtype)
        allocated = cache.buffer.numel() * cache.buffer.element_size()
        if cache.params_buffer is not None:
            allocated += cache.params_buffer.numel() * cache.params_buffer.element_size()
        assert allocated == cache.nbytes


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_k8v4_planes_and_bytes(device, layout):
    """k8v4: three planes of D / 2 bytes per block (key codes [0, D/2), key codes [D/2, D), int4 values), the
    params pool of the other integer formats, D + D / 2 + 16 bytes per (token, head); no single K view."""
    L, H, D, bs, nb = 2, 3, 80, 4, 5
    for dtype in MODEL_DTYPES:
        cfg = PagedConfig(num_layers=L, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb, dtype=dtype,
                          kv_dtype="k8v4", layout=layout, device=device)
        cache = PagedKVCache(cfg)
        want = (nb, 3, bs, H, D // 2) if layout == "NHD" else (nb, 3, H, bs, D // 2)
        assert cache.pool(1).shape == want and cache.buffer.dtype == torch.uint8
        pshape = (nb, 2, bs, H, 2) if layout == "NHD" else (nb, 2, H, bs, 2)
        assert cache.params(1).shape == pshape and cache.params(1).dtype == torch.float32
        assert cache_block_bytes(L, H, D, bs, dtype, "k8v4") == L * bs * H * (D + D // 2 + 16) == cfg.block_bytes
        assert cfg.block_bytes * nb == cache.nbytes
    with pytest.raises(ValueError, match="k8v4"):
        cache.kv(0)
    with pytest.raises(ValueError, match="even head_dim"):
        PagedConfig(num_layers=1, num_kv_heads=1, head_dim=7, block_size=4, num_blocks=2, kv_dtype="k8v4")


def bits_any(t: torch.Tensor) -> bool:
    return bool(pr.bits(t).ne(0).any())


def test_cache_block_bytes_defaults_and_keywords():
    assert cache_block_bytes(32, 8, 128, 16) == 32 * 2 * 16 * 8 * 128 * 2  # float16, auto
    assert cache_block_bytes(num_layers=2, num_kv_heads=3, head_dim=80, block_size=4, dtype=torch.bfloat16,
                             kv_dtype="int4") == 2 * 2 * 4 * 3 * (40 + 8)
    assert cache_block_bytes(1, 1, 8, 1, kv_dtype="fp8") == 2 * 8


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_flat_offsets_follow_the_flashinfer_convention(device, kv_dtype, layout):
    """Every element of kv(layer) and params(layer) sits at the flat offset of FlashInfer's paged layout:
    NHD ((page * 2 + kv) * page_size + token) * H + head, HND ((page * 2 + kv) * H + head) * page_size + token
    (times the row length), layers one after another; params the same with their planes (2: (scale, zero) of K
    and V; fp8k: 1, the keys' scales) and row width (2; fp8k: 1)."""
    L, H, D, bs, nb = 2, 3, 8, 4, 5
    cache = PagedKVCache(PagedConfig(num_layers=L, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=nb,
                                     kv_dtype=kv_dtype, layout=layout, device=device))
    dp = cache.config.row_elems
    elt = cache.buffer.element_size()
    base = cache.buffer.data_ptr()
    P, W = (1, 1) if kv_dtype == "fp8k" else (2, 2)  # params planes and floats per row
    for layer in range(L):
        k, v = cache.kv(layer)
        par = cache.params(layer)
        for page in (0, 2, nb - 1):
            for tok in (0, bs - 1):
                for head in (0, H - 1):
                    for kv, view in ((0, k), (1, v)):
                        has_par = par is not None and kv < P
                        if layout == "NHD":
                            row = ((page * 2 + kv) * bs + tok) * H + head
                            prow = ((page * P + kv) * bs + tok) * H + head
                            el = view[page, tok, head]
                            pel = par[page, kv, tok, head] if has_par else None
                        else:
                            row = ((page * 2 + kv) * H + head) * bs + tok
                            prow = ((page * P + kv) * H + head) * bs + tok
                            el = view[page, head, tok]
                            pel = par[page, kv, head, tok] if has_par else None
                        layer_rows = nb * 2 * bs * H
                        assert el.shape == (dp,) and el.stride() == (1,)
                        assert (el.data_ptr() - base) // elt == (layer * layer_rows + row) * dp
                        if pel is not None:  # (scale, zero) of the same row, same ordering
                            pbase = cache.params_buffer.data_ptr()
                            assert pel.shape == (W,)
                            assert (pel.data_ptr() - pbase) // 4 == (layer * nb * P * bs * H + prow) * W
    k, _ = cache.kv(1)
    if layout == "NHD":
        assert k.stride() == (2 * bs * H * dp, H * dp, dp, 1)
    else:
        assert k.stride() == (2 * H * bs * dp, bs * dp, dp, 1)


def test_kv_views_share_memory_with_the_pool(device):
    cache = PagedKVCache(PagedConfig(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=3,
                                     device=device))
    k, v = cache.kv(1)
    k[2, 3, 1, 5] = 7.0
    v[0, 1, 0, 0] = -3.0
    assert cache.pool(1)[2, 0, 3, 1, 5].item() == 7.0
    assert cache.buffer[1, 0, 1, 1, 0, 0].item() == -3.0
    assert int(pr.bits(cache.buffer).ne(0).sum()) == 2
    cache.pool(0)[1, 1, 2] = 1.5
    assert bool((cache.kv(0)[1][1, 2] == 1.5).all())


def test_flash_attention_k_cache_view(device):
    """NHD: pool[:, 0] is FlashAttention's k_cache [num_blocks, block_size, H, D]: token t of a sequence with
    block table bt is k_cache[bt[t // block_size], t % block_size]."""
    H, D, bs = 2, 8, 4
    gen = pr.generator(300)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs)
    k = pr.randn((10, H, D), torch.float16, gen, device)
    tables = [[5, 2, 9]]
    cache.append(0, k, k, cache.plan(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32([0, 10], device),
                                     kv_lens=pr.i32([0], device)))
    k_cache, v_cache = cache.kv(0)
    assert k_cache.shape == (16, bs, H, D)
    for t in range(10):
        pr.assert_bits_equal(k_cache[tables[0][t // bs], t % bs], k[t], f"token {t}")
        pr.assert_bits_equal(v_cache[tables[0][t // bs], t % bs], k[t], f"token {t}")


def test_rope_is_kept_on_the_cache(device):
    rope = RopeConfig(head_dim=16)
    cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=1, head_dim=16, block_size=2, num_blocks=2,
                                     device=device), rope=rope)
    assert cache.config.head_dim == 16 and cache.num_layers == 1
    assert cache.device.type == torch.device(device).type


# ---------------------------------------------------------------------------------------------------------
# validation

GOOD = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=4)


@pytest.mark.parametrize(
    "field, value, exc",
    [
        ("num_layers", 0, ValueError),
        ("num_layers", -1, ValueError),
        ("num_layers", 2.0, TypeError),
        ("num_layers", True, TypeError),
        ("num_layers", "2", TypeError),
        ("num_kv_heads", 0, ValueError),
        ("num_kv_heads", None, TypeError),
        ("head_dim", 0, ValueError),
        ("head_dim", 8.0, TypeError),
        ("block_size", 0, ValueError),
        ("block_size", torch.tensor(4), TypeError),
        ("num_blocks", 0, ValueError),
        ("num_blocks", 3.5, TypeError),
        ("dtype", torch.int8, ValueError),
        ("dtype", torch.float8_e4m3fn, ValueError),
        ("dtype", "float16", TypeError),
        ("kv_dtype", "int2", ValueError),
        ("kv_dtype", "FP8", ValueError),
        ("kv_dtype", 8, TypeError),
        ("kv_dtype", torch.uint8, TypeError),
        ("layout", "NDH", ValueError),
        ("layout", "nhd", ValueError),
        ("layout", 0, TypeError),
        ("device", "not-a-device", ValueError),
        ("device", 1.5, TypeError),
    ],
)
def test_config_rejects(field, value, exc):
    with pytest.raises(exc, match=pr.names(field)):
        PagedConfig(**{**GOOD, field: value})


def test_config_int4_needs_an_even_head_dim():
    with pytest.raises(ValueError, match=pr.names("head_dim")):
        PagedConfig(**{**GOOD, "head_dim": 9, "kv_dtype": "int4"})
    PagedConfig(**{**GOOD, "head_dim": 9, "kv_dtype": "int8"})  # odd is fine elsewhere
    PagedConfig(**{**GOOD, "head_dim": 10, "kv_dtype": "int4"})


def test_config_is_frozen():
    cfg = PagedConfig(**GOOD)
    with pytest.raises(AttributeError):
        cfg.num_blocks = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(num_layers=0), ValueError, "num_layers"),
        (dict(num_layers=1.0), TypeError, "num_layers"),
        (dict(num_kv_heads=0), ValueError, "num_kv_heads"),
        (dict(head_dim=-8), ValueError, "head_dim"),
        (dict(head_dim=7, kv_dtype="int4"), ValueError, "head_dim"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(block_size="16"), TypeError, "block_size"),
        (dict(dtype=torch.int32), ValueError, "dtype"),
        (dict(dtype="fp16"), TypeError, "dtype"),
        (dict(kv_dtype="int3"), ValueError, "kv_dtype"),
        (dict(kv_dtype=None), TypeError, "kv_dtype"),
    ],
)
def test_cache_block_bytes_rejects(kwargs, exc, name):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    with pytest.raises(exc, match=pr.names(name)):
        cache_block_bytes(**{**args, **kwargs})


def test_cache_constructor_rejects():
    with pytest.raises(TypeError, match=pr.names("config")):
        PagedKVCache(dict(GOOD))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=pr.names("rope")):
        PagedKVCache(PagedConfig(**GOOD), rope="default")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=pr.names("rope")):
        PagedKVCache(PagedConfig(**GOOD), rope=RopeConfig(head_dim=16))


@pytest.mark.parametrize("layer, exc", [(2, ValueError), (-1, ValueError), ("0", TypeError), (1.0, TypeError)])
def test_layer_index_is_checked(device, layer, exc):
    cache = PagedKVCache(PagedConfig(**GOOD, kv_dtype="int8", device=device))
    for fn in (cache.pool, cache.kv, cache.params):
        with pytest.raises(exc, match=pr.names("layer")):
            fn(layer)
