"""Launchers of the paged kernels: turn validated arguments and a launch description (:mod:`.policy`) into a
kernel launch (compiled on CUDA, interpreted on the CPU with ``KVCACHE_TRITON_INTERPRET=1``, else the pure-torch
reference). :class:`AppendPlan` repeats a compiled append with raw pointers (every layer of a step after the first)."""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from ..._backend import PreparedLaunch, pdl_enabled, use_triton
from ..._validate import cdiv, next_pow2, vec_elems
from ...rope import RopeKernelParams
from .format import KV_FORMAT_TABLE, block_key_words
from .kernels.append import _append_kernel, gdc_wait
from .kernels.block_keys import _int4b_append_kernel, _int4b_gather_kernel
from .kernels.codes import BY_CU_K_LENS, BY_KV_LENS, BY_SLOTS
from .kernels.copy_blocks import _copy_blocks_kernel
from .kernels.gather import _gather_kernel
from .kernels.lookup import _GUESS_ONE, _guess_mul
from .layer import PagedLayer
from .policy import AppendLaunch, GatherLaunch, RopeKind, check_launch, plan_append, plan_gather
from .reference import _rope_rows as rope_rows
from .reference import append_paged_kv_reference, gather_paged_kv_reference
from .step import StepPlan

__all__ = ["AppendPlan", "append_paged_kv_launch", "gather_paged_kv_launch", "copy_blocks_launch", "rope_kind",
           "pdl_supported", "default_append_launch", "append_index", "gather_lens", "rope_constants"]


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


def default_append_launch(n_rows: int, layer: PagedLayer, plan: StepPlan) -> AppendLaunch:
    """:func:`.policy.plan_append` for an append of ``n_rows`` rows into ``layer`` as ``plan`` describes, on the
    layer's device (``plan.rope_ready``: the cache's own RoPE frequencies, which no running kernel writes)."""
    dev = layer.device
    d = layer.geometry[3]
    return plan_append(n_rows=n_rows, n_seqs=plan.num_seqs if plan.slot_mapping is None else None,
                       num_kv_heads=layer.geometry[2], head_dim=d, kv_dtype=layer.kv_dtype,
                       rope=rope_kind(plan.rope, d), pdl=pdl_enabled() and pdl_supported(dev), ptx=ptx(dev),
                       metadata_ready=plan.metadata_ready, rope_ready=plan.rope_ready)


def _check_int4b(plan: StepPlan) -> None:
    """int4b takes ragged plans without context parallelism (a partial block's keys need the next block of its own
    table)."""
    if plan.slot_mapping is not None:
        raise ValueError("kv_dtype='int4b': expected a plan with block tables (a partial block's keys are written "
                         "into the next block of its table), got a slot_mapping plan")
    if plan.cp_size > 1:
        raise ValueError(f"kv_dtype='int4b': context parallelism is not supported (cp_size={plan.cp_size})")


def _int4b_strides(layer: PagedLayer) -> tuple[int, dict[str, int]]:
    """int4b's key-area words per slot and the element strides (token, head) of its data and params pools."""
    bs, H, D = layer.geometry[1:4]
    if bs & (bs - 1):
        raise NotImplementedError(f"kv_dtype='int4b': the kernels take a power-of-two block_size, got {bs}")
    wk = block_key_words(D, bs)
    w, dp = 2 + wk, D // 2
    if layer.layout == "HND":
        return wk, dict(S_TOK=dp, S_HEAD=bs * dp, P_TOK=w, P_HEAD=bs * w)
    return wk, dict(S_TOK=H * dp, S_HEAD=dp, P_TOK=H * w, P_HEAD=w)


# int4b append: programs the launch aims at (several blocks a program past it; a block's rows in registers each)
_INT4B_APPEND_PROGRAMS = 8192


def _append_int4b(k: torch.Tensor, v: torch.Tensor, layer: PagedLayer, plan: StepPlan) -> None:
    """int4b's append kernel (:mod:`.kernels.block_keys`): programs per (sequence, chunk, head) sharing the blocks
    each sequence's rows reach. ``plan.num_decode`` (a host hint, as for the attention) splits a mixed batch into a
    launch of its decode rows and one of the rest, so the decode rows take one program each (a row that leaves its
    block partial: up to ``block_size`` heads in one); every split is correct."""
    nb, bs, H, D = layer.geometry[:4]
    wk, strides = _int4b_strides(layer)
    b = plan.num_seqs
    if b == 0:
        return
    has_rope, rot, inter, attn_scale, inv_freq = _rope_args(plan.rope)
    bt, cu_q = plan.block_tables, plan.cu_q_lens
    lens, mode = (plan.kv_lens, BY_KV_LENS) if plan.kv_lens is not None else (plan.cu_k_lens, BY_CU_K_LENS)
    heads = 1  # heads per program: [block_size, heads, D / 2] tiles in registers
    groups = cdiv(H, heads)
    n, nd = k.shape[0], plan.num_decode
    parts = [(0, nd, nd), (nd, b, n - nd)] if 0 < nd < b else [(0, b, n)]
    for s0, s1, rows in parts:
        # blocks past the first per sequence: those of the most rows one sequence can hold if each of the others
        # holds one (the loop covers any split), at most the programs aimed at
        most = max(rows - (s1 - s0 - 1), 1)
        later = (most + bs - 2) // bs
        n_progs = max(1, min(later, cdiv(_INT4B_APPEND_PROGRAMS, (s1 - s0) * groups)))
        _int4b_append_kernel.launch(
            layer.device, (s1 - s0, n_progs, groups),
            k, v, layer.pool, layer.params, bt, cu_q, lens,
            layer.pool if inv_freq is None else inv_freq,
            k.stride(0), v.stride(0), bt.stride(0), bt.shape[1], s0, n_progs,  # type: ignore[union-attr]
            MODE=mode.value, ROPE=has_rope, ROT=rot, INTERLEAVED=inter, ATTN_SCALE=attn_scale, H=H, D=D, BS=bs,
            NUM_BLOCKS=nb, WK=wk, **strides, STRIDE_KH=k.stride(1), STRIDE_VH=v.stride(1), BLOCK_H=heads,
            ROW_HEADS=min(next_pow2(H), 1 << (bs.bit_length() - 1)),
            BLOCK_D2=max(2, next_pow2(D // 2)), LIBDEVICE=layer.device.type == "cuda", num_warps=2,
        )


def _gather_int4b(k_out: torch.Tensor, v_out: torch.Tensor, layer: PagedLayer, plan: StepPlan,
                  rope: RopeKernelParams | None) -> None:
    """int4b's gather kernel: one program per (block, sequence); ``rope`` rotates the gathered keys after it (torch)."""
    B, H, s_out, D = k_out.shape
    nb, bs = layer.geometry[:2]
    wk, strides = _int4b_strides(layer)
    lens, mode = gather_lens(plan)
    bt = plan.block_tables
    _int4b_gather_kernel.launch(
        layer.device, (cdiv(s_out, bs), B),
        k_out, v_out, layer.pool, layer.params, bt, lens, k_out.stride(0), k_out.stride(1), k_out.stride(2),
        v_out.stride(0), v_out.stride(1), v_out.stride(2), bt.stride(0), bt.shape[1], s_out,  # type: ignore[union-attr]
        MODE=mode.value, H=H, D=D, BS=bs, NUM_BLOCKS=nb, WK=wk, **strides, BLOCK_H=next_pow2(H),
        BLOCK_D2=max(2, next_pow2(D // 2)), LIBDEVICE=layer.device.type == "cuda", num_warps=4,
    )
    if rope is not None:  # token t of every sequence sits at position t (no context parallelism)
        x = k_out.transpose(1, 2).reshape(B * s_out, H, D).float()
        pos = torch.arange(s_out, device=k_out.device).repeat(B)
        k_out.copy_(rope_rows(x, pos, rope).reshape(B, s_out, H, D).transpose(1, 2))


def _block_strides(hnd: bool, H: int, DP: int, bs: int, kv_dtype: str) -> dict[str, int]:
    """Element strides inside one K (or V) region of a block, [bs, H, DP] (NHD) or [H, bs, DP] (HND): of a
    token and of a head, in the data pool (S_*) and in the params pool (P_*, ``w`` floats per row: 2 for (scale,
    zero), 1 for fp8k's key scales)."""
    w = KV_FORMAT_TABLE[kv_dtype].param_width or 2
    if hnd:
        return dict(S_TOK=DP, S_HEAD=bs * DP, P_TOK=w, P_HEAD=bs * w)
    return dict(S_TOK=H * DP, S_HEAD=DP, P_TOK=H * w, P_HEAD=w)


def _rope_args(rope):  # type: ignore[no-untyped-def]
    if rope is None:
        return False, 2, False, 1.0, None
    return True, int(rope.rotary_dim), bool(rope.interleaved), float(rope.attention_scaling), rope.inv_freq




def rope_constants(rope: RopeKernelParams | None) -> tuple | None:
    """What the append kernel specialises on of ``rope``: rotary dims, interleaving, attention scaling and the
    frequency bound (None without RoPE)."""
    if rope is None:
        return None
    return (int(rope.rotary_dim), bool(rope.interleaved), float(rope.attention_scaling), _max_freq(rope))


def _max_freq(rope) -> float:  # type: ignore[no-untyped-def]
    # the append's FMAX: max(inv_freq) when the params carry it (0.0: unknown, full-range cos / sin everywhere)
    top = getattr(rope, "max_inv_freq", 0.0) if rope is not None else 0.0
    return float(top) if top > 0 else 0.0  # (validated by the callers: a finite number >= 0)


def append_paged_kv_launch(k: torch.Tensor, v: torch.Tensor, layer: PagedLayer, plan: StepPlan,
                           launch: AppendLaunch | None = None) -> AppendPlan | None:
    """Launch the append kernel: ``k`` / ``v`` ``[N, H, D]`` into ``layer`` where ``plan`` says, both already
    validated (see :func:`kvcache.ops.append_paged_kv`).

    ``launch``: the launch description; default :func:`default_append_launch` (the policy). A variant built with
    ``dataclasses.replace`` is checked (:func:`.policy.check_launch`) before anything runs.

    Returns an :class:`AppendPlan` for repeating this launch with other tensors of the same kind (compiled
    kernels on CUDA), else None.
    """
    nb, bs, H, D = layer.geometry[:4]
    kind = rope_kind(plan.rope, D)
    if launch is None:
        launch = default_append_launch(k.shape[0], layer, plan)
    check_launch(launch, num_kv_heads=H, rope=kind, pdl_supported=pdl_supported(layer.device))
    n_tokens = k.shape[0]
    if n_tokens == 0:
        return None
    if layer.kv_dtype == "int4b":
        _check_int4b(plan)
        if use_triton(layer.device):
            _append_int4b(k, v, layer, plan)
            return None
    if not use_triton(layer.device):
        append_paged_kv_reference(k, v, layer, plan)
        return None
    ragged = plan.slot_mapping is None
    if ragged and plan.num_seqs == 0:
        return None  # no sequence: every row is padding
    has_rope, rot, inter, attn_scale, _ = _rope_args(plan.rope)
    pool, params = layer.pool, layer.params
    dp = pool.shape[-1]
    split, hg = launch.split, (launch.head_groups if launch.split else 1)
    # vector loads of k / v rows: the row strides (runtime ints) are passed in units of VEC elements (up to 16
    # bytes); the head strides and the half-row offset are constexprs, whose divisibility the compiler sees
    vec = vec_elems(k.element_size(), (k.stride(0), v.stride(0)))
    ns = plan.num_seqs
    index = append_index(plan)
    args = _append_args(k, v, pool, params, layer.scales, index, k.stride(0) // vec, v.stride(0) // vec, n_tokens)
    consts = dict(
        MODE=(BY_SLOTS if not ragged else BY_KV_LENS if plan.kv_lens is not None else BY_CU_K_LENS).value,
        QUANT=KV_FORMAT_TABLE[layer.kv_dtype].code, ROPE=has_rope,
        ROT=rot, INTERLEAVED=inter, ATTN_SCALE=attn_scale, FMAX=_max_freq(plan.rope), H=H, D=D, DP=dp,
        BLOCK_SIZE=bs, NUM_BLOCKS=nb, **_block_strides(layer.layout == "HND", H, dp, bs, layer.kv_dtype),
        CP_RANK=plan.cp_rank,
        CP_SIZE=plan.cp_size,
        SEARCH=next_pow2(ns) if 0 < ns <= 1024 else 0, LOG_B=max(ns - 1, 0).bit_length(),
        STRIDE_KH=k.stride(1), STRIDE_VH=v.stride(1), BLOCK_H=next_pow2(H) // hg, HG=hg,
        BLOCK_HF=next_pow2((D + 1) // 2),
        LIBDEVICE=pool.device.type == "cuda", SPLIT=split, PDL=launch.pdl, VEC=vec, EARLY=launch.early,
        LOAD_EV="evict_first" if launch.hints else "", STORE_CM=".cs" if launch.hints else "",
        ROPE_SELECT=launch.rope_select, MASKED=launch.masked, INDEX_FIRST=launch.index_first,
        CS_FIRST=launch.cs_first and kind == "full", SPECULATE=launch.speculate,
        FREQS_LATE=launch.freqs_late and kind == "full",
        # the 8-byte (scale, zero) store needs 8-byte aligned params
        PAIR_ASM=launch.pair_asm and params is not None and layer.align[3],
        num_warps=launch.num_warps,
    )
    if launch.pdl:
        consts["launch_pdl"] = True
    per_row = 2 * hg if split else 1
    prepared = _append_kernel.launch(pool.device, (per_row * n_tokens,), *args, **consts)
    if prepared is None:
        return None
    return AppendPlan(prepared, vec, per_row)


def append_index(plan: StepPlan) -> tuple:
    """What the append kernel reads of ``plan``: block tables, cu_q_lens, kv_lens (or cu_k_lens), slot mapping,
    positions and RoPE's inv_freq (None where absent), then the block-table row stride, its width and ``B``."""
    bt = plan.block_tables
    ragged = plan.slot_mapping is None
    return (bt, plan.cu_q_lens, plan.kv_lens if plan.kv_lens is not None else plan.cu_k_lens, plan.slot_mapping,
            plan.positions if plan.rope is not None else None, plan.rope.inv_freq if plan.rope is not None else None,
            bt.stride(0) if ragged else 0, bt.shape[1] if ragged else 0, plan.num_seqs)  # type: ignore[union-attr]


def _append_args(k, v, pool, params, scales, index: tuple, stride_kn: int, stride_vn: int, n_rows: int) -> tuple:  # type: ignore[no-untyped-def]
    """The append kernel's runtime arguments in its order (tensors, or their ``data_ptr()`` ints; ``index`` as
    :func:`append_index` gives it, or its pointers). A pointer the launch does not use (None) is passed as
    ``pool``: never read, and a valid address."""
    bt, cu, kl, sl, pos, inv, bt_stride, width, n_seqs = index
    return (
        k, v, pool, pool if params is None else params, pool if bt is None else bt, pool if cu is None else cu,
        pool if kl is None else kl, pool if sl is None else sl, pool if pos is None else pos,
        pool if inv is None else inv, pool if scales is None else scales, stride_kn, stride_vn, bt_stride, width,
        n_seqs, _GUESS_ONE if n_seqs == n_rows else _guess_mul(n_seqs, n_rows),  # a decode batch: no call
    )


class AppendPlan:
    """A compiled append launch, repeated with raw pointers for other tensors of the same kind.

    "The same kind": the same step plan (index tensors, RoPE, launch description, rows), and per layer the same
    16-byte alignment of every pointer (8-byte of ``params``, which selects the inline-PTX (scale, zero) store),
    k / v strides; :func:`~kvcache.ops.paged.run.append_rows` keys them by those. :meth:`launch` skips argument
    binding and the launcher's per-tensor pointer checks, which are most of an eager call's host time.
    """

    __slots__ = ("prepared", "vec", "per_row")

    def __init__(self, prepared: PreparedLaunch, vec: int, per_row: int) -> None:
        self.prepared = prepared
        self.vec = vec  # k / v row strides (elements) are passed divided by vec
        self.per_row = per_row  # programs per row: 1, or 2 x head groups (split: K and V separately)

    def launch(self, stream: int, n: int, k: int, v: int, stride_kn: int, stride_vn: int, layer_ptrs: tuple,
               index: tuple) -> None:
        """Launch on ``stream`` for ``n`` rows. ``k`` / ``v``: ``data_ptr()`` ints, rows ``stride_kn`` /
        ``stride_vn`` elements apart; ``layer_ptrs``: :attr:`PagedLayer.ptrs`; ``index``: :func:`append_index`
        with ``data_ptr()`` ints in place of its tensors."""
        pl = self.prepared
        pool, params, scales = layer_ptrs
        args = _append_args(k, v, pool, params, scales, index, stride_kn // self.vec, stride_vn // self.vec, n)
        pl.run(self.per_row * n, 1, 1, stream, *pl.head, *args, *pl.consts)


def gather_paged_kv_launch(k_out: torch.Tensor, v_out: torch.Tensor, layer: PagedLayer, plan: StepPlan,
                           rope: RopeKernelParams | None, launch: GatherLaunch | None = None) -> None:
    """Launch the gather kernel (arguments already validated): ``layer``'s blocks of ``plan``'s sequences into
    ``k_out`` / ``v_out`` ``[B, H, S_out, D]``; ``rope`` rotates the keys. ``launch``: default
    :func:`.policy.plan_gather` of the outputs (a variant is checked against the block size)."""
    B, H, s_out, D = k_out.shape
    if B == 0 or s_out == 0:
        return
    if layer.kv_dtype == "int4b":
        _check_int4b(plan)
        if use_triton(layer.device):
            _gather_int4b(k_out, v_out, layer, plan, rope)
            return
    if not use_triton(layer.device):
        gather_paged_kv_reference(k_out, v_out, layer, plan, rope)
        return
    pool = layer.pool
    nb, bs = layer.geometry[:2]
    has_rope, rot, inter, attn_scale, inv_freq = _rope_args(rope)
    if launch is None:
        launch = plan_gather(k_out, v_out, num_kv_heads=H, head_dim=D)
    tok = launch.tok
    if type(tok) is not int or tok < 1 or bs % tok or tok & (tok - 1):
        raise ValueError(f"tok: expected a power of two dividing block_size {bs}, got {tok!r}")
    out_strides = (*k_out.stride()[:3], *v_out.stride()[:3])
    vec = vec_elems(k_out.element_size(), out_strides)  # vector stores of output rows
    lens, mode = gather_lens(plan)
    bt = plan.block_tables
    _gather_kernel.launch(
        pool.device, (cdiv(s_out, tok), B),
        k_out, v_out, pool, pool if layer.params is None else layer.params, bt, lens,
        pool if inv_freq is None else inv_freq, pool if layer.scales is None else layer.scales,
        *[st // vec for st in out_strides], bt.stride(0), bt.shape[1], s_out,  # type: ignore[union-attr]
        MODE=mode.value, QUANT=KV_FORMAT_TABLE[layer.kv_dtype].code, ROPE=has_rope, ROT=rot, INTERLEAVED=inter,
        ATTN_SCALE=attn_scale, H=H, D=D, DP=pool.shape[-1], BLOCK_SIZE=bs, NUM_BLOCKS=nb,
        **_block_strides(layer.layout == "HND", H, pool.shape[-1], bs, layer.kv_dtype),
        CP_RANK=plan.cp_rank, CP_SIZE=plan.cp_size, TOK=tok, BLOCK_H=next_pow2(H), BLOCK_D=max(2, next_pow2(D)),
        LIBDEVICE=pool.device.type == "cuda", VEC=vec, WIDE=launch.wide,
        num_warps=launch.num_warps,
    )


def gather_lens(plan: StepPlan) -> tuple[torch.Tensor, tl.constexpr]:
    """The lengths a gather of ``plan``'s sequences reads, and how: its cumulative lengths after the step when it
    has them (no device op), else ``seq_lens``."""
    if plan.cu_k_lens is not None:
        return plan.cu_k_lens, BY_CU_K_LENS
    return plan.seq_lens, BY_KV_LENS


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
