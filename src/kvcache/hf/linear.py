"""LinearCache: a transformers ``Cache`` backed by :class:`~kvcache.LinearKVCache` / :class:`~kvcache.KVCacheManager`.

One static slot per batch row, ``[L, B, 2, H, S, D]``. ``update`` writes the step's keys and values with the
caches' ``append`` at the current length and returns views of the slots up to the new length (no copy when
the storage dtype is the model's), which transformers' own attention (sdpa, eager, ...) reads with its mask:
left padding is stored as the model computed it, exactly like ``DynamicCache``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from .._validate import bits
from ..linear import CacheConfig, KVCacheManager, KVLayerConfig, LinearKVCache, ManagerConfig
from ..support import check_supported
from ._common import LINEAR_KV_DTYPES, CacheCapacity, LayerView, ModelShape, to_storage, tokens_to_keep

__all__ = ["LinearCache"]


class LinearCache(CacheCapacity, Cache):
    """A transformers cache whose keys and values live in a kvcache linear cache.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config: layers, KV heads and head_dim are read from it.
    max_batch_size : int
        Batch rows (``num_beams`` x prompts for beam search).
    max_cache_len : int
        Tokens per row: prompt (with its left padding) plus new tokens.
    kv_dtype : str | torch.dtype
        ``"auto"`` (the model's dtype, read from the first ``update``), ``"fp32"``, ``"fp16"``, ``"bf16"`` or
        ``"fp8"`` (float8_e4m3fn, saturating at +-448, no scale), or a torch dtype.
    device : torch.device | str, optional
        Default: the device of the first ``update``'s keys.
    layers : list of (num_kv_heads, head_dim), optional
        Per-layer shapes for models whose layers differ (a :class:`~kvcache.KVCacheManager` then holds them).

    Notes
    -----
    The storage is allocated on the first ``update`` (the model's dtype and device are known then).
    ``store`` is the kvcache object (``None`` before): its ``lengths`` are committed after the last layer
    of each step; ``get_seq_length(layer_idx)`` is per layer.

    Examples
    --------
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    ...                   num_key_value_heads=2, vocab_size=100)
    >>> model = LlamaForCausalLM(cfg).eval()
    >>> cache = LinearCache(cfg, max_batch_size=1, max_cache_len=16)
    >>> out = model.generate(torch.tensor([[1, 2, 3]]), past_key_values=cache, max_new_tokens=4, min_new_tokens=4,
    ...                      do_sample=False)  # min_new_tokens: a random model may sample its end token early
    >>> cache.get_seq_length()
    6
    """

    def __init__(
        self,
        config: Any,
        *,
        max_batch_size: int,
        max_cache_len: int,
        kv_dtype: str | torch.dtype = "auto",
        device: torch.device | str | None = None,
        layers: list[tuple[int, int]] | None = None,
    ) -> None:
        shape = ModelShape.from_config(config)
        for name, value in (("max_batch_size", max_batch_size), ("max_cache_len", max_cache_len)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value}")
        if isinstance(kv_dtype, str):
            if kv_dtype not in LINEAR_KV_DTYPES:
                raise ValueError(
                    f"kv_dtype: expected one of {tuple(LINEAR_KV_DTYPES)} or a torch dtype, got {kv_dtype!r}")
            store_dtype = LINEAR_KV_DTYPES[kv_dtype]
        elif isinstance(kv_dtype, torch.dtype):
            store_dtype = kv_dtype
        else:
            raise TypeError(f"kv_dtype: expected a str or a torch.dtype, got {type(kv_dtype).__name__}")
        specs = [(shape.num_kv_heads, shape.head_dim)] * shape.num_layers if layers is None else list(layers)
        if len(specs) != shape.num_layers:
            raise ValueError(f"layers: expected {shape.num_layers} (num_kv_heads, head_dim) pairs, got {len(specs)}")
        check_supported(config, "hf-linear", name="config")  # a property of the model this path does not run
        super().__init__(layers=[LayerView(self, i) for i in range(shape.num_layers)])
        # behind CacheCapacity's read-only properties (transformers 5.17's Cache defines them read-only)
        self._max_batch = max_batch_size
        self._max_len = max_cache_len
        self.kv_dtype = kv_dtype
        self._store_dtype = store_dtype
        self._device = torch.device(device) if device is not None else None
        self._specs = specs
        self.store: LinearKVCache | KVCacheManager | None = None
        self._allocated = False
        self._model_dtype: torch.dtype | None = None
        self._layer_len = [0] * shape.num_layers

    # ------------------------------------------------------------------------------------------ storage

    def _allocate(self, key_states: torch.Tensor) -> None:
        if self._allocated:
            return
        dtype = self._store_dtype or key_states.dtype
        device = self._device or key_states.device
        if len(set(self._specs)) == 1:
            h, d = self._specs[0]
            self.store = LinearKVCache(CacheConfig(
                num_layers=len(self._specs), max_batch_size=self.max_batch_size, max_seq_len=self.max_cache_len,
                num_kv_heads=h, head_dim=d, dtype=dtype, device=device))
        else:
            self.store = KVCacheManager(ManagerConfig(
                max_batch_size=self.max_batch_size, max_seq_len=self.max_cache_len,
                layers=[KVLayerConfig(h, d) for h, d in self._specs], dtype=dtype, device=device))
        self._model_dtype = key_states.dtype
        self._allocated = True

    def _update(self, i: int, key_states: torch.Tensor, value_states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        self._allocate(key_states)
        store: LinearKVCache | KVCacheManager = self.store  # type: ignore[assignment]  # allocated above
        B, T = key_states.shape[0], key_states.shape[2]
        if store.active_batch_size == 0 and not any(self._layer_len):
            if B > self.max_batch_size:
                raise ValueError(f"key_states: expected a batch of at most {self.max_batch_size} rows "
                                 f"(max_batch_size), got {B}")
            store.reset_for_new_sequences([0] * B)
        if B != store.active_batch_size:
            raise ValueError(f"key_states: expected {store.active_batch_size} rows (the batch this cache holds), got "
                             f"{B}; call reset() before a new batch")
        base = store.host_lengths()[0] if B else 0
        if self._layer_len[i] != base:
            raise ValueError(f"layer_idx: layer {i} was already updated in this step (holds {self._layer_len[i]} "
                             f"tokens, the cache {base}); every layer is updated once per forward")
        dtype = store.dtype
        store.append(i, to_storage(key_states, dtype), to_storage(value_states, dtype))
        new_len = base + T
        self._layer_len[i] = new_len
        if all(n == new_len for n in self._layer_len):
            store.commit(T)
        k, v = store.kv(i)
        k, v = k[:B, :, :new_len], v[:B, :, :new_len]
        if dtype != key_states.dtype:
            k, v = k.to(key_states.dtype), v.to(value_states.dtype)
        return k, v

    # ------------------------------------------------------------------------------------------ Cache API

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held by layer ``layer_idx`` (left padding included, as transformers counts them)."""
        if not 0 <= layer_idx < len(self._layer_len):
            return 0
        return self._layer_len[layer_idx]

    def reset(self) -> None:
        """Forget every sequence (the storage is kept): the next ``update`` starts a new batch."""
        self._layer_len = [0] * len(self._layer_len)
        if self.store is not None:
            self.store.reset_for_new_sequences([])

    def _reset_layer(self, i: int) -> None:
        self.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop tokens from the end of every row: ``crop(-n)`` removes ``n`` (transformers 5.x); ``crop(n)`` with
        ``n >= 0`` keeps the first ``n`` (the older form)."""
        for i in range(len(self._layer_len)):
            self._crop_layer(i, tokens_to_remove)

    def _crop_layer(self, i: int, tokens_to_remove: int) -> None:
        self._layer_len[i] = tokens_to_keep(self._layer_len[i], tokens_to_remove)
        store = self.store
        if store is None or store.active_batch_size == 0:
            return
        base = store.host_lengths()[0]
        if all(n == self._layer_len[0] for n in self._layer_len) and self._layer_len[0] < base:
            store.commit(self._layer_len[0] - base)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``b`` takes the keys and values of row ``beam_idx[b]`` in every layer."""
        for i in range(len(self._layer_len)):
            self._reorder_layer(i, beam_idx)

    def _reorder_layer(self, i: int, beam_idx: torch.Tensor) -> None:
        store = self.store
        if store is None or store.active_batch_size == 0:
            return
        n = store.active_batch_size
        if not isinstance(beam_idx, torch.Tensor) or beam_idx.dim() != 1 or beam_idx.shape[0] != n:
            raise ValueError(f"beam_idx: expected a 1-d tensor of {n} row indices, got {beam_idx!r}")
        rows = bits(store.layer(i))[:n]  # the same-width integer view: fp8 has no index_select everywhere
        rows.copy_(rows.index_select(0, beam_idx.to(device=rows.device, dtype=torch.long)))

    def __repr__(self) -> str:
        return (f"LinearCache(layers={len(self._layer_len)}, max_batch_size={self.max_batch_size}, "
                f"max_cache_len={self.max_cache_len}, kv_dtype={self.kv_dtype!r}, store={self.store!r})")
