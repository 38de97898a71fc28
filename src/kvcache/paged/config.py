"""Paged-cache configuration and byte format.

Byte format of one layer's pool (``L`` layers share one allocation ``[L, ...]``):

==========  ============================================================  ==============================
kv_dtype    data, per layer                                                stored element
==========  ============================================================  ==============================
"auto"      NHD ``[num_blocks, 2, block_size, H, D]`` / HND ``[num_blocks,  the model dtype (fp16 / bf16)
            2, H, block_size, D]``
"fp8"       same shapes                                                    float8_e4m3fn of ``x * (1/scale)``
"int8"      same shapes                                                    uint8 code
"int4"      same shapes with ``D // 2`` bytes per row                      two uint4 codes per byte
"k8v4"      ``[num_blocks, 3, block_size, H, D // 2]`` (NHD) /             keys: uint8 codes; values: two
            ``[num_blocks, 3, H, block_size, D // 2]`` (HND)               uint4 codes per byte
"fp8k"      as "fp8"                                                       float8_e4m3fn of ``x * (1/scale)``
"int4b"     as "int4"                                                      two uint4 codes per byte (keys:
                                                                           int8 rows in a partial block)
==========  ============================================================  ==============================

``[:, 0]`` holds keys, ``[:, 1]`` values (k8v4: ``[:, 0]`` / ``[:, 1]`` the int8 codes of key elements ``[0, D/2)``
/ ``[D/2, D)``, ``[:, 2]`` the int4 values): the single-tensor paged layout of FlashInfer (``NHD``: ``[pages, 2,
page_size, heads, head_dim]``; ``HND``: ``[pages, 2, heads, page_size, head_dim]``), so ``auto`` and ``fp8``
pools are handed to FlashInfer as they are, and ``pool[:, 0]`` / ``pool[:, 1]`` (NHD) are the
``[num_blocks, block_size, H, D]`` K / V caches of FlashAttention's ``flash_attn_with_kvcache``.

Quantization (TurboMind's, per token and head, asymmetric):

* int8 / int4 / k8v4 (``b`` = 8 / 4 bits; k8v4: keys 8, values 4): over the ``D`` values of one (token, head) —
  keys after RoPE —
  ``scale = (max - min) / (2^b - 1)``, ``zero = min``, ``q = clamp(round_half_even((x - zero) * (1 / scale)),
  0, 2^b - 1)`` (one IEEE reciprocal per row, then multiplies; ``q = 0`` when ``scale == 0``: a constant
  vector round-trips exactly), dequantized as ``q * scale + zero``; all in float32. ``scale`` and ``zero``
  are float32, stored beside the data in a params pool of the data's layout with a last dim of 2:
  NHD ``[num_blocks, 2, block_size, H, 2]``, HND ``[num_blocks, 2, H, block_size, 2]``. Padded lanes
  (head_dim not a power of two) never take part in min / max. Error bound:
  ``|x - dequant(q)| <= scale / 2`` (plus float32 rounding).
* k8v4: keys are int8 rows (what quality needs most: their channels differ in size, and one scale per row
  spends 4 bits' 16 levels on the largest channel), values int4 rows; bytes per (token, head)
  ``D + D / 2 + 16``, against int8's ``2 D + 16`` and int4's ``D + 16``.
* int4 nibble order (planar halves, the values of k8v4 too): element ``i`` of a row in the low nibble of byte
  ``i``, element
  ``D/2 + i`` in the high nibble (``byte[i] = q[i] | q[D/2 + i] << 4``, ``i < D/2``). ``head_dim`` must be
  even. Chosen over adjacent pairs because the two halves are exactly the pairs of rotate-half RoPE: the
  kernels rotate, quantize and pack a row from two contiguous half tiles, with no data shuffles.
* fp8: ``float8_e4m3fn(clamp(x * (1 / scale), -448, 448))`` (round to nearest even, saturating) with one
  float32 scale per layer for K and one for V
  (``PagedKVCache.kv_scales[layer] = (k_scale, v_scale)``, default 1.0), as vLLM's ``fp8`` cache.
* fp8k: values as fp8 (scale ``v_scale``); keys (after RoPE) with one float32 scale per (token, head),
  ``scale = max(amax / 448, 2^-126)`` over the row's ``D`` elements (``amax`` the largest magnitude, non-zero; the
  floor keeps the scale a normal float32 with a finite reciprocal; ``k_scale`` is not used),
  stored as ``float8_e4m3fn(x * (1 / scale))`` (one IEEE reciprocal per row): the row's largest element is
  stored as +-448, exactly, which is what the scores of a key with an outlier channel need (e4m3's error is
  relative, so a fixed scale cannot help). ``scale == 0`` (a zero row) stores zeros; a row with a NaN or an
  infinity stores scale NaN (it reads back NaN). The scales live in a params pool of one plane: NHD
  ``[num_blocks, 1, block_size, H, 1]``, HND ``[num_blocks, 1, H, block_size, 1]``. Bytes per (token, head)
  ``2 D + 4`` (fp8: ``2 D``). Error bound of a key element: ``|x - dequant| <= max(|x| / 16, scale / 1024)``
  (half a step of e4m3's 3 mantissa bits, or of its subnormals; products below 2^-126 may flush to 0 on a GPU).
* int4b: values as int4's rows; keys as int4 codes per channel over each full block (an fp16 (scale, zero) per
  (block, head, channel), from the block's min / max), the partial last block of a sequence keeping its keys as
  int8 rows (int8's encoding) split over its own and the next block's key plane until it fills. One params plane of
  ``2 + ceil(D / block_size)`` float32 words per (token slot, head): the value row's (scale, zero), then the block's
  key area. ``block_size <= head_dim / 2`` (on CUDA a power of two); a sequence of ``L`` tokens holds
  ``L // block_size`` blocks, two more when ``L % block_size``. Bytes per (token, head)
  ``D + 4 (2 + ceil(D / block_size))``: 168 at D = 128, block 16.
  The full statement: :mod:`kvcache.ops.paged.block_keys`.
"""

from __future__ import annotations

import dataclasses

import torch

from .._device import resolve_device
from .._validate import MODEL_DTYPES, check_choice, check_dtype_in, check_int
from ..ops.paged.block_keys import blocks_for_tokens
from ..ops.paged.format import KV_FORMATS, LAYOUTS, KVFormat, kv_format

__all__ = ["PagedConfig", "cache_block_bytes", "KV_FORMATS", "LAYOUTS"]


def cache_block_bytes(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float16,
    kv_dtype: str = "auto",
) -> int:
    """Bytes of one block over all layers, K and V, quantization parameters included (TurboMind's
    ``get_cache_block_size``). Equals what :class:`~kvcache.paged.PagedKVCache` allocates per block.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim, block_size : int
    dtype : torch.dtype
        Model dtype (float16, bfloat16, float32): the stored element for ``kv_dtype="auto"``.
    kv_dtype : str
        ``"auto"``, ``"fp8"``, ``"int8"``, ``"int4"``, ``"k8v4"``, ``"fp8k"`` or ``"int4b"``.

    Example
    -------
    >>> cache_block_bytes(32, 8, 128, 16, torch.bfloat16, "k8v4") // (32 * 8 * 16)  # bytes per (token, head)
    208
    """
    check_int("num_layers", num_layers, 1)
    check_int("num_kv_heads", num_kv_heads, 1)
    check_int("head_dim", head_dim, 1)
    check_int("block_size", block_size, 1)
    check_dtype_in("dtype", dtype, MODEL_DTYPES)
    check_choice("kv_dtype", kv_dtype, KV_FORMATS)
    fmt = kv_format(kv_dtype)
    _check_geometry(fmt, head_dim, block_size)
    return num_layers * block_size * num_kv_heads * fmt.token_head_bytes(head_dim, dtype, block_size)


def _check_geometry(fmt: KVFormat, head_dim: int, block_size: int) -> None:
    if fmt.needs_even_head_dim and head_dim % 2:
        raise ValueError(f"head_dim: expected an even head_dim for kv_dtype={fmt.name!r}, got {head_dim}")
    if fmt.block_keys and 2 * block_size > head_dim:
        raise ValueError(f"block_size: expected at most head_dim / 2 = {head_dim // 2} for kv_dtype={fmt.name!r} (a "
                         f"block's key area holds its partial rows' (scale, zero) pairs), got {block_size}")


@dataclasses.dataclass(frozen=True)
class PagedConfig:
    """Shape and format of a :class:`~kvcache.paged.PagedKVCache`.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Any head_dim (even for int4 and k8v4).
    block_size : int
        Tokens per block (page), any positive int (16 and 64 are common).
    num_blocks : int
        Blocks in the pool of every layer.
    dtype : torch.dtype
        The model dtype: of K / V given to ``append`` and returned by ``gather``.
    kv_dtype : str
        ``"auto"`` (store ``dtype``), ``"fp8"``, ``"int8"``, ``"int4"``, ``"k8v4"``, ``"fp8k"``, ``"int4b"`` (see the
        module docstring).
    layout : str
        ``"NHD"`` (token-major inside a block) or ``"HND"`` (head-major).
    device : torch.device | str | int | None
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype = torch.float16
    kv_dtype: str = "auto"
    layout: str = "NHD"
    device: torch.device | str | int | None = None

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, 1)
        check_int("num_kv_heads", self.num_kv_heads, 1)
        check_int("head_dim", self.head_dim, 1)
        check_int("block_size", self.block_size, 1)
        check_int("num_blocks", self.num_blocks, 1)
        check_dtype_in("dtype", self.dtype, MODEL_DTYPES)
        check_choice("kv_dtype", self.kv_dtype, KV_FORMATS)
        check_choice("layout", self.layout, LAYOUTS)
        _check_geometry(kv_format(self.kv_dtype), self.head_dim, self.block_size)
        object.__setattr__(self, "device", resolve_device(self.device))
        pow2 = self.block_size & (self.block_size - 1) == 0
        if kv_format(self.kv_dtype).block_keys and self.device.type == "cuda" and not pow2:
            raise NotImplementedError(f"kv_dtype={self.kv_dtype!r}: the CUDA kernels take a power-of-two block_size, "
                                      f"got {self.block_size}")

    @property
    def quantized(self) -> bool:
        """True for int8 / int4 / k8v4 (scale and zero per token and head)."""
        return kv_format(self.kv_dtype).row_params

    @property
    def has_params(self) -> bool:
        """True where the cache keeps a params pool (:meth:`params_shape`): int8 / int4 / k8v4 (scale and zero per
        token and head of K and V) and fp8k (a scale per token and head of K)."""
        return kv_format(self.kv_dtype).has_params

    @property
    def storage_dtype(self) -> torch.dtype:
        """torch dtype of the data pool: the model dtype (auto), float8_e4m3fn (fp8, fp8k) or uint8 (int8 / int4 /
        k8v4)."""
        return kv_format(self.kv_dtype).storage_dtype(self.dtype)

    @property
    def row_elems(self) -> int:
        """Stored elements per (token, head) row of one plane: ``head_dim``, or ``head_dim // 2`` bytes for int4 and
        k8v4."""
        return kv_format(self.kv_dtype).row_elems(self.head_dim)

    def pool_shape(self) -> tuple[int, ...]:
        """Shape of one layer's data pool."""
        planes = kv_format(self.kv_dtype).planes
        if self.layout == "NHD":
            return (self.num_blocks, planes, self.block_size, self.num_kv_heads, self.row_elems)
        return (self.num_blocks, planes, self.num_kv_heads, self.block_size, self.row_elems)

    def params_shape(self) -> tuple[int, ...]:
        """Shape of one layer's params pool (formats where :attr:`has_params`): ``[num_blocks, P, block_size, H, W]``
        (NHD) / ``[num_blocks, P, H, block_size, W]`` (HND), ``(P, W)`` = (2, 2) for (scale, zero) of K and V, (1, 1)
        for fp8k's key scales."""
        fmt = kv_format(self.kv_dtype)
        p, w = (fmt.param_planes, fmt.params_width(self.head_dim, self.block_size)) if fmt.has_params else (2, 2)
        if self.layout == "NHD":
            return (self.num_blocks, p, self.block_size, self.num_kv_heads, w)
        return (self.num_blocks, p, self.num_kv_heads, self.block_size, w)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens holds: ``ceil(num_tokens / block_size)``; for int4b, a partial
        last block keeps the block after it too (its int8 key rows spill into that block's key plane), so
        ``num_tokens // block_size`` plus 2 when ``num_tokens % block_size``.

        Example
        -------
        >>> cfg = PagedConfig(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, num_blocks=8, kv_dtype="int4b")
        >>> cfg.blocks_for(32), cfg.blocks_for(33), PagedConfig(1, 1, 64, 16, 8).blocks_for(33)
        (2, 4, 3)
        """
        check_int("num_tokens", num_tokens, 0)
        if kv_format(self.kv_dtype).block_keys:
            return blocks_for_tokens(num_tokens, self.block_size)
        return -(-num_tokens // self.block_size)

    @property
    def block_bytes(self) -> int:
        """:func:`cache_block_bytes` of this config."""
        return cache_block_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype,
                                 self.kv_dtype)
