"""The engine runs exactly what it implements and refuses, by name and before any work, every model property it
does not: tiny random-weight models from transformers' own configs (fp32, CPU), greedy tokens compared with
transformers' ``generate``; each refusal also shows that the property changes transformers' own output."""

from __future__ import annotations

import pytest
import torch

import support_models as sm
from kvcache.engine import LLM, SamplingParams
from kvcache.support import PATHS, check_supported, unsupported_features


class _Tok:
    def decode(self, ids, **kwargs):
        return " ".join(map(str, ids))


def _engine_tokens(model, cache: str = "paged") -> list[int]:
    llm = LLM(model, tokenizer=_Tok(), cache=cache, max_num_seqs=2, max_model_len=64)
    out = llm.generate([sm.PROMPT], SamplingParams(max_tokens=sm.NEW_TOKENS, temperature=0))
    return out[0].token_ids


def _refusal(model, cache: str = "paged") -> str:
    """LLM's ValueError for ``model`` with ``cache``, one line naming the engine. A model the paged engine refuses
    is refused by the linear one too (which also refuses windows)."""
    msgs = {}
    for c in ("paged", "linear"):
        with pytest.raises(ValueError) as e:
            LLM(model, tokenizer=_Tok(), cache=c, max_num_seqs=2, max_model_len=64)
        msgs[c] = str(e.value)
        assert "\n" not in msgs[c] and msgs[c].startswith("model: ")
        assert "is not implemented by the kvcache engine" in msgs[c]
    return msgs[cache]


def _linear_features(model) -> str:
    """What the linear engine does not implement in ``model`` (the paged engine's refusals and windows), joined."""
    return "; ".join(map(str, unsupported_features(model, "engine-linear")))


@pytest.mark.parametrize("name", ["qwen2", "mistral", "stablelm"])
def test_supported_families_equal_transformers(name):
    # Llama and Qwen3 are covered by test_llm.py / the hf tests; StableLM: partial rotary (half the dims), LayerNorm
    model = sm.build(name)
    assert all(unsupported_features(model, p) == [] for p in PATHS if p != "engine-fused")
    ref = sm.greedy(model)
    assert _engine_tokens(model, "paged") == ref
    assert _engine_tokens(model, "linear") == ref


def test_other_activation_runs_the_modules_and_equals_transformers():
    model = sm.build("llama", hidden_act="gelu")
    names = [f.name for f in unsupported_features(model, "engine-fused")]
    assert names == ["an activation other than SiLU"]  # not fused, but the module path runs the model's MLP
    assert _engine_tokens(model) == sm.greedy(model)


def test_fused_path_names_norm_formulas_it_does_not_compute():
    assert [f.name for f in unsupported_features(sm.build("stablelm"), "engine-fused")] == [
        "a norm other than RMSNorm w * x / rms(x)"]
    found = unsupported_features(sm.build("gemma2"), "engine-fused")
    assert "a norm other than RMSNorm w * x / rms(x)" in [f.name for f in found]  # Gemma's (1 + w), by its output


@pytest.mark.parametrize("name", ["mistral_window", "qwen2_window"])
def test_window_equals_transformers_on_the_paged_engine(name):
    """Each layer attends with its own window (Mistral: sliding_window on every layer; Qwen2: use_sliding_window
    from max_window_layers on), window 8 inside a longer prompt; the window changes transformers' own tokens."""
    model = sm.build(name)
    assert unsupported_features(model, "engine-module") == []
    ref = sm.greedy(model)
    assert _engine_tokens(model, "paged") == ref
    no_window = sm.variant(model, sliding_window=None) if name == "mistral_window" else sm.build("qwen2")
    assert ref != sm.greedy(no_window)  # the same weights (seed), no window


def test_window_refused_by_the_linear_engine():
    model = sm.build("mistral_window")
    with pytest.raises(ValueError) as e:
        LLM(model, tokenizer=_Tok(), cache="linear", max_num_seqs=2, max_model_len=64)
    msg = str(e.value)
    assert msg.startswith("model: sliding-window attention (MistralConfig.sliding_window, sliding_window=8) is not "
                          "implemented by the kvcache engine (linear cache)")
    assert "engine-module" in msg and "hf-paged" in msg  # the paths that run it are named


def test_phi3_equals_transformers():
    """Phi-3: one qkv projection (split by heads on the module path) and a fused gate / up MLP (the model's own
    module): the fused decoder declines it by name, the engine's tokens equal transformers' (paged and linear);
    with a window, on the paged cache, and the window changes transformers' tokens."""
    model = sm.build("phi3")
    assert unsupported_features(model, "engine-module") == []
    assert [f.name for f in unsupported_features(model, "engine-fused")] == [
        "a fused q / k / v projection", "a fused gate / up projection"]
    ref = sm.greedy(model)
    assert _engine_tokens(model, "paged") == ref
    assert _engine_tokens(model, "linear") == ref
    windowed = sm.variant(model, sliding_window=sm.WINDOW)
    ref_w = sm.greedy(windowed)
    assert ref_w != ref
    assert _engine_tokens(windowed, "paged") == ref_w
    assert "sliding-window attention (Phi3Config.sliding_window" in _linear_features(windowed)


@pytest.fixture(scope="module")
def gemma2():
    return sm.build("gemma2")


def test_gemma2_window_refused(gemma2):
    assert "sliding-window attention (Gemma2Config.layer_types: 1 of 2" in _linear_features(gemma2)
    assert sm.greedy(gemma2) != sm.greedy(sm.variant(gemma2, layer_types=["full_attention"] * 2))


def test_gemma2_attention_softcap_refused(gemma2):
    assert "attention logit soft-capping" in _refusal(gemma2)
    # with small random weights the capped attention logits move the output logits, not always the argmax
    assert sm.logits_differ(gemma2, sm.variant(gemma2, attn_logit_softcapping=None))


def test_gemma2_final_softcap_refused(gemma2):
    assert "final logit soft-capping" in _refusal(gemma2)
    # monotonic: greedy tokens keep, the sampled distribution changes
    assert sm.logits_differ(gemma2, sm.variant(gemma2, final_logit_softcapping=None))


def test_gemma2_query_scale_refused(gemma2):
    assert "a query scale other than 1/sqrt(head_dim)" in _refusal(gemma2)
    assert sm.logits_differ(gemma2, sm.variant(gemma2, query_pre_attn_scalar=16))


def test_gemma2_extra_norms_refused(gemma2):
    msg = _refusal(gemma2)
    assert "extra norms the engine does not run" in msg
    other = sm.variant(gemma2)
    for layer in other.model.layers:
        layer.pre_feedforward_layernorm = torch.nn.Identity()
    assert sm.greedy(gemma2) != sm.greedy(other)


def test_gemma3_refused():
    model = sm.build("gemma3")
    msg = _refusal(model)
    assert "sliding-window attention (Gemma3TextConfig.layer_types: 1 of 2" in _linear_features(model)
    for name in ("a query scale other than 1/sqrt(head_dim)", "extra norms", "a rotary embedding kvcache does not"):
        assert name in msg
    assert sm.greedy(model) != sm.greedy(sm.variant(model, layer_types=["full_attention"] * 2))


def test_gpt2_refused():
    msg = _refusal(sm.build("gpt2"))
    assert "a decoder not laid out as model.layers + lm_head (GPT2LMHeadModel: transformer.h.0.attn.c_attn" in msg


def test_granite_multipliers_refused():
    model = sm.build("granite")
    msg = _refusal(model)
    assert "a query scale other than 1/sqrt(head_dim) (GraniteConfig.attention_multiplier=0.5)" in msg
    assert "a scaled embedding, residual or logits" in msg
    plain = sm.variant(model, embedding_multiplier=1.0, residual_multiplier=1.0, attention_multiplier=16 ** -0.5)
    assert sm.greedy(model) != sm.greedy(plain)


def test_cohere_refused():
    model = sm.build("cohere")
    msg = _refusal(model)
    assert "a scaled embedding, residual or logits (CohereConfig.logit_scale=0.5)" in msg
    assert "a decoder layer without the Llama layout" in msg  # one norm, attention and MLP in parallel
    assert sm.logits_differ(model, sm.variant(model, logit_scale=1.0))


def test_olmo2_refused():
    msg = _refusal(sm.build("olmo2"))
    assert "extra norms the engine does not run (model.layers.0: post_feedforward_layernorm)" in msg
    assert "a q / k norm over all heads" in msg


@pytest.mark.parametrize("flag, name", [("qk_layernorm", "q / k LayerNorm"),
                                        ("use_parallel_residual", "parallel attention and MLP residual")])
def test_stablelm_options_refused(flag, name):
    model = sm.build("stablelm", **{flag: True})
    assert f"{name} (StableLmConfig.{flag}=True)" in _refusal(model)
    plain = sm.build("stablelm")
    plain.load_state_dict(model.state_dict(), strict=False)
    assert sm.greedy(model) != sm.greedy(plain)


def test_replaced_attention_forward_refused():
    # a Llama whose attention forward was changed: the layout alone would pass, its forward is not Llama's
    model = sm.build("llama")
    attn = model.model.layers[0].self_attn
    base = type(attn)

    class Tempered(base):
        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states * 2.0, *args, **kwargs)

    attn.__class__ = Tempered
    assert "an architecture the engine has not verified (test_replaced_attention_forward_refused.<locals>.Tempered" \
        in _refusal(model)
    assert sm.greedy(model) != sm.greedy(sm.variant(model))


def test_rotary_embedding_checked_by_its_values():
    model = sm.build("llama")
    model.model.rotary_emb.inv_freq.mul_(0.5)  # the config says theta 1e4, the module computes something else
    assert "a rotary embedding kvcache does not compute (model.model.rotary_emb (LlamaRotaryEmbedding)" \
        in _refusal(model)
    assert sm.greedy(model) != sm.greedy(sm.variant(model))


def test_check_supported_validates_the_path():
    with pytest.raises(ValueError, match="path: expected one of"):
        check_supported(sm.build("llama"), "engine")
