"""Batch mapping after eviction: which old slot goes where (TensorRT Edge-LLM ``compact*``'s first half).

``build_batch_mapping`` numbers the sequences that are not finished ``0, 1, ...`` in order and marks finished
ones ``-1``: an order-preserving mapping, the precondition of in-place compaction (:mod:`kvcache.ops.compact`).
``check_batch_mapping`` is the debug check (syncs) that a mapping is one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton.language as tl

from .._backend import kernel, use_triton
from .._validate import check_device, check_dtype, check_ndim, check_tensor, fmt_shape, next_pow2
from .lengths import _MAX_BATCH

__all__ = ["build_batch_mapping", "build_batch_mapping_reference", "check_batch_mapping"]



@kernel(ints=("n", "stride"))
def _batch_mapping_kernel(
    finished,  # uint8 [n] with element stride `stride`: nonzero = evict
    mapping,  # int32 [>= n], written
    count,  # int32 [1]: new active batch size, written
    n,
    stride,
    BLOCK: tl.constexpr,
):
    i = tl.arange(0, BLOCK)
    m = i < n
    keep = ((tl.load(finished + i * stride, mask=m, other=1) == 0) & m).to(tl.int32)
    new_index = tl.cumsum(keep, axis=0) - 1
    tl.store(mapping + i, tl.where(keep > 0, new_index, -1), mask=m)
    tl.store(count, tl.sum(keep, axis=0))


def build_batch_mapping_reference(finished: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Pure-torch reference of :func:`build_batch_mapping` (returns a new mapping tensor)."""
    keep = ~finished.to(torch.bool)
    mapping = torch.where(keep, torch.cumsum(keep.to(torch.int32), 0, dtype=torch.int32) - 1, -1)
    return mapping.to(torch.int32), int(keep.sum())


def build_batch_mapping(
    finished: torch.Tensor | Sequence[bool],
    *,
    out: torch.Tensor | None = None,
    new_active_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int | torch.Tensor]:
    """Number the sequences that are not finished ``0, 1, ...`` in order; finished ones get ``-1``.

    Parameters
    ----------
    finished : torch.Tensor | sequence of bool
        shape ``[old_active]``, dtype bool, any device (a Python sequence is taken as a CPU tensor).
    out : torch.Tensor, optional
        shape ``[>= old_active]``, dtype int32, on ``finished``' device: the mapping is written to
        ``out[:old_active]`` (no allocation).
    new_active_out : torch.Tensor, optional
        shape ``[1]``, dtype int32, on ``finished``' device. When given, the new active batch size is
        written there and returned instead of an int: no host sync (CUDA-graph capturable).

    Returns
    -------
    (batch_mapping, new_active)
        ``batch_mapping``: int32 ``[old_active]``, ``mapping[i]`` = new index of sequence ``i`` or ``-1``.
        ``new_active``: int (reading it from a CUDA ``finished`` syncs once), or ``new_active_out``.

    Note
    ----
    The mapping is order-preserving (``mapping[i] <= i``, increasing over kept sequences): the precondition
    of in-place compaction.
    """
    if not isinstance(finished, torch.Tensor):
        if isinstance(finished, (str, bytes)) or not isinstance(finished, Sequence):
            raise TypeError(f"finished: expected a bool tensor or a sequence of bool, got {type(finished).__name__}")
        for i, f in enumerate(finished):
            if not isinstance(f, bool):
                raise TypeError(f"finished[{i}]: expected a bool, got {type(f).__name__}")
        finished = torch.tensor(list(finished), dtype=torch.bool)
    check_ndim("finished", finished, 1, "of bool [old_active]")
    check_dtype("finished", finished, torch.bool)
    n = finished.shape[0]
    if n > _MAX_BATCH:
        raise ValueError(f"finished: expected at most {_MAX_BATCH} sequences, got {n}")
    device = finished.device
    if (
        out is not None
        and type(out) is torch.Tensor
        and out.dtype is torch.int32
        and out.dim() == 1
        and out.shape[0] == n
        and out.stride(0) == 1
        and out.device == device
    ):
        mapping = out  # fast path: exactly the right buffer
    elif out is not None:
        check_tensor("out", out)
        check_ndim("out", out, 1, "of int32")
        check_dtype("out", out, torch.int32)
        check_device("out", out, device, "finished")
        if out.shape[0] < n or out.stride(0) != 1:
            raise ValueError(
                f"out: expected a contiguous tensor of at least {n} entries, got shape {fmt_shape(out.shape)}"
            )
        mapping = out[:n]
    else:
        mapping = torch.empty(n, dtype=torch.int32, device=device)
    if new_active_out is not None and not (
        type(new_active_out) is torch.Tensor
        and new_active_out.dtype is torch.int32
        and new_active_out.numel() == 1
        and new_active_out.device == device
    ):
        check_tensor("new_active_out", new_active_out)
        check_dtype("new_active_out", new_active_out, torch.int32)
        check_device("new_active_out", new_active_out, device, "finished")
        raise ValueError(f"new_active_out: expected shape [1], got {fmt_shape(new_active_out.shape)}")
    if not use_triton(device):
        ref, count = build_batch_mapping_reference(finished)
        mapping.copy_(ref)
        if new_active_out is not None:
            new_active_out.fill_(count)
            return mapping, new_active_out
        return mapping, count
    count_t = new_active_out if new_active_out is not None else torch.empty(1, dtype=torch.int32, device=device)
    if n > 0:
        _batch_mapping_kernel.launch(
            device, (1,), finished.view(torch.uint8), mapping, count_t, n, finished.stride(0),
            BLOCK=max(16, next_pow2(n)),
        )
    else:
        count_t.fill_(0)
    if new_active_out is not None:
        return mapping, new_active_out
    return mapping, int(count_t.item())


def check_batch_mapping(batch_mapping: torch.Tensor, old_active: int, new_active: int) -> None:
    """Debug check (syncs): ``batch_mapping[:old_active]`` numbers exactly ``new_active`` kept sequences
    ``0 .. new_active - 1`` in order and marks the others ``-1``. Raises ValueError otherwise."""
    m = batch_mapping[:old_active].cpu().tolist()
    kept = [j for j in m if j != -1]
    if kept != list(range(new_active)) or any(j < -1 for j in m):
        raise ValueError(
            f"batch_mapping: expected an order-preserving mapping of {old_active} sequences onto {new_active} "
            f"(kept numbered 0..{new_active - 1} in order, evicted -1), got {m}"
        )
