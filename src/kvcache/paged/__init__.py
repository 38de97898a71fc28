"""Paged KV caches: block pools (FlashInfer / FlashAttention layouts, fp8 / int8 / int4), fused
RoPE + quantize + append, gather, and a block allocator with prefix caching."""

from .allocator import BlockAllocator
from .batch import PagedBatch
from .cache import PagedKVCache, SwappedBlocks
from .config import PagedConfig, cache_block_bytes
from .format import KV_FORMAT_TABLE, KVFormat

__all__ = ["BlockAllocator", "PagedBatch", "PagedConfig", "PagedKVCache", "SwappedBlocks", "cache_block_bytes",
           "KVFormat", "KV_FORMAT_TABLE"]
