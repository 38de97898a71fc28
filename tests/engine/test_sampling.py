"""SamplingParams validation and the sampler (no model)."""

from __future__ import annotations

import pytest
import torch

from kvcache.engine import SamplingParams
from kvcache.engine.sampling import sample


def test_greedy_picks_the_argmax_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 4.9]])
    assert sample(logits, [SamplingParams(temperature=0.0)] * 2, [None, None]) == [1, 0]


def test_top_k_1_and_tiny_top_p_equal_greedy():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    want = logits.argmax(-1).tolist()
    for p in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)):
        gens = [torch.Generator().manual_seed(i) for i in range(6)]
        assert sample(logits, [p] * 6, gens) == want


def test_top_k_keeps_only_the_k_best():
    logits = torch.tensor([[0.0, 10.0, 9.0, -5.0, 9.5]])
    p = SamplingParams(temperature=100.0, top_k=2)
    picks = {sample(logits, [p], [torch.Generator().manual_seed(s)])[0] for s in range(200)}
    assert picks == {1, 4}


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    p = SamplingParams(temperature=1.0, top_p=0.8)  # 0.5 + 0.3 reach 0.8: tokens 0 and 1 only
    picks = {sample(probs.log(), [p], [torch.Generator().manual_seed(s)])[0] for s in range(300)}
    assert picks == {0, 1}


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    torch.manual_seed(1)
    logits = torch.randn(3, 100)
    p = SamplingParams(temperature=1.0, seed=5)
    a = sample(logits, [p] * 3, [torch.Generator().manual_seed(5) for _ in range(3)])
    b = sample(logits[1:2], [p], [torch.Generator().manual_seed(5)])
    assert b[0] == a[1]


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(max_tokens=1.5), TypeError, "max_tokens"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_k=-2), ValueError, "top_k"),
    (dict(top_k=2.0), TypeError, "top_k"),
    (dict(seed="1"), TypeError, "seed"),
    (dict(stop=[""]), TypeError, "stop"),
    (dict(stop=3), TypeError, "stop"),
    (dict(stop_token_ids=[-1]), TypeError, "stop_token_ids"),
    (dict(ignore_eos=1), TypeError, "ignore_eos"),
])
def test_bad_params_name_the_argument(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        SamplingParams(**kwargs)


def test_stop_normalised():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams().stop == () and SamplingParams().stop_token_ids == ()
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


def test_sample_checks_shapes():
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(2, 5), [SamplingParams()], [None])
