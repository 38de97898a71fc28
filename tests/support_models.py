"""Tiny random-weight transformers models (fp32, CPU) for the supported-model tests, built from transformers' own
config classes: 2 layers, hidden 64, 4 query / 2 KV heads of 16, vocab 128, a window of 8 where the model has one
(shorter than the prompt), and greedy references from transformers' own ``generate`` (eager attention)."""

from __future__ import annotations

import copy

import torch

VOCAB = 128
WINDOW = 8
PROMPT = [(7 * i + 3) % (VOCAB - 2) + 2 for i in range(20)]  # 20 tokens, no EOS / pad (ids 0 and 1)
NEW_TOKENS = 8

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=0,
               eos_token_id=1, pad_token_id=1, initializer_range=0.2)


def _config(name: str, **over):
    import transformers

    cls = getattr(transformers, name)
    kwargs = dict(_COMMON)
    kwargs.update(over)
    return cls(**{k: v for k, v in kwargs.items() if v is not ...})


# name -> (config class, overrides): each builds in well under a second
SPECS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "mistral_window": ("MistralConfig", {"sliding_window": WINDOW}),
    "qwen2_window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 0}),
    "gemma2": ("Gemma2Config", {"sliding_window": WINDOW, "query_pre_attn_scalar": 4, "attn_logit_softcapping": 1.0,
                                "final_logit_softcapping": 2.0, "hidden_activation": "gelu_pytorch_tanh",
                                "initializer_range": 0.02}),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": WINDOW, "query_pre_attn_scalar": 4, "initializer_range": 0.02,
                                    "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("Phi3Config", {"head_dim": ..., "sliding_window": None}),
    "cohere": ("CohereConfig", {"head_dim": ..., "logit_scale": 0.5}),
    "olmo2": ("Olmo2Config", {"head_dim": ...}),
    "stablelm": ("StableLmConfig", {"head_dim": ..., "partial_rotary_factor": 0.5}),
    "granite": ("GraniteConfig", {"head_dim": ..., "embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                                  "attention_multiplier": 0.5, "logits_scaling": 0.5}),
    "gpt_oss": ("GptOssConfig", {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "layer_types": ["sliding_attention", "full_attention"],
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "hidden_size": ...,
                            "intermediate_size": ..., "num_hidden_layers": ..., "num_attention_heads": ...,
                            "num_key_value_heads": ..., "head_dim": ..., "max_position_embeddings": ...}),
}


class IdsTokenizer:
    """The engine's tokenizer where the tests give token ids: ``decode`` writes the ids (the tests compare ids)."""

    def decode(self, ids, **kwargs) -> str:
        return " ".join(map(str, ids))


def build(name: str, **over):
    """A tiny model of ``SPECS[name]`` (seed 0, eval mode, eager attention), config fields overridden by ``over``."""
    from transformers import AutoModelForCausalLM

    cls, spec = SPECS[name]
    cfg = _config(cls, **{**spec, **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def gpt_oss():
    """A gpt-oss-like model: attention sinks (drawn large enough to matter: seed 1, x 3), alternating windows, its
    MoE MLP."""
    model = build("gpt_oss")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=g) * 3)
    return model


def variant(model, **config_fields):
    """The same weights under a config with ``config_fields`` changed (to show what a feature does)."""
    cfg = copy.deepcopy(model.config)
    for k, v in config_fields.items():
        setattr(cfg, k, v)
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    other.load_state_dict(model.state_dict())
    return other


@torch.inference_mode()
def greedy(model, prompt: list[int] = PROMPT, n: int = NEW_TOKENS, **kwargs) -> list[int]:
    """transformers' greedy tokens after ``prompt`` (``kwargs``: e.g. ``past_key_values``)."""
    x = torch.tensor([prompt])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


def logits_differ(a, b) -> bool:
    """The two models' logits after the prompt differ by more than rounding (fp32)."""
    return bool((last_logits(a) - last_logits(b)).abs().max() > 1e-4)


@torch.inference_mode()
def last_logits(model, prompt: list[int] = PROMPT) -> torch.Tensor:
    """float32 ``[vocab]``: the model's logits after ``prompt``."""
    return model(torch.tensor([prompt])).logits[0, -1].float()
