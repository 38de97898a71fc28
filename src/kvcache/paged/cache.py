"""PagedKVCache: per-layer block pools with fused RoPE + quantize + append, gather, copy-on-write, swap."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._backend import _current_device, _current_stream, _hooks_active
from .._device import check_memory
from .._validate import check_int
from ..ops import attention as attention_ops
from ..ops import paged as paged_ops
from ..ops.paged.batch import PagedBatch, unpack_append_batch, unpack_gather_batch
from ..ops.paged.launch import default_append_launch
from ..ops.paged.policy import SPLIT_BELOW
from ..rope import RopeConfig, RopeKernelParams
from .config import PagedConfig, cache_block_bytes
from .swap import SwappedBlocks, swap_in, swap_out

__all__ = ["PagedKVCache", "SwappedBlocks"]


class PagedKVCache:
    """Per-layer block pools (pages) for every attention layer.

    ``pool(layer)`` is ``[num_blocks, 2, block_size, H, D]`` (NHD) or ``[num_blocks, 2, H, block_size, D]``
    (HND) in the storage dtype of ``config.kv_dtype``; for ``"auto"`` and ``"fp8"`` it is FlashInfer's
    single-tensor paged KV cache, and ``kv(layer)`` returns the ``[num_blocks, block_size, H, D]`` K / V views
    FlashAttention's paged ``flash_attn_with_kvcache`` takes (NHD). int8 / int4 pools keep float32
    (scale, zero) per token and head in ``params(layer)``. All layers share one allocation,
    ``[L, *pool_shape]``, zero-initialised. Byte format: :mod:`kvcache.paged.config`.

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
            torch.zeros((L, *config.params_shape()), dtype=torch.float32, device=dev) if config.quantized else None
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
        # prepared append launches (CUDA): raw pointers of each layer's pool / params / scales and of the RoPE
        # frequencies, whether each is 16-byte aligned (part of a plan's key), and the plans seen so far
        self._row_shape = (config.num_kv_heads, config.head_dim)
        self._rope_fast = rope is None or self._rope_params is not None  # rope=None needs no per-call frequencies
        # what get_device() returns for the cache's tensors, -1 for the CPU (the config resolves "cuda" to cuda:i)
        self._dev_id = dev.index if dev.type == "cuda" else -1
        self._direct = dev.type == "cuda"
        inv = self._rope_params.inv_freq if self._rope_params is not None else None
        self._ptrs = []
        self._layer_align = []
        for i in range(L):
            ptrs = (self._pools[i].data_ptr(),
                    (self._params[i] if self._params[i] is not None else self._pools[i]).data_ptr(),
                    (inv if inv is not None else self._pools[i]).data_ptr(), self._scales[i].data_ptr())
            self._ptrs.append(ptrs)
            self._layer_align.append(tuple(p % 16 == 0 for p in ptrs))
        self._plans: dict[tuple, paged_ops.AppendPlan] = {}
        self._launches: dict[tuple, paged_ops.AppendLaunch] = {}  # the policy's launch per kind of call
        self.prepared_launches = 0  # appends launched through a prepared plan (a diagnostic)

    @staticmethod
    def nbytes_for(config: PagedConfig) -> int:
        """Bytes a cache of ``config`` allocates (pools of every layer, (scale, zero) included)."""
        return cache_block_bytes(config.num_layers, config.num_kv_heads, config.head_dim, config.block_size,
                                 config.dtype, config.kv_dtype) * config.num_blocks

    def unwritable_rows(self, batch: PagedBatch, num_rows: int) -> torch.Tensor:
        """Rows of an append of ``num_rows`` rows described by ``batch`` that would be skipped although meant to
        be written (block index past the table, block id or slot outside the pool): an int64 0-d device tensor,
        no sync. See :meth:`PagedBatch.unwritable_rows`."""
        return batch.unwritable_rows(num_rows, block_size=self._config.block_size,
                                     num_blocks=self._config.num_blocks)

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
        (``D // 2`` bytes per row for int4)."""
        return self.buffer[self._layer(layer)]

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of ``pool(layer)``: NHD ``[num_blocks, block_size, H, D]`` each (FlashAttention's
        paged ``k_cache`` / ``v_cache``), HND ``[num_blocks, H, block_size, D]``."""
        p = self.pool(layer)
        return p[:, 0], p[:, 1]

    def params(self, layer: int) -> torch.Tensor | None:
        """float32 (scale, zero) pool of ``layer`` for int8 / int4, else None."""
        return None if self.params_buffer is None else self.params_buffer[self._layer(layer)]

    # ------------------------------------------------------------------------------------------ append / gather

    def _rope_for(self, rope: RopeConfig | RopeKernelParams | bool | None,
                  seq_len: int | None) -> RopeKernelParams | RopeConfig | bool | None:
        # the kernel parameters of a call's `rope` argument (anything else is passed on, for the op to reject)
        if rope is False:
            return None
        if rope is None or rope is True:
            if self._rope is None:
                if rope is True:
                    raise ValueError("rope: True needs a RopeConfig given to the cache")
                return None
            if self._rope_params is not None:
                return self._rope_params
            config = self._rope
        elif isinstance(rope, RopeConfig):
            config = rope
        else:
            return rope
        if config.is_dynamic and seq_len is None:
            # transformers grows the base from max(position_ids) + 1 in every forward pass; here that length
            # is the caller's to give (reading it from the device would sync every call)
            raise ValueError("rope_seq_len: required with 'dynamic' RoPE scaling (the current length, "
                             "max(positions) + 1), got None")
        return config.kernel_params(seq_len, device=self.device)

    def append(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        block_tables: torch.Tensor | None = None,
        cu_q_lens: torch.Tensor | None = None,
        kv_lens: torch.Tensor | None = None,
        cu_k_lens: torch.Tensor | None = None,
        slot_mapping: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        rope: RopeConfig | RopeKernelParams | bool | None = None,
        rope_seq_len: int | None = None,
        cp_rank: int = 0,
        cp_size: int = 1,
        check: bool = False,
        metadata_ready: bool = False,
        batch: PagedBatch | None = None,
    ) -> None:
        """Write new K / V of one layer into the blocks: see :func:`kvcache.ops.append_paged_kv`.

        ``batch``: the step's :class:`~kvcache.paged.PagedBatch` (built once per step, read by every layer), in
        place of ``block_tables`` / ``cu_q_lens`` / ``kv_lens`` / ``cu_k_lens`` / ``slot_mapping`` /
        ``positions`` / ``cp_rank`` / ``cp_size``.

        ``rope``: None uses the cache's RopeConfig (if any), False disables, or a RopeConfig /
        RopeKernelParams for this call; ``rope_seq_len`` is the current length for ``"dynamic"`` scaling.
        ``metadata_ready``: no kernel that may still be running when this append starts writes the index
        tensors (see :func:`kvcache.ops.append_paged_kv`): decode-sized appends with programmatic dependent
        launch then overlap their lookup and RoPE's cos / sin with the previous kernel's tail. The cache's own
        RoPE parameters are covered (built once); parameters built in this call (a RopeConfig given here,
        dynamic scaling past the original length) are not, and such calls go as if without the promise. Without
        it, decode-sized appends with PDL look their rows up before the wait speculatively and check every
        value read after it (see :func:`kvcache.ops.append_paged_kv`): nearly as fast, and safe.
        """
        block_tables, cu_q_lens, kv_lens, cu_k_lens, slot_mapping, positions, cp_rank, cp_size = unpack_append_batch(
            batch, block_tables, cu_q_lens, kv_lens, cu_k_lens, slot_mapping, positions, cp_rank, cp_size)
        cfg = self._config
        check = check or self.debug
        # fast paths: the common calls (ragged with kv_lens, or slot mapping; the cache's own RoPE or none), every
        # argument checked in a few expressions (each tensor attribute read costs 0.1-0.3 us: read once, compare
        # ints; devices by index, -1 for the CPU); a prepared launch once the kind of call has been seen
        fast = (
            type(k) is torch.Tensor and type(v) is torch.Tensor and type(layer) is int and check is False
            and type(cp_size) is int and cp_size == 1 and type(cp_rank) is int and cp_rank == 0
            and (rope is False or (rope is None and self._rope_fast)) and type(metadata_ready) is bool
        )
        if fast:
            ksh = k.shape
            ks, vs = k.stride(), v.stride()
            H, D = self._row_shape
            did = self._dev_id
            fast = (
                0 <= layer < cfg.num_layers and len(ksh) == 3 and ksh[1] == H and ksh[2] == D and v.shape == ksh
                and ks[2] == 1 and vs[2] == 1 and k.dtype is cfg.dtype and v.dtype is cfg.dtype
                and k.get_device() == did and v.get_device() == did
                and ((k.is_cuda and v.is_cuda) if did >= 0 else (k.is_cpu and v.is_cpu))
            )
            n = ksh[0] if fast else 0
        use_rope = fast and rope is None and self._rope_params is not None
        if fast and slot_mapping is None:
            n_seqs = _ints_len(kv_lens, did)
            fast = (
                positions is None and cu_k_lens is None and n_seqs >= 0 and _ints_len(cu_q_lens, did) == n_seqs + 1
                and type(block_tables) is torch.Tensor and block_tables.dtype is torch.int32
            )
            if fast:
                bsh = block_tables.shape  # type: ignore[union-attr]
                bst = block_tables.stride()  # type: ignore[union-attr]
                fast = (
                    len(bsh) == 2 and bsh[0] == n_seqs and (bst[1] == 1 or bsh[1] <= 1)
                    and block_tables.get_device() == did  # type: ignore[union-attr]
                    and (block_tables.is_cuda if did >= 0 else block_tables.is_cpu)  # type: ignore[union-attr]
                )
        elif fast:
            fast = (
                block_tables is None and cu_q_lens is None and kv_lens is None and cu_k_lens is None
                and _ints_len(slot_mapping, did, True) == n and (not use_rope or _ints_len(positions, did, True) == n)
            )
        if not fast:
            i = self._layer(layer)
            for name, t in (("k", k), ("v", v)):
                if isinstance(t, torch.Tensor) and t.dtype != cfg.dtype:
                    raise ValueError(f"{name}: expected dtype {cfg.dtype} (the cache's model dtype), got {t.dtype}")
            params = self._rope_for(rope, rope_seq_len)
            if metadata_ready is True and params is not None and params is not rope and params is not self._rope_params:
                # RoPE parameters built in this call (a RopeConfig given here, dynamic scaling past the
                # original length): their inv_freq may have just been written on the device, so the promise
                # does not cover it; the append waits (a non-bool still reaches append_paged_kv's TypeError)
                metadata_ready = False
            paged_ops.append_paged_kv(
                k, v, self.buffer[i], None if self.params_buffer is None else self.params_buffer[i],
                kv_dtype=self._config.kv_dtype, layout=self._config.layout, block_tables=block_tables,
                cu_q_lens=cu_q_lens, kv_lens=kv_lens, cu_k_lens=cu_k_lens, slot_mapping=slot_mapping,
                positions=positions, rope=params, fp8_scales=self.kv_scales[i],
                cp_rank=cp_rank, cp_size=cp_size, check=check, metadata_ready=metadata_ready,
            )
            return
        if n == 0:
            return
        key = None
        launch = None
        if self._direct and not _hooks_active() and _current_device() == did:
            # a prepared launch: keyed by everything that selects the compiled kernel besides the cache itself,
            # the launch description (the policy's output) included
            ragged = slot_mapping is None
            pkey = (ragged, use_rope, n < SPLIT_BELOW, ragged and n == n_seqs, metadata_ready)
            launch = self._launches.get(pkey)
            if launch is None:
                launch = default_append_launch(k, self._pools[layer], kv_dtype=cfg.kv_dtype,
                                               n_seqs=n_seqs if ragged else None,
                                               rope=self._rope_params if use_rope else None,
                                               metadata_ready=metadata_ready, rope_ready=True)
                self._launches[pkey] = launch
            kp, vp = k.data_ptr(), v.data_ptr()
            if ragged:
                p1, p2, p3 = block_tables.data_ptr(), cu_q_lens.data_ptr(), kv_lens.data_ptr()  # type: ignore[union-attr]
                bt_stride, width = bst[0], bsh[1]
                ptrs = (p1, p2, p3, None, None)  # block tables, cu_q_lens, kv_lens; no slots / positions
                key = (True, use_rope, ks, vs, n_seqs, self._layer_align[layer], launch)
            else:
                p1, p2, p3 = slot_mapping.data_ptr(), positions.data_ptr() if use_rope else 0, 0  # type: ignore[union-attr]
                bt_stride = width = n_seqs = 0
                ptrs = (None, None, None, p1, p2 if use_rope else None)
                key = (False, use_rope, ks, vs, slot_mapping.dtype,  # type: ignore[union-attr]
                       positions.dtype if use_rope else None, self._layer_align[layer], launch)
            if (kp | vp | p1 | p2 | p3) & 15 or max(n, ks[0], vs[0], bt_stride, width) > 0x7FFFFFFF:
                key = None  # unaligned, or an int past int32: the generic launch
            plan = self._plans.get(key) if key is not None else None
            if plan is not None:
                pool_p, par_p, inv_p, sc_p = self._ptrs[layer]
                plan.launch(_current_stream(did), n, kp, vp, ks[0], vs[0], pool_p, par_p, inv_p if use_rope else None,
                            sc_p, *ptrs, bt_stride, width, n_seqs)
                self.prepared_launches += 1
                return
        plan = paged_ops.append_paged_kv_launch(
            k, v, self._pools[layer], self._params[layer], kv_dtype=cfg.kv_dtype, layout=cfg.layout,
            block_tables=block_tables, cu_q_lens=cu_q_lens, kv_lens=kv_lens, cu_k_lens=None,
            slot_mapping=slot_mapping, positions=positions if use_rope else None,
            rope=self._rope_params if use_rope else None, fp8_scales=self._scales[layer], cp_rank=0, cp_size=1,
            launch=launch, metadata_ready=metadata_ready,
            rope_ready=True,  # the cache's own frequencies, written once at init
        )
        if key is not None and plan is not None:
            if len(self._plans) >= 256:  # one per kind of call; bounded for callers whose batch size wanders
                self._plans.clear()
            self._plans[key] = plan

    def gather(
        self,
        layer: int,
        block_tables: torch.Tensor | None = None,
        *,
        kv_lens: torch.Tensor | None = None,
        cu_k_lens: torch.Tensor | None = None,
        k_out: torch.Tensor | None = None,
        v_out: torch.Tensor | None = None,
        max_len: int | None = None,
        rope: RopeConfig | RopeKernelParams | bool | None = False,
        rope_seq_len: int | None = None,
        cp_rank: int = 0,
        cp_size: int = 1,
        batch: PagedBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks of the requested sequences back to contiguous ``[B, H, S_out, D]`` K and V in the model
        dtype, dequantized, zero-padded: see :func:`kvcache.ops.gather_paged_kv`. ``rope`` (default off)
        rotates keys that were stored un-rotated. ``batch``: a ragged :class:`~kvcache.paged.PagedBatch` in
        place of ``block_tables`` / ``kv_lens`` / ``cu_k_lens`` / ``cp_rank`` / ``cp_size``: its sequences are
        read as they stand after the step (``batch.seq_lens`` tokens)."""
        block_tables, kv_lens, cu_k_lens, cp_rank, cp_size = unpack_gather_batch(batch, block_tables, kv_lens,
                                                                                cu_k_lens, cp_rank, cp_size)
        i = self._layer(layer)
        return paged_ops.gather_paged_kv(
            self.buffer[i], None if self.params_buffer is None else self.params_buffer[i],
            kv_dtype=self._config.kv_dtype, layout=self._config.layout, block_tables=block_tables,
            kv_lens=kv_lens, cu_k_lens=cu_k_lens, k_out=k_out, v_out=v_out, max_len=max_len,
            dtype=self._config.dtype, rope=self._rope_for(rope, rope_seq_len), fp8_scales=self.kv_scales[i],
            cp_rank=cp_rank, cp_size=cp_size,
        )

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        *,
        batch: PagedBatch,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        max_kv_len: int | None = None,
        num_splits: int | None = None,
        workspace: torch.Tensor | None = None,
        num_decode: int = 0,
    ) -> torch.Tensor:
        """Causal attention of the step's query rows over ``layer``'s blocks, read and dequantized in place (no
        gather): see :func:`kvcache.ops.paged_attention` (``num_decode``: the batch's leading decode sequences, a
        tile hint for mixed steps).

        ``q`` ``[n_tokens, Hq, D]``: rows ordered as the step's ragged ``batch`` (the
        :class:`~kvcache.paged.PagedBatch` its K / V were appended with, first: the sequences are read as they
        stand after the step, ``batch.seq_lens`` tokens). Returns ``out`` ``[n_tokens, Hq, D]``; ``lse`` float32
        ``[n_tokens, Hq]`` is filled when given (context-parallel ranks merge by it).

        Example
        -------
        >>> cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4,
        ...                                  num_blocks=8, dtype=torch.float32, kv_dtype="int8", device="cpu"))
        >>> batch = PagedBatch.ragged(torch.tensor([[2, 5]], dtype=torch.int32),
        ...                           torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))
        >>> k = torch.randn(6, 2, 8)
        >>> cache.append(0, k, k, batch=batch)
        >>> cache.attention(0, torch.randn(6, 4, 8), batch=batch).shape
        torch.Size([6, 4, 8])
        """
        if not isinstance(batch, PagedBatch) or not batch.is_ragged:
            got = "a slot-mapping PagedBatch" if isinstance(batch, PagedBatch) else type(batch).__name__
            raise TypeError(f"batch: expected a ragged PagedBatch (block tables + lengths), got {got}")
        i = self._layer(layer)
        return attention_ops.paged_attention(
            q, self._pools[i], self._params[i], self._scales[i], kv_dtype=self._config.kv_dtype,
            layout=self._config.layout, block_tables=batch.block_tables, cu_q_lens=batch.cu_q_lens,
            kv_lens=batch.seq_lens, scale=scale, window=window, softcap=softcap, sinks=sinks, out=out, lse=lse,
            cp_rank=batch.cp_rank, cp_size=batch.cp_size, max_kv_len=max_kv_len, num_splits=num_splits,
            workspace=workspace, num_decode=num_decode,
        )

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

def _ints_len(t: object, device_id: int, int64: bool = False) -> int:
    """Entries of ``t`` if it is a contiguous 1-d int32 tensor (int64 too with ``int64``) on the device
    ``device_id`` (``get_device()``: a CUDA index, or -1 for the CPU), else -1."""
    if type(t) is not torch.Tensor:
        return -1
    dt = t.dtype
    sh = t.shape
    ok = (
        (dt is torch.int32 or (int64 and dt is torch.int64)) and len(sh) == 1 and (sh[0] <= 1 or t.stride(0) == 1)
        and t.get_device() == device_id and (t.is_cuda if device_id >= 0 else t.is_cpu)  # an index alone is
        # ambiguous: -1 is the CPU and also "meta", 0 is cuda:0 and also other accelerators' first device
    )
    return sh[0] if ok else -1

