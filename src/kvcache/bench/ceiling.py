"""The copy ceilings of ``kvcache bench``: the fastest plain copy of the bytes an op must move.

The rule, for every bench that reports "% of ceiling" (attention, paged, linear): a row's ceiling is the faster
of two copies of the same bytes, measured in the same run under the same conditions as the row (the same pool of
thousands of blocks, GiBs of it; the same CUDA-graph replay with L2 flushed before every replay):

* **contiguous**: rows ``0 .. n-1`` of the source (one streaming pass, what the device's copy bandwidth means);
* **same pattern**: the rows the op touches (the blocks of its block table, drawn at random from all of the pool;
  the slots an append writes).

Both copies run one kernel (:func:`copy_rows`: 16-byte loads and stores, up to 64 KiB a program), so they differ only
in the access pattern, and both count bytes the same way: read + written, twice the bytes copied. Figures on the
H200, 4.3 GB copied in a CUDA graph: :func:`copy_rows` 4.17 TB/s contiguous, 4.08 TB/s over random 64 KiB
blocks; ``torch.index_select`` 3.73 TB/s whatever the pattern; a contiguous ``Tensor.copy_`` 2.71 TB/s, since in
a graph it becomes a driver memcpy node (4.26 TB/s eager). Either torch copy as one of the two would make a low
ceiling (a kvcache row at 148% of it).

An op that only reads (attention) counts the bytes it reads; a pure read stream can run a few percent faster
than a copy's read + write stream, so such rows may show slightly over 100%.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .._backend import Kernel
from .timing import graph_replay_us

__all__ = ["Ceiling", "copy_rows", "measure_ceiling"]

_WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# bytes one program copies: 64 KiB at 16 warps copies 4.3 GB at 4.17 TB/s on the H200 (32 KiB at 8 warps: 3.98;
# 8 KiB at 4 warps: 3.88; 128 KiB at 32 warps: 4.19; eviction or cache hints on the loads and stores only slow
# it). Smaller copies take smaller pieces, down to 4 KiB, to keep >= _MIN_PROGRAMS programs in flight; a warp
# per 4 KiB of a piece, 4 to 16.
_PIECE_BYTES = 65536
_MIN_PIECE_BYTES = 4096
_MIN_PROGRAMS = 1024


def _copy_rows_kernel(src, dst, ids, n, ROW: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr,
                      EVEN: tl.constexpr):
    # src [N, ROW] words, dst [n, ROW] words, ids [n]: dst[i] = src[ids[i]]; program (p, j) copies rows
    # [p * R, (p + 1) * R) x words [j * BLOCK, (j + 1) * BLOCK) (EVEN: ROW % BLOCK == 0, no column mask)
    r = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    rm = r < n
    row = tl.load(ids + r, mask=rm, other=0).to(tl.int64)
    w = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = rm[:, None] if EVEN else rm[:, None] & (w[None, :] < ROW)
    x = tl.load(src + row[:, None] * ROW + w[None, :], mask=m)
    tl.store(dst + r[:, None] * ROW + w[None, :], x, mask=m)


_copy_rows = Kernel(_copy_rows_kernel, ints=("n",))


def copy_rows(src: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[i] = src[ids[i]]`` by one Triton kernel, in the widest word (8, 4, 2 or 1 bytes) that divides a row.

    Parameters
    ----------
    src : torch.Tensor
        shape: [num_rows, row], any dtype, contiguous (e.g. a pool viewed as ``[num_blocks, -1]``).
    ids : torch.Tensor
        shape: [n], int32 or int64, on ``src``'s device, values in ``[0, num_rows)`` (not checked: a bench
        helper, the caller draws them).
    out : torch.Tensor
        shape: [n, row], ``src``'s dtype and device, contiguous; written.

    Returns
    -------
    torch.Tensor
        ``out``.

    Example
    -------
    >>> src = torch.arange(12, dtype=torch.float32).view(4, 3)
    >>> copy_rows(src, torch.tensor([2, 0]), torch.empty(2, 3)).tolist()  # on the CPU: Triton's interpreter
    [[6.0, 7.0, 8.0], [0.0, 1.0, 2.0]]
    """
    if not isinstance(src, torch.Tensor) or src.dim() != 2 or not src.is_contiguous():
        raise ValueError(f"src: expected a contiguous 2-D tensor, got {getattr(src, 'shape', type(src).__name__)}")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids: expected a 1-D int32 / int64 tensor, got {getattr(ids, 'shape', type(ids).__name__)}"
                         f" {getattr(ids, 'dtype', '')}")
    if not isinstance(out, torch.Tensor) or not out.is_contiguous() or tuple(out.shape) != (ids.numel(),
                                                                                          src.shape[1]):
        raise ValueError(f"out: expected a contiguous tensor of shape {[ids.numel(), src.shape[1]]}, "
                         f"got {list(getattr(out, 'shape', []))}")
    if out.dtype != src.dtype or out.device != src.device or ids.device != src.device:
        raise ValueError(f"out / ids: expected {src.dtype} on {src.device} (ids on it too), got out {out.dtype} "
                         f"on {out.device}, ids on {ids.device}")
    if ids.numel() == 0 or src.shape[1] == 0:
        return out
    row_bytes = src.shape[1] * src.element_size()
    word = next(w for w in _WORD if row_bytes % w == 0)
    s, d = src.view(torch.uint8).view(_WORD[word]), out.view(torch.uint8).view(_WORD[word])
    row, n = row_bytes // word, ids.numel()
    piece = _PIECE_BYTES
    while piece > _MIN_PIECE_BYTES and n * row_bytes < _MIN_PROGRAMS * piece:
        piece //= 2
    block = min(triton.next_power_of_2(row), piece // word)
    r = max(1, piece // word // block)  # rows per program when a row is smaller than a piece
    _copy_rows.launch(src.device, (triton.cdiv(n, r), triton.cdiv(row, block)), s, d, ids, n, ROW=row, R=r,
                      BLOCK=block, EVEN=row % block == 0, num_warps=max(4, min(16, piece // 4096)))
    return out


@dataclasses.dataclass(frozen=True)
class Ceiling:
    """The two copies of the same bytes and the ceiling they give.

    Attributes
    ----------
    contiguous_us, same_pattern_us : float
        Median microseconds of each copy.
    bytes : int
        Bytes each copy moves, read + written (twice the bytes copied).
    """

    contiguous_us: float
    same_pattern_us: float
    bytes: int

    @property
    def contiguous_gbs(self) -> float:
        return self.bytes / (self.contiguous_us * 1e3) if self.contiguous_us > 0 else 0.0

    @property
    def same_pattern_gbs(self) -> float:
        return self.bytes / (self.same_pattern_us * 1e3) if self.same_pattern_us > 0 else 0.0

    @property
    def gbs(self) -> float:
        """The ceiling: the faster of the two copies, in GB/s (bytes read + written per second)."""
        return max(self.contiguous_gbs, self.same_pattern_gbs)


def measure_ceiling(srcs: list[torch.Tensor], ids: torch.Tensor, rep: int = 60) -> Ceiling:
    """Time the contiguous and the same-pattern copy of rows ``ids`` of every tensor of ``srcs`` (one graph
    each, all of ``srcs`` in it; L2 flushed before every replay).

    Parameters
    ----------
    srcs : list of torch.Tensor
        Each shape: [num_rows, row] contiguous, on one CUDA device (e.g. a data pool and its (scale, zero) pool,
        viewed as ``[num_blocks, -1]``); every one has at least ``ids.numel()`` rows.
    ids : torch.Tensor
        shape: [n], int64: the rows the op reads or writes, in its order.
    rep : int
        Milliseconds of timed replays (``triton.testing.do_bench``'s ``rep``).

    Example
    -------
    >>> c = measure_ceiling([pool.view(pool.shape[0], -1)], table.reshape(-1).long())  # doctest: +SKIP
    >>> c.gbs  # doctest: +SKIP
    4250.0
    """
    if not srcs or any(s.dim() != 2 or s.shape[0] < ids.numel() for s in srcs):
        raise ValueError(f"srcs: expected 2-D tensors of >= {ids.numel()} rows, got "
                         f"{[tuple(s.shape) for s in srcs]}")
    dsts = [torch.empty((ids.numel(), s.shape[1]), dtype=s.dtype, device=s.device) for s in srcs]
    first = torch.arange(ids.numel(), dtype=ids.dtype, device=ids.device)

    def copies(rows: torch.Tensor) -> None:
        for s, d in zip(srcs, dsts):
            copy_rows(s, rows, d)

    contiguous_us = graph_replay_us(lambda: copies(first), rep=rep, warmup=10)[0]
    same_us = graph_replay_us(lambda: copies(ids), rep=rep, warmup=10)[0]
    moved = 2 * sum(d.numel() * d.element_size() for d in dsts)
    return Ceiling(contiguous_us, same_us, moved)
