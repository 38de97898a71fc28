"""Launchers of the paged kernels: turn validated arguments and a launch description (:mod:`.policy`) into a
kernel launch (compiled on CUDA, interpreted on the CPU with ``KVCACHE_TRITON_INTERPRET=1``, else the pure-torch
reference). :class:`AppendPlan` repeats a compiled append with raw pointers (the cache's hot path)."""

from __future__ import annotations

import functools

import torch

from ..._backend import PreparedLaunch, pdl_enabled, use_triton
from ..._validate import cdiv, next_pow2, vec_elems
from ...rope import RopeKernelParams
from .format import KV_FORMAT_TABLE
from .kernels.append import _append_kernel, gdc_wait
from .kernels.codes import BY_CU_K_LENS, BY_KV_LENS, BY_SLOTS
from .kernels.copy_blocks import _copy_blocks_kernel
from .kernels.gather import _gather_kernel
from .kernels.lookup import _GUESS_ONE, _guess_mul
from .policy import AppendLaunch, GatherLaunch, RopeKind, check_launch, plan_append, plan_gather
from .reference import append_paged_kv_reference, gather_paged_kv_reference

__all__ = ["AppendPlan", "append_paged_kv_launch", "gather_paged_kv_launch", "copy_blocks_launch", "rope_kind",
           "pdl_supported", "default_append_launch"]


def ptx(device: torch.device) -> bool:
    """Whether kernels for ``device`` are compiled from PTX (an NVIDIA GPU: inline PTX may be used)."""
    return device.type == "cuda" and torch.version.hip is None


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch is possible on ``device``: CUDA, compute capability >= 9.0, triton >= 3.4."""
    return device.type == "cuda" and gdc_wait is not None and torch.cuda.get_device_capability(device)[0] >= 9


def rope_kind(rope: RopeKernelParams | None, head_dim: int) -> RopeKind:
    """The policy's view of a RoPE: none, rotate-half over the whole head_dim ("full"), or anything else."""
    if rope is None:
        return "none"
    return "full" if (not rope.interleaved and int(rope.rotary_dim) == head_dim) else "partial"


def default_append_launch(k: torch.Tensor, pool: torch.Tensor, *, kv_dtype: str, n_seqs: int | None,
                          rope: RopeKernelParams | None, metadata_ready: bool = False,
                          rope_ready: bool = False) -> AppendLaunch:
    """:func:`.policy.plan_append` for an append of ``k`` ``[N, H, D]`` into ``pool`` on its device."""
    dev = pool.device
    return plan_append(n_rows=k.shape[0], n_seqs=n_seqs, num_kv_heads=k.shape[1], head_dim=k.shape[2],
                       kv_dtype=kv_dtype, rope=rope_kind(rope, k.shape[2]),
                       pdl=pdl_enabled() and pdl_supported(dev), ptx=ptx(dev), metadata_ready=metadata_ready,
                       rope_ready=rope_ready)


def _block_strides(hnd: bool, H: int, DP: int, bs: int) -> dict[str, int]:
    """Element strides inside one K (or V) region of a block, [bs, H, DP] (NHD) or [H, bs, DP] (HND): of a
    token and of a head, in the data pool (S_*) and in the (scale, zero) params pool (P_*, 2 floats per row)."""
    if hnd:
        return dict(S_TOK=DP, S_HEAD=bs * DP, P_TOK=2, P_HEAD=bs * 2)
    return dict(S_TOK=H * DP, S_HEAD=DP, P_TOK=H * 2, P_HEAD=2)


def _rope_args(rope):  # type: ignore[no-untyped-def]
    if rope is None:
        return False, 2, False, 1.0, None
    return True, int(rope.rotary_dim), bool(rope.interleaved), float(rope.attention_scaling), rope.inv_freq




def _max_freq(rope) -> float:  # type: ignore[no-untyped-def]
    # the append's FMAX: max(inv_freq) when the params carry it (0.0: unknown, full-range cos / sin everywhere)
    top = getattr(rope, "max_inv_freq", 0.0) if rope is not None else 0.0
    return float(top) if top > 0 else 0.0  # (validated by the callers: a finite number >= 0)


def append_paged_kv_launch(
    k: torch.Tensor,
    v: torch.Tensor,
    pool: torch.Tensor,
    params: torch.Tensor | None,
    *,
    kv_dtype: str,
    layout: str,
    block_tables: torch.Tensor | None,
    cu_q_lens: torch.Tensor | None,
    kv_lens: torch.Tensor | None,
    cu_k_lens: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    positions: torch.Tensor | None,
    rope: RopeKernelParams | None,
    fp8_scales: torch.Tensor | None,
    cp_rank: int,
    cp_size: int,
    launch: AppendLaunch | None = None,
    metadata_ready: bool = False,
    rope_ready: bool = False,
) -> AppendPlan | None:
    """Launch the append kernel; the arguments are those of :func:`kvcache.ops.append_paged_kv`, already
    validated (``k`` / ``v`` model dtype ``[N, H, D]``, ``pool`` / ``params`` one layer's pools, index tensors
    int32 / int64 on the pool's device, ``rope.inv_freq`` float32 on it, ``fp8_scales`` float32 ``[2]``).

    ``launch``: the launch description; default :func:`default_append_launch` (the policy, from
    ``metadata_ready`` and ``rope_ready``: no running kernel writes ``rope.inv_freq``). A variant built with
    ``dataclasses.replace`` is checked (:func:`.policy.check_launch`) before anything runs.

    Returns an :class:`AppendPlan` for repeating this launch with new tensors of the same kind (compiled
    kernels on CUDA), else None.
    """
    n_seqs = None if slot_mapping is not None else cu_q_lens.shape[0] - 1  # type: ignore[union-attr]
    H, D = k.shape[1], k.shape[2]
    kind = rope_kind(rope, D)
    if launch is None:
        launch = default_append_launch(k, pool, kv_dtype=kv_dtype, n_seqs=n_seqs, rope=rope,
                                       metadata_ready=metadata_ready, rope_ready=rope_ready)
    check_launch(launch, num_kv_heads=H, rope=kind, pdl_supported=pdl_supported(pool.device))
    n_tokens = k.shape[0]
    if n_tokens == 0:
        return None
    if not use_triton(pool.device):
        append_paged_kv_reference(
            k, v, pool, params, kv_dtype=kv_dtype, layout=layout, block_tables=block_tables, cu_q_lens=cu_q_lens,
            kv_lens=kv_lens, cu_k_lens=cu_k_lens, slot_mapping=slot_mapping, positions=positions, rope=rope,
            fp8_scales=fp8_scales, cp_rank=cp_rank, cp_size=cp_size,
        )
        return None
    if n_seqs == 0:
        return None  # no sequence: every row is padding
    quant = KV_FORMAT_TABLE[kv_dtype].code
    has_rope, rot, inter, attn_scale, inv_freq = _rope_args(rope)
    hnd = layout == "HND"
    bs = pool.shape[3] if hnd else pool.shape[2]
    split, hg = launch.split, (launch.head_groups if launch.split else 1)
    # vector loads of k / v rows: the row strides (runtime ints) are passed in units of VEC elements (up to 16
    # bytes); the head strides and the half-row offset are constexprs, whose divisibility the compiler sees
    vec = vec_elems(k.element_size(), (k.stride(0), v.stride(0)))
    ns = n_seqs or 0
    args = _append_args(
        k=k, v=v, pool=pool, params=params, block_tables=block_tables, cu_q=cu_q_lens,
        k_lens=kv_lens if kv_lens is not None else cu_k_lens, slots=slot_mapping, positions=positions,
        inv_freq=inv_freq, fp8_scales=fp8_scales, stride_kn=k.stride(0) // vec, stride_vn=v.stride(0) // vec,
        bt_stride=block_tables.stride(0) if block_tables is not None else 0,
        table_width=block_tables.shape[1] if block_tables is not None else 0, n_seqs=ns, n_rows=n_tokens,
    )
    consts = dict(
        MODE=(BY_SLOTS if slot_mapping is not None else BY_KV_LENS if kv_lens is not None else BY_CU_K_LENS).value,
        QUANT=quant, ROPE=has_rope,
        ROT=rot, INTERLEAVED=inter, ATTN_SCALE=attn_scale, FMAX=_max_freq(rope), H=H, D=D, DP=pool.shape[-1],
        BLOCK_SIZE=bs, NUM_BLOCKS=pool.shape[0], **_block_strides(hnd, H, pool.shape[-1], bs), CP_RANK=cp_rank,
        CP_SIZE=cp_size,
        SEARCH=next_pow2(ns) if 0 < ns <= 1024 else 0, LOG_B=max(ns - 1, 0).bit_length(),
        STRIDE_KH=k.stride(1), STRIDE_VH=v.stride(1), BLOCK_H=next_pow2(H) // hg, HG=hg,
        BLOCK_HF=next_pow2((D + 1) // 2),
        LIBDEVICE=pool.device.type == "cuda", SPLIT=split, PDL=launch.pdl, VEC=vec, EARLY=launch.early,
        LOAD_EV="evict_first" if launch.hints else "", STORE_CM=".cs" if launch.hints else "",
        ROPE_SELECT=launch.rope_select, MASKED=launch.masked, INDEX_FIRST=launch.index_first,
        CS_FIRST=launch.cs_first and kind == "full", SPECULATE=launch.speculate,
        FREQS_LATE=launch.freqs_late and kind == "full",
        # the 8-byte (scale, zero) store needs 8-byte aligned params
        PAIR_ASM=launch.pair_asm and params is not None and params.data_ptr() % 8 == 0,
        num_warps=launch.num_warps,
    )
    if launch.pdl:
        consts["launch_pdl"] = True
    per_row = 2 * hg if split else 1
    prepared = _append_kernel.launch(pool.device, (per_row * n_tokens,), *args, **consts)
    if prepared is None:
        return None
    return AppendPlan(prepared, vec, per_row)


def _append_args(k, v, pool, params, block_tables, cu_q, k_lens, slots, positions, inv_freq, fp8_scales,  # type: ignore[no-untyped-def]
                 stride_kn, stride_vn, bt_stride, table_width, n_seqs, n_rows) -> tuple:
    """The append kernel's runtime arguments in its order (tensors, or their ``data_ptr()`` ints). A pointer
    the launch does not use (None) is passed as ``pool``: never read, and a valid address."""
    return (
        k, v, pool, pool if params is None else params, pool if block_tables is None else block_tables,
        pool if cu_q is None else cu_q, pool if k_lens is None else k_lens, pool if slots is None else slots,
        pool if positions is None else positions, pool if inv_freq is None else inv_freq,
        pool if fp8_scales is None else fp8_scales, stride_kn, stride_vn, bt_stride, table_width, n_seqs,
        _GUESS_ONE if n_seqs == n_rows else _guess_mul(n_seqs, n_rows),  # a decode batch: no call (host time)
    )


class AppendPlan:
    """A compiled append launch, repeated with raw pointers for new tensors of the same kind.

    "The same kind": the same dtypes, 16-byte alignment of every pointer (and 8-byte alignment of ``params``,
    which selects the inline-PTX (scale, zero) store), k / v strides, mode, RoPE, format, number of sequences,
    and the :class:`~.policy.AppendLaunch`; the caller keys plans by those (see ``PagedKVCache.append``).
    :meth:`launch` skips argument binding and the launcher's per-tensor pointer checks, which are most of an eager
    call's host time.
    """

    __slots__ = ("prepared", "vec", "per_row")

    def __init__(self, prepared: PreparedLaunch, vec: int, per_row: int) -> None:
        self.prepared = prepared
        self.vec = vec  # k / v row strides (elements) are passed divided by vec
        self.per_row = per_row  # programs per row: 1, or 2 x head groups (split: K and V separately)

    def launch(
        self, stream: int, n: int, k: int, v: int, stride_kn: int, stride_vn: int, pool: int, params: int | None,
        inv_freq: int | None, fp8_scales: int, block_tables: int | None, cu_q: int | None, kv_lens: int | None,
        slots: int | None, positions: int | None, bt_stride: int, table_width: int, n_seqs: int,
    ) -> None:
        """Launch on ``stream`` for ``n`` rows. Pointers are ``data_ptr()`` ints (None: unused); ``k`` / ``v``
        rows ``stride_kn`` / ``stride_vn`` elements apart; ``block_tables`` int32 ``[n_seqs, table_width]``
        with rows ``bt_stride`` apart, ``cu_q`` int32 ``[n_seqs + 1]``, ``kv_lens`` int32 ``[n_seqs]``
        (ragged), or ``slots`` / ``positions`` int32 or int64 ``[n]`` (slot mapping)."""
        pl = self.prepared
        args = _append_args(k, v, pool, params, block_tables, cu_q, kv_lens, slots, positions, inv_freq, fp8_scales,
                            stride_kn // self.vec, stride_vn // self.vec, bt_stride, table_width, n_seqs, n)
        pl.run(self.per_row * n, 1, 1, stream, *pl.head, *args, *pl.consts)


def gather_paged_kv_launch(
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    pool: torch.Tensor,
    params: torch.Tensor | None,
    *,
    kv_dtype: str,
    layout: str,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor | None,
    cu_k_lens: torch.Tensor | None,
    rope: RopeKernelParams | None,
    fp8_scales: torch.Tensor | None,
    cp_rank: int,
    cp_size: int,
    launch: GatherLaunch | None = None,
) -> None:
    """Launch the gather kernel (arguments already validated). ``k_out`` / ``v_out``: ``[B, H, S_out, D]``.
    ``launch``: default :func:`.policy.plan_gather` of the outputs (a variant is checked against the block size)."""
    B, H, s_out, D = k_out.shape
    if B == 0 or s_out == 0:
        return
    if not use_triton(pool.device):
        gather_paged_kv_reference(
            k_out, v_out, pool, params, kv_dtype=kv_dtype, layout=layout, block_tables=block_tables,
            kv_lens=kv_lens, cu_k_lens=cu_k_lens, rope=rope, fp8_scales=fp8_scales, cp_rank=cp_rank,
            cp_size=cp_size,
        )
        return
    quant = KV_FORMAT_TABLE[kv_dtype].code
    hnd = layout == "HND"
    bs = pool.shape[3] if hnd else pool.shape[2]
    has_rope, rot, inter, attn_scale, inv_freq = _rope_args(rope)
    dummy = pool
    if launch is None:
        launch = plan_gather(k_out, v_out, num_kv_heads=H, head_dim=D)
    tok = launch.tok
    if type(tok) is not int or tok < 1 or bs % tok or tok & (tok - 1):
        raise ValueError(f"tok: expected a power of two dividing block_size {bs}, got {tok!r}")
    out_strides = (k_out.stride(0), k_out.stride(1), k_out.stride(2), v_out.stride(0), v_out.stride(1),
                   v_out.stride(2))
    vec = vec_elems(k_out.element_size(), out_strides)  # vector stores of output rows
    _gather_kernel.launch(
        pool.device, (cdiv(s_out, tok), B),
        k_out, v_out, pool, params if params is not None else dummy, block_tables,
        kv_lens if kv_lens is not None else cu_k_lens,
        inv_freq if inv_freq is not None else dummy,
        fp8_scales if fp8_scales is not None else dummy,
        *[st // vec for st in out_strides],
        block_tables.stride(0), block_tables.shape[1], s_out,
        MODE=(BY_KV_LENS if kv_lens is not None else BY_CU_K_LENS).value, QUANT=quant, ROPE=has_rope, ROT=rot,
        INTERLEAVED=inter,
        ATTN_SCALE=attn_scale, H=H, D=D, DP=pool.shape[-1], BLOCK_SIZE=bs, NUM_BLOCKS=pool.shape[0],
        **_block_strides(hnd, H, pool.shape[-1], bs),
        CP_RANK=cp_rank, CP_SIZE=cp_size, TOK=tok, BLOCK_H=next_pow2(H), BLOCK_D=max(2, next_pow2(D)),
        LIBDEVICE=pool.device.type == "cuda", VEC=vec, WIDE=launch.wide,
        num_warps=launch.num_warps,
    )


def copy_blocks_launch(buf: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy whole blocks ``pairs[i, 0] -> pairs[i, 1]`` in every layer of ``buf`` ``[L, num_blocks, ...]``."""
    n_pairs = pairs.shape[0]
    if n_pairs == 0:
        return
    L, nb = buf.shape[0], buf.shape[1]
    elems = buf[0, 0].numel()
    if not use_triton(buf.device):
        for src, dst in pairs.tolist():
            if 0 <= src < nb and 0 <= dst < nb:  # (the kernel skips such pairs too)
                buf[:, dst] = buf[:, src]
        return
    block = min(4096, max(128, next_pow2(elems)))
    _copy_blocks_kernel.launch(buf.device, (cdiv(elems, block), n_pairs, L), buf, pairs, n_pairs, nb * elems,
                               elems, nb, BLOCK=block)


# ------------------------------------------------------------------------------------------------------------
