"""Fixtures of the eval tests: a small random Llama and a character-level tokenizer with a chat template, both
built in memory (no download), so a whole evaluation runs in seconds on a CPU (one torch thread: the machine's
other test worker has the other core)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

PROMPTS = ["What is 2 + 2?", "Name a color.", "Say hello.", "Why is the sea salty?", "Count to three."]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_llama():
    """A 2-layer random Llama (GQA: 4 query heads over 2 KV heads, head_dim 16), float32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=512, initializer_range=0.1,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def char_tokenizer():
    """One token per printable ASCII character (ids 3..97), <pad> 0, <s> 1, </s> 2, and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for c in (chr(i) for i in range(32, 127)):
        vocab[c] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<s>assistant: {% endif %}")
    return tok
