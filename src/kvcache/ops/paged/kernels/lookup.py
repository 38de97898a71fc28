"""Where a row goes: its sequence (first guess, search), block and offset; the speculative lookup and its check."""

from __future__ import annotations

import triton
import triton.language as tl

from .codes import BY_KV_LENS, BY_SLOTS
from .rope import _rope_cs


@triton.jit
def _seq_rows(b, cu_q, k_lens, MODE: tl.constexpr, CM: tl.constexpr):
    # (cu_q[b], cu_q[b + 1], tokens sequence b held before the append: kv_lens[b], or its cu_k_lens length
    # minus its new rows); CM: the loads' cache modifier (".cg": from L2, past any line this SM's L1 holds)
    q0 = tl.load(cu_q + b, cache_modifier=CM)
    q1 = tl.load(cu_q + b + 1, cache_modifier=CM)
    if MODE == BY_KV_LENS:
        start = tl.load(k_lens + b, cache_modifier=CM)
    else:
        start = (tl.load(k_lens + b + 1, cache_modifier=CM) - tl.load(k_lens + b, cache_modifier=CM)) - (q1 - q0)
    return q0, q1, start


@triton.jit
def _find_seq(n, cu_q, k_lens, n_seqs, MODE: tl.constexpr, SEARCH: tl.constexpr, LOG_B: tl.constexpr,
              CM: tl.constexpr):
    # (b, cu_q[b], cu_q[b + 1], tokens cached before the append) of the sequence that owns row n, the largest
    # b with cu_q[b] <= n. One vector load of SEARCH entries, or a binary search when SEARCH == 0.
    if SEARCH > 0:
        ib = tl.arange(0, SEARCH)
        ends = tl.load(cu_q + 1 + ib, mask=ib < n_seqs, other=2147483647, cache_modifier=CM)  # cu_q[1 .. B]
        b = tl.sum((ends <= n).to(tl.int32), axis=0)  # sequences that end at or before row n
        q0 = tl.max(tl.where(ends <= n, ends, 0), axis=0)  # cu_q[b]
        q1 = tl.min(tl.where(ends > n, ends, 2147483647), axis=0)  # cu_q[b + 1]
        if MODE == BY_KV_LENS:
            kvl = tl.load(k_lens + ib, mask=ib < n_seqs, other=0, cache_modifier=CM)
            start = tl.sum(tl.where(ib == b, kvl, 0), axis=0)
        else:
            cks = tl.load(k_lens + 1 + ib, mask=ib < n_seqs, other=0, cache_modifier=CM)
            ck0 = tl.load(k_lens + ib, mask=ib < n_seqs, other=0, cache_modifier=CM)
            start = tl.sum(tl.where(ib == b, cks - ck0, 0), axis=0) - (q1 - q0)
    else:
        lo = n * 0
        hi = lo + n_seqs
        for _ in tl.static_range(LOG_B):
            mid = (lo + hi) // 2
            go = tl.load(cu_q + mid, cache_modifier=CM) <= n
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        b = lo
        q0, q1, start = _seq_rows(b, cu_q, k_lens, MODE, CM)
    return b.to(tl.int64), q0, q1, start


@triton.jit(noinline=True)
def _find_seq_call(n, cu_q, k_lens, n_seqs, MODE: tl.constexpr, SEARCH: tl.constexpr, LOG_B: tl.constexpr,
                   CM: tl.constexpr):
    # _find_seq as a call (see _row_target's CALL). It is taken only where the guess misses, and keeps the search's
    # code and registers out of the hot path: faster for per-row launches and for split launches of raw rows,
    # which are the ones that call it (numbers in docs/tuning-history.md).
    return _find_seq(n, cu_q, k_lens, n_seqs, MODE, SEARCH, LOG_B, CM)


_GUESS_BITS = 30
_GUESS_SHIFT = tl.constexpr(_GUESS_BITS)
_GUESS_ONE = 1 << _GUESS_BITS  # _guess_mul(n, n): one row per sequence


def _guess_mul(n_seqs: int, n_rows: int) -> int:
    """The append kernel's ``guess_mul``: ceil(n_seqs * 2**30 / n_rows), at most 2**30 (an int32 argument).

    The kernel's first guess of row n's sequence, ``(n * guess_mul) >> 30``, is floor(n * n_seqs / n_rows) +
    floor(frac + n * d / 2**30) with ``d`` the ceiling's excess (< 1): exact for decode batches (n_seqs ==
    n_rows: guess_mul = 2**30, the guess is n) and for prefills of L rows each until n reaches 2**30 / L. A
    multiply and a shift where a 64-bit division took about 25 dependent instructions ahead of the first index
    loads. The guess is checked in the kernel; a wrong one costs a search, never a wrong row."""
    if n_rows <= 0:
        return 0
    return min(((n_seqs << _GUESS_BITS) + n_rows - 1) // n_rows, 1 << _GUESS_BITS)


@triton.jit
def _guess(n, guess_mul, n_seqs):
    # row n's first guess of its sequence: floor(n * n_seqs / n_rows) by a multiply and a shift (see _guess_mul)
    return tl.minimum((n.to(tl.int64) * guess_mul) >> _GUESS_SHIFT, n_seqs - 1)


@triton.jit
def _local_pos(pos, valid, CP_RANK: tl.constexpr, CP_SIZE: tl.constexpr):
    # context parallelism: (valid and token `pos` on this rank, its local position pos // CP_SIZE)
    if CP_SIZE > 1:
        return valid & ((pos % CP_SIZE) == CP_RANK), pos // CP_SIZE
    return valid, pos


@triton.jit
def _row_target(
    n, block_tables, cu_q, k_lens, slots, positions, bt_stride, table_width, n_seqs, guess_mul,
    MODE: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    CP_RANK: tl.constexpr, CP_SIZE: tl.constexpr, SEARCH: tl.constexpr, LOG_B: tl.constexpr, CALL: tl.constexpr,
    CM: tl.constexpr,
):
    # where row n goes: (valid, block id, offset in the block, global position); CALL: a guess that misses calls
    # the search (_find_seq_call) rather than inlining it; CM: the index loads' cache modifier (see _seq_rows)
    pos = n.to(tl.int64) * 0
    if MODE == BY_SLOTS:
        slot = tl.load(slots + n, cache_modifier=CM).to(tl.int64)
        valid = slot >= 0
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        if ROPE:
            pos = tl.load(positions + n, cache_modifier=CM).to(tl.int64)
    else:
        # first guess: rows spread evenly over the sequences, floor(n * n_seqs / n_rows) by a multiply and a shift
        # (see _guess_mul; exact for decode batches and equal-length prefills), checked with two loads;
        # otherwise search
        g = _guess(n, guess_mul, n_seqs)
        c0, c1, s0 = _seq_rows(g, cu_q, k_lens, MODE, CM)
        if (c0 <= n) & (n < c1):
            b = g
            q0 = c0
            q1 = c1
            start = s0
        else:
            if CALL:
                b, q0, q1, start = _find_seq_call(n, cu_q, k_lens, n_seqs, MODE, SEARCH, LOG_B, CM)
            else:
                b, q0, q1, start = _find_seq(n, cu_q, k_lens, n_seqs, MODE, SEARCH, LOG_B, CM)
        pos = (start + (n - q0)).to(tl.int64)
        valid, lpos = _local_pos(pos, (b < n_seqs) & (n < q1) & (pos >= 0), CP_RANK, CP_SIZE)
        bi = lpos // BLOCK_SIZE
        valid = valid & (bi < table_width)
        blk = tl.load(block_tables + b * bt_stride + bi, mask=valid, other=-1, cache_modifier=CM).to(tl.int64)
        off = lpos % BLOCK_SIZE
    valid = valid & (blk >= 0) & (blk < NUM_BLOCKS)
    return valid, blk, off, pos



@triton.jit
def _lookup(
    n, block_tables, cu_q, k_lens, slots, positions, bt_stride, table_width, n_seqs, guess_mul, freqs,
    MODE: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_BLOCKS: tl.constexpr, CP_RANK: tl.constexpr,
    CP_SIZE: tl.constexpr, SEARCH: tl.constexpr, LOG_B: tl.constexpr, CALL: tl.constexpr, CS_GIVEN: tl.constexpr,
    FMAX: tl.constexpr, ATTN_SCALE: tl.constexpr, LIBDEVICE: tl.constexpr, CM: tl.constexpr,
):
    # _row_target of row n, and with CS_GIVEN RoPE's cos / sin at its position (_rope_cs; else placeholders):
    # (valid, block id, offset, position, cos, sin). Reads only index tensors and freqs: with INDEX_FIRST it
    # runs before the wait for the previous kernel; a speculative launch's slow path runs it after the wait
    # (CM ".cg")
    valid, blk, off, pos = _row_target(n, block_tables, cu_q, k_lens, slots, positions, bt_stride, table_width, n_seqs,
                                   guess_mul, MODE, ROPE, BLOCK_SIZE, NUM_BLOCKS, CP_RANK, CP_SIZE, SEARCH, LOG_B, CALL,
                                   CM)
    cs_c, cs_s = _lookup_cs(pos, freqs, CS_GIVEN, FMAX, ATTN_SCALE, LIBDEVICE)
    return valid, blk, off, pos, cs_c, cs_s


@triton.jit
def _lookup_cs(pos, freqs, CS_GIVEN: tl.constexpr, FMAX: tl.constexpr, ATTN_SCALE: tl.constexpr,
               LIBDEVICE: tl.constexpr):
    # with CS_GIVEN, RoPE's cos / sin at a looked-up position (_rope_cs); else placeholders (unused)
    if CS_GIVEN:
        return _rope_cs(pos, freqs, FMAX, ATTN_SCALE, LIBDEVICE)
    return freqs[None, :], freqs[None, :]


@triton.jit
def _spec_lookup(
    n, block_tables, cu_q, k_lens, slots, positions, bt_stride, table_width, n_seqs, guess_mul, freqs,
    MODE: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_BLOCKS: tl.constexpr, CP_RANK: tl.constexpr,
    CP_SIZE: tl.constexpr, CS_GIVEN: tl.constexpr, FMAX: tl.constexpr, ATTN_SCALE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    # SPECULATE's lookup, before the wait for the previous kernel: _lookup with the first guess only (no search),
    # plus what _spec_same re-reads after the wait: (valid, block id, offset, position, cos, sin, hit, a, b, c,
    # bt_ptr, bt_mask, raw). a, b, c: (cu_q[g], cu_q[g + 1], cached tokens) of the guess g, or (slot, position,
    # 0) by slot mapping; raw: the block-table entry read at bt_ptr where bt_mask (ragged). hit: the guess is
    # row n's sequence (else valid is False and the row is looked up again after the wait).
    pos = n.to(tl.int64) * 0
    if MODE == BY_SLOTS:
        slot = tl.load(slots + n).to(tl.int64)
        if ROPE:
            pos = tl.load(positions + n).to(tl.int64)
        valid = slot >= 0
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        hit = n >= 0
        a = slot
        b = pos
        c = pos * 0
        bt_ptr = block_tables
        bt_mask = n < 0
        raw = (n * 0 - 1).to(tl.int32)
    else:
        g = _guess(n, guess_mul, n_seqs)
        a, b, c = _seq_rows(g, cu_q, k_lens, MODE, "")
        hit = (a <= n) & (n < b)
        pos = (c + (n - a)).to(tl.int64)
        valid, lpos = _local_pos(pos, hit & (pos >= 0), CP_RANK, CP_SIZE)
        bi = lpos // BLOCK_SIZE
        bt_mask = valid & (bi < table_width)
        bt_ptr = block_tables + g * bt_stride + bi
        raw = tl.load(bt_ptr, mask=bt_mask, other=-1)
        blk = raw.to(tl.int64)
        off = lpos % BLOCK_SIZE
        valid = bt_mask
    valid = valid & (blk >= 0) & (blk < NUM_BLOCKS)
    cs_c, cs_s = _lookup_cs(pos, freqs, CS_GIVEN, FMAX, ATTN_SCALE, LIBDEVICE)
    return valid, blk, off, pos, cs_c, cs_s, hit, a, b, c, bt_ptr, bt_mask, raw


@triton.jit
def _spec_same(
    n, cu_q, k_lens, slots, positions, n_seqs, guess_mul, hit, a, b, c, bt_ptr, bt_mask, raw, MODE: tl.constexpr,
    ROPE: tl.constexpr,
):
    # After the wait: did _spec_lookup read what the index tensors now hold? Every value it read is read again
    # from L2 (".cg": past a line this SM's L1 may still hold from before the wait) at the same address and
    # compared; the lookup is a function of those values alone.
    if MODE == BY_SLOTS:
        same = tl.load(slots + n, cache_modifier=".cg").to(tl.int64) == a
        if ROPE:
            same = same & (tl.load(positions + n, cache_modifier=".cg").to(tl.int64) == b)
    else:
        g = _guess(n, guess_mul, n_seqs)
        a2, b2, c2 = _seq_rows(g, cu_q, k_lens, MODE, ".cg")
        raw2 = tl.load(bt_ptr, mask=bt_mask, other=-1, cache_modifier=".cg")
        same = hit & (a2 == a) & (b2 == b) & (c2 == c) & (raw2 == raw)
    return same

