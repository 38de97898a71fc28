"""``paged_attention``: query rows of a ragged batch attend to their sequences' paged K / V where it lies."""

from __future__ import annotations

import dataclasses
import math

import torch

from ..._backend import use_triton
from ..paged.format import kv_format
from ..paged.layer import PagedLayer
from ..paged.step import StepPlan
from . import _checks as c
from ._launch import AttentionPart, launch_paged_attention, num_sms
from .policy import DECODE_ROWS, AttentionPlan, attention_plan, attention_workspace_size
from .reference import paged_attention_reference

__all__ = ["paged_attention", "attend"]


def paged_attention(
    q: torch.Tensor, pool: torch.Tensor, params: torch.Tensor | None = None, kv_scales: torch.Tensor | None = None,
    *, kv_dtype: str, layout: str,  # the pool's format
    block_tables: torch.Tensor, cu_q_lens: torch.Tensor, kv_lens: torch.Tensor,  # the ragged batch
    scale: float | None = None, window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
    cp_rank: int = 0, cp_size: int = 1, max_kv_len: int | None = None, num_splits: int | None = None,
    workspace: torch.Tensor | None = None, num_decode: int = 0, q_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of a ragged batch's new query rows over one layer of a paged KV cache.

    Reads K / V blocks in place and dequantizes them in registers (every ``kv_dtype`` and layout of
    :class:`kvcache.PagedKVCache`); no gather. Decode rows (1 token) and prefill / extend chunks mix freely.
    Append the step's K / V first (``kv_lens`` counts them).

    Parameters
    ----------
    q : torch.Tensor
        shape ``[n_tokens, Hq, D]``, float16 / bfloat16 / float32 (the pool's dtype for ``kv_dtype="auto"``),
        head_dim contiguous. ``Hq`` any multiple of the pool's ``H`` (GQA / MQA).
    pool : torch.Tensor
        One layer's pool, ``PagedKVCache.pool(layer)``: NHD ``[num_blocks, P, block_size, H, R]`` or HND
        ``[num_blocks, P, H, block_size, R]`` with ``P = 2`` planes (K, V) and ``R = D`` (``D // 2`` bytes for
        int4), or for k8v4 ``P = 3`` planes of ``R = D // 2`` bytes; contiguous.
    params : torch.Tensor, optional
        ``PagedKVCache.params(layer)``: float32 (scale, zero) per token and head, ``[num_blocks, 2, ...]``,
        required for int8 / int4 / k8v4; fp8k: the keys' float32 scale per token and head, ``[num_blocks, 1, ...,
        1]``; int4b: one plane of ``2 + ceil(D / block_size)`` words per (token slot, head).
    kv_scales : torch.Tensor, optional
        ``PagedKVCache.kv_scales[layer]``: float32 ``[2]`` = (k_scale, v_scale), required for fp8 and fp8k (which
        uses v_scale alone), ignored for the other formats.
    kv_dtype, layout : str
        ``"auto" | "fp8" | "int8" | "int4" | "k8v4" | "fp8k" | "int4b"`` and ``"NHD" | "HND"`` (the byte format of
        :mod:`kvcache.paged.config`).
    block_tables : torch.Tensor
        int32 ``[B, max_blocks]``: each sequence's blocks in order (this rank's local blocks under context
        parallelism).
    cu_q_lens : torch.Tensor
        int32 ``[B + 1]``, ``cu_q_lens[0] == 0``: rows ``cu_q_lens[b] .. cu_q_lens[b + 1]`` of ``q`` belong to
        sequence ``b``. Rows past ``cu_q_lens[B]`` are padding: their ``out`` / ``lse`` rows are not written.
    kv_lens : torch.Tensor
        int32 ``[B]``: tokens of sequence ``b`` including the ones just appended (global length under context
        parallelism). Query row ``i`` of ``b`` is at position ``kv_lens[b] - q_len_b + i`` and attends to every
        key position ``<=`` its own.
    scale : float, optional
        Score scale; default ``1 / sqrt(D)``.
    window : int, optional
        Sliding window: a row at position ``p`` attends to positions ``p - window + 1 .. p`` (``window`` keys,
        itself included: transformers' ``sliding_window``, FlashAttention ``window_size=(window - 1, 0)``).
    softcap : float, optional
        Scores become ``softcap * tanh(score / softcap)`` (after ``scale``, before masking).
    sinks : torch.Tensor, optional
        float32 ``[Hq]``: per-head sink logits (gpt-oss): they join each row's softmax denominator as a key of
        value zero. Under context parallelism rank 0 alone adds them, so the ranks' results merge exactly.
    out : torch.Tensor, optional
        ``[n_tokens, Hq, D]`` of q's dtype (head_dim contiguous): written in place and returned.
    lse : torch.Tensor, optional
        float32 ``[n_tokens, Hq]``: filled with each row's natural-log log-sum-exp of scores (sink included);
        ``-inf`` for a row with nothing to attend to (its output row is zeros).
    cp_rank, cp_size : int
        Context parallelism: this rank holds global token ``t`` iff ``t % cp_size == cp_rank``, at local index
        ``t // cp_size``. Returns this rank's partial result: combine ranks with
        :func:`merge_attention_states` on (out, lse).
    max_kv_len : int, optional
        Host-side bound of any ``kv_lens`` entry, for the launch plan (default: the block table's capacity,
        ``max_blocks * block_size * cp_size``). Never read from the device.
    num_splits : int, optional
        Programs per (query tile, KV head) sharing its KV range (flash-decoding). Default: chosen from the
        shapes by :func:`kvcache.ops.attention.attention_plan` (split for few long sequences).
    workspace : torch.Tensor, optional
        float32, at least :func:`~kvcache.ops.attention.attention_workspace_size` ``(n_tokens, Hq, D,
        num_splits)`` elements: scratch of split launches. Allocated here when needed and not given.
    num_decode : int
        Host hint for mixed batches: sequences ``0 .. num_decode - 1`` are decode rows (one query token each).
        With ``0 < num_decode < B`` the batch runs as two launches, those sequences with decode tiles (16 rows:
        one token's GQA group) and the rest with prefill tiles, instead of one launch whose tiles suit the whole
        batch (a mixed batch of many decode rows and a prefill chunk would give every decode row a 64-128-row
        prefill tile). Results do not depend on it: any value is correct for any batch (the tiles handle any
        number of rows per sequence), it only chooses tiles. Default 0: one launch. A mixed step of 63 decode
        rows followed by one 512-token chunk: ``num_decode=63``.
    q_rope : (torch.Tensor, torch.Tensor), optional
        ``(cos, sin)`` tables ``[max_pos, D]`` of q's dtype, contiguous, each row the cos / sin of its position's
        ``D / 2`` frequencies written twice (transformers' ``rotary_emb`` output for positions ``0 .. max_pos - 1``):
        ``q`` is given un-rotated and each row is rotated (rotate-half over the whole head_dim, in float32, rounded
        once to q's dtype) at its position ``kv_lens[b] - q_len_b + i`` inside the kernel, instead of by a separate
        RoPE pass. A row whose position is outside the tables is rotated to zero. ``q`` itself is not changed.

    Returns
    -------
    torch.Tensor
        ``out``: ``[n_tokens, Hq, D]``, q's dtype.

    Note
    ----
    With ``out`` given and, for split launches, ``workspace`` given, the call allocates nothing and never
    syncs: it is capturable in a CUDA graph, and its grid depends on ``q.shape``, ``block_tables.shape`` and the
    plan only (fix ``num_splits`` / ``max_kv_len`` at capture). Block ids outside the pool and lengths past the
    block table are skipped, never read.

    Example
    -------
    >>> import torch, kvcache
    >>> from kvcache.ops import paged_attention
    >>> cache = kvcache.PagedKVCache(kvcache.PagedConfig(num_layers=1, num_kv_heads=2, head_dim=64,
    ...                              block_size=16, num_blocks=8, dtype=torch.float32, device="cpu"))
    >>> k = v = torch.randn(5, 2, 64)
    >>> bt = torch.tensor([[0, 1]], dtype=torch.int32)
    >>> cu = torch.tensor([0, 5], dtype=torch.int32)
    >>> cache.append(0, k, v, cache.plan(bt, cu, torch.zeros(1, dtype=torch.int32)))
    >>> o = paged_attention(torch.randn(5, 4, 64), cache.pool(0), kv_dtype="auto", layout="NHD",
    ...                     block_tables=bt, cu_q_lens=cu, kv_lens=torch.tensor([5], dtype=torch.int32))
    >>> o.shape
    torch.Size([5, 4, 64])
    """
    q = c.check_q(q, 3, "[n_tokens, num_q_heads, head_dim]")
    c.check_pool(pool, params, kv_scales, kv_dtype, layout, q)
    layer = PagedLayer(pool, params, kv_scales if kv_format(kv_dtype).per_layer_scale else None, kv_dtype, layout)
    index = dict(block_tables=block_tables, cu_q_lens=cu_q_lens, seq_lens=kv_lens, cp_rank=cp_rank, cp_size=cp_size)
    options = dict(scale=scale, window=window, softcap=softcap, q_rope=q_rope, max_kv_len=max_kv_len,
                   num_decode=num_decode, num_splits=num_splits, workspace=workspace)
    plan = StepPlan.build(layer.geometry, q.device, index, options, lens_name="kv_lens", q_dtype=q.dtype)
    return attend(q, layer, plan, sinks, out, lse)


@dataclasses.dataclass(slots=True)
class _AttentionMemo:
    """A plan's attention for queries of one kind (rows, heads, dtype): its launches and the workspace elements
    they need."""

    key: tuple
    parts: list[AttentionPart]
    need: int


def attend(q: torch.Tensor, layer: PagedLayer, plan: StepPlan, sinks: torch.Tensor | None, out: torch.Tensor | None,
           lse: torch.Tensor | None) -> torch.Tensor:
    """Attention of ``q`` ``[n_tokens, Hq, D]`` over ``layer`` as ``plan`` describes the step (built for the
    layer's geometry: the caller checks): the one path of :meth:`kvcache.PagedKVCache.attention` and
    :func:`paged_attention`. Per call only q, sinks, out and lse are checked; the launches (tiles, splits,
    workspace) are derived by the first call for queries of this kind and reused by the others."""
    plan.require("attention", ragged=True, rows=True)
    _check_q(q, layer)
    n, hq, _ = q.shape
    dev = q.device
    if sinks is not None:
        c.check_sinks(sinks, hq, dev)
    if out is None:
        out = torch.empty_like(q)
    elif not (type(out) is torch.Tensor and out.shape == q.shape and out.dtype is q.dtype and out.stride(2) == 1
              and out.device == dev):
        c.check_out(out, q)
    if lse is not None:
        c.check_lse(lse, (n, hq), dev)
    memo = plan.attention_memo
    if memo is None or memo.key != (n, hq, q.dtype):
        memo = plan.attention_memo = _plan_attention(q, layer, plan)
    if layer.kv_dtype == "int4b" and plan.cp_size > 1:
        raise ValueError(f"kv_dtype='int4b': context parallelism is not supported (cp_size={plan.cp_size})")
    if not use_triton(dev):
        seq_lens = plan.seq_lens
        if plan.q_rope is not None:
            q = _rotate_rows(q, plan.q_rope, plan.cu_q_lens, seq_lens)  # type: ignore[arg-type]
        paged_attention_reference(q, layer.pool, layer.params, layer.scales, kv_dtype=layer.kv_dtype,
                                  layout=layer.layout, block_tables=plan.block_tables, cu_q_lens=plan.cu_q_lens,
                                  kv_lens=seq_lens, out=out, lse=lse, scale=memo.parts[0].scale, window=plan.window,
                                  softcap=plan.softcap, sinks=sinks, cp_rank=plan.cp_rank, cp_size=plan.cp_size)
        return out
    workspace = plan.workspace
    if memo.need and workspace is None:
        # per call, as the caller's own buffer would be: a captured graph owns what it allocates
        workspace = torch.empty(memo.need, dtype=torch.float32, device=dev)
    for part in memo.parts:
        # rows are addressed by cu_q_lens' absolute offsets: each launch reads the whole q and writes only the rows
        # of its own sequences
        launch_paged_attention(q, out, lse, sinks, layer, plan, part, workspace)
    return out


def _check_q(q: object, layer: PagedLayer) -> None:
    """q ``[n_tokens, Hq, D]`` for ``layer``: its head_dim, a multiple of its KV heads, the pool's dtype for
    ``kv_dtype="auto"`` (any of float16 / bfloat16 / float32 for the quantized formats), its device. A few int
    compares when q has the layer's model dtype; the detailed checks otherwise."""
    if type(q) is torch.Tensor:
        sh = q.shape
        _, _, h, d, kv_dtype, _ = layer.geometry
        if (len(sh) == 3 and sh[2] == d and sh[1] % h == 0 and q.dtype is layer.dtype and q.stride(2) == 1
                and q.get_device() == layer.dev_id and (q.is_cuda if layer.dev_id >= 0 else q.is_cpu)):
            return
    q = c.check_q(q, 3, "[n_tokens, num_q_heads, head_dim]")
    c.check_pool(layer.pool, layer.params, layer.scales, layer.kv_dtype, layer.layout, q)
    c.check_gqa(q.shape[1], layer.geometry[2])


def _plan_attention(q: torch.Tensor, layer: PagedLayer, plan: StepPlan) -> _AttentionMemo:
    """The launches of ``plan``'s attention for queries like ``q``: one, or, for a mixed batch whose tiles would
    suit neither half, one over its leading decode sequences and one over the rest."""
    n, hq, d = q.shape
    dev = q.device
    b = plan.num_seqs
    q_rope = plan.q_rope
    if q_rope is not None and q_rope[0].dtype != q.dtype:
        raise ValueError(f"q_rope cos: expected dtype {q.dtype} (q's), got {q_rope[0].dtype}")
    bt, cu, lens = plan.block_tables, plan.cu_q_lens, plan.seq_lens
    cap = bt.shape[1] * layer.geometry[1] * plan.cp_size  # type: ignore[union-attr]
    max_kv_len = cap if plan.max_kv_len is None else plan.max_kv_len
    scale = plan.scale if plan.scale is not None else 1.0 / math.sqrt(d)

    def plan_for(n_rows: int, n_seqs: int) -> AttentionPlan:
        return attention_plan(num_q_heads=hq, num_kv_heads=layer.geometry[2], head_dim=d, n_tokens=n_rows,
                              num_seqs=n_seqs, max_kv_len=min(max_kv_len, cap) // plan.cp_size, num_sms=num_sms(dev),
                              num_splits=plan.num_splits, kv_dtype=layer.kv_dtype, q_bytes=q.element_size())

    nd = plan.num_decode
    if 0 < nd < b and n > DECODE_ROWS * b:
        parts = [AttentionPart(bt[:nd], cu[: nd + 1], lens[:nd], plan_for(nd, nd), scale),  # type: ignore[index]
                 AttentionPart(bt[nd:], cu[nd:], lens[nd:], plan_for(max(n - nd, 0), b - nd), scale)]  # type: ignore[index]
    else:
        parts = [AttentionPart(bt, cu, lens, plan_for(n, b), scale)]  # type: ignore[arg-type]
    need = max(attention_workspace_size(n, hq, d, p.plan.num_splits) for p in parts)
    if plan.workspace is not None:
        c.check_workspace(plan.workspace, need, dev)
    return _AttentionMemo((n, hq, q.dtype), parts, need)


def _rotate_rows(q: torch.Tensor, q_rope: tuple[torch.Tensor, torch.Tensor], cu_q_lens: torch.Tensor,
                 kv_lens: torch.Tensor) -> torch.Tensor:
    """``q`` rotated at each row's position (the kernel's ``Q_ROPE``, in torch); rows past ``cu_q_lens[-1]`` kept."""
    cos, sin = q_rope
    n, half = q.shape[0], q.shape[-1] // 2
    if kv_lens.numel() == 0:
        return q
    cu = cu_q_lens.long()
    rows = torch.arange(n, device=q.device)
    seq = (torch.searchsorted(cu, rows, right=True) - 1).clamp(0, max(kv_lens.shape[0] - 1, 0))
    pos = kv_lens.long()[seq] - (cu[seq + 1] - cu[seq]) + (rows - cu[seq])
    ok = (pos >= 0) & (pos < cos.shape[0]) & (rows < cu[-1])
    p = pos.clamp(0, cos.shape[0] - 1)
    c = torch.where(ok[:, None], cos[p, :half].float(), 0.0)[:, None, :]
    s = torch.where(ok[:, None], sin[p, :half].float(), 0.0)[:, None, :]
    a, b = q[..., :half].float(), q[..., half:].float()
    out = torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(q.dtype)
    return torch.where((rows < cu[-1])[:, None, None], out, q)
