"""The public paged ops: validate, then launch (:mod:`.launch`, with the launch chosen by :mod:`.policy`).

Which tokens go where:

* ragged batch: sequence ``b`` owns rows ``cu_q_lens[b] .. cu_q_lens[b + 1]`` of ``k`` / ``v``; its first new
  token has position ``kv_lens[b]`` (tokens already cached), or ``total_b - q_len_b`` with
  ``total_b = cu_k_lens[b + 1] - cu_k_lens[b]`` (TurboMind's cumulative lengths after the append). Token at
  position ``p`` goes to block ``block_tables[b, p // block_size]``, offset ``p % block_size``.
* context parallel (``cp_size > 1``): token ``p`` lives on rank ``p % cp_size`` at local position
  ``p // cp_size``; a rank writes only its tokens, and RoPE uses the global position ``p``.
* slot mapping: row ``n`` goes to slot ``slot_mapping[n]`` (``block * block_size + offset``), ``-1`` = skip;
  RoPE positions come from ``positions``.

Bad input, fast by default: rows whose block index falls outside the block table, whose block id or slot is
out of range, and padding rows past ``cu_q_lens[-1]`` are skipped on the device, never written out of bounds.
``check=True`` (or ``PagedKVCache(..., debug=True)`` for every append) syncs and raises ValueError before
writing anything, also for a slot written twice in one append and for fp8 scales that are not finite and > 0;
``StepPlan.unwritable_rows`` / ``PagedKVCache.unwritable_rows`` count the rows that would be skipped, on the
device, without a sync. NaN / inf in K / V stay visible (fp8 stores NaN; int8 / int4 store the (token, head)
with scale and zero NaN). The byte format
(layouts, fp8 / int8 / int4) is documented in :mod:`kvcache.paged.config`.
"""

from __future__ import annotations

import torch

from ..._validate import fmt_shape
from ...rope import RopeKernelParams
from .launch import copy_blocks_launch
from .layer import PagedLayer
from .run import append_rows, gather_rows
from .step import StepPlan

__all__ = ["append_paged_kv", "gather_paged_kv", "copy_blocks"]


def append_paged_kv(
    k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor, params: torch.Tensor | None = None, *,
    kv_dtype: str = "auto", layout: str = "NHD",  # the pool's format
    block_tables: torch.Tensor | None = None, cu_q_lens: torch.Tensor | None = None,
    kv_lens: torch.Tensor | None = None, cu_k_lens: torch.Tensor | None = None,  # a ragged batch
    slot_mapping: torch.Tensor | None = None, positions: torch.Tensor | None = None,  # or a slot mapping
    rope: RopeKernelParams | None = None, fp8_scales: torch.Tensor | None = None, cp_rank: int = 0,
    cp_size: int = 1, check: bool = False, metadata_ready: bool = False,
) -> None:
    """Write new keys and values into paged blocks in one pass: RoPE on K and quantization fused.

    Parameters
    ----------
    k, v : torch.Tensor
        shape ``[num_tokens, H, D]``, float16 / bfloat16 / float32, head_dim contiguous (token and head
        strides free: e.g. views into a fused QKV projection). Keys are un-rotated when ``rope`` is given.
    pool : torch.Tensor
        One layer's data pool (layout and dtype in :mod:`kvcache.paged.config`), written in place.
    params : torch.Tensor, optional
        float32 scale / zero pool, required for ``kv_dtype`` int8 / int4 / k8v4; fp8k: its key-scale pool; int4b: its
        params plane (values' scale / zero, the blocks' key areas).
    kv_dtype, layout : str
        The pool's format: ``"auto" | "fp8" | "int8" | "int4" | "k8v4" | "fp8k" | "int4b"`` and ``"NHD" | "HND"``.
    block_tables : torch.Tensor
        int32 ``[B, max_blocks]``: block ids of each sequence, in order (ragged mode).
    cu_q_lens : torch.Tensor
        int32 ``[B + 1]``, ``cu_q_lens[0] == 0``: rows of ``k`` / ``v`` per sequence (ragged mode; prefill
        chunks and decode tokens mixed). Rows past ``cu_q_lens[B]`` are padding and skipped.
    kv_lens : torch.Tensor
        int32 ``[B]``: tokens each sequence already holds (position of its first new token). Or:
    cu_k_lens : torch.Tensor
        int32 ``[B + 1]``: cumulative total lengths *after* this append (TurboMind).
    slot_mapping : torch.Tensor
        int64 or int32 ``[num_tokens]``: instead of the ragged description, the pool slot
        ``block * block_size + offset`` of every row; ``-1`` skips the row.
    positions : torch.Tensor
        int32 / int64 ``[num_tokens]``: RoPE positions in slot-mapping mode (required there with ``rope``).
    rope : RopeKernelParams, optional
        ``RopeConfig.kernel_params(...)`` with ``inv_freq`` on the pool's device: rotate keys before storing.
    fp8_scales : torch.Tensor
        float32 ``[2]`` (k_scale, v_scale), required for ``kv_dtype="fp8"`` and ``"fp8k"`` (v_scale alone is used).
    cp_rank, cp_size : int
        Context parallelism: token ``p`` is stored only by rank ``p % cp_size``, at local position
        ``p // cp_size`` of the rank's block table; RoPE uses the global position.
    check : bool
        Debug mode (syncs): verify lengths, block-table capacity and block ids on the host and raise
        ValueError before writing. Without it, such rows are skipped on the device.
    metadata_ready : bool
        The caller's promise that no kernel that may still be running when this append starts writes the index
        tensors (``block_tables``, ``cu_q_lens``, ``kv_lens`` / ``cu_k_lens``, ``slot_mapping``,
        ``positions``) or ``rope.inv_freq``. That is: not the kernel just before this append on the stream,
        and not any kernel that one may overlap. A kernel launched without programmatic dependent launch (PDL)
        starts only after its predecessor has finished; a kernel launched with PDL may overlap its
        predecessor, and passes the guarantee on only if it waits for it before releasing its own dependents
        (kvcache's kernels do). Typically true of metadata copied in or computed at the start of a step and
        read by every layer's append. Decode-sized appends (fewer than 2048 rows) launched with PDL (Hopper)
        then find where each row goes, and compute RoPE's cos / sin (rotate-half over the whole head; not for
        fp8), before waiting for the previous kernel, which they wait for only to read ``k`` / ``v``; see
        :func:`~kvcache.ops.paged.plan_append`. The launch shape changes with it, and with it the compiler's
        contraction of the RoPE arithmetic: rotated keys may differ from the launch that waits in the last bit
        (within the same bounds). A broken promise reads stale indices: rows written to the wrong slots.

        Default False. Without the promise, decode-sized appends with PDL *speculate* (batches of one row per
        sequence, or by slot mapping; without RoPE, or with rotate-half RoPE over the whole head): they do the
        same lookup before the wait, then read every index value it used again from L2 after the wait
        (``ld.global.cg``) and compare; a row whose values changed (or whose sequence the first guess missed) is
        looked up and written again after the wait. ``rope.inv_freq`` is read after the wait there (the
        cache's own frequencies, built once, before it, with cos / sin: rotated keys may then differ from a
        launch that waits first in the last bit, as with the promise). Other appends wait before every read.

    Note
    ----
    One kernel launch, no allocation, no host sync: capturable in a CUDA graph.
    """
    layer = PagedLayer(pool, params, fp8_scales, kv_dtype, layout)
    index = dict(block_tables=block_tables, cu_q_lens=cu_q_lens, kv_lens=kv_lens, cu_k_lens=cu_k_lens,
                 slot_mapping=slot_mapping, positions=positions, cp_rank=cp_rank, cp_size=cp_size)
    plan = StepPlan.build(layer.geometry, pool.device, index, dict(metadata_ready=metadata_ready, check=check),
                          rope=rope)
    append_rows(k, v, layer, plan)


def gather_paged_kv(
    pool: torch.Tensor, params: torch.Tensor | None = None, *, kv_dtype: str = "auto", layout: str = "NHD",
    block_tables: torch.Tensor | None = None, kv_lens: torch.Tensor | None = None,
    cu_k_lens: torch.Tensor | None = None,  # the sequences, as they stand
    k_out: torch.Tensor | None = None, v_out: torch.Tensor | None = None, max_len: int | None = None,
    dtype: torch.dtype | None = None,  # the outputs
    rope: RopeKernelParams | None = None, fp8_scales: torch.Tensor | None = None, cp_rank: int = 0,
    cp_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read sequences' blocks back into contiguous, dequantized K and V (TurboMind ``FlattenKV``).

    Parameters
    ----------
    pool, params, kv_dtype, layout
        One layer's pool, as in :func:`append_paged_kv`.
    block_tables : torch.Tensor
        int32 ``[B, max_blocks]`` of the requested sequences.
    kv_lens : torch.Tensor
        int32 ``[B]``: tokens each sequence holds (global count; with context parallelism the rank holds
        ``ceil((kv_lens - cp_rank) / cp_size)`` of them). Or ``cu_k_lens`` int32 ``[B + 1]``.
    k_out, v_out : torch.Tensor, optional
        shape ``[B, H, S_out, D]`` (any strides, head_dim contiguous) of the model dtype: filled, token ``t``
        at index ``t``, zeros past each sequence's (local) length. Default: new contiguous tensors with
        ``S_out = max_len``.
    max_len : int, optional
        ``S_out`` when the outputs are allocated here; default: the longest sequence (reads ``kv_lens``:
        one sync). With ``k_out`` / ``v_out`` given: None, or their ``S_out``.
    dtype : torch.dtype, optional
        Output dtype when allocating (default: the pool's model dtype; required for quantized pools).
    rope : RopeKernelParams, optional
        Apply RoPE to the keys while reading (for caches that store keys un-rotated); position of local
        token ``t`` is ``t * cp_size + cp_rank``.
    fp8_scales : torch.Tensor
        float32 ``[2]`` for ``kv_dtype="fp8"`` and ``"fp8k"`` (v_scale alone is used).

    Returns
    -------
    (k, v) : ``[B, H, S_out, D]`` each.
    """
    layer = PagedLayer(pool, params, fp8_scales, kv_dtype, layout)
    index = dict(block_tables=block_tables, seq_lens=kv_lens, cu_k_lens=cu_k_lens, cp_rank=cp_rank, cp_size=cp_size)
    plan = StepPlan.build(layer.geometry, pool.device, index, lens_name="kv_lens")
    return gather_rows(layer, plan, k_out, v_out, max_len, dtype, rope)


def copy_blocks(buffers: list[torch.Tensor], pairs: torch.Tensor, *, check: bool = True) -> None:
    """Copy whole blocks ``pairs[i, 0] -> pairs[i, 1]`` in every layer (copy-on-write of shared blocks).

    Parameters
    ----------
    buffers : list of torch.Tensor
        Each ``[L, num_blocks, ...]`` contiguous (the data pool of all layers, and the params pool if any),
        with the same ``num_blocks``.
    pairs : torch.Tensor
        int64 ``[n, 2]`` on the buffers' device: (source block, destination block), ids in
        ``[0, num_blocks)``. Destinations must be distinct and not sources of other pairs.
    check : bool
        Validate the ids before copying (reads ``pairs``: one device sync on a GPU). With ``check=False``
        the caller vouches for them; a pair with an id out of range is then skipped, never written out of
        bounds.
    """
    if not isinstance(pairs, torch.Tensor):
        raise TypeError(f"pairs: expected an int64 tensor [n, 2], got {type(pairs).__name__}")
    if type(check) is not bool:
        raise TypeError(f"check: expected a bool, got {type(check).__name__}")
    if isinstance(buffers, torch.Tensor) or not isinstance(buffers, (list, tuple)) or not buffers:
        raise TypeError(f"buffers: expected a non-empty list of tensors, got {type(buffers).__name__}")
    for i, buf in enumerate(buffers):
        if not isinstance(buf, torch.Tensor) or buf.dim() < 3 or not buf.is_contiguous():
            got = (f"{fmt_shape(buf.shape)} strides {tuple(buf.stride())}" if isinstance(buf, torch.Tensor)
                   else type(buf).__name__)
            raise ValueError(f"buffers[{i}]: expected a contiguous tensor [L, num_blocks, ...], got {got}")
        if pairs.device != buf.device:
            raise ValueError(f"pairs: expected device {buf.device} (of buffers[{i}]), got {pairs.device}")
        if buf.shape[1] != buffers[0].shape[1]:
            raise ValueError(f"buffers[{i}]: expected {buffers[0].shape[1]} blocks (as buffers[0]), got "
                             f"{buf.shape[1]}")
    if pairs.dtype != torch.int64 or pairs.dim() != 2 or pairs.shape[1] != 2 or not pairs.is_contiguous():
        raise ValueError(f"pairs: expected a contiguous int64 tensor [n, 2], got {pairs.dtype} "
                         f"{fmt_shape(pairs.shape)}")
    if check and pairs.shape[0]:
        nb = buffers[0].shape[1]
        vals = pairs.tolist()
        bad = [x for pair in vals for x in pair if not 0 <= x < nb]
        if bad:
            raise ValueError(f"pairs: expected block ids in [0, {nb}), got {bad[:8]}")
        dst = [d for _, d in vals]
        if len(set(dst)) != len(dst) or set(dst) & {s for s, _ in vals}:
            raise ValueError(f"pairs: expected distinct destinations that are not also sources, got {vals[:8]}")
    for buf in buffers:
        copy_blocks_launch(buf, pairs)
