"""PagedKVCache: per-layer block pools with fused RoPE + quantize + append, gather, copy-on-write, swap."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._device import check_memory
from .._validate import check_int
from ..ops import paged as paged_ops
from ..ops.attention.paged import attend
from ..ops.paged.layer import PagedLayer
from ..ops.paged.run import append_rows, gather_rows
from ..rope import RopeConfig, RopeKernelParams
from .config import PagedConfig, cache_block_bytes
from .plan import StepPlan, resolve_rope
from .swap import SwappedBlocks, swap_in, swap_out

__all__ = ["PagedKVCache", "SwappedBlocks"]


class PagedKVCache:
    """Per-layer block pools (pages) for every attention layer.

    ``pool(layer)`` is ``[num_blocks, 2, block_size, H, D]`` (NHD) or ``[num_blocks, 2, H, block_size, D]``
    (HND) in the storage dtype of ``config.kv_dtype``; for ``"auto"`` and ``"fp8"`` it is FlashInfer's
    single-tensor paged KV cache, and ``kv(layer)`` returns the ``[num_blocks, block_size, H, D]`` K / V views
    FlashAttention's paged ``flash_attn_with_kvcache`` takes (NHD). int8 / int4 / k8v4 pools keep float32
    (scale, zero) per token and head in ``params(layer)``, fp8k pools a float32 scale per key row. All layers share
    one allocation, ``[L, *pool_shape]``, zero-initialised. Byte format: :mod:`kvcache.paged.config`.

    Blocks are owned by a :class:`~kvcache.paged.BlockAllocator` (or any scheduler); this class only moves
    bytes: :meth:`append`, :meth:`gather`, :meth:`copy_blocks`, :meth:`swap_out` / :meth:`swap_in`.

    Parameters
    ----------
    config : PagedConfig
    rope : RopeConfig, optional
        Default RoPE applied to keys by :meth:`append` (``rope=`` per call overrides; ``rope=False``
        disables). Its kernel parameters are kept on the device, so appends stay capturable in CUDA graphs
        (except ``"dynamic"`` scaling, whose frequencies depend on the sequence length).
    debug : bool
        Every :meth:`append` runs with ``check=True``: lengths, block-table capacity, block ids, slots written
        twice and fp8 scales are verified on the host (a sync per call) and a bad batch raises ValueError before
        anything is written. Without it, rows that cannot be written (block index past the table, block id or
        slot outside the pool) are skipped on the device; :meth:`unwritable_rows` counts them without a sync.

    Example
    -------
    >>> cache = PagedKVCache(PagedConfig(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=8,
    ...                                  dtype=torch.float16, device="cpu"), debug=True)
    >>> cache.pool(0).shape
    torch.Size([8, 2, 4, 2, 8])
    """

    def __init__(self, config: PagedConfig, *, rope: RopeConfig | None = None, debug: bool = False) -> None:
        if not isinstance(config, PagedConfig):
            raise TypeError(f"config: expected a PagedConfig, got {type(config).__name__}")
        if rope is not None and not isinstance(rope, RopeConfig):
            raise TypeError(f"rope: expected a RopeConfig, got {type(rope).__name__}")
        if rope is not None and rope.head_dim != config.head_dim:
            raise ValueError(f"rope: expected head_dim {config.head_dim} (the cache's), got {rope.head_dim}")
        if type(debug) is not bool:
            raise TypeError(f"debug: expected a bool, got {type(debug).__name__}")
        self._config = config
        self.debug = debug
        dev = config.device
        L = config.num_layers
        check_memory(self.nbytes_for(config), dev, "config")
        self.buffer = torch.zeros((L, *config.pool_shape()), dtype=config.storage_dtype, device=dev)
        self.params_buffer = (
            torch.zeros((L, *config.params_shape()), dtype=torch.float32, device=dev) if config.has_params else None
        )
        # [L, 2] view of [L, 4] storage: every layer's (k_scale, v_scale) starts on a 16-byte boundary, so all
        # layers share one compiled kernel and prepared launch
        self.kv_scales = torch.ones((L, 4), dtype=torch.float32, device=dev)[:, :2]
        # per-layer views, made once (a view costs about a microsecond per call on the hot path)
        self._pools = list(self.buffer.unbind(0))
        self._params = list(self.params_buffer.unbind(0)) if self.params_buffer is not None else [None] * L
        self._scales = list(self.kv_scales.unbind(0))
        self._rope = rope
        self._rope_params = None
        if rope is not None and not rope.is_dynamic:
            self._rope_params = rope.kernel_params(device=dev)
        # each layer's storage as the launchers take it (geometry, pointers and their alignment worked out once)
        self._layers = [PagedLayer(self._pools[i], self._params[i], self._scales[i], config.kv_dtype, config.layout,
                                   config.dtype) for i in range(L)]
        self._geometry = self._layers[0].geometry
        self._launch_store: dict = {}  # the append launches of earlier steps' plans (see StepPlan.build)
        for lay in self._layers:
            lay.geometry = self._geometry  # one tuple: a plan of this cache is recognised by identity
        self.prepared_launches = 0  # appends that repeated a prepared launch (a diagnostic)

    @staticmethod
    def nbytes_for(config: PagedConfig) -> int:
        """Bytes a cache of ``config`` allocates (pools of every layer, (scale, zero) included)."""
        return cache_block_bytes(config.num_layers, config.num_kv_heads, config.head_dim, config.block_size,
                                 config.dtype, config.kv_dtype) * config.num_blocks

    def unwritable_rows(self, plan: StepPlan, num_rows: int) -> torch.Tensor:
        """Rows of an append of ``num_rows`` rows described by ``plan`` that would be skipped although meant to be
        written (block index past the table, block id or slot outside the pool): an int64 0-d device tensor,
        no sync. See :meth:`StepPlan.unwritable_rows`."""
        return self._check_plan(plan).unwritable_rows(num_rows)

    # ------------------------------------------------------------------------------------------ views

    @property
    def config(self) -> PagedConfig:
        """The :class:`PagedConfig` the cache was built from."""
        return self._config

    @property
    def device(self) -> torch.device:
        """Device of the pools."""
        return self._config.device  # type: ignore[return-value]

    @property
    def num_layers(self) -> int:
        """Number of attention layers (one pool each)."""
        return self._config.num_layers

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the pools of every layer, (scale, zero) included (``cache_block_bytes(...) *
        num_blocks``)."""
        n = self.buffer.numel() * self.buffer.element_size()
        if self.params_buffer is not None:
            n += self.params_buffer.numel() * 4
        return n

    def _layer(self, layer: int) -> int:
        return check_int("layer", layer, 0, self._config.num_layers - 1)

    def pool(self, layer: int) -> torch.Tensor:
        """Data pool of ``layer``: NHD ``[num_blocks, 2, block_size, H, D]`` / HND ``[num_blocks, 2, H, block_size, D]``
        (``D // 2`` bytes per row for int4; k8v4: 3 planes of ``D // 2`` bytes, :mod:`kvcache.paged.config`)."""
        return self.buffer[self._layer(layer)]

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of ``pool(layer)``: NHD ``[num_blocks, block_size, H, D]`` each (FlashAttention's
        paged ``k_cache`` / ``v_cache``), HND ``[num_blocks, H, block_size, D]``. Not for k8v4, whose key rows span
        two planes, and int4b, whose partial blocks' key rows do (:meth:`gather` reads them back). int8 / int4 / fp8k
        rows decode only with ``params(layer)``."""
        if self._config.kv_dtype in ("k8v4", "int4b"):
            raise ValueError(f"kv: kv_dtype {self._config.kv_dtype!r} stores key rows in two planes (no single K "
                             "view); use pool(layer) or gather")
        p = self.pool(layer)
        return p[:, 0], p[:, 1]

    def params(self, layer: int) -> torch.Tensor | None:
        """float32 params pool of ``layer``: (scale, zero) of K and V for int8 / int4 / k8v4, the keys' scales for
        fp8k, int4b's plane of value (scale, zero) and block key areas (:meth:`PagedConfig.params_shape`); None for
        the other formats."""
        return None if self.params_buffer is None else self.params_buffer[self._layer(layer)]

    # ------------------------------------------------------------------------------------------ append / gather

    def plan(
        self,
        block_tables: torch.Tensor | None = None, cu_q_lens: torch.Tensor | None = None,
        kv_lens: torch.Tensor | None = None, *, cu_k_lens: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,  # the ragged batch
        slot_mapping: torch.Tensor | None = None, positions: torch.Tensor | None = None,  # or a slot mapping
        cp_rank: int = 0, cp_size: int = 1,
        rope: RopeConfig | RopeKernelParams | bool | None = None, rope_seq_len: int | None = None,  # the keys' RoPE
        scale: float | None = None, window: int | None = None, softcap: float | None = None,
        q_rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # the query side of every layer's attention
        max_kv_len: int | None = None, num_decode: int = 0, num_splits: int | None = None,
        workspace: torch.Tensor | None = None,  # host hints and scratch of the attention launches
        metadata_ready: bool = False, check: bool = False,
    ) -> StepPlan:
        """The step's :class:`~kvcache.paged.StepPlan`: built and validated once (host-side checks from tensor
        metadata, no device sync), then handed to every layer's :meth:`append`, :meth:`attention` and
        :meth:`gather`.

        Parameters
        ----------
        block_tables, cu_q_lens, kv_lens, cu_k_lens : torch.Tensor, optional
            A ragged batch: int32 ``[B, max_blocks]`` block tables, int32 ``[B + 1]`` rows per sequence, and
            exactly one of int32 ``[B]`` tokens held before the step / int32 ``[B + 1]`` cumulative lengths after
            it (see :func:`kvcache.ops.append_paged_kv`). Without ``cu_q_lens``: a plan for :meth:`gather` only,
            with ``seq_lens`` or ``cu_k_lens``.
        seq_lens : torch.Tensor, optional
            int32 ``[B]``: tokens each sequence holds after the step, for a caller that has it on the device
            already; else computed once here (one device op).
        slot_mapping, positions : torch.Tensor, optional
            Instead of a ragged batch: int64 / int32 ``[N]`` slots (``-1`` skips the row) and RoPE positions
            (required with RoPE). Such a plan serves :meth:`append` only.
        cp_rank, cp_size : int
            Context parallelism (ragged): this rank stores global token ``t`` iff ``t % cp_size == cp_rank``.
        rope : RopeConfig, RopeKernelParams or bool, optional
            The keys' RoPE in the append: None the cache's own (if any), False none, or one for this step.
        rope_seq_len : int, optional
            The current length (``max(positions) + 1``), required with ``"dynamic"`` RoPE scaling.
        scale, window, softcap, q_rope
            The query side of :meth:`attention` for every layer of the plan (see
            :func:`kvcache.ops.paged_attention`); layers whose window or soft-cap differ take
            ``plan.with_options(window=...)``.
        max_kv_len, num_decode, num_splits, workspace
            Host hints and scratch of the attention launch (see :func:`kvcache.ops.paged_attention`): the bound
            of any sequence's length (default: the block table's capacity), the batch's leading decode sequences,
            a forced KV split, a float32 workspace for split launches.
        metadata_ready : bool
            The promise that no kernel still running when an append starts writes the index tensors (see
            :func:`kvcache.ops.append_paged_kv`). RoPE parameters built here (a RopeConfig given here, dynamic
            scaling) are not covered by it: such plans append as without the promise.
        check : bool
            Debug mode (also with ``PagedKVCache(debug=True)``): every append verifies lengths, block-table
            capacity, block ids, slots written twice and fp8 scales on the host (a sync) and raises ValueError
            before writing.

        Returns
        -------
        StepPlan

        Example
        -------
        >>> cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4,
        ...                                  num_blocks=8, dtype=torch.float32, kv_dtype="int8", device="cpu"))
        >>> plan = cache.plan(torch.tensor([[2, 5]], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32),
        ...                   torch.tensor([0], dtype=torch.int32))
        >>> k = torch.randn(6, 2, 8)
        >>> cache.append(0, k, k, plan)
        >>> cache.attention(0, torch.randn(6, 4, 8), plan).shape
        torch.Size([6, 4, 8])
        """
        params = resolve_rope(self._rope, self._rope_params, rope, rope_seq_len, self.device)
        if metadata_ready is True and params is not None and params is not rope and params is not self._rope_params:
            # RoPE parameters built here: their inv_freq may have just been written on the device, so the promise
            # does not cover it; the appends wait
            metadata_ready = False
        index = dict(block_tables=block_tables, cu_q_lens=cu_q_lens, kv_lens=kv_lens, cu_k_lens=cu_k_lens,
                     seq_lens=seq_lens, slot_mapping=slot_mapping, positions=positions, cp_rank=cp_rank,
                     cp_size=cp_size)
        options = dict(scale=scale, window=window, softcap=softcap, q_rope=q_rope, max_kv_len=max_kv_len,
                       num_decode=num_decode, num_splits=num_splits, workspace=workspace,
                       metadata_ready=metadata_ready, check=check or self.debug if type(check) is bool else check)
        return StepPlan.build(self._geometry, self.device, index, options, rope=params,  # type: ignore[arg-type]
                              rope_ready=params is not None and params is self._rope_params,
                              rope_seq_len=rope_seq_len, launch_store=self._launch_store)

    def _check_plan(self, plan: object) -> StepPlan:
        if type(plan) is StepPlan and plan.geometry is self._geometry:
            return plan
        if not isinstance(plan, StepPlan):
            raise TypeError(f"plan: expected a StepPlan (PagedKVCache.plan(...)), got {type(plan).__name__}")
        if plan.geometry != self._geometry or plan.device != self.device:
            raise ValueError(f"plan: built for pools {plan.geometry} on {plan.device}, this cache has "
                             f"{self._geometry} on {self.device}")
        return plan

    def _layer_storage(self, layer: int) -> PagedLayer:
        if type(layer) is int and 0 <= layer < self._config.num_layers:
            return self._layers[layer]
        return self._layers[self._layer(layer)]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> None:
        """Write one layer's new K / V into its blocks where ``plan`` says (RoPE on K and quantization fused): see
        :func:`kvcache.ops.append_paged_kv`.

        ``k``, ``v``: ``[N, H, D]`` of the cache's model dtype (head_dim contiguous, other strides free). Rows of
        a ragged plan past ``cu_q_lens[B]`` are padding and skipped. Per call only ``k`` / ``v`` are checked; the
        first append of a plan derives its launch, which every later layer repeats. One kernel launch, no
        allocation, no host sync (unless the plan's ``check``): capturable in a CUDA graph.

        Example
        -------
        >>> cache = PagedKVCache(PagedConfig(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
        ...                                  num_blocks=8, dtype=torch.float32, device="cpu"))
        >>> plan = cache.plan(slot_mapping=torch.tensor([0, 5, -1]))
        >>> for layer in range(2):
        ...     cache.append(layer, torch.ones(3, 2, 8), torch.zeros(3, 2, 8), plan)
        >>> cache.kv(1)[0][1, 1, 0, 0].item()  # slot 5: block 1, offset 1
        1.0
        """
        lay = self._layer_storage(layer)
        if append_rows(k, v, lay, self._check_plan(plan)):
            self.prepared_launches += 1

    def gather(
        self,
        layer: int,
        plan: StepPlan,
        *,
        k_out: torch.Tensor | None = None,
        v_out: torch.Tensor | None = None,
        max_len: int | None = None,
        rope: RopeConfig | RopeKernelParams | bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks of the plan's sequences, as they stand after the step (``plan.seq_lens`` tokens), back to
        contiguous ``[B, H, S_out, D]`` K and V in the model dtype, dequantized, zero-padded: see
        :func:`kvcache.ops.gather_paged_kv`. ``rope`` (default off): True rotates keys stored un-rotated with the
        cache's RoPE (``"dynamic"`` scaling at the plan's ``rope_seq_len``), or a RopeConfig / RopeKernelParams."""
        plan = self._check_plan(plan)
        lay = self._layer_storage(layer)
        params = resolve_rope(self._rope, self._rope_params, rope, plan.rope_seq_len, self.device)
        return gather_rows(lay, plan, k_out, v_out, max_len, self._config.dtype, params)  # type: ignore[arg-type]

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        plan: StepPlan,
        *,
        sinks: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of the step's query rows over ``layer``'s blocks, read and dequantized in place (no
        gather): see :func:`kvcache.ops.paged_attention`; the options (scale, window, soft-cap, q_rope, launch
        hints) are the plan's.

        ``q`` ``[n_tokens, Hq, D]``: rows ordered as the plan's ragged batch (append the step's K / V first: the
        sequences are read as they stand after the step, ``plan.seq_lens`` tokens). ``sinks``: float32 ``[Hq]``
        per-head sink logits of this layer. Returns ``out`` ``[n_tokens, Hq, D]``; ``lse`` float32
        ``[n_tokens, Hq]`` is filled when given (context-parallel ranks merge by it).

        Example
        -------
        >>> cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4,
        ...                                  num_blocks=8, dtype=torch.float32, device="cpu"))
        >>> plan = cache.plan(torch.tensor([[2, 5]], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32),
        ...                   torch.tensor([0], dtype=torch.int32), window=4)
        >>> cache.append(0, torch.randn(6, 2, 8), torch.randn(6, 2, 8), plan)
        >>> cache.attention(0, torch.randn(6, 4, 8), plan).shape
        torch.Size([6, 4, 8])
        """
        return attend(q, self._layer_storage(layer), self._check_plan(plan), sinks, out, lse)

    # ------------------------------------------------------------------------------------------ blocks

    def _block_ids(self, name: str, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name}: expected a 1-d int tensor of block ids, got {ids.dtype} {list(ids.shape)}")
            vals = ids.tolist()
        else:
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                raise TypeError(f"{name}: expected a sequence of block ids, got {type(ids).__name__}")
            vals = [check_int(f"{name}[{j}]", x) for j, x in enumerate(ids)]
        nb = self._config.num_blocks
        bad = [x for x in vals if not 0 <= x < nb]
        if bad:
            raise ValueError(f"{name}: expected block ids in [0, {nb}), got {bad[:8]}")
        return torch.tensor(vals, dtype=torch.int64)

    def copy_blocks(self, src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor) -> None:
        """Copy blocks ``src[i] -> dst[i]`` in every layer (data and params): the device half of
        copy-on-write (``BlockAllocator.copy_on_write`` gives the pairs). One launch per pool."""
        s = self._block_ids("src", src)
        d = self._block_ids("dst", dst)
        if s.shape != d.shape:
            raise ValueError(f"dst: expected {s.shape[0]} block ids (as src), got {d.shape[0]}")
        if len(set(d.tolist())) != d.shape[0] or set(d.tolist()) & set(s.tolist()):
            raise ValueError("dst: expected distinct block ids that are not also sources")
        pairs = torch.stack([s, d], dim=1).contiguous().to(self.device)
        bufs = [self.buffer] + ([self.params_buffer] if self.params_buffer is not None else [])
        paged_ops.copy_blocks(bufs, pairs, check=False)  # validated above, on the host

    def swap_out(self, block_ids: Sequence[int] | torch.Tensor, *, stream: torch.cuda.Stream | None = None,
                 pin_memory: bool = True) -> SwappedBlocks:
        """Copy blocks of every layer to page-locked host memory, asynchronously on ``stream``: see
        :func:`kvcache.paged.swap.swap_out`."""
        return swap_out(self, self._block_ids("block_ids", block_ids), stream=stream, pin_memory=pin_memory)

    def swap_in(self, swapped: SwappedBlocks, block_ids: Sequence[int] | torch.Tensor, *,
                stream: torch.cuda.Stream | None = None) -> None:
        """Copy swapped-out blocks back into blocks ``block_ids`` of every layer: see
        :func:`kvcache.paged.swap.swap_in`."""
        if not isinstance(swapped, SwappedBlocks):
            raise TypeError(f"swapped: expected SwappedBlocks, got {type(swapped).__name__}")
        swap_in(self, swapped, self._block_ids("block_ids", block_ids), stream=stream)

    def swap_key(self) -> tuple:
        """(kv_dtype, layout, num_kv_heads, head_dim, block_size, num_layers): blocks swapped out of this cache
        go back only into a cache with the same key."""
        c = self._config
        return (c.kv_dtype, c.layout, c.num_kv_heads, c.head_dim, c.block_size, c.num_layers)
