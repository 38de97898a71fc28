"""Configuration dataclasses of the linear caches, validated at construction."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .._device import resolve_device
from .._validate import check_int, check_kv_dtype

__all__ = ["CacheConfig", "KVLayerConfig", "ManagerConfig"]

# Kernel grids put heads x 2 and layers on grid axes limited to 65535 programs.
_MAX_GRID_AXIS = 65535


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Shape of a :class:`~kvcache.LinearKVCache`: ``[num_layers, max_batch_size, 2, num_kv_heads,
    max_seq_len, head_dim]`` elements of ``dtype`` on ``device``.

    Parameters
    ----------
    num_layers, max_batch_size, max_seq_len, num_kv_heads, head_dim : int
        All >= 1. Any head_dim (not only powers of two) and any head count.
    dtype : torch.dtype
        ``torch.float16``, ``torch.bfloat16``, ``torch.float8_e4m3fn`` (stored bytes; scales belong to
        attention) or ``torch.float32`` (the CPU models' default).
    device : torch.device | str | int | None
        ``None``: the current CUDA device if there is one, else the CPU.
    """

    num_layers: int
    max_batch_size: int
    max_seq_len: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    device: torch.device | str | int | None = None

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, 1, _MAX_GRID_AXIS)
        check_int("max_batch_size", self.max_batch_size, 1)
        check_int("max_seq_len", self.max_seq_len, 1)
        check_int("num_kv_heads", self.num_kv_heads, 1, _MAX_GRID_AXIS // 2)
        check_int("head_dim", self.head_dim, 1)
        check_kv_dtype("dtype", self.dtype)
        object.__setattr__(self, "device", resolve_device(self.device))

    @property
    def layer_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one layer: ``(max_batch_size, 2, num_kv_heads, max_seq_len, head_dim)``."""
        return (self.max_batch_size, 2, self.num_kv_heads, self.max_seq_len, self.head_dim)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the whole buffer: ``(num_layers, *layer_shape)``."""
        return (self.num_layers, *self.layer_shape)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclasses.dataclass(frozen=True)
class KVLayerConfig:
    """KV heads and head size of one attention layer (layers of one model may differ)."""

    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        check_int("num_kv_heads", self.num_kv_heads, 1, _MAX_GRID_AXIS // 2)
        check_int("head_dim", self.head_dim, 1)


@dataclasses.dataclass(frozen=True)
class ManagerConfig:
    """Shape of a :class:`~kvcache.KVCacheManager`: layer ``i`` is ``[max_batch_size, 2,
    layers[i].num_kv_heads, max_seq_len, layers[i].head_dim]`` elements of ``dtype`` on ``device``.

    ``layers`` is stored as a tuple so the config stays immutable.
    """

    max_batch_size: int
    max_seq_len: int
    layers: Sequence[KVLayerConfig]
    dtype: torch.dtype = torch.float16
    device: torch.device | str | int | None = None

    def __post_init__(self) -> None:
        check_int("max_batch_size", self.max_batch_size, 1)
        check_int("max_seq_len", self.max_seq_len, 1)
        if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, Sequence):
            raise TypeError(f"layers: expected a sequence of KVLayerConfig, got {type(self.layers).__name__}")
        if not 1 <= len(self.layers) <= _MAX_GRID_AXIS:
            raise ValueError(f"layers: expected 1 to {_MAX_GRID_AXIS} layer configs, got {len(self.layers)}")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, KVLayerConfig):
                raise TypeError(f"layers[{i}]: expected a KVLayerConfig, got {type(layer).__name__}")
        object.__setattr__(self, "layers", tuple(self.layers))
        check_kv_dtype("dtype", self.dtype)
        object.__setattr__(self, "device", resolve_device(self.device))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_shape(self, i: int) -> tuple[int, int, int, int, int]:
        layer = self.layers[i]
        return (self.max_batch_size, 2, layer.num_kv_heads, self.max_seq_len, layer.head_dim)

    @property
    def nbytes(self) -> int:
        elt = torch.empty((), dtype=self.dtype).element_size()
        per_slot_token = sum(2 * lc.num_kv_heads * lc.head_dim for lc in self.layers)
        return self.max_batch_size * self.max_seq_len * per_slot_token * elt
