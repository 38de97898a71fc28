"""Launch variants of the paged append for the tests: built from the policy's own output
(:func:`kvcache.ops.paged.plan_append`) with ``dataclasses.replace``, and run through the launcher's ``launch=``
argument on a test cache's layer.

Variant names (``SHAPES``):

* ``per-row``: one program per row (K and V), the launch of a prefill-sized append;
* ``split-kv``: one program for each row's K and one for its V, the launch of a decode-sized append;
* ``split-kv-heads``: as ``split-kv``, each row's heads in two groups of programs (one where there is only one
  head).
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from kvcache._backend import pdl_enabled
from kvcache.ops.paged import AppendLaunch, PagedLayer, append_paged_kv_launch, plan_append
from kvcache.ops.paged.format import KV_FORMAT_TABLE
from kvcache.ops.paged.launch import pdl_supported, ptx, rope_kind
from kvcache.ops.paged.policy import SPLIT_BELOW
from kvcache.rope import RopeConfig, RopeKernelParams

SHAPES = ("per-row", "split-kv", "split-kv-heads")


def device_plan(k: torch.Tensor, *, kv_dtype: str, n_seqs: int | None, rope: RopeKernelParams | None,
                n_rows: int | None = None, metadata_ready: bool = False, rope_ready: bool = False,
                pdl: bool | None = None) -> AppendLaunch:
    """The policy's launch for an append of ``k`` (``n_rows`` rows if given) on ``k``'s device: PDL where the
    device supports it and ``KVCACHE_PDL`` allows it (or ``pdl``), inline PTX on NVIDIA builds."""
    dev = k.device
    if pdl is None:
        pdl = pdl_enabled() and pdl_supported(dev)
    return plan_append(n_rows=k.shape[0] if n_rows is None else n_rows, n_seqs=n_seqs, num_kv_heads=k.shape[1],
                       head_dim=k.shape[2], kv_dtype=kv_dtype, rope=rope_kind(rope, k.shape[2]), pdl=pdl,
                       ptx=ptx(dev), metadata_ready=metadata_ready, rope_ready=rope_ready)


def as_split(plan: AppendLaunch, *, num_kv_heads: int, head_dim: int, kv_dtype: str, slots: bool, rope: bool,
             head_groups: int = 1) -> AppendLaunch:
    """``plan`` with one program per row's K and one per its V (``head_groups`` programs each), and what a split
    launch takes with it: the stores before the block-table wait (predicated, except where K and V programs
    both rotate: quantized slot mapping with RoPE), no cache hints, no inline-PTX (scale, zero) store, one warp
    per KiB of row."""
    select = rope and KV_FORMAT_TABLE[kv_dtype].code >= 1 and slots
    return dataclasses.replace(plan, split=True, head_groups=head_groups, early=True, masked=not select,
                               rope_select=select, hints=False, pair_asm=False,
                               num_warps=max(1, min(8, num_kv_heads * head_dim // 1024)))


def variant(shape: str, k: torch.Tensor, *, kv_dtype: str, n_seqs: int | None,
            rope: RopeKernelParams | None) -> AppendLaunch:
    """The launch named ``shape`` (see :data:`SHAPES`) for an append of ``k`` ``[N, H, D]``."""
    if shape == "per-row":
        return device_plan(k, kv_dtype=kv_dtype, n_seqs=n_seqs, rope=rope, n_rows=max(k.shape[0], SPLIT_BELOW))
    if shape not in SHAPES:
        raise ValueError(f"shape: expected one of {SHAPES}, got {shape!r}")
    H, D = k.shape[1], k.shape[2]
    plan = device_plan(k, kv_dtype=kv_dtype, n_seqs=n_seqs, rope=rope, n_rows=min(k.shape[0], SPLIT_BELOW - 1))
    groups = min(2, 1 << (H - 1).bit_length()) if shape == "split-kv-heads" else 1
    return as_split(plan, num_kv_heads=H, head_dim=D, kv_dtype=kv_dtype, slots=n_seqs is None,
                    rope=rope is not None, head_groups=groups)


def kernel_rope(rope: RopeConfig | RopeKernelParams | None, device: torch.device) -> RopeKernelParams | None:
    """The kernel parameters of ``rope`` on ``device`` (None: no RoPE)."""
    if isinstance(rope, RopeConfig):
        return rope.kernel_params(device=device)
    return rope


def append_with(cache, layer: int, k: torch.Tensor, v: torch.Tensor, launch: AppendLaunch | str | None, *,  # type: ignore[no-untyped-def]
                rope: RopeConfig | RopeKernelParams | None = None, rope_ready: bool = False, **index):
    """Append ``k`` / ``v`` into ``layer`` of the :class:`~kvcache.PagedKVCache` ``cache`` through
    :func:`kvcache.ops.paged.append_paged_kv_launch` with ``launch``: an :class:`AppendLaunch`, a name of
    :data:`SHAPES` (:func:`variant`), or None (the policy's). ``rope`` None: no RoPE; ``index``: the step's
    :meth:`~kvcache.PagedKVCache.plan` keywords (``rope_ready``: the plan's promise about ``inv_freq``). Returns
    the launcher's plan (or None)."""
    cfg = cache.config
    params = kernel_rope(rope, k.device)
    plan = dataclasses.replace(cache.plan(rope=params if params is not None else False, **index),
                               rope_ready=rope_ready)
    if isinstance(launch, str):
        launch = variant(launch, k, kv_dtype=cfg.kv_dtype, n_seqs=None if plan.slot_mapping is not None
                         else plan.num_seqs, rope=params)
    storage = PagedLayer(cache.pool(layer), cache.params(layer), cache.kv_scales[layer], cfg.kv_dtype, cfg.layout)
    return append_paged_kv_launch(k, v, storage, plan, launch)


_LATE_WRITERS = None


def late_writer_kernels():  # type: ignore[no-untyped-def]
    """(late_writer, eager_copy): a Triton kernel launched with PDL that releases its dependents at once, then
    spins and only then writes ``dst``, and a control that copies without waiting for the previous kernel (built
    on first use: GPU only)."""
    global _LATE_WRITERS
    if _LATE_WRITERS is None:
        import triton.language as tl
        from triton.language.extra.cuda import gdc_launch_dependents

        @triton.jit
        def late_writer(src, dst, n, SPIN: tl.constexpr, BLOCK: tl.constexpr):
            gdc_launch_dependents()  # the next kernel may start now, long before dst is written
            acc = tl.program_id(0).to(tl.float32)
            for _ in range(SPIN):
                acc = acc * 0.999 + 1.0
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(src + offs, mask=offs < n)
            tl.store(dst + offs, x + (acc * 0.0).to(x.dtype), mask=offs < n)

        @triton.jit
        def eager_copy(src, dst, n, BLOCK: tl.constexpr):  # no wait for the previous kernel: a control
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

        _LATE_WRITERS = late_writer, eager_copy
    return _LATE_WRITERS
