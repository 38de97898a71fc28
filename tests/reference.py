"""Independent reference of every op in :mod:`kvcache.ops`, written from the docstrings.

This is a second implementation, on purpose: plain Python loops over slices, no import of ``kvcache`` (but for
``kvcache._validate.bits``, the bit view every test compares with) and nothing copied from the library's
``*_reference`` functions. Every function returns new values and leaves
its arguments alone. Tensor results are *bit views* (the integer dtype of the same width), so tests
compare them bit-exactly with ``torch.equal`` whatever the stored dtype (fp8, NaN payloads, bool bytes).

The second half holds small helpers to make test data: random bits, sentinel-filled arenas.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from kvcache._validate import bits

SENTINEL_BYTE = 0x7B


# ---------------------------------------------------------------------------------------------------------
# lengths


def increment_lengths(
    lengths: Sequence[int], increment: int | Sequence[int], max_len: int | None = None
) -> tuple[list[int], bool]:
    """New lengths and whether the update was rejected (then the lengths are the old ones)."""
    incs = [increment] * len(lengths) if isinstance(increment, int) else list(increment)
    new = []
    for old, inc in zip(lengths, incs):
        new.append(old + inc)
    if max_len is not None:
        for v in new:
            if v > max_len or v < 0:
                return list(lengths), True
    return new, False


def build_batch_mapping(finished: Sequence[bool]) -> tuple[list[int], int]:
    mapping = []
    next_slot = 0
    for f in finished:
        if f:
            mapping.append(-1)
        else:
            mapping.append(next_slot)
            next_slot += 1
    return mapping, next_slot


def compact_lengths(
    lengths: Sequence[int], mapping: Sequence[int], old_active: int, new_active: int, dst: Sequence[int]
) -> list[int]:
    """``dst`` after ``dst[mapping[i]] = lengths[i]`` for every kept ``i < old_active`` (old values read)."""
    out = list(dst)
    for i in range(old_active):
        j = mapping[i]
        if 0 <= j < new_active:
            out[j] = lengths[i]
    return out


# ---------------------------------------------------------------------------------------------------------
# save / restore


def save_kv_layer(src: torch.Tensor, batch_idx: int, seq_len: int) -> torch.Tensor:
    """Bits ``[2, H, seq_len, D]``: the first ``seq_len`` tokens of slot ``batch_idx`` of ``src``."""
    s = bits(src)
    _, _, h, _, d = s.shape
    out = torch.empty((2, h, seq_len, d), dtype=s.dtype, device=s.device)
    for kv in range(2):
        for head in range(h):
            for t in range(seq_len):
                out[kv, head, t] = s[batch_idx, kv, head, t]
    return out


def restore_kv_layer(dst: torch.Tensor, src: torch.Tensor, batch_idx: int) -> torch.Tensor:
    """Bits of ``dst`` ``[B, 2, H, S, D]`` after the saved prefix ``src`` was put into slot ``batch_idx``."""
    out = bits(dst).clone()
    s = bits(src)
    _, h, seq_len, _ = s.shape
    for kv in range(2):
        for head in range(h):
            for t in range(seq_len):
                out[batch_idx, kv, head, t] = s[kv, head, t]
    return out


def save_kv_layers(src: Sequence[torch.Tensor], batch_idx: int, seq_len: int) -> list[torch.Tensor]:
    return [save_kv_layer(layer, batch_idx, seq_len) for layer in src]


def restore_kv_layers(
    dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], batch_idx: int
) -> list[torch.Tensor]:
    return [restore_kv_layer(layer, snap, batch_idx) for layer, snap in zip(dst, src)]


# ---------------------------------------------------------------------------------------------------------
# compaction


def compact_kv_layer(
    layer: torch.Tensor, mapping: Sequence[int], lengths: Sequence[int], old_active: int, new_active: int
) -> torch.Tensor:
    """Bits of ``layer`` after compaction: slot ``mapping[i]`` gets the first ``lengths[i]`` tokens of the
    *old* slot ``i`` for every kept ``i < old_active``; every other element keeps its old value."""
    old = bits(layer)
    out = old.clone()
    for i in range(old_active):
        j = mapping[i]
        if not 0 <= j < new_active:
            continue
        for kv in range(2):
            for head in range(old.shape[2]):
                out[j, kv, head, : lengths[i]] = old[i, kv, head, : lengths[i]]
    return out


def compact_kv_layers(
    layers: Sequence[torch.Tensor], mapping: Sequence[int], lengths: Sequence[int], old_active: int, new_active: int
) -> list[torch.Tensor]:
    return [compact_kv_layer(layer, mapping, lengths, old_active, new_active) for layer in layers]


def compact_batch(
    src: torch.Tensor, mapping: Sequence[int], dst: torch.Tensor, old_active: int, new_active: int
) -> torch.Tensor:
    """Bits of ``dst`` after ``dst[mapping[i]] = src[i]`` for every kept ``i < old_active`` (old rows read;
    ``dst`` may be ``src``)."""
    s = bits(src).clone()
    out = bits(dst).clone()
    for i in range(old_active):
        j = mapping[i]
        if 0 <= j < new_active:
            out[j] = s[i]
    return out


# ---------------------------------------------------------------------------------------------------------
# test data


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_tensor(
    shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Random bits of ``dtype`` (every byte pattern, NaN payloads included); bool gets 0/1."""
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).to(torch.bool).to(device)
    n = 1
    for s in shape:
        n *= s
    elt = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * elt,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape).to(device)


def sentinel_like_bits(t: torch.Tensor) -> torch.Tensor:
    """A bit view shaped like ``t`` holding the sentinel in every byte (for comparisons)."""
    b = torch.full((t.numel() * t.element_size(),), SENTINEL_BYTE, dtype=torch.uint8, device=t.device)
    return bits(b.view(t.dtype)).reshape(t.shape)


def is_sentinel(t: torch.Tensor) -> bool:
    """True when every byte of ``t`` is the sentinel (``t`` may be any view)."""
    return torch.equal(bits(t), sentinel_like_bits(t))


class Arena:
    """One sentinel-filled byte buffer holding tensors carved out of it, with sentinel gaps between them.

    ``arena.tensor(shape, dtype)`` returns a contiguous tensor that is a view of the buffer;
    ``arena.gaps_untouched()`` checks that every byte outside the handed-out tensors is still the sentinel.
    """

    def __init__(self, nbytes: int, device: torch.device | str = "cpu") -> None:
        self.buf = torch.full((nbytes,), SENTINEL_BYTE, dtype=torch.uint8, device=device)
        self.used: list[tuple[int, int]] = []

    def tensor(self, shape: Sequence[int], dtype: torch.dtype, offset: int) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > self.buf.numel():
            raise ValueError("arena too small")
        for a, b in self.used:
            if offset < b and a < offset + nbytes:
                raise ValueError("arena tensors overlap")
        self.used.append((offset, offset + nbytes))
        return self.buf[offset : offset + nbytes].view(dtype).view(tuple(shape))

    def gaps_untouched(self) -> bool:
        mask = torch.ones(self.buf.numel(), dtype=torch.bool, device=self.buf.device)
        for a, b in self.used:
            mask[a:b] = False
        return bool((self.buf[mask] == SENTINEL_BYTE).all())


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= s
    return n


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor") -> None:
    """Bit-exact comparison with a useful message (first mismatching index, both values)."""
    a, e = bits(actual), bits(expected)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    if torch.equal(a, e):
        return
    diff = (a != e).nonzero()
    first = tuple(int(x) for x in diff[0])
    raise AssertionError(
        f"{what}: {diff.shape[0]} of {a.numel()} elements differ; first at {first}: "
        f"got {int(a[first])}, expected {int(e[first])}"
    )


def names(argument: str) -> str:
    """``pytest.raises(..., match=names("dst"))``: the message starts with the argument's name."""
    return "^" + re.escape(argument) + r"(?!\w)"
