"""The engine runs exactly what it implements and refuses, by name and before any work, every model property it
does not: tiny random-weight models from transformers' own configs (fp32, CPU), greedy tokens compared with
transformers' ``generate``; each refusal also shows that the property changes transformers' own output."""

from __future__ import annotations

import pytest
import torch

import support_models as sm
from kvcache.engine import LLM, SamplingParams
from kvcache.support import PATHS, check_supported, unsupported_features


def _engine_tokens(model, cache: str = "paged") -> list[int]:
    llm = LLM(model, tokenizer=sm.IdsTokenizer(), cache=cache, max_num_seqs=2, max_model_len=64)
    out = llm.generate([sm.PROMPT], SamplingParams(max_tokens=sm.NEW_TOKENS, temperature=0))
    return out[0].token_ids


def _engine_both(model) -> tuple[list[int], list[int]]:
    """The engine's greedy tokens on the paged and on the linear cache."""
    return _engine_tokens(model, "paged"), _engine_tokens(model, "linear")


def _refusal(model, cache: str = "paged") -> str:
    """LLM's ValueError for ``model`` with ``cache``, one line naming the engine. A model the paged engine refuses
    is refused by the linear one too."""
    msgs = {}
    for c in ("paged", "linear"):
        with pytest.raises(ValueError) as e:
            LLM(model, tokenizer=sm.IdsTokenizer(), cache=c, max_num_seqs=2, max_model_len=64)
        msgs[c] = str(e.value)
        assert "\n" not in msgs[c] and msgs[c].startswith("model: ")
        assert "is not implemented by the kvcache engine" in msgs[c]
    return msgs[cache]


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
def test_window_equals_transformers_on_both_engines(name):
    """Each layer attends with its own window (Mistral: sliding_window on every layer; Qwen2: use_sliding_window
    from max_window_layers on), window 8 inside a longer prompt; the window changes transformers' own tokens."""
    model = sm.build(name)
    assert unsupported_features(model, "engine-module") == unsupported_features(model, "engine-linear") == []
    ref = sm.greedy(model)
    assert _engine_both(model) == (ref, ref)
    no_window = sm.variant(model, sliding_window=None) if name == "mistral_window" else sm.build("qwen2")
    assert ref != sm.greedy(no_window)  # the same weights (seed), no window


@pytest.mark.parametrize("cache", ["paged", "linear"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gpt_oss"])
def test_mixed_steps_and_prefix_hits_equal_transformers(name, cache):
    # 3 prompts on 2 sequences with a 12-token budget and blocks of 4: prefill chunks beside decode rows in one
    # step, prompts sharing a prefix restored from the prefix cache (paged) or the shared-prefix snapshot (linear),
    # each layer attending with its window, soft-cap (Gemma 2), rope (Gemma 3) and sinks (gpt-oss)
    model = sm.build(name)
    prompts = [sm.PROMPT, sm.PROMPT[:16] + [5, 9, 11, 40, 50], sm.PROMPT[:12] + [7]]
    llm = LLM(model, tokenizer=sm.IdsTokenizer(), cache=cache, max_num_seqs=2, max_model_len=64, block_size=4,
              max_num_batched_tokens=12)
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))]
    assert llm.stats.cached_prompt_tokens > 0
    assert got == [sm.greedy(model, prompt=p, n=6) for p in prompts]


def test_linear_window_layers_hold_only_twice_their_window():
    # Gemma 3 (one sliding, one global layer), window 8: the sliding layer's slots hold 16 tokens, the global one's
    # max_model_len; 40 tokens generated after a 20-token prompt slide the window layer's slot several times
    model = sm.build("gemma3")
    llm = LLM(model, tokenizer=sm.IdsTokenizer(), cache="linear", max_num_seqs=2, max_model_len=64)
    got = llm.generate([sm.PROMPT], SamplingParams(max_tokens=40, temperature=0))[0].token_ids
    assert got == sm.greedy(model, n=40)
    token = 2 * 2 * 16 * 4  # K and V, 2 heads of 16 fp32: bytes of one token in one layer
    assert llm.core.window_cache.config.max_seq_len == 2 * sm.WINDOW
    assert llm.stats.cache_bytes == 2 * (64 + 2 * sm.WINDOW) * token  # 2 slots
    # the default max_model_len counts the window layer at its 16 tokens: what the memory holds for the global one
    mem = 2 * (100 + 2 * sm.WINDOW) * token
    llm = LLM(model, tokenizer=sm.IdsTokenizer(), cache="linear", max_num_seqs=2, kv_cache_memory=mem)
    assert llm.max_model_len == 100
    # every layer windowed (Mistral): the slots' length is the model's, the memory the windows'
    mistral = LLM(sm.build("mistral_window"), tokenizer=sm.IdsTokenizer(), cache="linear", max_num_seqs=2,
                  kv_cache_memory=mem)
    assert mistral.max_model_len == 256 and mistral.stats.cache_bytes == 2 * 2 * 2 * sm.WINDOW * token


def test_phi3_equals_transformers():
    """Phi-3: one qkv projection (split by heads on the module path) and a fused gate / up MLP (the model's own
    module): the fused decoder declines it by name, the engine's tokens equal transformers' (paged and linear),
    with and without a window, and the window changes transformers' tokens."""
    model = sm.build("phi3")
    assert unsupported_features(model, "engine-module") == []
    assert [f.name for f in unsupported_features(model, "engine-fused")] == [
        "a fused q / k / v projection", "a fused gate / up projection", "an MLP other than down(act(gate(x)) * up(x))"]
    ref = sm.greedy(model)
    assert _engine_tokens(model, "paged") == ref
    assert _engine_tokens(model, "linear") == ref
    windowed = sm.variant(model, sliding_window=sm.WINDOW)
    ref_w = sm.greedy(windowed)
    assert ref_w != ref
    assert _engine_both(windowed) == (ref_w, ref_w)


@pytest.fixture(scope="module")
def gemma2():
    return sm.build("gemma2")


def _sampled(model, seeds=range(4)) -> list[list[int]]:
    """The engine's seeded samples (temperature 1) of the test prompt, one list per seed."""
    llm = LLM(model, tokenizer=sm.IdsTokenizer(), max_num_seqs=2, max_model_len=64)
    return [llm.generate([sm.PROMPT], SamplingParams(max_tokens=sm.NEW_TOKENS, temperature=1.0, seed=s))[0].token_ids
            for s in seeds]


def test_gemma2_equals_transformers_on_both_engines(gemma2):
    """Gemma 2 (its scaled embedding and (1 + w) norms run as its modules, the norms around the MLP wired as its
    decoder layer does, each layer's window, the query scale query_pre_attn_scalar^-0.5, attention and final logit
    soft-capping): greedy tokens equal to transformers' on the paged and the linear cache."""
    assert unsupported_features(gemma2, "engine-module") == unsupported_features(gemma2, "engine-linear") == []
    ref = sm.greedy(gemma2)
    assert _engine_both(gemma2) == (ref, ref)


@pytest.mark.parametrize("change", [{"layer_types": ["full_attention"] * 2}, {"query_pre_attn_scalar": 16}],
                         ids=["no-window", "query-scale"])
def test_gemma2_features_change_tokens_and_the_engine_follows(gemma2, change):
    # each property changes transformers' own greedy tokens (a prompt where it does), and the engine follows
    other = sm.variant(gemma2, **change)
    prompts = [sm.PROMPT] + [[(11 * i + 5 * j + 1) % 126 + 2 for i in range(30)] for j in range(6)]
    differ = [p for p in prompts if sm.greedy(gemma2, prompt=p, n=16) != sm.greedy(other, prompt=p, n=16)]
    assert differ
    llm = LLM(other, tokenizer=sm.IdsTokenizer(), max_num_seqs=2, max_model_len=64)
    got = llm.generate([differ[0]], SamplingParams(max_tokens=16, temperature=0))[0].token_ids
    assert got == sm.greedy(other, prompt=differ[0], n=16)


@pytest.mark.parametrize("field", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_gemma2_softcaps_reach_the_engines_sampling(field):
    # weights 10x the default init, so the caps bind (logits move by 2-7); they still leave this tiny model's
    # argmax alone: the engine's seeded samples (the same seeds) change when transformers' logits do, and its greedy
    # tokens equal transformers' with and without the cap
    model = sm.build("gemma2", initializer_range=0.2)
    other = sm.variant(model, **{field: None})
    assert (sm.last_logits(model) - sm.last_logits(other)).abs().max() > 1.0
    assert _sampled(model) != _sampled(other)
    assert _engine_both(model) == (sm.greedy(model),) * 2
    assert _engine_tokens(other, "paged") == sm.greedy(other)


def test_gemma2_extra_norms_are_run(gemma2):
    other = sm.variant(gemma2)
    for layer in other.model.layers:
        layer.pre_feedforward_layernorm = torch.nn.Identity()
    assert sm.greedy(gemma2) != sm.greedy(other)
    assert "extra" not in " ".join(f.name for f in unsupported_features(gemma2, "engine-module"))
    other = sm.variant(gemma2)
    other.model.layers[0].extra_norm = torch.nn.LayerNorm(other.config.hidden_size)  # not Gemma 2's layout
    assert "extra norms the engine does not run" in _refusal(other)


@pytest.fixture(scope="module")
def gemma3():
    return sm.build("gemma3")


def test_gemma3_equals_transformers_on_both_engines(gemma3):
    """Gemma 3 text: each layer type's rope (global: rope_theta with its scaling; sliding: the local base), q / k
    norms, query_pre_attn_scalar, the sliding layers' window, the norms around the MLP, the scaled embedding: greedy
    tokens equal to transformers' (paged: eager and through the graph path's padded buffers; linear); the window
    changes them."""
    assert unsupported_features(gemma3, "engine-module") == unsupported_features(gemma3, "engine-linear") == []
    ref = sm.greedy(gemma3)
    assert _engine_both(gemma3) == (ref, ref)
    llm = LLM(gemma3, tokenizer=sm.IdsTokenizer(), max_num_seqs=2, max_model_len=64, cuda_graphs=True)
    assert llm.generate([sm.PROMPT], SamplingParams(max_tokens=sm.NEW_TOKENS, temperature=0))[0].token_ids == ref
    assert ref != sm.greedy(sm.variant(gemma3, layer_types=["full_attention"] * 2))


@pytest.mark.parametrize("ropes", [
    {"sliding_attention": {"rope_type": "default", "rope_theta": 1e6}},
    {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}],
    ids=["local-base", "global-scaling"])
def test_gemma3_each_layer_types_rope_changes_tokens_and_the_engine_follows(gemma3, ropes):
    other = sm.variant(gemma3, rope_parameters={**gemma3.config.rope_parameters, **ropes})
    ref = sm.greedy(other)
    assert ref != sm.greedy(gemma3)
    assert _engine_both(other) == (ref, ref)


def test_gemma3_bidirectional_attention_refused(gemma3):
    other = sm.variant(gemma3, use_bidirectional_attention=True)
    assert "bidirectional attention (Gemma3TextConfig.use_bidirectional_attention=True)" in _refusal(other)
    assert sm.logits_differ(gemma3, other)


@pytest.fixture(scope="module")
def gpt_oss():
    return sm.gpt_oss()


def test_gpt_oss_equals_transformers_on_both_engines(gpt_oss):
    """Sinks in the kernel's softmax, the sliding layers' window, its half-width rotary tables (rotate-half pairs),
    attention biases and its mixture-of-experts MLP run as its own module: equal to transformers' greedy tokens;
    the sinks and the window each change them."""
    assert unsupported_features(gpt_oss, "engine-module") == unsupported_features(gpt_oss, "engine-linear") == []
    assert [f.name for f in unsupported_features(gpt_oss, "engine-fused")][:1] == ["a mixture-of-experts MLP"]
    ref = sm.greedy(gpt_oss)
    assert _engine_both(gpt_oss) == (ref, ref)
    no_sinks = sm.variant(gpt_oss)
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: no sink
    assert sm.greedy(no_sinks) != ref
    assert sm.greedy(sm.variant(gpt_oss, layer_types=["full_attention"] * 2)) != ref


def test_gpt_oss_yarn_rope_equals_transformers():
    # gpt-oss's own rope: yarn without truncation (its half-width cos / sin checked against RopeConfig's)
    model = sm.build("gpt_oss", max_position_embeddings=256, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0})
    assert unsupported_features(model, "engine-module") == []
    assert _engine_tokens(model, "paged") == sm.greedy(model)


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_kernels_take_each_layers_rope_window_and_sinks(name, monkeypatch, gpt_oss, gemma3):
    # through the Triton interpreter: the paged append rotates the sliding layers' keys with the plan's own rope,
    # the paged and linear attention kernels take each layer's window and sinks
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the kernels run compiled on the GPU, the CPU interpreter is not used")
    model = {"gemma3": gemma3, "gpt_oss": gpt_oss}[name]
    ref = sm.greedy(model, n=4)
    monkeypatch.setenv("KVCACHE_TRITON_INTERPRET", "1")
    for cache in ("paged", "linear"):
        llm = LLM(model, tokenizer=sm.IdsTokenizer(), cache=cache, max_num_seqs=2, max_model_len=64)
        assert llm.generate([sm.PROMPT], SamplingParams(max_tokens=4, temperature=0))[0].token_ids == ref, cache


def test_sinks_of_an_unverified_attention_refused():
    # a sinks parameter on an attention whose forward does not add it (Llama's): refused, never dropped
    model = sm.build("llama")
    model.model.layers[1].self_attn.sinks = torch.nn.Parameter(torch.zeros(4))
    assert "attention sinks (model.layers.1.self_attn.sinks)" in _refusal(model)


def test_gpt2_refused():
    msg = _refusal(sm.build("gpt2"))
    assert "a decoder not laid out as model.layers + lm_head (GPT2LMHeadModel: transformer.h.0.attn.c_attn" in msg


def test_granite_multipliers_refused():
    model = sm.build("granite")
    msg = _refusal(model)
    assert "a scaled embedding, residual or logits (GraniteConfig.embedding_multiplier=3.0)" in msg
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


def test_tensor_parallel_refuses_layers_beyond_llamas(gemma2):
    # the sharded forward is the Llama layer: Gemma 2's norms around the MLP and Phi-3's qkv projection are refused
    # by name before any process group is read
    from kvcache.engine.tp import TPLlamaForward

    for model in (gemma2, sm.build("phi3"), sm.build("gemma3")):
        with pytest.raises(ValueError, match="tensor parallelism runs Llama-layout layers only"):
            TPLlamaForward(model, group=None)
    with pytest.raises(ValueError, match="tensor parallelism runs one rope for every layer and no attention sinks"):
        TPLlamaForward(sm.build("gpt_oss"), group=None)
    with pytest.raises(ValueError, match="tp_group: torch.distributed is not initialized"):
        TPLlamaForward(sm.build("llama"), group=None)  # a Llama passes the layout check
