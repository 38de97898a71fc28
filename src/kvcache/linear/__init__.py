"""Linear caches (TensorRT Edge-LLM's design): one static slot per sequence, ``[B, 2, H, S, D]`` per layer.

:class:`LinearKVCache` (every layer alike) and :class:`KVCacheManager` (layers of their own head count and
head_dim), their configs, and :class:`KVSnapshot` (a saved prefix: save / restore, files, transfer).
"""

from .cache import LinearKVCache
from .config import CacheConfig, KVLayerConfig, ManagerConfig
from .manager import KVCacheManager
from .snapshot import KVSnapshot

__all__ = ["CacheConfig", "KVLayerConfig", "ManagerConfig", "LinearKVCache", "KVCacheManager", "KVSnapshot"]
