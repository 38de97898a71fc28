"""Sequence-length kernels: increment (decode / prefill commit) and compaction after eviction.

Both kernels run as one program over the whole active batch, which makes them all-or-nothing (increment)
and race-free in place (compaction): every length is loaded before any is stored.

Rules that hold for any input, valid or not (the reference and the kernel follow the same ones):

* Sums are taken in 64 bits. Without ``max_len`` a length saturates at the int32 range
  ``[-2**31, 2**31 - 1]`` instead of wrapping; with ``max_len`` a sum outside ``[0, max_len]`` refuses the
  whole update.
* Compaction applies entry ``i`` (``dst[mapping[i]] = lengths[i]``) only when it is *valid*
  (``0 <= mapping[i] < new_active`` and ``mapping[i] <= i``) and ``mapping[i]`` is larger than every earlier
  valid entry's: exactly the entries that the in-place data kernels of :mod:`kvcache.ops.compact` move (no
  slot written twice, no race), so lengths and data never disagree, even for a malformed mapping passed with
  ``check=False``. For an order-preserving mapping (what :func:`~kvcache.ops.build_batch_mapping` makes) that
  is every kept entry.
* Every op that writes a tensor through a kernel bumps its version counter (``tensor._version``), as torch's
  own in-place ops do, so holders of the tensor (the caches' host mirror of the lengths) see the write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.graph import increment_version

from .._backend import kernel, use_triton
from .._validate import check_device, check_dtype, check_int, check_ndim, check_tensor, next_pow2

__all__ = [
    "launch_increment",
    "increment_lengths",
    "increment_lengths_reference",
    "compact_lengths",
    "compact_lengths_reference",
    "compaction_moves",
]

_INT32_MAX = 2**31 - 1
_INT32_MIN = -(2**31)
_MAX_BATCH = 1 << 20  # one program holds the whole batch in registers
# Rank keys of the compaction rule: mapping[i] * _KEY_SCALE + (_KEY_SCALE - 1 - i) in int64 (i < _MAX_BATCH).
_KEY_SCALE = 2 * _MAX_BATCH


@kernel(ints=("n", "scalar_increment", "max_len"))
def _increment_lengths_kernel(
    lengths,  # int32 [n], in/out
    increment,  # int32 [n] when HAS_TENSOR, else unused
    overflow,  # int32 [1] when HAS_FLAG, else unused
    n,
    scalar_increment,
    max_len,
    HAS_TENSOR: tl.constexpr,
    CHECK: tl.constexpr,
    HAS_FLAG: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program: load every length, decide, then store, so a rejected increment changes nothing.
    # Sums in 64 bits: nothing wraps (saturate without CHECK, refuse with it).
    i = tl.arange(0, BLOCK)
    m = i < n
    old = tl.load(lengths + i, mask=m, other=0).to(tl.int64)
    if HAS_TENSOR:
        new = old + tl.load(increment + i, mask=m, other=0).to(tl.int64)
    else:
        new = old + scalar_increment.to(tl.int64)
    if CHECK:
        bad = m & ((new > max_len) | (new < 0))
        nbad = tl.sum(bad.to(tl.int32), axis=0)
        # (i * 0 + nbad) makes the condition a vector: triton 3.9's interpreter rejects vector & scalar masks
        tl.store(lengths + i, new.to(tl.int32), mask=m & ((i * 0 + nbad) == 0))
        if HAS_FLAG:
            if nbad > 0:
                tl.store(overflow, 1)
    else:
        new = tl.minimum(tl.maximum(new, -2147483648), 2147483647)
        tl.store(lengths + i, new.to(tl.int32), mask=m)


def increment_lengths_reference(
    lengths: torch.Tensor,
    increment: int | torch.Tensor,
    *,
    max_len: int | None = None,
    overflow: torch.Tensor | None = None,
) -> None:
    """Pure-torch reference of :func:`increment_lengths` (same arguments, same semantics)."""
    new = lengths.to(torch.int64) + (increment.to(torch.int64) if isinstance(increment, torch.Tensor) else increment)
    if max_len is not None:
        if lengths.numel() > 0 and bool(((new > max_len) | (new < 0)).any()):
            if overflow is not None:
                overflow.fill_(1)
            return
    else:
        new = new.clamp_(_INT32_MIN, _INT32_MAX)
    lengths.copy_(new.to(torch.int32))


def increment_lengths(
    lengths: torch.Tensor,
    increment: int | torch.Tensor,
    *,
    max_len: int | None = None,
    overflow: torch.Tensor | None = None,
) -> None:
    """Add ``increment`` to every sequence length, in place.

    Parameters
    ----------
    lengths : torch.Tensor
        shape: ``[n]``, dtype: int32, any device. Updated in place.
    increment : int | torch.Tensor
        An int added to every length (decode: 1), or per-sequence counts (prefill), shape ``[n]``,
        dtype int32, on ``lengths``' device.
    max_len : int, optional
        Bound checked on the device without a host sync: if any new length would be ``> max_len`` or
        ``< 0``, **no** length changes (all or nothing) and ``overflow[0]`` is set to 1. Without it, a
        length saturates at ``2**31 - 1`` (or ``-2**31``) instead of wrapping around.
    overflow : torch.Tensor, optional
        shape ``[1]``, dtype int32, on ``lengths``' device; set to 1 when ``max_len`` rejects the update,
        never cleared. Only with ``max_len``.

    Note
    ----
    No allocation, no host sync: capturable in a CUDA graph (an int increment is baked into the graph).
    Bumps ``lengths._version`` like a torch in-place op (the caches' host mirror of their lengths relies on
    it; a CUDA-graph replay runs no Python and bumps nothing).

    Examples
    --------
    >>> lengths = torch.tensor([3, 5], dtype=torch.int32)
    >>> increment_lengths(lengths, 1)
    >>> lengths.tolist()
    [4, 6]
    >>> increment_lengths(lengths, torch.tensor([2, 0], dtype=torch.int32), max_len=5, overflow=flag)  # doctest: +SKIP
    """
    if (
        type(lengths) is torch.Tensor
        and lengths.dtype is torch.int32
        and lengths.dim() == 1
        and lengths.stride(0) == 1
        and type(increment) is int
        and -_INT32_MAX <= increment <= _INT32_MAX
        and max_len is None
        and overflow is None
        and 0 < lengths.shape[0] <= _MAX_BATCH
    ):
        launch_increment(lengths, increment, None, None)  # fast path: the decode-step call
        return
    lengths = check_tensor("lengths", lengths)
    check_ndim("lengths", lengths, 1, "of sequence lengths [n]")
    check_dtype("lengths", lengths, torch.int32)
    if not lengths.is_contiguous():
        raise ValueError(f"lengths: expected a contiguous tensor, got strides {tuple(lengths.stride())}")
    n = lengths.shape[0]
    if isinstance(increment, torch.Tensor):
        check_ndim("increment", increment, 1, "of per-sequence counts [n]")
        check_dtype("increment", increment, torch.int32)
        check_device("increment", increment, lengths.device, "lengths")
        if increment.shape[0] != n:
            raise ValueError(f"increment: expected shape [{n}] (the shape of lengths), got [{increment.shape[0]}]")
        if not increment.is_contiguous():
            raise ValueError(f"increment: expected a contiguous tensor, got strides {tuple(increment.stride())}")
    else:
        check_int("increment", increment, -_INT32_MAX, _INT32_MAX)
    if max_len is not None:
        check_int("max_len", max_len, 0, _INT32_MAX)
    if overflow is not None:
        if max_len is None:
            raise ValueError("overflow: expected None when max_len is None (nothing is checked)")
        check_tensor("overflow", overflow)
        check_dtype("overflow", overflow, torch.int32)
        check_device("overflow", overflow, lengths.device, "lengths")
        if overflow.numel() != 1:
            raise ValueError(f"overflow: expected shape [1], got {list(overflow.shape)}")
    if n > _MAX_BATCH:
        raise ValueError(f"lengths: expected at most {_MAX_BATCH} sequences, got {n}")
    if n == 0:
        return
    launch_increment(lengths, increment, max_len, overflow)


def launch_increment(
    lengths: torch.Tensor, increment: int | torch.Tensor, max_len: int | None, overflow: torch.Tensor | None
) -> None:
    """Launcher of :func:`increment_lengths` without validation (callers validated; ``lengths`` non-empty)."""
    if not use_triton(lengths.device):
        increment_lengths_reference(lengths, increment, max_len=max_len, overflow=overflow)
        return
    increment_version(lengths)
    n = lengths.shape[0]
    has_tensor = isinstance(increment, torch.Tensor)
    _increment_lengths_kernel.launch(
        lengths.device,
        (1,),
        lengths,
        increment if has_tensor else lengths,
        overflow if overflow is not None else lengths,
        n,
        0 if has_tensor else increment,
        max_len if max_len is not None else 0,
        HAS_TENSOR=has_tensor,
        CHECK=max_len is not None,
        HAS_FLAG=overflow is not None,
        BLOCK=max(16, next_pow2(n)),
    )


@kernel(ints=("old_active", "new_active"))
def _compact_lengths_kernel(
    lengths,  # int32 [>= old_active]
    mapping,  # int32 [>= old_active]: new index or -1
    dst,  # int32 [>= new_active]; may alias lengths
    old_active,
    new_active,
    KEY_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Applies the entries the in-place data kernels move (module doc): valid (0 <= j < new_active, j <= i) and
    # j above every earlier valid j. The last test is a prefix max of rank keys j * SCALE + (SCALE - 1 - i) over
    # valid entries: entry i holds the running maximum exactly when its j beats every earlier valid j (ties go
    # to the earlier entry).
    i = tl.arange(0, BLOCK)
    m = i < old_active
    j = tl.load(mapping + i, mask=m, other=-1)
    length = tl.load(lengths + i, mask=m, other=0)
    valid = m & (j >= 0) & (j < new_active) & (j <= i)
    key = tl.where(valid, j.to(tl.int64) * KEY_SCALE + (KEY_SCALE - 1 - i), -9223372036854775807)
    running = tl.associative_scan(key, 0, _max_combine)
    # Every thread has loaded before any stores: dst may alias lengths.
    tl.debug_barrier()
    keep = valid & (running == key)
    tl.store(dst + j, length, mask=keep)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


def compaction_moves(
    batch_mapping: torch.Tensor, old_active: int, new_active: int, in_place: bool = True
) -> list[tuple[int, int]]:
    """The ``(old, new)`` slot pairs a compaction applies, in ascending ``old`` order (host; reads the mapping).

    In place: valid (``0 <= j < new_active``, ``j <= i``) and ``j`` above every earlier valid entry's (the rule
    of the module doc). Out of place (:func:`~kvcache.ops.compact_batch` into another tensor): ``0 <= j < new_active``
    (several entries onto one ``j``: the last one wins, as in the kernel's ascending walk).
    """
    out = []
    running = -(2**63)
    for i, j in enumerate(batch_mapping[:old_active].tolist()):
        if in_place:
            if 0 <= j < new_active and j <= i and j > running:
                out.append((i, j))
                running = j
        elif 0 <= j < new_active:
            out.append((i, j))
    return out


def compact_lengths_reference(
    lengths: torch.Tensor, batch_mapping: torch.Tensor, old_active: int, new_active: int, dst: torch.Tensor
) -> None:
    """Pure-torch reference of :func:`compact_lengths`."""
    src = lengths[:old_active].tolist()
    for i, j in compaction_moves(batch_mapping, old_active, new_active):
        dst[j] = src[i]


def compact_lengths(
    lengths: torch.Tensor,
    batch_mapping: torch.Tensor,
    old_active: int,
    new_active: int,
    dst_lengths: torch.Tensor | None = None,
) -> None:
    """``dst_lengths[batch_mapping[i]] = lengths[i]`` for every kept ``i < old_active``.

    An entry is applied when ``0 <= batch_mapping[i] < new_active``, ``batch_mapping[i] <= i`` and
    ``batch_mapping[i]`` is larger than every earlier applied entry (module doc): the entries the in-place data
    compaction moves; for an order-preserving mapping, every kept one.

    Parameters
    ----------
    lengths : torch.Tensor
        shape ``[>= old_active]``, dtype int32.
    batch_mapping : torch.Tensor
        shape ``[>= old_active]``, dtype int32: new batch index, or ``-1`` for evicted (see
        :func:`~kvcache.ops.build_batch_mapping`).
    old_active, new_active : int
        Active batch size before and after eviction.
    dst_lengths : torch.Tensor, optional
        shape ``[>= new_active]``, dtype int32; defaults to ``lengths`` (in place, race-free: one program
        loads every length before storing any).

    Note
    ----
    Run it after every layer was compacted: the layer kernels read ``lengths``.

    Examples
    --------
    >>> lengths = torch.tensor([4, 9, 2], dtype=torch.int32)
    >>> compact_lengths(lengths, torch.tensor([0, -1, 1], dtype=torch.int32), 3, 2)
    >>> lengths[:2].tolist()
    [4, 2]
    """
    check_tensor("lengths", lengths)
    check_tensor("batch_mapping", batch_mapping)
    dst = lengths if dst_lengths is None else check_tensor("dst_lengths", dst_lengths)
    # blame the odd one out: lengths' device unless a separate dst agrees with batch_mapping against it
    ref = ("lengths", lengths.device)
    if dst_lengths is not None and dst.device == batch_mapping.device != lengths.device:
        ref = ("batch_mapping", batch_mapping.device)
    _check_lengths_args(lengths, batch_mapping, old_active, new_active, dst, ref=ref)
    if old_active == 0:
        return
    if not use_triton(lengths.device):
        compact_lengths_reference(lengths, batch_mapping, old_active, new_active, dst)
        increment_version(dst)
        return
    _compact_lengths_kernel.launch(
        lengths.device,
        (1,),
        lengths,
        batch_mapping,
        dst,
        old_active,
        new_active,
        KEY_SCALE=_KEY_SCALE,
        BLOCK=max(16, next_pow2(old_active)),
    )
    increment_version(dst)


def _check_lengths_args(
    lengths: torch.Tensor,
    batch_mapping: torch.Tensor,
    old_active: int,
    new_active: int,
    dst: torch.Tensor,
    max_batch: int | None = None,
    *,
    ref: tuple[str, torch.device],
) -> None:
    """Validation shared by the compaction entry points (lengths, mapping, batch sizes); every tensor must be
    on ``ref``'s device (``ref`` = (name, device) of the argument the others are compared with)."""
    dev = ref[1]
    if (
        type(old_active) is int
        and type(new_active) is int
        and 0 <= new_active <= old_active <= (_MAX_BATCH if max_batch is None else max_batch)
        and _ok_int32(lengths, old_active, dev)
        and _ok_int32(batch_mapping, old_active, dev)
        and _ok_int32(dst, new_active, dev)
    ):
        return  # fast path: everything valid
    check_int("old_active", old_active, 0, _MAX_BATCH if max_batch is None else max_batch)
    check_int("new_active", new_active, 0, old_active)
    for name, t, need in (
        ("lengths", lengths, old_active),
        ("batch_mapping", batch_mapping, old_active),
        ("dst_lengths", dst, new_active),
    ):
        check_ndim(name, t, 1, "of int32")
        check_dtype(name, t, torch.int32)
        check_device(name, t, ref[1], ref[0])
        if t.shape[0] < need:
            raise ValueError(f"{name}: expected at least {need} entries, got shape [{t.shape[0]}]")
        if t.stride(0) != 1:
            raise ValueError(f"{name}: expected a contiguous tensor, got stride {t.stride(0)}")


def _ok_int32(t: torch.Tensor, need: int, device: torch.device) -> bool:
    return (
        type(t) is torch.Tensor
        and t.dtype is torch.int32
        and t.dim() == 1
        and t.shape[0] >= need
        and t.stride(0) == 1
        and t.device == device
    )
