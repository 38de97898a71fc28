"""What the two transformers caches share: the model's KV shape, kv_dtype names, the per-layer view objects.

transformers' ``Cache`` is a list of per-layer objects (``CacheLayerMixin``) that ``generate``, the masks and
the model query one by one (``update``, ``get_seq_length``, ``get_mask_sizes``). Here every layer object is a
thin view that forwards to its owner, a kvcache-backed cache holding all layers in one allocation; the
owner keeps one length per layer (transformers updates the layers one after the other within a step).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

# kv_dtype names of the linear caches -> stored torch dtype ("auto": the model's dtype)
LINEAR_KV_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
}
FP8_MAX = 448.0  # largest finite float8_e4m3fn: values beyond it saturate instead of becoming NaN


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """KV geometry of a decoder: ``num_layers`` attention layers of ``num_kv_heads`` x ``head_dim``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """Read a transformers ``PretrainedConfig`` (its text config for multimodal models).

        Raises
        ------
        TypeError
            ``config`` lacks ``num_hidden_layers`` / ``num_attention_heads`` / ``hidden_size``.
        """
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        try:
            layers = int(text.num_hidden_layers)
            heads = int(text.num_attention_heads)
            hidden = int(text.hidden_size)
        except AttributeError as e:
            raise TypeError(
                f"config: expected a transformers decoder config (num_hidden_layers, num_attention_heads, "
                f"hidden_size), got {type(config).__name__}"
            ) from e
        kv = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        return cls(layers, int(kv), int(head_dim))


def tokens_to_keep(current: int, value: int) -> int:
    """The length after ``crop(value)``: ``value < 0`` removes ``-value`` tokens (transformers 5.x); ``value >= 0``
    is the length to keep (the older absolute form), never more than ``current``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"tokens_to_remove: expected an int, got {type(value).__name__}")
    keep = current + value if value < 0 else min(value, current)
    return max(keep, 0)


def to_storage(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the linear cache's storage dtype (fp8 saturates at +-448 like the paged fp8 format)."""
    if x.dtype == dtype:
        return x
    if dtype == torch.float8_e4m3fn:
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


class LayerView(CacheLayerMixin):
    """One layer of a kvcache-backed transformers cache: forwards every call to its owner."""

    is_compileable = False  # host-side bookkeeping per step
    is_croppable = True
    is_sliding = False

    def __init__(self, owner: Any, index: int) -> None:
        super().__init__()
        self._owner = owner
        self._index = index

    def __repr__(self) -> str:
        return f"{type(self._owner).__name__}.layers[{self._index}]"

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self._owner._allocated

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:  # set by CacheLayerMixin.__init__; the owner decides
        pass

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self._owner._allocate(key_states)  # one argument before transformers 5.x

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._owner._update(self._index, key_states, value_states)

    def get_mask_sizes(self, query_length: Any, *args: Any) -> tuple[int, int]:
        # transformers 5.x passes the query length; 4.x passed cache_position (a tensor of the new positions)
        q = int(query_length.shape[0]) if isinstance(query_length, torch.Tensor) else int(query_length)
        return self._owner._layer_len[self._index] + q, 0

    def get_seq_length(self) -> int:
        return self._owner._layer_len[self._index]

    def get_max_length(self) -> int:
        return self._owner.max_cache_len

    def get_max_cache_shape(self) -> int:  # the name before transformers 5.x
        return self._owner.max_cache_len

    def reset(self) -> None:
        self._owner._reset_layer(self._index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._owner._reorder_layer(self._index, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        self._owner._crop_layer(self._index, tokens_to_remove)

    def offload(self) -> None:  # the pools stay on their device
        pass

    def prefetch(self) -> None:
        pass

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(f"{type(self._owner).__name__}: batch_repeat_interleave is not supported")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self._owner).__name__}: batch_select_indices is not supported")


class CacheCapacity:
    """``max_batch_size`` / ``max_cache_len`` of kvcache's transformers caches, from ``_max_batch`` / ``_max_len``
    (read-only properties: transformers 5.17's ``Cache`` defines them so, 5.24's not at all)."""

    _max_batch: int
    _max_len: int

    @property
    def max_batch_size(self) -> int:
        """Rows the cache holds at most."""
        return self._max_batch

    @property
    def max_cache_len(self) -> int:
        """Tokens per row the cache holds at most."""
        return self._max_len
