"""KV-cache kernels. Every op works in place on tensors the caller owns: no allocation, no host sync
(except where a docstring says so), capturable in a CUDA graph.

CUDA tensors run compiled Triton kernels; CPU tensors run the pure-torch ``*_reference`` of each op, or the
Triton kernels through Triton's interpreter when ``KVCACHE_TRITON_INTERPRET=1`` (see ``kvcache._backend``).
"""

from .attention import linear_attention, merge_attention_states, paged_attention
from .compact import (
    build_batch_mapping,
    build_batch_mapping_reference,
    check_batch_mapping,
    compact_batch,
    compact_batch_reference,
    compact_kv_layer,
    compact_kv_layer_reference,
    compact_kv_layers,
)
from .copy import (
    restore_kv_layer,
    restore_kv_layer_reference,
    restore_kv_layers,
    save_kv_layer,
    save_kv_layer_reference,
    save_kv_layers,
)
from .lengths import compact_lengths, compact_lengths_reference, increment_lengths, increment_lengths_reference
from .paged import append_paged_kv, copy_blocks, gather_paged_kv

__all__ = [
    "increment_lengths",
    "increment_lengths_reference",
    "save_kv_layer",
    "save_kv_layer_reference",
    "restore_kv_layer",
    "restore_kv_layer_reference",
    "save_kv_layers",
    "restore_kv_layers",
    "build_batch_mapping",
    "build_batch_mapping_reference",
    "check_batch_mapping",
    "compact_kv_layer",
    "compact_kv_layer_reference",
    "compact_kv_layers",
    "compact_batch",
    "compact_batch_reference",
    "compact_lengths",
    "compact_lengths_reference",
    "append_paged_kv",
    "gather_paged_kv",
    "copy_blocks",
    "paged_attention",
    "linear_attention",
    "merge_attention_states",
]
