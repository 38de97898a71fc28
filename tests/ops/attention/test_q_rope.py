"""paged_attention with the query rotation fused (``q_rope=(cos, sin)``): un-rotated queries in, the result of
attending with the queries rotated at their positions (rotate-half in float32, one rounding to q's dtype) out,
against the float64 reference; decode and prefill tiles, split launches, every format; positions outside the tables
rotate to zero; q itself is untouched; bad tables are refused.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvcache.ops import paged_attention
from sweeps import each_value, named

from .attn_reference import assert_attn_close, i32, make_paged, paged_expected


def _tables(max_pos: int, d: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)


def _rotated(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_lens: list[int], kv_lens: list[int]):
    """The rule, row by row: position kv_len - q_len + i; outside the tables the row becomes zero."""
    out = torch.zeros_like(q, device="cpu")
    half = q.shape[-1] // 2
    row = 0
    for ql, kl in zip(q_lens, kv_lens):
        for i in range(ql):
            p = kl - ql + i
            if 0 <= p < cos.shape[0]:
                c, s = cos[p, :half].cpu().float(), sin[p, :half].cpu().float()
                a, b = q[row, :, :half].cpu().float(), q[row, :, half:].cpu().float()
                out[row] = torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(q.dtype)
            row += 1
    return out


def _attend(cache, bt, q, q_lens, kv_lens, device, **kw):  # type: ignore[no-untyped-def]
    cfg = cache.config
    cu = [0]
    for x in q_lens:
        cu.append(cu[-1] + x)
    return paged_attention(q, cache.pool(0), cache.params(0), cache.kv_scales[0] if cfg.kv_dtype == "fp8" else None,
                           kv_dtype=cfg.kv_dtype, layout=cfg.layout, block_tables=bt, cu_q_lens=i32(cu, device),
                           kv_lens=i32(list(kv_lens), device), **kw)


@pytest.mark.parametrize(("batch", "dtype", "kv_dtype"), each_value(
    ["decode", "mixed"], named([torch.bfloat16, torch.float16], ["bf16", "fp16"]), ["auto", "fp8", "int8", "int4"]))
def test_fused_query_rope_equals_rotated_queries(device, kv_dtype, dtype, batch):
    H, hq, D, bs = 2, 8, 64, 16
    if batch == "decode":  # decode tiles (one row per sequence), an empty sequence among them
        kv_lens, q_lens, kw_list = [40, 17, 0, 1, 70, 33], [1, 1, 0, 1, 1, 1], [{}, {"num_splits": 3}]
    else:  # decode rows, a prefill chunk and an extend chunk: prefill tiles, and the two-launch split
        kv_lens, q_lens, kw_list = [40, 17, 33, 70, 50], [1, 1, 1, 30, 12], [{}, {"num_decode": 3}]
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="HND", H=H, D=D, bs=bs, lens=kv_lens, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    q = (torch.randn((sum(q_lens), hq, D), generator=g) + 0.25).to(dtype).to(device)
    q0 = q.clone()
    cos, sin = _tables(max(kv_lens) + 3, D, dtype, device)
    want_q = _rotated(q, cos, sin, q_lens, kv_lens)
    eo, el = paged_expected(want_q, cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D))
    for kw in kw_list:
        lse = torch.empty((q.shape[0], hq), dtype=torch.float32, device=device)
        out = _attend(cache, bt, q, q_lens, kv_lens, device, q_rope=(cos, sin), lse=lse, **kw)
        assert_attn_close(out, lse, eo, el, dtype, what=f"{kv_dtype} {batch} {kw}")
        assert torch.equal(q, q0)  # rotated in registers only
    # the same attention on queries rotated beforehand: equal within the rounding of the rotation (one q ulp)
    plain = _attend(cache, bt, want_q.to(device), q_lens, kv_lens, device)
    fused = _attend(cache, bt, q, q_lens, kv_lens, device, q_rope=(cos, sin))
    torch.testing.assert_close(fused.float(), plain.float(), atol=2e-2, rtol=2e-2)


def test_positions_outside_the_tables_rotate_to_zero(device):
    H, hq, D, bs = 1, 2, 64, 16
    kv_lens, q_lens = [20, 9], [4, 1]
    cache, bt, _ = make_paged(device, kv_dtype="auto", layout="NHD", H=H, D=D, bs=bs, lens=kv_lens)
    q = torch.randn((5, hq, D), generator=torch.Generator().manual_seed(1)).half().to(device)
    cos, sin = _tables(18, D, torch.float16, device)  # positions 16..19 of sequence 0: 16, 17 inside, 18, 19 not
    want_q = _rotated(q, cos, sin, q_lens, kv_lens)
    assert (want_q[2:4] == 0).all() and (want_q[:2] != 0).any() and (want_q[4] != 0).any()
    eo, el = paged_expected(want_q, cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D))
    lse = torch.empty((5, hq), dtype=torch.float32, device=device)
    out = _attend(cache, bt, q, q_lens, kv_lens, device, q_rope=(cos, sin), lse=lse)
    assert_attn_close(out, lse, eo, el, torch.float16, what="outside the tables")


def test_bad_tables_are_refused(device, other_device):
    H, hq, D, bs = 1, 2, 64, 16
    cache, bt, _ = make_paged(device, kv_dtype="auto", layout="NHD", H=H, D=D, bs=bs, lens=[5])
    q = torch.randn((1, hq, D), generator=torch.Generator().manual_seed(1)).half().to(device)
    cos, sin = _tables(8, D, torch.float16, device)
    cases = [
        (cos, TypeError, "q_rope: expected None or a \\(cos, sin\\) pair"),
        ((cos,), TypeError, "pair"),
        ((cos.float(), sin), ValueError, "q_rope cos"),
        ((cos, sin[:, :32]), ValueError, r"q_rope sin: expected a contiguous \[max_pos, 64\]"),
        ((cos, sin[:4]), ValueError, "differ in shape"),
        ((cos.t().contiguous().t(), sin), ValueError, "contiguous"),
        ((cos[None], sin), ValueError, "q_rope cos"),
        ((cos.to(other_device), sin), ValueError, "q_rope cos"),
    ]
    for bad, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            _attend(cache, bt, q, [1], [5], device, q_rope=bad)


@pytest.mark.parametrize("D", [80, 96, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_fused_query_rope_head_dims(device, D, dtype):
    # head dims whose halves do not fill a power-of-two tile (80, 96): the tables' masked lanes; float32 queries
    H, hq, bs = 2, 4, 16
    kv_lens, q_lens = [23, 40, 9], [1, 17, 9]
    cache, bt, _ = make_paged(device, kv_dtype="auto", layout="NHD", H=H, D=D, bs=bs, lens=kv_lens, dtype=dtype)
    q = torch.randn((sum(q_lens), hq, D), generator=torch.Generator().manual_seed(4)).to(dtype).to(device)
    cos, sin = _tables(max(kv_lens), D, dtype, device)
    eo, el = paged_expected(_rotated(q, cos, sin, q_lens, kv_lens), cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D))
    lse = torch.empty((q.shape[0], hq), dtype=torch.float32, device=device)
    out = _attend(cache, bt, q, q_lens, kv_lens, device, q_rope=(cos, sin), lse=lse)
    assert_attn_close(out, lse, eo, el, dtype, what=f"D {D} {dtype}")
