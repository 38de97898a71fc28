"""Launchers of the attention kernels: validated arguments in, one attention launch (plus one merge launch when
the KV range is split) out. No allocation when the caller passes ``out`` (and ``workspace`` for split launches),
no host sync: capturable in a CUDA graph.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from ..._validate import cdiv, next_pow2
from .._pdl import pdl_options
from ..paged.format import KV_FORMAT_TABLE
from ..paged.layer import PagedLayer
from ..paged.step import StepPlan
from ._combine import _combine_kernel, _merge_kernel
from ._kernel import _attention_kernel
from .policy import AttentionPlan


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (132 where there is none: the CPU interpreter)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _search_steps(n_seqs: int) -> int:
    """Binary-search steps that find any of ``n_seqs`` sequences, rounded up to a multiple of 8: one compiled
    kernel for every batch of up to 128 sequences (a step past the answer re-reads one cached int)."""
    need = math.ceil(math.log2(max(n_seqs, 1))) + 1
    return 8 * -(-need // 8)


def _strides3(t: torch.Tensor | None, linear: bool) -> tuple[int, int, int]:
    """(token, head, batch) strides of q / out ``[n, Hq, D]`` or ``[B, Hq, q_len, D]``, lse likewise."""
    if t is None:
        return 0, 0, 0
    if linear:
        return t.stride(2), t.stride(1), t.stride(0)
    return t.stride(0), t.stride(1), 0


class AttentionPart(NamedTuple):
    """One attention launch of a step: its sequences' block tables, cu_q_lens and lengths (the whole batch, or
    the decode or the prefill sequences of a mixed one), its tiles and the resolved score scale."""

    block_tables: torch.Tensor
    cu_q_lens: torch.Tensor
    kv_lens: torch.Tensor
    plan: AttentionPlan
    scale: float


class _KV(NamedTuple):
    """The KV side of one launch as the kernel takes it: tensors, pool / params strides and the batch's shape."""

    pool: torch.Tensor
    params: torch.Tensor | None
    kv_scales: torch.Tensor | None
    block_tables: torch.Tensor | None
    cu_q_lens: torch.Tensor | None
    kv_lens: torch.Tensor
    strides: tuple[int, int, int, int]  # block, K/V, token, head (elements of the pool)
    p_strides: tuple[int, int, int, int]  # the same of params
    bs: int
    h: int
    table: tuple[int, int, int]  # block-table width and row stride, blocks in the pool
    rows: tuple[int, int, int, int]  # query rows, q_len (linear), sequences, programs per KV head


def launch_paged_attention(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None, sinks: torch.Tensor | None,
                           layer: PagedLayer, step: StepPlan, part: AttentionPart,
                           workspace: torch.Tensor | None) -> None:
    """Launch ``part`` of ``step``'s attention over ``layer`` (validated): q / out ``[n, Hq, D]``, lse
    ``[n, Hq]``; the step gives context parallelism, window, soft-cap and ``q_rope``."""
    n_rows = q.shape[0]
    bt = part.block_tables
    n_seqs = bt.shape[0]
    num_blocks, bs, h = layer.geometry[:3]
    kv = _KV(layer.pool, layer.params, layer.scales, bt, part.cu_q_lens, part.kv_lens, *layer.strides, bs, h,
             (bt.shape[1], bt.stride(0), num_blocks),
             (n_rows, 0, n_seqs, n_rows // part.plan.block_q + n_seqs if n_seqs else 0))
    _launch(q, out, lse, sinks, kv, layer.kv_dtype, part.plan, workspace, (step.cp_rank, step.cp_size),
            (part.scale, step.window, step.softcap), step.q_rope)


def launch_linear_attention(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                            sinks: torch.Tensor | None, layer: torch.Tensor, kv_scales: torch.Tensor | None,
                            lengths: torch.Tensor, options: tuple[float, int | None, float | None],
                            plan: AttentionPlan, workspace: torch.Tensor | None) -> None:
    """Launch attention over a linear cache layer ``[B, 2, H, S, D]`` (validated): q / out ``[B, Hq, q_len, D]``,
    lse ``[B, Hq, q_len]``, ``lengths`` the tokens cached before the new rows; ``options`` = (scale, window,
    softcap)."""
    bsz, _, q_len, _ = q.shape
    kv = _KV(layer, None, kv_scales, None, None, lengths, tuple(layer.stride()[:4]), (0, 0, 0, 0),  # type: ignore[arg-type]
             layer.shape[3], layer.shape[2], (1, 0, layer.shape[0]),
             (bsz * q_len, q_len, bsz, bsz * cdiv(q_len, plan.block_q) if q_len else 0))
    # the linear layer's strides are (batch, K/V, head, token): token and head swap places against a paged pool
    st = kv.strides
    kv = kv._replace(strides=(st[0], st[1], st[3], st[2]))
    _launch(q, out, lse, sinks, kv, "fp8" if layer.dtype == torch.float8_e4m3fn else "auto", plan, workspace,
            (0, 1), options, None)


def _launch(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None, sinks: torch.Tensor | None, kv: _KV,
            kv_dtype: str, plan: AttentionPlan, workspace: torch.Tensor | None, cp: tuple[int, int],
            options: tuple[float, int | None, float | None], q_rope: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """One attention launch (plus one merge launch when the KV range is split); linear mode when
    ``kv.block_tables`` is None."""
    linear = kv.block_tables is None
    dev = q.device
    n_rows, q_len, n_seqs, grid0 = kv.rows
    hq, d = q.shape[1], q.shape[-1]
    if grid0 == 0 or n_rows == 0:
        return
    scale, window, softcap = options
    pool = kv.pool
    g = hq // kv.h
    h1 = (d + 1) // 2
    splits = plan.num_splits
    dummy = kv.kv_lens
    if splits > 1:
        ws_out = workspace[: splits * n_rows * hq * d]  # type: ignore[index]
        ws_lse = workspace[splits * n_rows * hq * d: splits * n_rows * hq * (d + 1)]  # type: ignore[index]
    else:
        ws_out = ws_lse = dummy
    sq, so, sl = _strides3(q, linear), _strides3(out, linear), _strides3(lse, linear)
    quant = KV_FORMAT_TABLE[kv_dtype].code
    fp8 = quant in (1, 5)  # fp8 / fp8k: e4m3 rows with the layer's scales
    integer = quant in (2, 3, 4, 6)  # int8 / int4 / k8v4 / int4b: values as codes with (scale, zero) per token
    kv_scales = kv.kv_scales if fp8 else None
    # triton's interpreter computes bf16 dots wrongly (it multiplies the raw bits): float32 operands there
    dot_f32 = dev.type != "cuda" and q.dtype == torch.bfloat16
    if fp8:
        pool = pool.view(torch.uint8)  # bytes: see _load_kv
    if plan.warp_split and not (integer and quant != 6):
        raise ValueError(f"warp-split attention tiles need an int8 / int4 / k8v4 cache, got kv_dtype {kv_dtype!r}")
    p_strides = kv.p_strides
    wk = 0
    if quant == 6:  # int4b: one params plane, the values' (scale, zero) in words 0, 1 of each slot
        p_strides = (p_strides[0], 0, p_strides[2], p_strides[3])
        wk = kv.params.shape[-1] - 2  # type: ignore[union-attr]
    # int8 / int4 / k8v4 decode tiles (16 rows) and warp-split tiles fold V's (scale, zero) per token (_kernel
    # docstring)
    v_fold = integer and (plan.block_q * next_pow2(g) <= 16 or plan.warp_split)
    s_blk, s_kv, s_tok, s_head = kv.strides
    table_width, bt_stride, n_blocks = kv.table
    _attention_kernel.launch(
        dev, (grid0 * kv.h, splits),
        q, out, lse if lse is not None else dummy, ws_out, ws_lse, pool,
        kv.params if kv.params is not None else dummy, kv_scales if kv_scales is not None else dummy,
        sinks if sinks is not None else dummy, kv.block_tables if not linear else dummy,
        kv.cu_q_lens if kv.cu_q_lens is not None else dummy, kv.kv_lens,
        q_rope[0] if q_rope is not None else dummy, q_rope[1] if q_rope is not None else dummy,
        sq[0], sq[1], sq[2], so[0], so[1], so[2], sl[0], sl[1], sl[2], bt_stride, table_width, n_blocks, q_len,
        n_seqs, n_rows, cp[0], cp[1], window if window is not None else 0, splits, grid0,
        q_rope[0].shape[0] if q_rope is not None else 0,
        SM_SCALE=float(scale), SOFTCAP=float(softcap) if softcap is not None else 0.0, D=d, H1=h1,
        HALF_P=max(16, next_pow2(h1)), HQ=hq, G=g, G_P=next_pow2(g), BLOCK_Q=plan.block_q, BLOCK_N=plan.block_n,
        BS=kv.bs, S_BLK=s_blk, S_KV=s_kv, S_TOK=s_tok, S_HEAD=s_head, P_BLK=p_strides[0], P_KV=p_strides[1],
        P_TOK=p_strides[2], P_HEAD=p_strides[3], QUANT=quant, WK=wk, FP8_SCALED=kv_scales is not None,
        LINEAR=linear, LOG_B=_search_steps(n_seqs), HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None, HAS_LSE=lse is not None,
        PRECISION="ieee" if q.dtype == torch.float32 or dot_f32 else None, DOT_F32=dot_f32,
        V_FOLD=v_fold, Q_RESCALE=v_fold and quant in (2, 4) and q.dtype == torch.bfloat16,  # int8 keys
        WARPS_K=plan.num_warps if plan.warp_split else 1, HEADS_INNER=plan.block_q * next_pow2(g) <= 16,
        MIN_SPLIT_TILES=max(1, plan.min_split_keys // plan.block_n), INTERP=dev.type != "cuda",
        Q_ROPE=q_rope is not None, num_warps=plan.num_warps, num_stages=plan.num_stages,
        # programmatic dependent launch where available: the launch overlaps the previous kernel's tail
        **pdl_options(dev),
    )
    if splits > 1:
        _combine_kernel.launch(
            dev, (n_rows, hq),
            ws_out, ws_lse, out, lse if lse is not None else dummy,
            kv.cu_q_lens if kv.cu_q_lens is not None else dummy,
            so[0], so[1], so[2], sl[0], sl[1], sl[2], n_rows, q_len, n_seqs, splits,
            D=d, D_P=next_pow2(d), HQ=hq, SPLITS_P=max(2, next_pow2(splits)), LINEAR=linear,
            HAS_LSE=lse is not None, num_warps=4 if d >= 128 else 2,
        )


def launch_merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor) -> None:
    """Launch the two-state merge on contiguous validated tensors (rows = every dim but the last of out)."""
    d = out.shape[-1]
    n = lse.numel()
    if n == 0:
        return
    d_p = next_pow2(d)
    block_r = max(1, min(64, 4096 // d_p))
    _merge_kernel.launch(out.device, (cdiv(n, block_r),), out_a, lse_a, out_b, lse_b, out, lse, n,
                         D=d, D_P=d_p, BLOCK_R=block_r, num_warps=4)
