"""The ``"kvcache_paged"`` attention implementation: transformers' attention-function registry entry that writes
a step's keys and values into a :class:`~kvcache.hf.PagedCache` and attends over its blocks in place.

``register()`` (run on ``import kvcache.hf``) adds the function to ``AttentionInterface`` and transformers'
sdpa mask builder to ``AttentionMaskInterface`` under the same name, so a model loaded with
``attn_implementation="kvcache_paged"`` gets the usual 4-D boolean mask: its diagonal says which tokens of
the chunk are real (left padding is not), and only those are written and attend.

The step's :class:`~kvcache.paged.StepPlan` is built once per forward, by the first layer (which rows are real
and where their tokens go); every layer then appends with ``PagedKVCache.append(layer, k, v, plan)`` and attends
with ``PagedKVCache.attention(layer, q, plan)``, which reads and dequantizes the blocks in its kernel (no gather),
causal over each row's real tokens. Layers whose scale, window or soft-cap differ from the first layer's share a
plan of their own (``StepPlan.with_options``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .paged import ATTN_IMPLEMENTATION, PagedCache

__all__ = ["ATTN_IMPLEMENTATION", "kvcache_paged_attention", "register"]


def register() -> None:
    """Register ``"kvcache_paged"`` with transformers' attention and mask registries (idempotent).

    Examples
    --------
    >>> register()
    >>> from transformers import AttentionInterface
    >>> "kvcache_paged" in AttentionInterface._global_mapping
    True
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvcache_paged_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def _valid_tokens(mask: torch.Tensor | None, B: int, past: int, T: int) -> torch.Tensor | None:
    """bool ``[B, T]``: token ``t`` of row ``b`` is real iff it may attend to itself (its own key at ``past + t``).
    None without a mask (no padding)."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[0] not in (1, B) or mask.shape[-1] < past + T or mask.shape[-2] != T:
        raise ValueError(f"attention_mask: expected [{B}, 1, {T}, >= {past + T}], got {list(mask.shape)}")
    diag = torch.diagonal(mask[:, 0, :, past : past + T], dim1=-2, dim2=-1).expand(B, T)
    return diag if diag.dtype == torch.bool else diag == 0  # additive float masks: 0 where allowed


def kvcache_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function over a :class:`~kvcache.hf.PagedCache`'s blocks.

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (unused beyond transformers' calling convention).
    query : torch.Tensor
        ``[B, Hq, T, D]``, the model's dtype, RoPE applied.
    key, value : torch.Tensor
        ``[B, H, T, D]``: the step's new keys / values as returned by ``PagedCache.update`` (which marks them);
        unmarked keys (another cache, or none) are attended directly with SDPA under ``attention_mask``.
    attention_mask : torch.Tensor, optional
        ``[B, 1, T, KV]`` bool (True = attend) or additive float, or None (no padding).
    dropout : float
        Must be 0 (inference).
    scaling : float, optional
        Softmax scale (default ``D ** -0.5``).

    Returns
    -------
    tuple
        ``(out, None)``: ``out`` ``[B, T, Hq, D]``, zeros at padding rows.

    Examples
    --------
    >>> q = torch.randn(1, 4, 3, 8); k = torch.randn(1, 2, 3, 8)
    >>> out, _ = kvcache_paged_attention(torch.nn.Module(), q, k, k, None)
    >>> out.shape
    torch.Size([1, 3, 4, 8])
    """
    if dropout:
        raise ValueError(f"dropout: expected 0.0 (kvcache_paged attention is for inference), got {dropout}")
    pending = getattr(key, "_kvcache_pending", None)
    if pending is None:
        Hq, H = query.shape[1], key.shape[1]
        causal = attention_mask is None and query.shape[2] > 1
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, is_causal=causal,
                                             scale=scaling, enable_gqa=Hq != H)
        return out.transpose(1, 2).contiguous(), None
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    pending.cache.check_layer(pending.layer, module, window, softcap, kwargs)  # sinks, a window the mask alone sets
    return attend(pending.cache, pending.layer, query, key, value, attention_mask, scaling, window=window,
                  softcap=softcap, sinks=sinks), None


def attend(cache: PagedCache, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: torch.Tensor | None, scaling: float | None, *, window: int | None = None,
           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Write the step's real tokens of ``layer`` into ``cache`` and attend (``window``: transformers'
    ``sliding_window``, ``softcap``: logit soft-capping, ``sinks``: ``[Hq]`` attention sinks, gpt-oss's ``s_aux``):
    ``[B, T, Hq, D]``."""
    B, Hq, T, D = query.shape
    scale = float(scaling) if scaling is not None else D**-0.5
    if cache._plan is None:
        cache._begin_step(T, _valid_tokens(attention_mask, B, cache._hf_len, T), scale=scale, window=window,
                          softcap=softcap)
    cache._write(layer, key, value)
    q = query.transpose(1, 2).reshape(B * T, Hq, D)
    rows = cache._rows
    if rows is not None:
        q = q.index_select(0, rows)
    plan = cache._attention_plan(scale, window, softcap)
    if sinks is not None:
        sinks = sinks.detach().float().contiguous()
    o = cache.paged.attention(layer, q.contiguous(), plan, sinks=sinks)  # type: ignore[union-attr]
    cache._finish_layer()
    if rows is None:
        return o.view(B, T, Hq, D)
    out = o.new_zeros((B * T, Hq, D))
    out.index_copy_(0, rows, o)
    return out.view(B, T, Hq, D)
