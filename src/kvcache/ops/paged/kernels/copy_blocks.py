"""Whole-block copies in every layer (the device half of copy-on-write)."""

from __future__ import annotations

import triton.language as tl

from ...._backend import kernel


@kernel(ints=("n_pairs", "layer_stride", "elems", "num_blocks"))
def _copy_blocks_kernel(
    buf,  # [L, num_blocks, elems] (any dtype)
    pairs,  # int64 [n_pairs, 2]: (src block, dst block)
    n_pairs, layer_stride, elems, num_blocks,
    BLOCK: tl.constexpr,
):
    # grid: (cdiv(elems, BLOCK), n_pairs, L); a pair with an id outside [0, num_blocks) is skipped
    c = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)
    src = tl.load(pairs + p * 2)
    dst = tl.load(pairs + p * 2 + 1)
    ok = (src >= 0) & (src < num_blocks) & (dst >= 0) & (dst < num_blocks)
    src = tl.where(ok, src, 0)
    dst = tl.where(ok, dst, 0)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    m = tl.where(ok, offs < elems, False)  # (tl.where: a scalar & tile mask is rejected by triton 3.9's interpreter)
    x = tl.load(buf + layer * layer_stride + src * elems + offs, mask=m)
    tl.store(buf + layer * layer_stride + dst * elems + offs, x, mask=m)
