"""Tests of the paged KV cache (layout, append, gather, block allocator)."""
