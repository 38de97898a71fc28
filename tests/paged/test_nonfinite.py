"""A NaN or an infinity in K / V stays visible after a round trip through the pool, never a finite value, the
same on the torch path, the interpreter and the GPU:

* auto: stored as given (a copy);
* fp8: finite values saturate at +-448 x scale; NaN and +-inf are stored as NaN (e4m3fn has no infinity);
* int8 / int4: a (token, head) holding a NaN or an infinity stores codes 0 with scale and zero NaN, and reads
  back as NaN in every element; its other heads and tokens are unaffected.
* fp8k: values as fp8; a key (token, head) holding a NaN or an infinity stores scale NaN and reads back as NaN
  in every element, its other heads and tokens within the documented bound.
"""

from __future__ import annotations

import pytest
import torch

from kvcache import PagedConfig, PagedKVCache, RopeConfig
from sweeps import pairwise

H, D, BS = 3, 16, 4
BAD = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}


def _roundtrip(device: torch.device, kv_dtype: str, layout: str, x: torch.Tensor, rope: bool) -> tuple:
    cfg = PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=4, dtype=torch.float16,
                      kv_dtype=kv_dtype, layout=layout, device=device)
    cache = PagedKVCache(cfg, rope=RopeConfig(head_dim=D) if rope else None)
    n = x.shape[0]
    tables = torch.tensor([[2, 0]], dtype=torch.int32, device=device)
    cache.append(0, x, x, cache.plan(tables, torch.tensor([0, n], dtype=torch.int32, device=device),
                                     torch.zeros(1, dtype=torch.int32, device=device)))
    k, v = cache.gather(0, cache.plan(tables, seq_lens=torch.tensor([n], dtype=torch.int32, device=device)))
    return k[0].transpose(0, 1).float().cpu(), v[0].transpose(0, 1).float().cpu(), cache


@pytest.mark.parametrize(("kv_dtype", "layout", "bad"), pairwise(
    ["auto", "fp8", "int8", "int4", "k8v4", "fp8k"], ["NHD", "HND"], list(BAD)))
def test_nonfinite_values_stay_visible(device, kv_dtype, layout, bad):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, H, D, generator=gen) * 2
    x[1, 0, 3] = BAD[bad]  # token 1, head 0
    x[4, 2, D - 1] = BAD[bad]  # token 4, head 2: the last element (int4: the second half's high nibble)
    xd = x.to(torch.float16).to(device)
    k, v, _ = _roundtrip(device, kv_dtype, layout, xd, rope=False)
    heads = torch.zeros(6, H, dtype=torch.bool)
    heads[1, 0] = heads[4, 2] = True
    elems = ~torch.isfinite(x)
    if kv_dtype == "auto":  # a copy: the same values, NaN where NaN (its payload is not compared: converting
        # the gathered rows to float32 on a GPU makes every NaN the canonical one)
        want = x.to(torch.float16).float()
        assert torch.equal(torch.isnan(v), torch.isnan(want))
        assert torch.equal(v[~torch.isnan(want)], want[~torch.isnan(want)])
    elif kv_dtype in ("fp8", "fp8k"):
        assert torch.isnan(v[elems]).all()
        assert torch.isfinite(v[~elems]).all()
        if kv_dtype == "fp8k":  # keys: the whole (token, head) NaN, the others within max(|x| / 16, scale / 1024)
            assert torch.isnan(k[heads]).all()
            assert torch.isfinite(k[~heads]).all()
            xh = x.to(torch.float16).float()[~heads]
            scale = xh.abs().amax(-1, keepdim=True) / 448
            err = (k[~heads] - xh).abs()
            assert bool((err <= torch.maximum(xh.abs() / 16, scale / 1024) + xh.abs() * 2.0**-10).all())
    else:
        assert torch.isnan(v[heads]).all()  # every element of the (token, head)
        assert torch.isfinite(v[~heads]).all()
        step = (x.amax(-1) - x.amin(-1)) / (255 if kv_dtype == "int8" else 15)
        err = (v - x).abs()[~heads]
        assert bool((err <= step[~heads][:, None] / 2 + 1e-2).all())


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8", "int4", "k8v4", "fp8k"])
def test_nonfinite_keys_with_rope_stay_visible(device, kv_dtype):
    """RoPE mixes a pair's two elements: a non-finite element makes its partner non-finite too; whatever it
    touches comes back NaN or infinite, never finite."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, H, D, generator=gen)
    x[2, 1, 0] = float("nan")
    x[3, 0, 5] = float("inf")
    k, _, _ = _roundtrip(device, kv_dtype, "NHD", x.to(torch.float16).to(device), rope=True)
    assert not torch.isfinite(k[2, 1, 0]) and not torch.isfinite(k[3, 0, 5])
    assert not torch.isfinite(k[2, 1, D // 2]) and not torch.isfinite(k[3, 0, 5 + D // 2])  # the partners
    untouched = torch.ones(5, H, dtype=torch.bool)
    untouched[2, 1] = untouched[3, 0] = False
    assert torch.isfinite(k[untouched]).all()


def test_int_format_stores_nan_scale_and_zero_codes(device):
    x = torch.randn(2, H, D).to(torch.float16)
    x[0, 1, 7] = float("nan")
    _, _, cache = _roundtrip(device, "int8", "NHD", x.to(device), rope=False)
    params = cache.params(0).cpu()  # [num_blocks, 2, BS, H, 2]; token 0 is block 2, offset 0
    assert torch.isnan(params[2, 1, 0, 1]).all()
    assert torch.isfinite(params[2, 1, 0, 0]).all() and torch.isfinite(params[2, 1, 1]).all()
    assert (cache.pool(0).cpu()[2, 1, 0, 1] == 0).all()
