"""The rotation of the rotated formats in registers (:mod:`kvcache.ops.paged.rotation` defines it)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _butterflies(y, M: tl.constexpr, N: tl.constexpr, P: tl.constexpr):
    # y [M, N] float32, N a power of two: Sylvester butterflies of span 1, 2, ..., P / 2 along dim 1 (blocks of P)
    for s in tl.static_range(P.bit_length() - 1):  # span 1 << s
        z = tl.permute(tl.reshape(y, [M, N // (2 << s), 2, 1 << s]), (0, 1, 3, 2))
        u, w = tl.split(z)
        y = tl.reshape(tl.permute(tl.join(u + w, u - w), (0, 1, 3, 2)), [M, N])
    return y


@triton.jit
def _rotate_halves(x1, x2, D: tl.constexpr):
    """``[x1, x2] R`` of rows of ``D`` elements given as float32 half tiles ``[M, N]`` (elements ``[0, D/2)`` and
    ``[D/2, D)``; lanes past ``D/2`` zero, ``N`` a power of two): the sum and difference of the halves, butterflies
    inside blocks of ``P`` (the largest power of two dividing ``D/2``), one multiply by ``1 / sqrt(2 P)``. The same
    float32 operations in the same order as :func:`kvcache.ops.paged.rotation.rotate_rows`."""
    M: tl.constexpr = x1.shape[0]
    N: tl.constexpr = x1.shape[1]
    P: tl.constexpr = (D // 2) & (-(D // 2))
    c: tl.constexpr = 1.0 / (2.0 * P) ** 0.5
    y1 = _butterflies(x1 + x2, M, N, P)
    y2 = _butterflies(x1 - x2, M, N, P)
    return y1 * c, y2 * c
