"""The rotation of the rotated formats (``fp8``, ``int4``): an orthonormal Walsh-Hadamard transform of each row.

A format stores ``quant(x R)`` instead of ``quant(x)``: ``R`` spreads a row's few large channels (keys have
channels tens of times larger than others) over all of them, so one scale per row (int4) or the per-layer scale
(fp8) no longer spends its levels on one channel. ``R`` is symmetric and its own inverse (``R R = I``), so reads
rotate back with the same ``R``; attention rotates the query instead (``(q R) . (k R) = q . k``) and the output
once (``(p V R) R = p V``).

For a row ``x = [a, b]`` of ``D`` elements (``a`` the first ``D / 2``, ``b`` the rest), with ``P`` the largest
power of two dividing ``D / 2``:

    x R = [(a + b) Hp, (a - b) Hp] / sqrt(2 P)

where ``Hp`` is the block-diagonal matrix of ``P x P`` Sylvester Hadamard matrices (entries +-1). For ``D`` a
power of two this is the normalised Hadamard matrix of order ``D``. The kernels compute it with the same float32
operations in the same order (the sum and difference of the halves, then butterflies of span 1, 2, ..., P / 2, then
one multiply), so their codes equal :func:`rotate_rows`'s bit for bit.
"""

from __future__ import annotations

import math

import torch

__all__ = ["rotate_rows", "rotation_block"]


def rotation_block(head_dim: int) -> int:
    """``P``: the largest power of two dividing ``head_dim // 2`` (the Hadamard blocks' order).

    Example
    -------
    >>> rotation_block(128), rotation_block(96)
    (64, 16)
    """
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim: expected an even int >= 2, got {head_dim!r}")
    half = head_dim // 2
    return half & -half


def rotate_rows(x: torch.Tensor) -> torch.Tensor:
    """``x R`` in float32 over the last dim (see the module docstring); ``R`` is its own inverse.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., D]`` of a floating dtype, ``D`` even.

    Returns
    -------
    torch.Tensor
        float32 ``[..., D]``.

    Example
    -------
    >>> x = torch.randn(3, 64)
    >>> torch.allclose(rotate_rows(rotate_rows(x)), x, atol=1e-5)
    True
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {type(x).__name__}")
    d = x.shape[-1] if x.dim() else 0
    p = rotation_block(d)
    x = x.float()
    half = d // 2
    a, b = x[..., :half], x[..., half:]
    y = torch.stack([a + b, a - b], dim=-2)  # [..., 2, half]
    lead = y.shape[:-1]
    h = 1
    while h < p:  # butterflies of span h inside blocks of p
        z = y.reshape(*lead, half // (2 * h), 2, h)
        u, w = z[..., 0, :], z[..., 1, :]
        y = torch.stack([u + w, u - w], dim=-2).reshape(*lead, half)
        h *= 2
    return (y * (1.0 / math.sqrt(2 * p))).reshape(x.shape)
