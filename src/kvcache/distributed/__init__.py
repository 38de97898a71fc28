"""Beyond one GPU, on torch.distributed (NCCL on GPUs, gloo on CPUs).

* context parallel (:mod:`.context`): each rank stores its round-robin share of every sequence; gathers
  reassemble the single-rank K / V exactly; per-rank attention is merged by log-sum-exp;
* tensor parallel (:mod:`.tensor`): which KV / query heads each rank holds (KV heads replicated when fewer
  than ranks), and cache configs sized for a rank's share;
* KV transfer (:mod:`.transfer`, wire format in :mod:`.wire`): paged blocks (any kv_dtype, scales included) or a
  ``KVSnapshot`` sent point-to-point in pipelined chunks, each checksummed on the device and checked before it
  is written, the receiver's blocks from its own allocator.

Every function takes an optional ``group`` (default: the world) and must be called by the ranks concerned
in the same order, as torch.distributed's own collectives and point-to-point calls.
"""

from .context import (
    cp_append,
    cp_attention,
    cp_blocks_needed,
    cp_gather,
    cp_local_len,
    cp_merge_attention,
    cp_plan,
)
from .snapshots import recv_snapshot, send_snapshot
from .tensor import KVHeadShard, kv_heads_for_rank, shard_cache_config, shard_kv_heads, shard_paged_config
from .transfer import recv_blocks, send_blocks

__all__ = [
    "cp_local_len",
    "cp_blocks_needed",
    "cp_plan",
    "cp_append",
    "cp_gather",
    "cp_merge_attention",
    "cp_attention",
    "KVHeadShard",
    "kv_heads_for_rank",
    "shard_kv_heads",
    "shard_paged_config",
    "shard_cache_config",
    "send_blocks",
    "recv_blocks",
    "send_snapshot",
    "recv_snapshot",
]
