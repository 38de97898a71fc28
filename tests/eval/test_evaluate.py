"""kvcache.eval.evaluate on a small random Llama: the report's structure and the properties that could fail
(auto equal to full precision up to float32 rounding, int4 further from it than int8, KL >= 0, every greedy
answer identical for auto, bytes per token from the cache's own allocation)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvcache.eval import EvalReport, evaluate, format_table, load_text
from kvcache.paged import cache_block_bytes

from .conftest import PROMPTS

SCORED = 300


@pytest.fixture(scope="module")
def report(tiny_llama, char_tokenizer) -> EvalReport:
    tiny_llama.set_attn_implementation("sdpa")
    return evaluate(tiny_llama, char_tokenizer, text=load_text("alice")[:4000], text_name="alice", chunk=32,
                    window=96, max_tokens=SCORED, prompts=PROMPTS, max_new_tokens=12, batch_size=2)


def test_structure(report: EvalReport, tiny_llama) -> None:
    assert [r.kv_dtype for r in report.formats] == ["auto", "fp8", "fp8k", "int8", "k8v4", "int4"]
    assert report.scored_tokens == SCORED  # 3 windows of 95 scored tokens + one of 15
    assert report.text_tokens == 4000 and report.window == 96 and report.chunk == 32
    assert report.prompts == len(PROMPTS) and report.max_new_tokens == 12
    assert report.reference_bytes_per_token == 2 * 2 * 16 * 4  # K and V, 2 heads x 16, float32
    for r in report.formats:
        assert len(r.first_divergence) == len(PROMPTS)
        assert r.greedy_identical == sum(d is None for d in r.first_divergence)
        assert all(d is None or 0 <= d <= 12 for d in r.first_divergence)
        assert 0.0 <= r.top1 <= 1.0 and math.isfinite(r.perplexity)
        # the paged cache's own allocation equals the documented byte format
        assert r.bytes_per_token == cache_block_bytes(1, 2, 16, 1, torch.float32, r.kv_dtype)
    assert tiny_llama.config._attn_implementation == "sdpa"  # the model's own attention is given back
    d = json.loads(json.dumps(report.to_dict()))
    assert d["formats"][5]["kv_dtype"] == "int4"
    assert d["formats"][5]["perplexity_delta_pct"] == pytest.approx(
        (report.formats[5].perplexity / report.reference_perplexity - 1) * 100)


def test_auto_equals_full_precision(report: EvalReport) -> None:
    auto = report.result("auto")
    assert auto.perplexity == pytest.approx(report.reference_perplexity, rel=1e-5)
    assert auto.kl < 1e-6 and auto.top1 == 1.0
    assert auto.greedy_identical == len(PROMPTS) and auto.mean_first_divergence is None


def test_quantized_formats_drift_in_order(report: EvalReport) -> None:
    int8, int4, fp8 = report.result("int8"), report.result("int4"), report.result("fp8")
    k8v4 = report.result("k8v4")
    assert all(r.kl >= 0.0 for r in report.formats)
    assert int4.kl > int8.kl > 0.0 and fp8.kl > int8.kl
    assert int4.kl > k8v4.kl > int8.kl  # 8-bit keys: between int8 and int4
    assert int4.bytes_per_token < k8v4.bytes_per_token < int8.bytes_per_token
    assert int4.top1 <= int8.top1 < 1.0 or int4.top1 < int8.top1
    assert int4.bytes_per_token < int8.bytes_per_token < report.result("auto").bytes_per_token
    assert int4.greedy_identical < len(PROMPTS)
    # fp8k: fp8 values and keys with their own scales; 4 bytes of key scale per (token, head) over fp8's
    fp8k = report.result("fp8k")
    assert fp8.bytes_per_token < fp8k.bytes_per_token < int8.bytes_per_token
    assert int4.kl > fp8k.kl > int8.kl  # 3 mantissa bits: further than int8's 256 levels, far closer than int4
    assert fp8k.kl != fp8.kl  # its keys are stored otherwise than fp8's (a fallback to fp8 would give fp8's KL)


def test_table(report: EvalReport) -> None:
    md = format_table(report).splitlines()
    assert md[0].startswith("LlamaForCausalLM (float32, cpu), text 'alice': 300 scored tokens of 4,000")
    assert md[-6].startswith("| auto | 256 | ") and f"| {len(PROMPTS)}/{len(PROMPTS)} | - |" in md[-6]
    plain = format_table(report, markdown=False).splitlines()
    assert plain[-1].startswith("int4") and "|" not in plain[-1]


def test_token_ids_need_no_tokenizer(tiny_llama) -> None:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (150,), generator=g)
    r = evaluate(tiny_llama, None, kv_dtypes=["auto", "int8"], text=ids, window=64, chunk=16,
                 prompts=[[1, 5, 6, 7], [1, 9]], max_new_tokens=6)
    assert r.text == "custom" and r.scored_tokens == 63 + 63 + 21 and r.prompts == 2
    assert r.result("auto").greedy_identical == 2


@pytest.mark.parametrize("kwargs, error, match", [
    ({"kv_dtypes": "int8"}, TypeError, "^kv_dtypes: expected a sequence"),
    ({"kv_dtypes": ("int8", "int3")}, ValueError, "^kv_dtypes: .*'int3'"),
    ({"kv_dtypes": ("int8", "int8")}, ValueError, "^kv_dtypes: expected each format once"),
    ({"kv_dtypes": ()}, ValueError, "^kv_dtypes: expected at least one"),
    ({"chunk": 0}, ValueError, "^chunk: expected an int >= 1, got 0"),
    ({"window": 1}, ValueError, "^window: expected an int >= 2, got 1"),
    ({"window": 1024}, ValueError, r"^window: expected at most the model's max_position_embeddings \(512\)"),
    ({"max_tokens": 0}, ValueError, "^max_tokens: expected an int >= 1"),
    ({"max_new_tokens": 2.5}, TypeError, "^max_new_tokens: expected an int, got float"),
    ({"batch_size": 0}, ValueError, "^batch_size: expected an int >= 1"),
    ({"prompts": "Hi"}, TypeError, "^prompts: expected a sequence"),
    ({"prompts": [[]]}, ValueError, r"^prompts\[0\]: expected at least one token"),
    ({"text": "   "}, ValueError, "^text: expected some text"),
    ({"text": torch.ones(2, 3, dtype=torch.long)}, ValueError, "^text: expected a 1-d integer tensor"),
    ({"text": [7]}, ValueError, "^text: expected at least 2 tokens, got 1"),
])
def test_bad_arguments(tiny_llama, char_tokenizer, kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        evaluate(tiny_llama, char_tokenizer, **{"text": "some text", "window": 64, **kwargs})
    assert tiny_llama.config._attn_implementation == "sdpa"


def test_bad_model_and_tokenizer(tiny_llama) -> None:
    with pytest.raises(TypeError, match="^model: expected a transformers causal LM"):
        evaluate(object(), None, text=[1, 2, 3], prompts=[])
    with pytest.raises(ValueError, match="^tokenizer: expected a tokenizer to encode the text"):
        evaluate(tiny_llama, None, text="a str needs a tokenizer", window=64, prompts=[])
