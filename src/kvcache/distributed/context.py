"""Context parallelism across real ranks: each rank of a group stores its round-robin share of every sequence
(token ``p`` on rank ``p % cp_size`` at local position ``p // cp_size``, TurboMind's split), gathers reassemble
the single-rank K/V exactly, and per-rank partial attention is merged by log-sum-exp.

Every rank is given the same step description (the new K/V of all tokens, global ``kv_lens``); it keeps its
own block tables, sized by :func:`cp_local_len`, and its own allocator.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import ops
from .._validate import check_int
from ..paged import PagedKVCache
from ..rope import RopeConfig, RopeKernelParams
from ._comm import as_bytes, comm_device, group_rank_size

__all__ = ["cp_local_len", "cp_blocks_needed", "cp_append", "cp_gather", "cp_merge_attention", "cp_attention"]

MergeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def cp_local_len(total: int, cp_rank: int, cp_size: int) -> int:
    """Tokens of a ``total``-token sequence stored by rank ``cp_rank`` of ``cp_size``: the positions ``p < total``
    with ``p % cp_size == cp_rank``, that is ``ceil((total - cp_rank) / cp_size)`` (0 if negative).

    Example
    -------
    >>> [cp_local_len(10, r, 3) for r in range(3)]
    [4, 3, 3]
    """
    check_int("total", total, 0)
    cp_size = check_int("cp_size", cp_size, 1)
    check_int("cp_rank", cp_rank, 0, cp_size - 1)
    return max(total - cp_rank + cp_size - 1, 0) // cp_size


def cp_blocks_needed(total: int, block_size: int, cp_rank: int, cp_size: int) -> int:
    """Blocks rank ``cp_rank`` needs for its share of a ``total``-token sequence (its block-table width).

    Example
    -------
    >>> cp_blocks_needed(100, 16, 0, 2)  # 50 local tokens
    4
    """
    check_int("block_size", block_size, 1)
    return -(-cp_local_len(total, cp_rank, cp_size) // block_size)


def _check_cache(cache: object) -> PagedKVCache:
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a kvcache.PagedKVCache, got {type(cache).__name__}")
    return cache


def cp_append(
    cache: PagedKVCache,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    kv_lens: torch.Tensor | None = None,
    cu_k_lens: torch.Tensor | None = None,
    rope: RopeConfig | RopeKernelParams | bool | None = None,
    rope_seq_len: int | None = None,
    group: dist.ProcessGroup | None = None,
    check: bool = False,
) -> None:
    """Append a step's new K / V on every rank of a context-parallel group: this rank stores its share.

    Parameters
    ----------
    cache : PagedKVCache
        This rank's cache.
    layer : int
    k, v : torch.Tensor
        shape ``[num_tokens, H, D]``, the cache's model dtype: the new tokens of *all* sequences (the same on
        every rank); keys un-rotated when RoPE applies.
    block_tables : torch.Tensor
        int32 ``[B, max_blocks]``: this rank's blocks of each sequence (local positions; width at least
        :func:`cp_blocks_needed` of the total length).
    cu_q_lens : torch.Tensor
        int32 ``[B + 1]``: rows of ``k`` / ``v`` per sequence.
    kv_lens, cu_k_lens : torch.Tensor
        Exactly one: int32 ``[B]`` global tokens already held (all ranks together), or int32 ``[B + 1]``
        cumulative global totals after the append.
    rope, rope_seq_len
        As :meth:`PagedKVCache.append`; RoPE uses the global position.
    group : ProcessGroup, optional
        The context-parallel group (default: the world); ``cp_rank`` / ``cp_size`` are this process's rank in it
        and its size.
    check : bool
        Debug mode (syncs): block tables checked on the host, ValueError before writing.

    Example
    -------
    >>> # on every rank of the group, the same k / v; each rank's own block table
    >>> cp_append(cache, 0, k, v, block_tables=bt_local, cu_q_lens=cu, kv_lens=lens)  # doctest: +SKIP
    """
    cache = _check_cache(cache)
    rank, size = group_rank_size(group)
    cache.append(layer, k, v, block_tables=block_tables, cu_q_lens=cu_q_lens, kv_lens=kv_lens,
                 cu_k_lens=cu_k_lens, rope=rope, rope_seq_len=rope_seq_len, cp_rank=rank, cp_size=size, check=check)


def _all_gather_bytes(local: torch.Tensor, size: int, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank's copy of ``local`` (same shape and dtype on every rank), in group-rank order."""
    dev = comm_device(group, local.device)
    src = as_bytes(local.contiguous()).to(dev)
    parts = [torch.empty_like(src) for _ in range(size)]
    dist.all_gather(parts, src, group=group)
    return [p.to(local.device).view(local.dtype).view(local.shape) for p in parts]


def cp_gather(
    cache: PagedKVCache,
    layer: int,
    *,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    max_len: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reassemble the single-rank contiguous K / V of a context-parallel group (a collective: every rank
    calls it with the same ``kv_lens`` and ``max_len``, and every rank gets the result).

    Each rank gathers its share (dequantized) and the shares are all-gathered as bytes and interleaved:
    the result equals, bit for bit, :meth:`PagedKVCache.gather` of one cache that holds every token.

    Parameters
    ----------
    cache : PagedKVCache
        This rank's cache.
    layer : int
    block_tables : torch.Tensor
        int32 ``[B, max_blocks]``: this rank's blocks of the requested sequences.
    kv_lens : torch.Tensor
        int32 ``[B]``: global tokens of each sequence (all ranks together).
    max_len : int, optional
        ``S`` of the result; default the longest sequence (reads ``kv_lens``: one sync).
    group : ProcessGroup, optional
        The context-parallel group (default: the world).

    Returns
    -------
    (k, v) : torch.Tensor
        shape ``[B, H, S, D]`` each, the cache's model dtype, on the cache's device; zeros past each
        sequence's length.

    Example
    -------
    >>> k, v = cp_gather(cache, 0, block_tables=bt_local, kv_lens=lens)  # doctest: +SKIP
    """
    cache = _check_cache(cache)
    rank, size = group_rank_size(group)
    if not isinstance(kv_lens, torch.Tensor):
        raise TypeError(f"kv_lens: expected an int32 tensor [B], got {type(kv_lens).__name__}")
    if max_len is None:
        max_len = int(kv_lens.max().item()) if kv_lens.numel() else 0
    check_int("max_len", max_len, 0)
    local_len = -(-max_len // size)  # rank 0 holds the most tokens: every rank gathers this many
    k, v = cache.gather(layer, block_tables, kv_lens=kv_lens, max_len=local_len, cp_rank=rank, cp_size=size)
    both = torch.stack((k, v))  # [2, B, H, S_local, D]: one collective for K and V
    parts = _all_gather_bytes(both, size, group)
    full = torch.stack(parts, dim=4)  # [2, B, H, S_local, cp_size, D]: local t of rank r is token t * size + r
    full = full.reshape(*both.shape[:3], local_len * size, both.shape[-1])[:, :, :, :max_len]
    return full[0].contiguous(), full[1].contiguous()


def _merge_fn(merge: MergeFn | None) -> MergeFn:
    if merge is not None:
        if not callable(merge):
            raise TypeError(f"merge: expected a callable (out_a, lse_a, out_b, lse_b) -> (out, lse), got "
                            f"{type(merge).__name__}")
        return merge
    fn = getattr(ops, "merge_attention_states", None)
    if fn is None:
        raise RuntimeError("merge: kvcache.ops.merge_attention_states is not available in this version; pass "
                           "merge=(out_a, lse_a, out_b, lse_b) -> (out, lse)")
    return fn


def cp_merge_attention(
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    merge: MergeFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every rank's partial attention (over its share of the keys) into the full result (a collective).

    The partials are all-gathered in one message (``out`` and ``lse`` bytes together) and folded in group-rank
    order, ``merge(merge(p0, p1), p2) ...``, so every rank computes the same bits.

    Parameters
    ----------
    out : torch.Tensor
        shape ``[n_tokens, Hq, D]``, float16 / bfloat16 / float32: this rank's attention output over its keys.
    lse : torch.Tensor
        shape ``[n_tokens, Hq]``, float32: its log-sum-exp of the scaled scores (``-inf`` where the rank holds
        no key a query may see), in the convention ``merge`` expects.
    group : ProcessGroup, optional
        The context-parallel group (default: the world).
    merge : callable, optional
        ``(out_a, lse_a, out_b, lse_b) -> (out, lse)``; default :func:`kvcache.ops.merge_attention_states`
        (RuntimeError where this version has none).

    Returns
    -------
    (out, lse) : ``[n_tokens, Hq, D]`` of ``out``'s dtype and ``[n_tokens, Hq]`` float32.

    Example
    -------
    >>> out, lse = cp_merge_attention(out_local, lse_local)  # doctest: +SKIP
    """
    fn = _merge_fn(merge)
    for name, t in (("out", out), ("lse", lse)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if out.dim() != 3 or out.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"out: expected a float16 / bfloat16 / float32 tensor [n_tokens, Hq, D], got {out.dtype} "
                         f"{list(out.shape)}")
    if lse.dtype != torch.float32 or tuple(lse.shape) != tuple(out.shape[:2]):
        raise ValueError(f"lse: expected float32 {list(out.shape[:2])} (out's [n_tokens, Hq]), got {lse.dtype} "
                         f"{list(lse.shape)}")
    if lse.device != out.device:
        raise ValueError(f"lse: expected device {out.device} (of out), got {lse.device}")
    _, size = group_rank_size(group)
    if size == 1:
        return out, lse
    ob, lb = as_bytes(out.contiguous()), as_bytes(lse.contiguous())
    parts = _all_gather_bytes(torch.cat((ob, lb)), size, group)
    outs = [p[: ob.numel()].view(out.dtype).view(out.shape) for p in parts]
    lses = [p[ob.numel():].view(torch.float32).view(lse.shape) for p in parts]
    acc_o, acc_l = outs[0], lses[0]
    for o, s in zip(outs[1:], lses[1:]):
        acc_o, acc_l = fn(acc_o, acc_l, o, s)
    return acc_o, acc_l


def cp_attention(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    *,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    **attention_kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context-parallel paged attention (a collective): each rank attends to its share of the keys with
    ``kvcache.ops.paged_attention(..., cp_rank=, cp_size=)``, then :func:`cp_merge_attention` combines the
    partials with ``kvcache.ops.merge_attention_states``.

    Parameters
    ----------
    q : torch.Tensor
        shape ``[n_tokens, Hq, D]``, the cache's model dtype: the same queries on every rank.
    cache : PagedKVCache
        This rank's cache (its share already appended, e.g. by :func:`cp_append`).
    layer : int
    block_tables : torch.Tensor
        int32 ``[B, max_blocks]``: this rank's blocks.
    cu_q_lens : torch.Tensor
        int32 ``[B + 1]``: query rows per sequence.
    kv_lens : torch.Tensor
        int32 ``[B]``: global tokens of each sequence, the new ones included.
    group : ProcessGroup, optional
        The context-parallel group (default: the world).
    **attention_kwargs
        Passed on to ``paged_attention`` (``scale``, ``window``, ``softcap``, ``sinks``: rank 0 alone adds the
        sinks, so the merge is exact).

    Returns
    -------
    (out, lse) : ``[n_tokens, Hq, D]`` and float32 ``[n_tokens, Hq]``, equal on every rank.

    Example
    -------
    >>> out, lse = cp_attention(q, cache, 0, block_tables=bt_local, cu_q_lens=cu, kv_lens=lens)  # doctest: +SKIP
    """
    attn = getattr(ops, "paged_attention", None)
    if attn is None or getattr(ops, "merge_attention_states", None) is None:
        raise RuntimeError("cp_attention: needs kvcache.ops.paged_attention and merge_attention_states, which this "
                           "version does not have")
    cache = _check_cache(cache)
    rank, size = group_rank_size(group)
    i = check_int("layer", layer, 0, cache.num_layers - 1)
    for name in ("cp_rank", "cp_size", "lse", "kv_scales"):
        if name in attention_kwargs:
            raise ValueError(f"{name}: set by cp_attention (the group's rank / size, this cache's scales), not "
                             f"by the caller")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q: expected a tensor [n_tokens, Hq, D], got "
                         f"{list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    cfg = cache.config
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    out = attn(q, cache.pool(i), cache.params(i), cache.kv_scales[i] if cfg.kv_dtype == "fp8" else None,
               kv_dtype=cfg.kv_dtype, layout=cfg.layout, block_tables=block_tables, cu_q_lens=cu_q_lens,
               kv_lens=kv_lens, lse=lse, cp_rank=rank, cp_size=size, **attention_kwargs)
    return cp_merge_attention(out, lse, group=group)
