"""kvcache: the KV-cache layer of an LLM inference engine (PyTorch + Triton)."""

from . import ops
from .config import CacheConfig, KVLayerConfig, ManagerConfig
from .linear import LinearKVCache
from .manager import KVCacheManager
from .paged import BlockAllocator, PagedBatch, PagedConfig, PagedKVCache, cache_block_bytes
from .rope import RopeConfig
from .snapshot import KVSnapshot

__version__ = "0.1.0"

__all__ = [
    "ops",
    "CacheConfig",
    "KVLayerConfig",
    "ManagerConfig",
    "LinearKVCache",
    "KVCacheManager",
    "KVSnapshot",
    "PagedConfig",
    "PagedKVCache",
    "BlockAllocator",
    "PagedBatch",
    "cache_block_bytes",
    "RopeConfig",
    "__version__",
]
