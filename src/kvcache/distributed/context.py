"""Context parallelism across real ranks: each rank of a group stores its round-robin share of every sequence
(token ``p`` on rank ``p % cp_size`` at local position ``p // cp_size``, TurboMind's split), gathers reassemble
the single-rank K/V exactly, and per-rank partial attention is merged by log-sum-exp.

Every rank is given the same step (the new K/V of all tokens, global ``kv_lens``); it keeps its own block tables,
sized by :func:`cp_local_len`, and its own allocator. A step is described once per rank by :func:`cp_plan` (the
cache's :class:`~kvcache.paged.StepPlan` with this process's rank and size in the group) and every layer's
:func:`cp_append`, :func:`cp_attention` and :func:`cp_gather` takes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import ops
from .._validate import check_int
from ..paged import PagedKVCache, StepPlan
from ._comm import as_bytes, comm_device, group_rank_size

__all__ = ["cp_local_len", "cp_blocks_needed", "cp_plan", "cp_append", "cp_gather", "cp_merge_attention",
           "cp_attention"]

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


def _check_plan(plan: object, group: dist.ProcessGroup | None) -> tuple[StepPlan, int, int]:
    """``plan`` with this process's ``(rank, size)`` in ``group``; ValueError if the plan was built for another."""
    if not isinstance(plan, StepPlan):
        raise TypeError(f"plan: expected a StepPlan (cp_plan(...)), got {type(plan).__name__}")
    rank, size = group_rank_size(group)
    if (plan.cp_rank, plan.cp_size) != (rank, size):
        raise ValueError(f"plan: expected cp_rank / cp_size {rank} / {size} (this process in the group), got "
                         f"{plan.cp_rank} / {plan.cp_size}; build it with cp_plan(cache, ..., group=group)")
    return plan, rank, size


def cp_plan(
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor | None = None,
    kv_lens: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    **options: Any,
) -> StepPlan:
    """This rank's plan of a context-parallel step: :meth:`PagedKVCache.plan` with ``cp_rank`` / ``cp_size`` of
    this process in ``group``. Built once per step and handed to :func:`cp_append`, :func:`cp_attention` and
    :func:`cp_gather` for every layer.

    Parameters
    ----------
    cache : PagedKVCache
        This rank's cache.
    block_tables : torch.Tensor
        int32 ``[B, max_blocks]``: this rank's blocks of each sequence (local positions; width at least
        :func:`cp_blocks_needed` of the total length).
    cu_q_lens : torch.Tensor, optional
        int32 ``[B + 1]``: the step's rows per sequence (the same on every rank; None for a plan that only
        gathers, with ``seq_lens=``).
    kv_lens : torch.Tensor, optional
        int32 ``[B]``: global tokens each sequence held before the step (all ranks together); or ``cu_k_lens=``.
    group : ProcessGroup, optional
        The context-parallel group (default: the world).
    **options
        The other arguments of :meth:`PagedKVCache.plan` (``cu_k_lens``, ``seq_lens`` (global), ``rope``,
        ``scale``, ``window``, ``softcap``, ``check``, ...); not ``cp_rank`` / ``cp_size``.

    Returns
    -------
    StepPlan

    Example
    -------
    >>> plan = cp_plan(cache, bt_local, cu, lens)                       # doctest: +SKIP
    >>> cp_append(cache, 0, k, v, plan)                                 # doctest: +SKIP
    """
    cache = _check_cache(cache)
    for name in ("cp_rank", "cp_size"):
        if name in options:
            raise ValueError(f"{name}: set by cp_plan (this process's rank in the group / its size), not by the "
                             "caller")
    rank, size = group_rank_size(group)
    return cache.plan(block_tables, cu_q_lens, kv_lens, cp_rank=rank, cp_size=size, **options)


def cp_append(
    cache: PagedKVCache,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: StepPlan,
    *,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Append a step's new K / V on every rank of a context-parallel group: this rank stores its share.

    Parameters
    ----------
    cache : PagedKVCache
        This rank's cache.
    layer : int
    k, v : torch.Tensor
        shape ``[num_tokens, H, D]``, the cache's model dtype: the new tokens of *all* sequences (the same on
        every rank); keys un-rotated when RoPE applies (it uses the global position).
    plan : StepPlan
        This rank's plan of the step (:func:`cp_plan`); ``check=True`` there verifies the block tables on the
        host (a sync) and raises ValueError before writing.
    group : ProcessGroup, optional
        The context-parallel group the plan was built for (default: the world).

    Example
    -------
    >>> # on every rank of the group, the same k / v; each rank's own block table
    >>> cp_append(cache, 0, k, v, cp_plan(cache, bt_local, cu, lens))  # doctest: +SKIP
    """
    cache = _check_cache(cache)
    plan, _, _ = _check_plan(plan, group)
    cache.append(layer, k, v, plan)


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
    plan: StepPlan,
    *,
    max_len: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reassemble the single-rank contiguous K / V of a context-parallel group (a collective: every rank
    calls it with the same global lengths and ``max_len``, and every rank gets the result).

    Each rank gathers its share (dequantized) and the shares are all-gathered as bytes and interleaved:
    the result equals, bit for bit, :meth:`PagedKVCache.gather` of one cache that holds every token.

    Parameters
    ----------
    cache : PagedKVCache
        This rank's cache.
    layer : int
    plan : StepPlan
        This rank's ragged plan (:func:`cp_plan`): its block tables, and the sequences as they stand after its
        step (``plan.seq_lens``: global tokens, all ranks together). A plan for gathers only:
        ``cp_plan(cache, bt_local, seq_lens=lens)``.
    max_len : int, optional
        ``S`` of the result; default the longest sequence (reads ``plan.seq_lens``: one sync).
    group : ProcessGroup, optional
        The context-parallel group (default: the world).

    Returns
    -------
    (k, v) : torch.Tensor
        shape ``[B, H, S, D]`` each, the cache's model dtype, on the cache's device; zeros past each
        sequence's length.

    Example
    -------
    >>> k, v = cp_gather(cache, 0, cp_plan(cache, bt_local, seq_lens=lens))  # doctest: +SKIP
    """
    cache = _check_cache(cache)
    plan, _, size = _check_plan(plan, group)
    plan.require("cp_gather", ragged=True, rows=False)
    if max_len is None:
        lens = plan.seq_lens
        max_len = int(lens.max().item()) if lens.numel() else 0
    check_int("max_len", max_len, 0)
    local_len = -(-max_len // size)  # rank 0 holds the most tokens: every rank gathers this many
    k, v = cache.gather(layer, plan, max_len=local_len)
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
    plan: StepPlan,
    *,
    sinks: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context-parallel paged attention (a collective): each rank attends to its share of the keys with
    :meth:`PagedKVCache.attention` (the plan's ``cp_rank`` / ``cp_size``, ``lse`` filled), then
    :func:`cp_merge_attention` combines the partials with ``kvcache.ops.merge_attention_states``.

    Parameters
    ----------
    q : torch.Tensor
        shape ``[n_tokens, Hq, D]``, the cache's model dtype: the same queries on every rank.
    cache : PagedKVCache
        This rank's cache (its share already appended, e.g. by :func:`cp_append` with the same plan).
    layer : int
    plan : StepPlan
        This rank's plan of the step (:func:`cp_plan`): its block tables, the step's rows, the global lengths,
        and the query-side options (``scale``, ``window``, ``softcap``).
    sinks : torch.Tensor, optional
        float32 ``[Hq]``: this layer's sink logits; rank 0 alone adds them, so the merge is exact.
    group : ProcessGroup, optional
        The context-parallel group (default: the world).

    Returns
    -------
    (out, lse) : ``[n_tokens, Hq, D]`` and float32 ``[n_tokens, Hq]``, equal on every rank.

    Example
    -------
    >>> plan = cp_plan(cache, bt_local, cu, lens_before)                   # doctest: +SKIP
    >>> cp_append(cache, 0, k, v, plan)                                    # doctest: +SKIP
    >>> out, lse = cp_attention(q, cache, 0, plan)                         # doctest: +SKIP
    """
    if getattr(ops, "merge_attention_states", None) is None:
        raise RuntimeError("cp_attention: needs kvcache.ops.merge_attention_states, which this version does not "
                           "have")
    cache = _check_cache(cache)
    plan, _, _ = _check_plan(plan, group)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q: expected a tensor [n_tokens, Hq, D], got "
                         f"{list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    out = cache.attention(layer, q, plan, sinks=sinks, lse=lse)
    return cp_merge_attention(out, lse, group=group)
