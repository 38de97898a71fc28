"""merge_attention_states: two partial results over disjoint key sets merge into the whole (against the float64
reference), -inf sides contribute nothing whatever their outputs hold, in-place merges, validation."""

from __future__ import annotations

import math

import pytest
import torch

from kvcache.ops import merge_attention_states

from .attn_reference import assert_attn_close, dense_attention


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_merge_disjoint_keys(device, dtype):
    gen = torch.Generator().manual_seed(0)
    n, hq, d, nk = 3, 4, 80, 20
    q, k, v = (torch.randn(s, generator=gen) for s in ((n, hq, d), (nk, 2, d), (nk, 2, d)))
    q_pos, k_pos = [100] * n, list(range(nk))
    sinks = torch.tensor([0.5, 1.0, -1.0, 2.0])
    whole_o, whole_l = dense_attention(q, k, v, q_pos, k_pos, scale=0.1, sinks=sinks)
    a = dense_attention(q, k[::2], v[::2], q_pos, k_pos[::2], scale=0.1, sinks=sinks)
    b = dense_attention(q, k[1::2], v[1::2], q_pos, k_pos[1::2], scale=0.1)
    out, lse = merge_attention_states(a[0].to(dtype).to(device), a[1].float().to(device), b[0].to(dtype).to(device),
                                      b[1].float().to(device))
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_attn_close(out, lse, whole_o, whole_l, dtype)


def test_merge_inf_sides_and_in_place(device):
    oa = torch.tensor([[[1.0, 2.0]], [[float("nan"), 5.0]], [[3.0, 3.0]]], device=device)
    ob = torch.tensor([[[9.0, 9.0]], [[4.0, 4.0]], [[float("inf"), 1.0]]], device=device)
    la = torch.tensor([[0.0], [float("-inf")], [float("-inf")]], device=device)
    lb = torch.tensor([[float("-inf")], [1.0], [float("-inf")]], device=device)
    out, lse = merge_attention_states(oa, la, ob, lb, out=oa, lse=la)  # in place into the a side
    assert out is oa and lse is la
    assert out[0].tolist() == [[1.0, 2.0]] and out[1].tolist() == [[4.0, 4.0]] and out[2].tolist() == [[0.0, 0.0]]
    assert lse[:, 0].tolist() == [0.0, 1.0, float("-inf")]


def test_merge_equal_lse(device):
    o1 = torch.ones(2, 1, 16, device=device)
    o2 = torch.zeros(2, 1, 16, device=device)
    lse_in = torch.zeros(2, 1, device=device)
    out, lse = merge_attention_states(o1, lse_in, o2, lse_in)
    assert torch.allclose(out, torch.full_like(out, 0.5)) and torch.allclose(lse, torch.full_like(lse, math.log(2)))


def test_merge_validation(device):
    o = torch.zeros(2, 3, 8, device=device)
    l_ = torch.zeros(2, 3, device=device)
    with pytest.raises(ValueError, match="out_b: expected"):
        merge_attention_states(o, l_, torch.zeros(2, 3, 4, device=device), l_)
    with pytest.raises(ValueError, match="lse_b: expected dtype"):
        merge_attention_states(o, l_, o, l_.half())
    with pytest.raises(ValueError, match="lse_a: expected shape"):
        merge_attention_states(o, torch.zeros(2, 4, device=device), o, l_)
    with pytest.raises(ValueError, match="out: expected a contiguous"):
        merge_attention_states(o, l_, o, l_, out=torch.zeros(2, 8, 3, device=device).transpose(1, 2))
    with pytest.raises(TypeError, match="out_a: expected a torch.Tensor"):
        merge_attention_states([0.0], l_, o, l_)
