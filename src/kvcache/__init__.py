"""kvcache: the KV-cache layer of an LLM inference engine (PyTorch + Triton)."""

from . import ops
from .linear import CacheConfig, KVCacheManager, KVLayerConfig, KVSnapshot, LinearKVCache, ManagerConfig
from .paged import BlockAllocator, PagedConfig, PagedKVCache, StepPlan, cache_block_bytes
from .rope import RopeConfig

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
    "StepPlan",
    "cache_block_bytes",
    "RopeConfig",
    "__version__",
]
