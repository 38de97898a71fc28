"""LinearKVCache: one static buffer ``[L, B, 2, H, S, D]`` with a slot per sequence (TensorRT Edge-LLM)."""

from __future__ import annotations

import torch

from ._slots import SlotCache
from .config import CacheConfig

__all__ = ["LinearKVCache"]


class LinearKVCache(SlotCache):
    """Static KV cache for every decoder layer, allocated once for ``max_batch_size`` sequences.

    Layout: ``buffer`` is ``[num_layers, max_batch_size, 2, num_kv_heads, max_seq_len, head_dim]``
    (``[:, :, 0]`` keys, ``[:, :, 1]`` values), zero-initialised on ``config.device``. Sequences occupy slots
    ``0 .. active_batch_size - 1``; ``lengths[b]`` tokens of slot ``b`` are valid, the rest is stale and never
    read.

    Parameters
    ----------
    config : CacheConfig

    Examples
    --------
    >>> cache = LinearKVCache(CacheConfig(num_layers=2, max_batch_size=4, max_seq_len=128,
    ...                                   num_kv_heads=2, head_dim=64, device="cpu"))
    >>> cache.reset_for_new_sequences([0, 0])
    >>> cache.commit(torch.tensor([5, 7], dtype=torch.int32))   # after prefill writes 5 and 7 tokens
    >>> cache.commit(1)                                          # after a decode step
    >>> cache.lengths.tolist()
    [6, 8]
    """

    def __init__(self, config: CacheConfig) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config: expected a CacheConfig, got {type(config).__name__}")
        self._config = config
        self._init_state([(config.num_kv_heads, config.head_dim)] * config.num_layers, config.max_batch_size,
                         config.max_seq_len, config.dtype, config.device)  # type: ignore[arg-type]

    @property
    def config(self) -> CacheConfig:
        return self._config

    @property
    def num_layers(self) -> int:
        return self._config.num_layers

    @property
    def buffer(self) -> torch.Tensor:
        """The whole cache: ``[L, B, 2, H, S, D]``."""
        return self._store.buffer  # type: ignore[return-value]

    def layer(self, i: int) -> torch.Tensor:
        """Layer ``i``: a view ``[B, 2, H, S, D]`` of :attr:`buffer`."""
        return self._store.layers[self._check_layer_index(i)]

    def kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer ``i``: two views ``[B, H, S, D]`` of the same memory."""
        layer = self.layer(i)
        return layer[:, 0], layer[:, 1]

    def __repr__(self) -> str:
        c = self._config
        return (
            f"LinearKVCache(layers={c.num_layers}, max_batch={c.max_batch_size}, max_seq={c.max_seq_len}, "
            f"kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, dtype={c.dtype}, device={c.device}, "
            f"active={self.active_batch_size})"
        )
