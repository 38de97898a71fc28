"""Pure-torch float32 attention over the caches: the CPU backend of the attention ops and their definition.

Every rule the kernels follow is written here once, plainly:

* Query row ``i`` of sequence ``b`` (``q_len`` rows, ``kv_len`` tokens cached including them) has position
  ``kv_len - q_len + i`` and attends to key positions ``p`` with ``p <= pos`` and, with a sliding window ``w``,
  ``p > pos - w``: exactly ``w`` keys including itself (transformers' ``sliding_window``, Mistral; FlashAttention
  ``window_size=(w - 1, 0)``).
* Score ``s = scale * q . k``; soft-capping ``s = softcap * tanh(s / softcap)`` (Gemma 2) before masking.
* Sinks (gpt-oss): one logit per q head that joins the softmax denominator with a zero value vector, i.e. a
  virtual key of score ``sinks[h]`` and value 0. With context parallelism only rank 0 holds it, so merging the
  ranks' partial results by log-sum-exp counts it once.
* Context parallelism: this rank holds global token ``t`` iff ``t % cp_size == cp_rank``, at local index
  ``t // cp_size``; positions and causality are global.
* ``lse`` is the natural-log log-sum-exp of the row's scores (sink included); a row with nothing to attend to
  gives zeros and ``lse = -inf``.
"""

from __future__ import annotations

import math

import torch

from ..paged.block_keys import read_sequence
from ..paged.format import stored_planes, unpack_codes

__all__ = ["dequantize_rows", "attend_rows", "paged_attention_reference", "linear_attention_reference",
           "merge_attention_states_reference"]


def dequantize_rows(
    pool: torch.Tensor,
    params: torch.Tensor | None,
    kv_scales: torch.Tensor | None,
    kv_dtype: str,
    layout: str,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    which: int,
) -> torch.Tensor:
    """float32 ``[n, H, D]`` K (``which=0``) or V (``which=1``) rows at (block, offset) pairs of a paged pool."""
    # params plane of these rows: (scale, zero) of K / V; fp8k: the keys' scales alone (plane 0)
    pp = 0 if kv_dtype == "fp8k" else which
    if layout == "NHD":
        raw = pool[blocks, which, offsets]  # [n, H, R]
        par = params[blocks, pp, offsets] if params is not None else None
    else:
        raw = pool[blocks, which, :, offsets]  # [n, H, R]
        par = params[blocks, pp, :, offsets] if params is not None else None
    if kv_dtype == "auto":
        return raw.float()
    if kv_dtype == "fp8k" and which == 0:
        return raw.float() * par  # type: ignore[operator]
    if kv_dtype in ("fp8", "fp8k"):
        scale = kv_scales[which].float() if kv_scales is not None else torch.ones((), device=pool.device)
        return raw.float() * scale
    planes = [pool[blocks, p, offsets] if layout == "NHD" else pool[blocks, p, :, offsets]
              for p in stored_planes(kv_dtype, which)]
    codes = unpack_codes(kv_dtype, which, planes)
    return codes.float() * par[..., 0:1] + par[..., 1:2]


def attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention of one sequence in float32.

    q ``[n_q, Hq, D]``, k / v ``[n_k, H, D]`` (float32), q_pos ``[n_q]``, k_pos ``[n_k]`` (global positions);
    sinks float32 ``[Hq]`` or None. Returns out ``[n_q, Hq, D]`` and lse ``[n_q, Hq]`` (float32).
    """
    n_q, hq, d = q.shape
    g = hq // k.shape[1]
    kk = k.repeat_interleave(g, dim=1)  # [n_k, Hq, D]
    vv = v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~allowed[None], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float()[:, None, None].expand(hq, n_q, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)  # [Hq, n_q]
    finite = torch.isfinite(lse) | torch.isnan(lse)
    p = torch.exp(s - torch.where(finite, lse, torch.zeros_like(lse))[..., None])
    if sinks is not None:
        p = p[..., :-1]
    out = torch.einsum("hqk,khd->qhd", p, vv)
    return out, lse.transpose(0, 1).contiguous()


def paged_attention_reference(
    q: torch.Tensor,
    pool: torch.Tensor,
    params: torch.Tensor | None,
    kv_scales: torch.Tensor | None,
    *,
    kv_dtype: str,
    layout: str,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    cp_rank: int,
    cp_size: int,
) -> None:
    """:func:`kvcache.ops.paged_attention` in float32 torch (writes ``out`` / ``lse`` rows of real tokens).

    Reads the lengths on the host: for the CPU backend and tests only.
    """
    bs = pool.shape[2] if layout == "NHD" else pool.shape[3]
    nb = pool.shape[0]
    cu = cu_q_lens.tolist()
    lens = kv_lens.tolist()
    table = block_tables.long()
    n_rows = q.shape[0]
    for b in range(block_tables.shape[0]):
        q0, q1 = max(0, min(cu[b], n_rows)), max(0, min(cu[b + 1], n_rows))
        if q1 <= q0:
            continue
        q_len, kv_len = cu[b + 1] - cu[b], lens[b]
        n_local = max(0, -(-(kv_len - cp_rank) // cp_size))
        n_local = min(n_local, table.shape[1] * bs)
        j = torch.arange(n_local, device=pool.device)
        if kv_dtype == "int4b":  # a block's key form follows from the sequence's length
            k, v, keep = read_sequence(pool, params, layout, table[b].tolist(), n_local)
            j, k, v = j[keep], k[keep], v[keep]
        else:
            blocks = table[b, j // bs] if n_local else j
            keep = (blocks >= 0) & (blocks < nb)  # out-of-range block ids are not read (the kernels skip them)
            j, blocks = j[keep], blocks[keep]
            k = dequantize_rows(pool, params, kv_scales, kv_dtype, layout, blocks, j % bs, 0)
            v = dequantize_rows(pool, params, kv_scales, kv_dtype, layout, blocks, j % bs, 1)
        q_pos = kv_len - q_len + torch.arange(q0 - cu[b], q1 - cu[b], device=pool.device)
        o, l_ = attend_rows(q[q0:q1], k, v, q_pos, j * cp_size + cp_rank, scale=scale, window=window,
                            softcap=softcap, sinks=sinks if cp_rank == 0 else None)
        out[q0:q1] = o.to(out.dtype)
        if lse is not None:
            lse[q0:q1] = l_


def linear_attention_reference(
    q: torch.Tensor,
    layer: torch.Tensor,
    lengths: torch.Tensor,
    kv_scales: torch.Tensor | None,
    *,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> None:
    """:func:`kvcache.ops.linear_attention` in float32 torch (reads the lengths on the host)."""
    bsz, _, q_len, _ = q.shape
    cap = layer.shape[3]
    for b, n0 in enumerate(lengths.tolist()):
        kv_len = n0 + q_len
        n = max(0, min(kv_len, cap))
        k = layer[b, 0, :, :n].float().transpose(0, 1)  # [n, H, D]
        v = layer[b, 1, :, :n].float().transpose(0, 1)
        if kv_scales is not None:
            k, v = k * kv_scales[0].float(), v * kv_scales[1].float()
        q_pos = kv_len - q_len + torch.arange(q_len, device=q.device)
        o, l_ = attend_rows(q[b].transpose(0, 1), k, v, q_pos, torch.arange(n, device=q.device), scale=scale,
                            window=window, softcap=softcap, sinks=sinks)
        out[b] = o.transpose(0, 1).to(out.dtype)
        if lse is not None:
            lse[b] = l_.transpose(0, 1)


def merge_attention_states_reference(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """:func:`kvcache.ops.merge_attention_states` in float32 torch (``out`` may alias ``out_a`` / ``out_b``)."""
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m_safe), torch.exp(lb - m_safe)
    tot = wa + wb
    denom = torch.where(tot > 0, tot, torch.ones_like(tot))
    oa = torch.where(wa[..., None] > 0, out_a.float(), torch.zeros((), device=out_a.device))
    ob = torch.where(wb[..., None] > 0, out_b.float(), torch.zeros((), device=out_b.device))
    o = (oa * wa[..., None] + ob * wb[..., None]) / denom[..., None]
    new_lse = torch.where(tot > 0, m_safe + torch.log(denom), torch.full_like(m, -math.inf))
    out.copy_(o.to(out.dtype))
    lse.copy_(new_lse)
