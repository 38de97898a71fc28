"""kvcache.hf runs what it implements equal to transformers and refuses the rest by name: tiny random-weight
models from transformers' own configs (fp32, CPU), the window shorter than the prompt, greedy tokens compared with
transformers' ``generate`` (eager attention) through PagedCache (in place and gathered) and LinearCache."""

from __future__ import annotations

import pytest
import torch

import support_models as sm
from kvcache.hf import LinearCache, PagedCache
from kvcache.support import check_supported, unsupported_features

HF_PATHS = ("hf-paged", "hf-gathered", "hf-linear")


def _cache(model, path: str):
    """A cache for ``path``, the model's attention set accordingly."""
    model.set_attn_implementation("kvcache_paged" if path == "hf-paged" else "eager")
    if path == "hf-linear":
        return LinearCache(model.config, max_batch_size=1, max_cache_len=64)
    return PagedCache(model.config, max_batch_size=1, max_cache_len=64, block_size=4)


def _tokens(model, path: str) -> list[int]:
    out = sm.greedy(model, past_key_values=_cache(model, path))
    model.set_attn_implementation("eager")
    return out


WINDOWED = {"mistral_window": {}, "qwen2_window": {}, "gemma2": {}, "gemma3": {}, "phi3": {"sliding_window": sm.WINDOW}}
OTHERS = ["qwen3", "gpt2", "cohere", "olmo2", "granite", "stablelm"]


@pytest.mark.parametrize("name", list(WINDOWED) + OTHERS)
def test_models_equal_transformers_on_every_hf_path(name):
    model = sm.build(name, **WINDOWED.get(name, {}))
    ref = sm.greedy(model)
    for path in HF_PATHS:
        assert unsupported_features(model, path) == []
        assert _tokens(model, path) == ref, path


@pytest.mark.parametrize("name", list(WINDOWED))
def test_the_window_changes_transformers_tokens(name):
    # the equality above covers the window: without it transformers' own tokens differ
    model = sm.build(name, **WINDOWED[name])
    full = (sm.variant(model, layer_types=["full_attention"] * 2) if getattr(model.config, "layer_types", None)
            else sm.variant(model, sliding_window=None))
    assert sm.greedy(model) != sm.greedy(full)


@torch.inference_mode()
def test_gemma2_softcap_and_query_scale_honoured_in_place():
    # Gemma 2's attention soft-cap and query_pre_attn_scalar move its logits (not always the argmax of a tiny
    # random model): kvcache_paged's logits equal transformers' far closer than either property moves them
    model = sm.build("gemma2")
    x = torch.tensor([sm.PROMPT])
    want = model(x).logits[0, -1]
    got = model.set_attn_implementation("kvcache_paged") or model(x, past_key_values=_cache(model, "hf-paged"))
    torch.testing.assert_close(got.logits[0, -1], want, rtol=0, atol=1e-5)
    model.set_attn_implementation("eager")
    for other in (sm.variant(model, attn_logit_softcapping=None), sm.variant(model, query_pre_attn_scalar=16)):
        assert (other(x).logits[0, -1] - want).abs().max() > 1e-4


@pytest.fixture(scope="module")
def gpt_oss():
    return sm.gpt_oss()


def test_gpt_oss_sinks_honoured_in_place(gpt_oss):
    # the sinks gpt-oss's attention passes (s_aux) join the kernel's softmax: equal to transformers, and the sinks
    # change transformers' own tokens
    assert unsupported_features(gpt_oss, "hf-paged") == []
    assert _tokens(gpt_oss, "hf-paged") == sm.greedy(gpt_oss)
    no_sinks = sm.variant(gpt_oss)
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: no sink
    assert sm.greedy(gpt_oss) != sm.greedy(no_sinks)


def test_sinks_not_passed_refused_in_place(gpt_oss):
    # a sinks parameter whose attention does not pass it would be left out of the softmax: refused by name
    import transformers.models.gpt_oss.modeling_gpt_oss as gm

    other = sm.variant(gpt_oss)

    original = gm.ALL_ATTENTION_FUNCTIONS.get_interface

    def drop_s_aux(name, default):
        fn = original(name, default)
        return lambda *a, s_aux=None, **k: fn(*a, **k)
    gm.ALL_ATTENTION_FUNCTIONS.get_interface = drop_s_aux
    try:
        with pytest.raises(ValueError, match=r"^model: attention sinks \(layer 0: sinks, not passed as s_aux\)"):
            _tokens(other, "hf-paged")
    finally:
        gm.ALL_ATTENTION_FUNCTIONS.get_interface = original
        other.set_attn_implementation("eager")


def test_gpt_oss_equal_transformers_gathered_and_linear(gpt_oss):
    ref = sm.greedy(gpt_oss)
    assert _tokens(gpt_oss, "hf-gathered") == ref
    assert _tokens(gpt_oss, "hf-linear") == ref


def test_window_set_by_the_mask_alone_refused_in_place():
    # a layer whose attention does not pass its window (the mask alone windows it): kvcache_paged would attend
    # over every key, so it refuses rather than trust the kwargs
    model = sm.build("qwen2_window")
    model.model.layers[0].self_attn.sliding_window = None
    assert sm.greedy(model) == sm.greedy(sm.build("qwen2_window"))  # eager: the mask still windows
    with pytest.raises(ValueError, match=r"sliding-window attention of layer 0 \(the config gives 8, the attention "
                                         r"passes sliding_window=None\)"):
        _tokens(model, "hf-paged")


@pytest.mark.parametrize("make, path, name", [
    (lambda t: t.Qwen3NextConfig(), "hf-linear", "layers other than full or sliding-window attention"),
    (lambda t: t.DeepseekV3Config(), "hf-linear", "latent attention (keys and values of other widths)"),
    (lambda t: t.Llama4TextConfig(), "hf-gathered", "chunked attention"),
    (lambda t: t.BloomConfig(), "hf-paged", "ALiBi position biases"),
    (lambda t: t.FalconConfig(alibi=True), "hf-paged", "ALiBi position biases (FalconConfig.alibi=True)"),
    (lambda t: t.Gemma3TextConfig(use_bidirectional_attention=True), "hf-paged", "bidirectional attention"),
])
def test_cache_refuses_config_at_construction(make, path, name):
    import transformers

    cfg = make(transformers)
    cfg._attn_implementation = "kvcache_paged" if path == "hf-paged" else "eager"
    cls = LinearCache if path == "hf-linear" else PagedCache
    with pytest.raises(ValueError, match="^config: ") as e:
        cls(cfg, max_batch_size=1, max_cache_len=16)
    assert name in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="is not implemented by kvcache.hf's"):
        check_supported(cfg, path)


def test_alibi_runs_on_the_gathered_and_linear_paths():
    import transformers

    cfg = transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=sm.VOCAB, bos_token_id=0,
                                   eos_token_id=1, pad_token_id=1, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ref = sm.greedy(model)
    assert _tokens(model, "hf-linear") == ref
    assert _tokens(model, "hf-gathered") == ref


def test_paged_cache_checks_again_when_the_attention_changes():
    # built for gathered K / V, then switched to kvcache_paged: the first update checks the in-place path
    import transformers

    cfg = transformers.FalconConfig(alibi=True)
    cfg._attn_implementation = "eager"
    cache = PagedCache(cfg, max_batch_size=1, max_cache_len=16)
    cfg._attn_implementation = "kvcache_paged"
    k = torch.zeros(1, cfg.num_kv_heads, 2, cfg.hidden_size // cfg.num_attention_heads)
    with pytest.raises(ValueError, match="ALiBi position biases"):
        cache.update(k, k, 0)
