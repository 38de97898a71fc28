"""``paged_attention``: query rows of a ragged batch attend to their sequences' paged K / V where it lies."""

from __future__ import annotations

import torch

from ..._backend import use_triton
from ..._validate import check_cp, check_int
from . import _checks as c
from ._launch import launch_attention, num_sms
from .policy import DECODE_ROWS, AttentionPlan, attention_plan, attention_workspace_size
from .reference import paged_attention_reference

__all__ = ["paged_attention"]


def paged_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    params: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    *,
    kv_dtype: str,
    layout: str,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    max_kv_len: int | None = None,
    num_splits: int | None = None,
    workspace: torch.Tensor | None = None,
    num_decode: int = 0,
    q_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
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
        One layer's pool, ``PagedKVCache.pool(layer)``: NHD ``[num_blocks, 2, block_size, H, R]`` or HND
        ``[num_blocks, 2, H, block_size, R]`` with ``R = D`` (``D // 2`` bytes for int4); contiguous.
    params : torch.Tensor, optional
        ``PagedKVCache.params(layer)``: float32 (scale, zero) per token and head, required for int8 / int4.
    kv_scales : torch.Tensor, optional
        ``PagedKVCache.kv_scales[layer]``: float32 ``[2]`` = (k_scale, v_scale), required for fp8, ignored for the
        other formats.
    kv_dtype, layout : str
        ``"auto" | "fp8" | "int8" | "int4"`` and ``"NHD" | "HND"`` (the byte format of
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
    n, hq, d = q.shape
    dev = q.device
    nb, bs, h = c.check_pool(pool, params, kv_scales, kv_dtype, layout, q)
    c.check_gqa(hq, h)
    scale, window, softcap = c.check_options(scale, window, softcap, sinks, hq, d, dev)
    cp_rank, cp_size = check_cp(cp_rank, cp_size)
    c.check_tensor_arg("block_tables", block_tables, dtypes=(torch.int32,), ndim=2, device=dev, ref="q")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables: expected contiguous rows, got strides {tuple(block_tables.stride())}")
    b = block_tables.shape[0]
    c.check_int_vec("cu_q_lens", cu_q_lens, b + 1, dev)
    c.check_int_vec("kv_lens", kv_lens, b, dev)
    if out is None:
        out = torch.empty_like(q)
    else:
        c.check_out(out, q)
    if lse is not None:
        c.check_lse(lse, (n, hq), dev)
    cap = block_tables.shape[1] * bs * cp_size
    if max_kv_len is None:
        max_kv_len = cap
    check_int("max_kv_len", max_kv_len, 0)
    if num_splits is not None:
        check_int("num_splits", num_splits, 1, 1024)
    check_int("num_decode", num_decode, 0, b)
    q_rope = c.check_q_rope(q_rope, q)

    def plan_for(n_rows: int, n_seqs: int) -> AttentionPlan:
        return attention_plan(num_q_heads=hq, num_kv_heads=h, head_dim=d, n_tokens=n_rows, num_seqs=n_seqs,
                              max_kv_len=min(max_kv_len, cap) // cp_size, num_sms=num_sms(dev),
                              num_splits=num_splits, kv_dtype=kv_dtype, q_bytes=q.element_size())

    # (sequences, plan) per launch: a mixed batch splits into its leading decode sequences and the rest when the
    # whole batch would take prefill tiles
    plan = plan_for(n, b)
    launches = [(slice(0, b), plan)]
    if 0 < num_decode < b and n > DECODE_ROWS * b:
        launches = [(slice(0, num_decode), plan_for(num_decode, num_decode)),
                    (slice(num_decode, b), plan_for(max(n - num_decode, 0), b - num_decode))]
    need = max(attention_workspace_size(n, hq, d, p.num_splits) for _, p in launches)
    if workspace is not None:
        c.check_workspace(workspace, need, dev)
    if not use_triton(dev):
        if q_rope is not None:
            q = _rotate_rows(q, q_rope, cu_q_lens, kv_lens)
        paged_attention_reference(q, pool, params, kv_scales, kv_dtype=kv_dtype, layout=layout,
                                  block_tables=block_tables, cu_q_lens=cu_q_lens, kv_lens=kv_lens, out=out, lse=lse,
                                  scale=scale, window=window, softcap=softcap, sinks=sinks, cp_rank=cp_rank,
                                  cp_size=cp_size)
        return out
    if need and workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=dev)
    for seqs, p in launches:
        # rows are addressed by cu_q_lens' absolute offsets: each launch reads the whole q and writes only the rows
        # of its own sequences
        launch_attention(q, out, lse, pool, params, kv_scales if kv_dtype == "fp8" else None, sinks,
                         kv_dtype=kv_dtype, layout=layout, block_tables=block_tables[seqs],
                         cu_q_lens=cu_q_lens[seqs.start: seqs.stop + 1], kv_lens=kv_lens[seqs], scale=scale,
                         window=window, softcap=softcap, cp_rank=cp_rank, cp_size=cp_size, plan=p,
                         workspace=workspace, q_rope=q_rope)
    return out


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
