"""Launch policy of the paged append: a pure function from the kind of append (rows, sequences, format, RoPE,
what the device offers) to an :class:`AppendLaunch`, the hashable description of the kernel's launch.

The rules and the measurements behind them: ``docs/paged-kernels.md`` (rules), ``docs/tuning-history.md``
(how they were found) and ``BENCHMARKS.md`` (current numbers).
Tests call :func:`plan_append` directly; variants of a launch are ``dataclasses.replace(plan, ...)`` of a plan.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from ..._validate import next_pow2
from .format import KV_FORMAT_TABLE

__all__ = ["AppendLaunch", "GatherLaunch", "RopeKind", "plan_append", "plan_gather", "check_launch", "SPLIT_BELOW"]

# Appends of fewer rows than this are decode-sized: K and V get programs of their own (half the work on each
# program's critical path), and with programmatic dependent launch (PDL) the lookup may run before the wait for
# the previous kernel. Prefill-sized appends (this many rows or more) are bandwidth-bound: one program per row.
SPLIT_BELOW = 2048

RopeKind = Literal["none", "full", "partial"]  # full: rotate-half over the whole head_dim; partial: anything else


@dataclasses.dataclass(frozen=True, slots=True)
class AppendLaunch:
    """How one append launches (the kernel's constexpr switches and its grid shape).

    Attributes
    ----------
    split : bool
        One program per row's K and one per row's V (decode-sized launches), else one program per row.
    head_groups : int
        Split launches: programs per row's K (or V), each with ``next_pow2(H) // head_groups`` heads; a power of
        two. 1 for launches that do not split.
    pdl : bool
        Launched with programmatic dependent launch: the kernel waits for the previous grid before reading
        anything it may have written, and releases the next grid only after that wait.
    index_first : bool
        The lookup (where each row goes), and with ``cs_first`` RoPE's cos / sin, before the wait (PDL).
    cs_first : bool
        RoPE's cos / sin right after the lookup (rotate-half RoPE over the whole head only).
    speculate : bool
        ``index_first`` without the caller's promise: every index value read before the wait is read again
        after it and compared; rows whose values changed (or whose first guess missed) are redone.
    freqs_late : bool
        ``inv_freq`` read after the wait (a speculative launch whose frequencies a running kernel may write).
    early : bool
        RoPE and quantization before the block-table load returns; only the stores wait for it.
    masked : bool
        ``early`` launches: stores predicated on the row's validity instead of behind a branch.
    rope_select : bool
        Split launches with RoPE by slot mapping, quantized: K and V programs both rotate, V keeps its row.
    hints : bool
        Prefill-sized launches: K / V loads evict first, pool stores streaming (``.cs``).
    pair_asm : bool
        int8 / int4 per-row launches on NVIDIA: (scale, zero) stored as one 8-byte PTX store per head
        (taken only where ``params`` is 8-byte aligned).
    num_warps : int
    """

    split: bool
    head_groups: int
    pdl: bool
    index_first: bool
    cs_first: bool
    speculate: bool
    freqs_late: bool
    early: bool
    masked: bool
    rope_select: bool
    hints: bool
    pair_asm: bool
    num_warps: int


def plan_append(
    *,
    n_rows: int,
    n_seqs: int | None,
    num_kv_heads: int,
    head_dim: int,
    kv_dtype: str,
    rope: RopeKind,
    pdl: bool,
    ptx: bool,
    metadata_ready: bool = False,
    rope_ready: bool = False,
) -> AppendLaunch:
    """The launch of an append of ``n_rows`` rows.

    Parameters
    ----------
    n_rows : int
        Rows of ``k`` / ``v``.
    n_seqs : int or None
        Sequences of a ragged batch; None for a slot mapping.
    num_kv_heads, head_dim : int
    kv_dtype : str
        ``"auto" | "fp8" | "int8" | "int4" | "k8v4" | "fp8k"``.
    rope : {"none", "full", "partial"}
        No RoPE; rotate-half over the whole head_dim; partial rotary dim or interleaved pairs.
    pdl : bool
        Programmatic dependent launch is available and enabled (Hopper or later, ``KVCACHE_PDL`` not 0).
    ptx : bool
        The kernel is compiled from PTX (an NVIDIA GPU): inline PTX may be used.
    metadata_ready : bool
        The caller's promise that no running kernel writes the index tensors (see
        :func:`kvcache.ops.append_paged_kv`).
    rope_ready : bool
        No running kernel writes ``inv_freq`` (the cache's own frequencies, built once).

    Returns
    -------
    AppendLaunch

    Example
    -------
    >>> plan_append(n_rows=256, n_seqs=256, num_kv_heads=8, head_dim=128, kv_dtype="int8", rope="full",
    ...             pdl=True, ptx=True).speculate
    True
    """
    quant = KV_FORMAT_TABLE[kv_dtype].code
    decode = n_rows < SPLIT_BELOW
    has_rope = rope != "none"
    # speculation only where the first guess is exact for every row: one row per sequence (a decode batch), or a
    # slot mapping; mixed batches would redo most rows after the wait (2-4x slower). It re-reads no partner
    # elements nor per-element frequencies: no partial / interleaved RoPE
    exact = n_seqs is None or n_seqs == n_rows
    speculate = rope != "partial" and exact and not metadata_ready and pdl and decode
    # the promise (or speculation in its place) moves the lookup before the wait: decode-sized launches with
    # PDL only (without PDL there is no wait to overlap; prefills are not latency-bound)
    index_first = (metadata_ready or speculate) and pdl and decode
    # quantized decode by slot mapping with RoPE that waits first: one program of H * D / 256 warps per row
    slot_rope_rows = not index_first and n_seqs is None and has_rope and quant >= 2 and decode
    if index_first:
        split = quant == 1  # per-row programs for fp16 / int8 / int4 (K and V chains side by side), split for fp8
    else:
        split = decode and not slot_rope_rows
    # with speculation, the frequencies are read after the wait unless no running kernel writes them
    freqs_late = speculate and rope == "full" and not rope_ready
    cs_first = index_first and quant != 1 and rope == "full" and not freqs_late
    early = split or index_first or slot_rope_rows
    rope_select = split and has_rope and quant >= 1 and n_seqs is None
    H, D = num_kv_heads, head_dim
    if split:
        warps = H * D // 1024
    elif quant == 0 or slot_rope_rows:
        warps = H * D // 256
    else:
        warps = H * D // 512
    return AppendLaunch(
        split=split, head_groups=1, pdl=pdl, index_first=index_first, cs_first=cs_first, speculate=speculate,
        freqs_late=freqs_late, early=early, masked=early and not rope_select, rope_select=rope_select,
        hints=not split, pair_asm=ptx and not split and 2 <= quant <= 4, num_warps=max(1, min(8, warps)),
    )


def check_launch(launch: AppendLaunch, *, num_kv_heads: int, rope: RopeKind, pdl_supported: bool) -> None:
    """Raise ValueError for a launch the kernel cannot run correctly (variants built with
    ``dataclasses.replace``): speculation with partial RoPE or without the lookup first, cos / sin first with
    late frequencies, head groups that are not a power of two within the heads, PDL where unsupported."""
    if not isinstance(launch, AppendLaunch):
        raise TypeError(f"launch: expected an AppendLaunch, got {type(launch).__name__}")
    hg = launch.head_groups
    top = next_pow2(num_kv_heads)
    if type(hg) is not int or hg < 1 or hg & (hg - 1) or hg > top:
        raise ValueError(f"head_groups: expected a power of two <= {top}, got {hg!r}")
    if type(launch.num_warps) is not int or launch.num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps: expected a power of two in [1, 32], got {launch.num_warps!r}")
    if launch.pdl and not pdl_supported:
        raise ValueError("pdl: programmatic dependent launch needs a CUDA device of compute capability >= 9.0 "
                         "and triton >= 3.4")
    if launch.speculate:
        if rope == "partial":
            raise ValueError("speculate: True needs no RoPE or rotate-half RoPE over the whole head_dim")
        if not launch.index_first:
            raise ValueError("speculate: True looks rows up before the wait; expected index_first True, got False")
    if launch.cs_first and launch.freqs_late:
        raise ValueError("cs_first: True needs inv_freq before the wait; expected freqs_late False")


# Outputs spanning this many elements or more (first to last element, + 1) take 64-bit output offsets: int32
# products of the strides overflow past 2**31.
GATHER_WIDE_FROM = 1 << 31


@dataclasses.dataclass(frozen=True, slots=True)
class GatherLaunch:
    """How one gather launches: ``tok`` tokens per program (a power of two dividing the block size),
    ``num_warps``, and ``wide``: 64-bit output offsets (outputs of 2**31 elements or more)."""

    tok: int
    num_warps: int
    wide: bool


def plan_gather(k_out: torch.Tensor, v_out: torch.Tensor, *, num_kv_heads: int, head_dim: int) -> GatherLaunch:
    """The gather's launch for outputs ``k_out`` / ``v_out`` ``[B, H, S_out, D]``: one token per program
    (2 warps at 8 x 128 heads), 64-bit offsets only where an output spans 2**31 elements (its strides are
    non-negative: the span is the largest offset + 1).

    Example
    -------
    >>> out = torch.empty(2, 8, 64, 128, dtype=torch.float16)
    >>> plan_gather(out, out, num_kv_heads=8, head_dim=128)
    GatherLaunch(tok=1, num_warps=2, wide=False)
    """
    span = max(sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1 for t in (k_out, v_out))
    return GatherLaunch(tok=1, num_warps=max(1, min(8, num_kv_heads * head_dim // 512)),
                        wide=span >= GATHER_WIDE_FROM)
