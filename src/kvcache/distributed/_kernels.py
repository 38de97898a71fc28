"""Device kernels of KV transfers: the chunk checksum and the checked scatter of received rows.

Both have a Triton kernel (CUDA tensors, or CPU tensors under Triton's interpreter) and a pure-torch reference
of the same function for CPU tensors (see :mod:`kvcache._backend`).

Checksum of a chunk body (``n`` int32 words ``w_i``, read as uint32) with chunk index ``c``: two 32-bit lanes,
every operation modulo ``2**32``::

    seed_a = c * 0x85EBCA77 + 0x165667B1            seed_b = c * 0x27D4EB2F + 0x61C88647
    a_i = fmix32(w_i ^ (i * 0x9E3779B1 + seed_a))   b_i = lowbias32(w_i + (i * 0xC2B2AE3D + seed_b))
    A = sum_i a_i                                   B = sum_i b_i

``fmix32`` is MurmurHash3's finaliser (xor-shift 16, * 0x85EBCA6B, xor-shift 13, * 0xC2B2AE35, xor-shift 16),
``lowbias32`` C. Wellons' (xor-shift 16, * 0x7FEB352D, xor-shift 15, * 0x846CA68B, xor-shift 16): both are
bijections of uint32, so for a fixed position each lane is a bijection of the word, and a change confined to one
word (any bytes of it) changes both sums: always detected. Changes to several words, words moved inside a body
and a body received at another chunk's index are detected unless two 32-bit sums of mixed values collide
(about 2**-64 for random damage). Sums are order-free, so any grid and reduction order gives the same bits.
An integrity check against corruption, not a cryptographic hash: anyone can forge a body with a given sum.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .._backend import kernel, use_triton
from .._validate import cdiv, next_pow2, vec_elems

__all__ = ["seeds", "checksum_into", "reference_sums", "scatter_rows"]

_M32 = 0xFFFFFFFF
_HASH_BLOCK = 1024  # words per tile
_HASH_PROGRAMS = 1024  # programs at most: tiles per program grow (powers of two) past that
_COPY_BLOCK = 2048  # words per program of the scatter


def _signed32(x: int) -> int:
    x &= _M32
    return x - (1 << 32) if x >= 1 << 31 else x


def seeds(chunk: int) -> tuple[int, int]:
    """The two lanes' seeds of chunk index ``chunk`` (uint32 values as signed int32, the kernel's argument)."""
    return _signed32(chunk * 0x85EBCA77 + 0x165667B1), _signed32(chunk * 0x27D4EB2F + 0x61C88647)


@kernel(ints=("n_vecs", "seed_a", "seed_b"))
def _checksum_kernel(
    words,  # int32 [n]: the body
    out,  # int32 [2]: lanes A, B; the program sums are added to it (zero it first)
    n_vecs,  # n / VEC
    seed_a,  # int32, a uint32 bit pattern
    seed_b,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,  # tiles of BLOCK words per program
    VEC: tl.constexpr,  # a power of two dividing n: the mask is uniform over VEC words (vector loads)
):
    pid = tl.program_id(0)
    n = n_vecs * VEC
    sa = seed_a.to(tl.uint32, bitcast=True)
    sb = seed_b.to(tl.uint32, bitcast=True)
    acc_a = tl.zeros([BLOCK], dtype=tl.uint32)
    acc_b = tl.zeros([BLOCK], dtype=tl.uint32)
    for t in range(TILES):
        offs = (pid * TILES + t) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        w = tl.load(words + offs, mask=m, other=0).to(tl.uint32, bitcast=True)
        i = offs.to(tl.uint32)
        x = w ^ (i * 0x9E3779B1 + sa)
        x ^= x >> 16
        x *= 0x85EBCA6B
        x ^= x >> 13
        x *= 0xC2B2AE35
        x ^= x >> 16
        y = w + (i * 0xC2B2AE3D + sb)
        y ^= y >> 16
        y *= 0x7FEB352D
        y ^= y >> 15
        y *= 0x846CA68B
        y ^= y >> 16
        acc_a += tl.where(m, x, 0)
        acc_b += tl.where(m, y, 0)
    # sums of 16-bit halves cannot overflow 32 bits (BLOCK <= 65536 terms), whatever tl.sum accumulates in
    a = tl.sum(acc_a & 0xFFFF, axis=0) + (tl.sum(acc_a >> 16, axis=0) << 16)
    b = tl.sum(acc_b & 0xFFFF, axis=0) + (tl.sum(acc_b >> 16, axis=0) << 16)
    # two's complement addition is addition modulo 2**32: the int32 atomics add the uint32 sums exactly
    tl.atomic_add(out, a.to(tl.int32, bitcast=True))
    tl.atomic_add(out + 1, b.to(tl.int32, bitcast=True))


def reference_sums(words: torch.Tensor, chunk: int) -> torch.Tensor:
    """Pure-torch checksum of int32 ``words`` [n] at chunk index ``chunk``: int32 [2] on their device."""
    w = words.to(torch.int64) & _M32
    i = torch.arange(w.numel(), dtype=torch.int64, device=w.device)
    sa, sb = (s & _M32 for s in seeds(chunk))
    x = w ^ ((i * 0x9E3779B1 + sa) & _M32)
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    x ^= x >> 16
    y = (w + i * 0xC2B2AE3D + sb) & _M32
    y ^= y >> 16
    y = (y * 0x7FEB352D) & _M32
    y ^= y >> 15
    y = (y * 0x846CA68B) & _M32
    y ^= y >> 16
    sums = torch.stack([x.sum(), y.sum()]) & _M32  # < n * 2**32 < 2**63
    return torch.where(sums >= 1 << 31, sums - (1 << 32), sums).to(torch.int32)


def checksum_into(words: torch.Tensor, chunk: int, out: torch.Tensor) -> None:
    """Add the checksum of int32 ``words`` [n] (contiguous) to ``out`` (int32 [2], zeroed by the caller, same
    device). Triton on CUDA and under the interpreter, :func:`reference_sums` otherwise. No host sync."""
    n = words.numel()
    if n == 0:
        return
    if not use_triton(words.device):
        out.add_(reference_sums(words, chunk))
        return
    tiles = next_pow2(max(1, cdiv(cdiv(n, _HASH_BLOCK), _HASH_PROGRAMS)))
    sa, sb = seeds(chunk)
    vec = vec_elems(4, [n])  # chunk bodies are whole 16-byte sections: 4 words
    _checksum_kernel.launch(words.device, (cdiv(n, _HASH_BLOCK * tiles),), words, out, n // vec, sa, sb,
                            BLOCK=_HASH_BLOCK, TILES=tiles, VEC=vec)


@kernel(ints=("n_vecs",))
def _scatter_kernel(
    src,  # [k, n] words: the rows as received
    dst,  # [R, n] words: the pool's rows
    idx,  # int64 [k]: destination row of each source row
    got,  # int32 [2]: the checksum computed here (CHECK)
    want,  # int32 [2]: the sender's (CHECK)
    n_vecs,  # words per row / VEC
    CHECK: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
):
    # grid: (k, cdiv(n, BLOCK)); with CHECK, nothing is read or written unless the checksums are equal (the
    # test folded into the mask: no branch on a loaded value)
    r = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    width = n_vecs * VEC
    vecs = n_vecs
    if CHECK:
        differ = (tl.load(got) ^ tl.load(want)) | (tl.load(got + 1) ^ tl.load(want + 1))
        vecs = tl.where(differ == 0, vecs, 0)  # a row of 0 words: every lane masked off
    # a product with the constexpr VEC: the mask stays uniform over VEC lanes (vector loads and stores)
    offs = t * BLOCK + tl.arange(0, BLOCK)
    m = offs < vecs * VEC
    row = tl.load(idx + r)
    x = tl.load(src + tl.multiple_of(r * width, VEC) + offs, mask=m)
    tl.store(dst + tl.multiple_of(row * width, VEC) + offs, x, mask=m)


def scatter_rows(src: torch.Tensor, dst: torch.Tensor, idx: torch.Tensor,
                 check: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """``dst[idx[r]] = src[r]`` for rows of words (``src`` [k, n], ``dst`` [R, n] of one dtype, ``idx`` int64
    [k], one device); with ``check = (got, want)`` (int32 [2] each) only if ``got == want``. On CUDA the test
    runs on the device (no host sync); the pure-torch path decides on the host."""
    k, n = src.shape
    if k == 0 or n == 0:
        return
    if not use_triton(src.device):
        if check is None or torch.equal(check[0], check[1]):
            dst.index_copy_(0, idx, src)
        return
    vec = vec_elems(src.element_size(), [n])
    got, want = check if check is not None else (idx, idx)
    block = min(_COPY_BLOCK, max(128, next_pow2(n)))
    _scatter_kernel.launch(src.device, (k, cdiv(n, block)), src, dst, idx, got, want, n // vec,
                           CHECK=check is not None, BLOCK=block, VEC=vec)
