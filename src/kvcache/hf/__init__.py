"""transformers integration: caches backed by kvcache, and an attention function that reads the paged blocks.

* :class:`LinearCache`: a ``transformers`` Cache over :class:`~kvcache.LinearKVCache` (or
  :class:`~kvcache.KVCacheManager` for layers of different shapes); any attention implementation.
* :class:`PagedCache`: a ``transformers`` Cache over :class:`~kvcache.PagedKVCache` + :class:`~kvcache.BlockAllocator`,
  every kv_dtype (auto, fp8, int8, int4). With ``attn_implementation="kvcache_paged"`` (registered on import),
  attention reads the blocks in place; with any other implementation the cache hands it gathered K / V.

Example::

    import kvcache.hf
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="kvcache_paged")
    cache = kvcache.hf.PagedCache(model.config, max_batch_size=4, max_cache_len=1024, kv_dtype="int8")
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
"""

from .attention import ATTN_IMPLEMENTATION, kvcache_paged_attention, register
from .linear import LinearCache
from .paged import PagedCache

register()

__all__ = ["LinearCache", "PagedCache", "ATTN_IMPLEMENTATION", "kvcache_paged_attention", "register"]
