"""One layer's paged storage as the launchers take it: validated once (by the cache when it is built, by the loose
keyword ops per call), with what every launch reads from it worked out ahead (geometry, raw pointers and their
alignment for the prepared launches)."""

from __future__ import annotations

import torch

from .checks import check_fp8_scales, pool_geometry
from .format import kv_format
from .step import Geometry

__all__ = ["PagedLayer"]


class PagedLayer:
    """One layer's pools: data ``pool``, float32 ``params`` ((scale, zero) for int8 / int4 / k8v4, key scales for
    fp8k), fp8 / fp8k ``(k_scale, v_scale)``, in the format ``kv_dtype`` / ``layout`` (see :mod:`kvcache.paged.config`).

    Parameters
    ----------
    pool : torch.Tensor
        NHD ``[num_blocks, P, block_size, H, R]`` or HND ``[num_blocks, P, H, block_size, R]``, contiguous; ``P``
        planes: 2 (K, V), 3 for k8v4.
    params : torch.Tensor or None
        float32 ``[num_blocks, 2, *pool.shape[2:4], 2]`` for int8 / int4 / k8v4, ``[num_blocks, 1,
        *pool.shape[2:4], 1]`` for fp8k, else None.
    scales : torch.Tensor or None
        float32 ``[2]`` (k_scale, v_scale), required for fp8 and fp8k (v_scale alone; ignored, and not kept, for the
        other formats).
    kv_dtype, layout : str
    dtype : torch.dtype, optional
        The model dtype that every K / V / q handed to this layer must have (a cache's); None: any the format
        takes (the loose ops check it per call).

    Attributes
    ----------
    geometry : tuple
        ``(num_blocks, block_size, num_kv_heads, head_dim, kv_dtype, layout)``, as a :class:`StepPlan`'s.
    ptrs : tuple of int
        ``data_ptr()`` of pool, params and scales (the pool's in place of a missing one: never read).
    align : tuple of bool
        Which of ``ptrs`` are 16-byte aligned, and whether ``params`` is 8-byte aligned: part of the key of a
        prepared launch (layers of one cache share one where these agree).
    strides : tuple of tuple of int
        Element strides (block, K / V, token, head) of ``pool`` and of ``params`` (zeros without), as the
        attention kernel takes them.

    Example
    -------
    >>> pool = torch.zeros(8, 2, 4, 2, 16, dtype=torch.float16)
    >>> PagedLayer(pool, None, None, "auto", "NHD").geometry
    (8, 4, 2, 16, 'auto', 'NHD')
    """

    __slots__ = ("pool", "params", "scales", "kv_dtype", "layout", "dtype", "geometry", "device", "dev_id", "ptrs",
                 "align", "strides")

    def __init__(self, pool: torch.Tensor, params: torch.Tensor | None, scales: torch.Tensor | None, kv_dtype: str,
                 layout: str, dtype: torch.dtype | None = None) -> None:
        nb, bs, h, dp = pool_geometry(pool, params, kv_dtype, layout)
        self.pool = pool
        self.params = params
        self.scales = check_fp8_scales(scales, kv_dtype, pool.device)
        self.kv_dtype = kv_dtype
        self.layout = layout
        self.dtype = dtype
        self.geometry: Geometry = (nb, bs, h, dp * 2 if kv_format(kv_dtype).value_bits == 4 else dp, kv_dtype, layout)
        self.device = pool.device
        # what get_device() returns for tensors on this device: a CUDA index, -1 for the CPU
        self.dev_id = pool.device.index if pool.device.type == "cuda" else -1
        self.ptrs = tuple(t.data_ptr() for t in (pool, pool if params is None else params,
                                                 pool if self.scales is None else self.scales))
        par = params.data_ptr() if params is not None else 0
        self.align = (*(p % 16 == 0 for p in self.ptrs), par % 8 == 0)
        order = (0, 1, 2, 3) if layout == "NHD" else (0, 1, 3, 2)  # (block, K / V, token, head)
        ps = params.stride() if params is not None else (0, 0, 0, 0)
        self.strides = (tuple(pool.stride(i) for i in order), tuple(ps[i] for i in order))
