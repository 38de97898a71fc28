"""After the attention kernel's KV loop: the sink's virtual key, and the stores of output rows."""

from __future__ import annotations

import triton
import triton.language as tl

from ._loads import LOG2E


@triton.jit
def _store_rows(ptr, rows, dd, ok_m, ok_d, val):
    tl.store(ptr + rows[:, None] + dd[None, :], val, mask=ok_m[:, None] & ok_d[None, :])


@triton.jit
def _add_sink(sinks, hq, ok_m, split, cp_rank, m_i, l_i, acc_lo, acc_hi, zacc, pvs, V_FOLD: tl.constexpr,
              V_MAGIC: tl.constexpr):
    # the sink: a virtual key of score sinks[h] and value 0, held by split 0 of CP rank 0 only
    sk = tl.load(sinks + hq, mask=ok_m, other=float("-inf")).to(tl.float32) * LOG2E
    sk = tl.where((split == 0) & (cp_rank == 0), sk, float("-inf"))
    m_new = tl.maximum(m_i, sk)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.exp2(sk - m_safe)
    if V_FOLD:
        zacc = zacc * alpha
    if V_MAGIC:
        pvs = pvs * alpha[:, None]
    return m_new, l_i, acc_lo * alpha[:, None], acc_hi * alpha[:, None], zacc, pvs
