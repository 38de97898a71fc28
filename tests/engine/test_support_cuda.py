"""The architectures the engine runs, on the GPU: the fused path on CUDA, eager and in CUDA graphs, and the linear
cache, each equal to transformers' greedy tokens on tiny random fp32 models (windows shorter than the prompt).
GPU-sized: marked slow, and skipped without CUDA (the CPU runs of tests/engine/test_support.py cover the torch
path)."""

from __future__ import annotations

import pytest
import torch

import support_models as sm
from kvcache.engine import LLM, SamplingParams

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the fused path and CUDA graphs")]

ARCHITECTURES = ["llama", "qwen3", "mistral_window", "qwen2_window", "phi3", "gemma2", "gemma3", "gpt_oss"]
PROMPTS = [sm.PROMPT, sm.PROMPT[5:] + sm.PROMPT[:3]]


@torch.inference_mode()
def _transformers(model) -> list[list[int]]:
    outs = []
    for p in PROMPTS:
        x = torch.tensor([p], device="cuda")
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=sm.NEW_TOKENS, do_sample=False)
        outs.append(y[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_fp32_on_cuda_equals_transformers(name):
    model = sm.build(name).to("cuda")
    want = _transformers(model)
    sp = SamplingParams(max_tokens=sm.NEW_TOKENS, temperature=0)
    # one engine at a time: each fuses the model's weights for itself
    modes = [("paged", False), ("paged", True), ("paged", None), ("linear", False)]
    if name == "gpt_oss":  # transformers' float32 MoE module cannot be captured: refused by name, eager by default
        with pytest.raises(ValueError, match="^cuda_graphs: .*gpt-oss's mixture-of-experts MLP in float32"):
            LLM(model, tokenizer=sm.IdsTokenizer(), cuda_graphs=True, max_num_seqs=2, max_model_len=64)
        modes.remove(("paged", True))
    for cache, graphs in modes:
        llm = LLM(model, tokenizer=sm.IdsTokenizer(), cache=cache, cuda_graphs=graphs, max_num_seqs=2, max_model_len=64)
        got = [o.token_ids for o in llm.generate(PROMPTS, sp)]
        assert got == want, f"{name}: cache={cache} cuda_graphs={graphs}"
        del llm
