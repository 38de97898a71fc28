"""Tensor parallelism: which KV heads (and query heads) each rank holds, and caches sized for a rank's share.

Heads are split in contiguous runs (Megatron / vLLM column-parallel q / k / v): with ``num_kv_heads >=
tp_size`` rank ``r`` holds KV heads ``[r * n, (r + 1) * n)``, ``n = num_kv_heads / tp_size``; with fewer KV heads
than ranks every KV head is replicated on ``tp_size / num_kv_heads`` consecutive ranks (rank ``r`` holds head
``r // (tp_size / num_kv_heads)``). Query heads are always split evenly, so the query heads of a rank are
exactly those whose GQA group is one of its KV heads.
"""

from __future__ import annotations

import dataclasses

from .._validate import check_int
from ..linear import CacheConfig
from ..paged import PagedConfig

__all__ = ["KVHeadShard", "kv_heads_for_rank", "shard_kv_heads", "shard_paged_config", "shard_cache_config"]


@dataclasses.dataclass(frozen=True)
class KVHeadShard:
    """The heads one tensor-parallel rank holds.

    Attributes
    ----------
    tp_rank, tp_size : int
    kv_heads : tuple of int
        Global KV head ids held by this rank, ascending and contiguous.
    q_heads : tuple of int or None
        Global query heads computed by this rank (None when ``num_q_heads`` was not given).
    replicas : int
        Ranks holding each of these KV heads: 1 when sharded, ``tp_size // num_kv_heads`` when replicated.
    """

    tp_rank: int
    tp_size: int
    kv_heads: tuple[int, ...]
    q_heads: tuple[int, ...] | None
    replicas: int

    @property
    def num_kv_heads(self) -> int:
        """KV heads in this rank's cache."""
        return len(self.kv_heads)

    @property
    def kv_slice(self) -> slice:
        """``slice`` of the global KV heads held here (rows of a ``[H, ...]`` weight or tensor)."""
        return slice(self.kv_heads[0], self.kv_heads[-1] + 1)

    @property
    def q_slice(self) -> slice | None:
        """``slice`` of the global query heads computed here, or None."""
        if self.q_heads is None:
            return None
        return slice(self.q_heads[0], self.q_heads[-1] + 1)


def _check_heads(num_kv_heads: int, tp_size: int, num_q_heads: int | None) -> None:
    check_int("num_kv_heads", num_kv_heads, 1)
    check_int("tp_size", tp_size, 1)
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        raise ValueError(f"tp_size: expected a divisor of num_kv_heads ({num_kv_heads}) or a multiple of it, got "
                         f"{tp_size}")
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        raise ValueError(f"tp_size: expected a multiple of num_kv_heads ({num_kv_heads}) when larger, got {tp_size}")
    if num_q_heads is not None:
        check_int("num_q_heads", num_q_heads, 1)
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads: expected a multiple of num_kv_heads ({num_kv_heads}), got {num_q_heads}")
        if num_q_heads % tp_size:
            raise ValueError(f"num_q_heads: expected a multiple of tp_size ({tp_size}), got {num_q_heads}")


def kv_heads_for_rank(num_kv_heads: int, tp_rank: int, tp_size: int, *, num_q_heads: int | None = None) -> KVHeadShard:
    """The KV heads (and query heads) tensor-parallel rank ``tp_rank`` of ``tp_size`` holds.

    Parameters
    ----------
    num_kv_heads : int
        The model's KV heads. ``tp_size`` must divide it, or be a multiple of it (replication).
    tp_rank, tp_size : int
    num_q_heads : int, optional
        The model's query heads: a multiple of ``num_kv_heads`` and of ``tp_size``.

    Returns
    -------
    KVHeadShard

    Example
    -------
    >>> kv_heads_for_rank(8, 1, 4, num_q_heads=32).kv_heads
    (2, 3)
    >>> kv_heads_for_rank(2, 3, 4).kv_heads  # 2 KV heads on 4 ranks: each on two ranks
    (1,)
    """
    _check_heads(num_kv_heads, tp_size, num_q_heads)
    check_int("tp_rank", tp_rank, 0, tp_size - 1)
    if num_kv_heads >= tp_size:
        n = num_kv_heads // tp_size
        kv = tuple(range(tp_rank * n, (tp_rank + 1) * n))
        replicas = 1
    else:
        replicas = tp_size // num_kv_heads
        kv = (tp_rank // replicas,)
    q = None
    if num_q_heads is not None:
        nq = num_q_heads // tp_size
        q = tuple(range(tp_rank * nq, (tp_rank + 1) * nq))
    return KVHeadShard(tp_rank=tp_rank, tp_size=tp_size, kv_heads=kv, q_heads=q, replicas=replicas)


def shard_kv_heads(num_kv_heads: int, tp_size: int, *, num_q_heads: int | None = None) -> list[KVHeadShard]:
    """:func:`kv_heads_for_rank` of every rank, in rank order.

    Example
    -------
    >>> [s.kv_heads for s in shard_kv_heads(4, 2)]
    [(0, 1), (2, 3)]
    """
    _check_heads(num_kv_heads, tp_size, num_q_heads)
    return [kv_heads_for_rank(num_kv_heads, r, tp_size, num_q_heads=num_q_heads) for r in range(tp_size)]


def shard_paged_config(config: PagedConfig, tp_rank: int, tp_size: int) -> PagedConfig:
    """The :class:`PagedConfig` of rank ``tp_rank``'s cache: ``num_kv_heads`` of its share, everything else
    (block size, number of blocks, formats) unchanged, so block ids mean the same on every rank.

    Example
    -------
    >>> cfg = PagedConfig(num_layers=2, num_kv_heads=8, head_dim=64, block_size=16, num_blocks=32, device="cpu")
    >>> shard_paged_config(cfg, 0, 4).num_kv_heads
    2
    """
    if not isinstance(config, PagedConfig):
        raise TypeError(f"config: expected a PagedConfig, got {type(config).__name__}")
    shard = kv_heads_for_rank(config.num_kv_heads, tp_rank, tp_size)
    return dataclasses.replace(config, num_kv_heads=shard.num_kv_heads)


def shard_cache_config(config: CacheConfig, tp_rank: int, tp_size: int) -> CacheConfig:
    """The :class:`CacheConfig` (linear cache) of rank ``tp_rank``: ``num_kv_heads`` of its share.

    Example
    -------
    >>> cfg = CacheConfig(num_layers=2, max_batch_size=4, max_seq_len=128, num_kv_heads=2, head_dim=64, device="cpu")
    >>> shard_cache_config(cfg, 3, 4).num_kv_heads  # replicated: one head per rank
    1
    """
    if not isinstance(config, CacheConfig):
        raise TypeError(f"config: expected a CacheConfig, got {type(config).__name__}")
    shard = kv_heads_for_rank(config.num_kv_heads, tp_rank, tp_size)
    return dataclasses.replace(config, num_kv_heads=shard.num_kv_heads)
