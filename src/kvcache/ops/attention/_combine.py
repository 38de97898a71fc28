"""Log-sum-exp merges of partial attention results: the split-KV combine of one launch (``_combine_kernel``) and
the merge of two states (``_merge_kernel``, behind :func:`kvcache.ops.merge_attention_states`)."""

from __future__ import annotations

import triton.language as tl

from ..._backend import kernel
from ._loads import LN2, LOG2E


@kernel(ints=("s_ot", "s_oh", "s_ob", "s_lt", "s_lh", "s_lb", "n_rows", "q_len_u", "n_seqs", "num_splits"))
def _combine_kernel(
    ws_out, ws_lse, out, lse, cu_q, s_ot, s_oh, s_ob, s_lt, s_lh, s_lb, n_rows, q_len_u, n_seqs, num_splits,
    D: tl.constexpr, D_P: tl.constexpr, HQ: tl.constexpr, SPLITS_P: tl.constexpr,
    LINEAR: tl.constexpr, HAS_LSE: tl.constexpr,
):
    """Merge the splits of one (row, q head) by log-sum-exp into ``out`` (and ``lse``)."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    if LINEAR:
        b = row // q_len_u
        i = row - b * q_len_u
    else:
        if (row < tl.load(cu_q)) | (row >= tl.load(cu_q + n_seqs)):
            return  # rows of other launches' sequences, and padding rows past the batch's last token: untouched
        b = row * 0
        i = row
    ss = tl.arange(0, SPLITS_P)
    dd = tl.arange(0, D_P)
    ok_s = ss < num_splits
    w = (ss.to(tl.int64) * n_rows + row) * HQ + h
    ls = tl.load(ws_lse + w, mask=ok_s, other=float("-inf"))
    m = tl.max(ls, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wt = tl.exp2((ls - m_safe) * LOG2E)
    tot = tl.sum(wt, 0)
    parts = tl.load(ws_out + w[:, None] * D + dd[None, :], mask=ok_s[:, None] & (dd[None, :] < D), other=0.0)
    parts = tl.where(wt[:, None] > 0, parts, 0.0)
    o = tl.sum(parts * wt[:, None], 0) / tl.where(tot > 0, tot, 1.0)
    o_row = b.to(tl.int64) * s_ob + i.to(tl.int64) * s_ot + h * s_oh
    tl.store(out + o_row + dd, o.to(out.dtype.element_ty), mask=dd < D)
    if HAS_LSE:
        tl.store(lse + b.to(tl.int64) * s_lb + i.to(tl.int64) * s_lt + h * s_lh,
                 tl.where(tot > 0, m_safe + tl.log2(tl.where(tot > 0, tot, 1.0)) * LN2, float("-inf")))


@kernel(ints=("n_rows",))
def _merge_kernel(
    out_a, lse_a, out_b, lse_b, out, lse, n_rows,
    D: tl.constexpr, D_P: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Log-sum-exp merge of two partial results, ``BLOCK_R`` rows of ``D`` per program (contiguous rows)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    dd = tl.arange(0, D_P)
    ok_r = rows < n_rows
    ok = ok_r[:, None] & (dd[None, :] < D)
    la = tl.load(lse_a + rows, mask=ok_r, other=float("-inf"))
    lb = tl.load(lse_b + rows, mask=ok_r, other=float("-inf"))
    m = tl.maximum(la, lb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp2((la - m_safe) * LOG2E)
    wb = tl.exp2((lb - m_safe) * LOG2E)
    tot = wa + wb
    has = tot > 0
    oa = tl.load(out_a + rows[:, None] * D + dd[None, :], mask=ok, other=0.0).to(tl.float32)
    ob = tl.load(out_b + rows[:, None] * D + dd[None, :], mask=ok, other=0.0).to(tl.float32)
    oa = tl.where(wa[:, None] > 0, oa, 0.0)
    ob = tl.where(wb[:, None] > 0, ob, 0.0)
    o = (oa * wa[:, None] + ob * wb[:, None]) / tl.where(has, tot, 1.0)[:, None]
    tl.store(out + rows[:, None] * D + dd[None, :], o.to(out.dtype.element_ty), mask=ok)
    tl.store(lse + rows, tl.where(has, m_safe + tl.log2(tl.where(has, tot, 1.0)) * LN2, float("-inf")),
             mask=ok_r)
