"""``linear_attention``: new query rows of each slot attend to the slot's cached prefix plus themselves, read
in place from a linear cache layer ``[B, 2, H, S, D]``.
"""

from __future__ import annotations

import torch

from ..._backend import use_triton
from ..._validate import check_int, fmt_shape
from . import _checks as c
from ._launch import launch_linear_attention, num_sms
from .policy import attention_plan, attention_workspace_size
from .reference import linear_attention_reference

__all__ = ["linear_attention"]

_LAYER_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float32)


def linear_attention(
    q: torch.Tensor,
    layer: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    num_splits: int | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q_len`` new rows per slot over a linear KV cache layer.

    Convention: the new tokens' K / V are already written at positions ``lengths[b] .. lengths[b] + q_len - 1``
    of slot ``b``, and ``lengths`` counts the tokens cached *before* them (``LinearKVCache.lengths`` before
    ``commit``). Row ``i`` of slot ``b`` is at position ``lengths[b] + i`` and attends to positions ``<=`` its
    own: the slot's valid prefix plus the new rows, causally. No mask tensor is built.

    Parameters
    ----------
    q : torch.Tensor
        shape ``[B, Hq, q_len, D]``, float16 / bfloat16 / float32, head_dim contiguous; ``B`` is the active
        batch (``<= layer.shape[0]``), ``Hq`` a multiple of ``H``.
    layer : torch.Tensor
        ``[B_max, 2, H, S, D]`` (``LinearKVCache.layer(i)`` / ``KVCacheManager.layer(i)``), float16 / bfloat16
        (q's dtype), float8_e4m3fn (stored bytes, scale 1 unless ``kv_scales``) or float32; head_dim contiguous.
    lengths : torch.Tensor
        int32 ``[B]``: tokens cached before the new rows. Keys past ``S`` are never read.
    scale, window, softcap, sinks
        As in :func:`kvcache.ops.paged_attention`.
    kv_scales : torch.Tensor, optional
        float32 ``[2]`` (k_scale, v_scale) for a float8 layer: K = stored * k_scale, V = stored * v_scale.
    out : torch.Tensor, optional
        ``[B, Hq, q_len, D]`` of q's dtype, head_dim contiguous: written and returned.
    lse : torch.Tensor, optional
        float32 ``[B, Hq, q_len]``: natural-log log-sum-exp of each row's scores (``-inf`` when empty).
    num_splits, workspace
        As in :func:`kvcache.ops.paged_attention` (split decode over the KV range; scratch of split launches).

    Returns
    -------
    torch.Tensor
        ``out``.

    Note
    ----
    No allocation (with ``out`` and, when splitting, ``workspace``) and no sync: capturable in a CUDA graph.

    Example
    -------
    >>> import torch, kvcache
    >>> from kvcache.ops import linear_attention
    >>> cache = kvcache.LinearKVCache(kvcache.CacheConfig(num_layers=1, max_batch_size=2, max_seq_len=32,
    ...                               num_kv_heads=2, head_dim=64, dtype=torch.float16, device="cpu"))
    >>> _ = cache.layer(0).normal_()  # stands for keys / values written by the model
    >>> q = torch.randn(2, 4, 1, 64, dtype=torch.float16)  # one decode row per slot
    >>> o = linear_attention(q, cache.layer(0), torch.tensor([7, 3], dtype=torch.int32))
    >>> o.shape
    torch.Size([2, 4, 1, 64])
    """
    q = c.check_q(q, 4, "[B, num_q_heads, q_len, head_dim]")
    bsz, hq, q_len, d = q.shape
    dev = q.device
    c.check_tensor_arg("layer", layer, dtypes=_LAYER_DTYPES, ndim=5, device=dev, ref="q")
    if layer.shape[1] != 2 or layer.shape[4] != d or layer.shape[0] < bsz or (d > 1 and layer.stride(4) != 1):
        raise ValueError(f"layer: expected [>= {bsz}, 2, H, S, {d}] with head_dim contiguous, got "
                         f"{fmt_shape(layer.shape)} strides {tuple(layer.stride())}")
    if layer.dtype != torch.float8_e4m3fn and layer.dtype != q.dtype:
        raise ValueError(f"layer: expected dtype {q.dtype} (q's) or float8_e4m3fn, got {layer.dtype}")
    h = layer.shape[2]
    c.check_gqa(hq, h)
    c.check_int_vec("lengths", lengths, bsz, dev)
    scale, window, softcap = c.check_options(scale, window, softcap, sinks, hq, d, dev)
    if kv_scales is not None and layer.dtype != torch.float8_e4m3fn:
        raise ValueError(f"kv_scales: expected None for a {layer.dtype} layer (float8 only), got a tensor")
    c.check_kv_scales(kv_scales, dev, required=False)
    if out is None:
        out = torch.empty_like(q)
    else:
        c.check_out(out, q)
    if lse is not None:
        c.check_lse(lse, (bsz, hq, q_len), dev)
    if num_splits is not None:
        check_int("num_splits", num_splits, 1, 1024)
    kv_dtype = "fp8" if layer.dtype == torch.float8_e4m3fn else "auto"
    plan = attention_plan(num_q_heads=hq, num_kv_heads=h, head_dim=d, n_tokens=bsz * q_len, num_seqs=bsz,
                          max_kv_len=layer.shape[3], num_sms=num_sms(dev), num_splits=num_splits, kv_dtype=kv_dtype,
                          q_bytes=q.element_size())
    need = attention_workspace_size(bsz * q_len, hq, d, plan.num_splits)
    if workspace is not None:
        c.check_workspace(workspace, need, dev)
    if not use_triton(dev):
        linear_attention_reference(q, layer, lengths, kv_scales, out=out, lse=lse, scale=scale, window=window,
                                   softcap=softcap, sinks=sinks)
        return out
    if need and workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=dev)
    launch_linear_attention(q, out, lse, sinks, layer, kv_scales, lengths, (scale, window, softcap), plan, workspace)
    return out
