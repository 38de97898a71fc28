"""Paged KV caches: block pools (FlashInfer / FlashAttention layouts, fp8 / int8 / int4), fused
RoPE + quantize + append, gather, a block allocator with prefix caching, and host / disk tiers behind it."""

from ..ops.paged.format import KV_FORMAT_TABLE, KVFormat
from .allocator import BlockAllocator
from .cache import PagedKVCache, SwappedBlocks
from .config import PagedConfig, cache_block_bytes
from .events import KVEventLog
from .plan import StepPlan
from .tiers import TieredCache, TierStats

__all__ = ["BlockAllocator", "StepPlan", "PagedConfig", "PagedKVCache", "SwappedBlocks", "cache_block_bytes",
           "KVFormat", "KV_FORMAT_TABLE", "TieredCache", "TierStats", "KVEventLog"]
