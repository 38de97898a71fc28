"""KVCacheManager: per-layer caches whose KV-head count and head size may differ (TensorRT Edge-LLM)."""

from __future__ import annotations

import torch

from ._slots import SlotCache
from .cache import append_slots
from .config import KVLayerConfig, ManagerConfig

__all__ = ["KVCacheManager"]


class KVCacheManager(SlotCache):
    """One tensor per attention layer, ``[max_batch_size, 2, H_i, max_seq_len, D_i]``.

    All layers live in one zero-initialised allocation (a design choice over one allocation per layer:
    every multi-layer kernel then addresses all layers from one base pointer through a static table, in one
    launch, with no per-call host work). Uniform layers are views of one ``[L, B, 2, H, S, D]`` tensor, the
    layout of :class:`~kvcache.LinearKVCache`.

    Lengths, active batch size, ``reset_for_new_sequences``, ``commit``, ``evict``, ``save`` and ``restore``
    behave as in :class:`~kvcache.LinearKVCache`.

    Parameters
    ----------
    config : ManagerConfig
    """

    def __init__(self, config: ManagerConfig) -> None:
        if not isinstance(config, ManagerConfig):
            raise TypeError(f"config: expected a ManagerConfig, got {type(config).__name__}")
        self._config = config
        self._init_state([(lc.num_kv_heads, lc.head_dim) for lc in config.layers], config.max_batch_size,
                         config.max_seq_len, config.dtype, config.device)  # type: ignore[arg-type]

    @property
    def config(self) -> ManagerConfig:
        return self._config

    @property
    def num_layers(self) -> int:
        return len(self._config.layers)

    @property
    def is_uniform(self) -> bool:
        """True when every layer has the same ``num_kv_heads`` and ``head_dim``."""
        return self._store.uniform

    def layer(self, i: int) -> torch.Tensor:
        """Combined K/V of layer ``i``: ``[B, 2, H_i, S, D_i]``."""
        return self._store.layers[self._check_layer_index(i)]

    def kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Separate K and V of layer ``i``: two views ``[B, H_i, S, D_i]`` of the combined tensor's memory."""
        layer = self.layer(i)
        return layer[:, 0], layer[:, 1]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new keys and values of layer ``layer`` (``[active_batch_size, H_i, T, D_i]``, the cache's dtype
        and device) at each active sequence's current length; lengths are not changed (``commit`` after the
        last layer). Bounds are checked before any write. See :meth:`kvcache.LinearKVCache.append`.

        Examples
        --------
        >>> cfg = ManagerConfig(max_batch_size=1, max_seq_len=8, layers=[KVLayerConfig(2, 8), KVLayerConfig(1, 16)],
        ...                     dtype=torch.float32, device="cpu")
        >>> cache = KVCacheManager(cfg)
        >>> cache.reset_for_new_sequences([0])
        >>> cache.append(1, torch.ones(1, 1, 3, 16), torch.zeros(1, 1, 3, 16))
        >>> cache.commit(3)
        """
        append_slots(self, self.layer(layer), k, v)

    def layer_config(self, i: int) -> KVLayerConfig:
        return self._config.layers[self._check_layer_index(i)]

    def __repr__(self) -> str:
        c = self._config
        return (
            f"KVCacheManager(layers={len(c.layers)}, uniform={self.is_uniform}, max_batch={c.max_batch_size}, "
            f"max_seq={c.max_seq_len}, dtype={c.dtype}, device={c.device}, active={self.active_batch_size})"
        )
