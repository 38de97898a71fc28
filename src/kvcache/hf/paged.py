"""PagedCache: a transformers ``Cache`` backed by :class:`~kvcache.PagedKVCache` + :class:`~kvcache.BlockAllocator`.

Every batch row owns a block table; blocks are allocated as rows grow, shared by beam search (fork, then
copy-on-write of the one partly filled block a row writes next), freed by ``crop`` and ``reset``.

Two ways to run attention, chosen per step by the model's ``config._attn_implementation``:

* ``"kvcache_paged"`` (see :mod:`kvcache.hf.attention`): ``update`` only records the step; the attention
  function writes the new keys and values (padding rows left out: a row's blocks hold its real tokens only,
  found from the attention mask) and attends over the blocks in place.
* anything else (sdpa, eager, ...): ``update`` writes every token (left padding included, as the model
  computed it) and returns the layer's keys and values gathered back to ``[B, H, L, D]`` (dequantized), for
  transformers' attention and its mask. Correct with every implementation; it reads the whole cache every layer.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from .._validate import cdiv
from ..ops.paged.block_keys import blocks_for_tokens
from ..ops.paged.format import kv_format
from ..paged import BlockAllocator, PagedConfig, PagedKVCache, StepPlan
from ..paged.config import KV_FORMATS, LAYOUTS
from ..support import check_supported, layer_window
from ._common import CacheCapacity, LayerView, ModelShape, tokens_to_keep

__all__ = ["PagedCache"]

ATTN_IMPLEMENTATION = "kvcache_paged"


class Pending:
    """What ``update`` hands the ``kvcache_paged`` attention function (attached to the returned keys)."""

    __slots__ = ("cache", "layer")

    def __init__(self, cache: PagedCache, layer: int) -> None:
        self.cache = cache
        self.layer = layer


class PagedCache(CacheCapacity, Cache):
    """A transformers cache whose keys and values live in the blocks of a kvcache paged cache.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config: layers, KV heads and head_dim are read from it, and, at each step,
        ``_attn_implementation`` (``"kvcache_paged"``: attention in place; else gathered K / V).
    max_batch_size : int
        Batch rows (prompts x ``num_beams``).
    max_cache_len : int
        Tokens per row the pool is sized for by default (``num_blocks = max_batch_size * ceil(max_cache_len /
        block_size)``).
    kv_dtype : str
        ``"auto"`` (the model's dtype), ``"fp8"``, ``"fp8k"``, ``"int8"``, ``"int4"``, ``"k8v4"`` or ``"int4b"`` (see
        :mod:`kvcache.paged.config`; int4b: ``block_size <= head_dim / 2``, and :meth:`crop` inside a full block is
        refused).
    block_size : int
        Tokens per block.
    num_blocks : int, optional
        Blocks in the pool (default above).
    layout : str
        ``"NHD"`` or ``"HND"``.
    device : torch.device | str, optional
        Default: the device of the first ``update``'s keys.

    Notes
    -----
    The pools are allocated on the first ``update`` (the model's dtype, the dtype of K / V given to the
    paged cache, is known then). ``paged`` (the :class:`~kvcache.PagedKVCache`) and ``allocator`` are
    public; ``block_tables`` lists each row's blocks.

    Examples
    --------
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    ...                   num_key_value_heads=2, vocab_size=100)
    >>> model = LlamaForCausalLM(cfg).eval()
    >>> cache = PagedCache(cfg, max_batch_size=1, max_cache_len=32, kv_dtype="int8", block_size=4)
    >>> out = model.generate(torch.tensor([[1, 2, 3]]), past_key_values=cache, max_new_tokens=4, min_new_tokens=4,
    ...                      do_sample=False)  # min_new_tokens: a random model may sample its end token early
    >>> cache.get_seq_length(), cache.block_tables
    (6, [[0, 1]])
    """

    def __init__(
        self,
        config: Any,
        *,
        max_batch_size: int,
        max_cache_len: int,
        kv_dtype: str = "auto",
        block_size: int = 16,
        num_blocks: int | None = None,
        layout: str = "NHD",
        device: torch.device | str | None = None,
    ) -> None:
        shape = ModelShape.from_config(config)
        ints = {"max_batch_size": max_batch_size, "max_cache_len": max_cache_len, "block_size": block_size}
        if num_blocks is not None:
            ints["num_blocks"] = num_blocks
        for name, value in ints.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value}")
        if kv_dtype not in KV_FORMATS:
            raise ValueError(f"kv_dtype: expected one of {KV_FORMATS}, got {kv_dtype!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        if kv_format(kv_dtype).needs_even_head_dim and shape.head_dim % 2:
            raise ValueError(f"kv_dtype: {kv_dtype!r} needs an even head_dim, the model's is {shape.head_dim}")
        self.model_config = config
        check_supported(config, self._path(), name="config")  # a property of the model this path does not run
        self._checked = {self._path()}  # the paths checked (a model may change its attention implementation)
        self._checked_layers: set[int] = set()  # layers whose attention module kvcache_paged has inspected
        super().__init__(layers=[LayerView(self, i) for i in range(shape.num_layers)])
        self.shape = shape
        # behind CacheCapacity's read-only properties (transformers 5.17's Cache defines them read-only)
        self._max_batch = max_batch_size
        self._max_len = max_cache_len
        self.kv_dtype = kv_dtype
        self.block_size = block_size
        self._spare = kv_format(kv_dtype).block_keys  # int4b: a partial block keeps the block after it
        self.num_blocks = num_blocks if num_blocks is not None else max_batch_size * (
            cdiv(max_cache_len, block_size) + self._spare)
        self.layout = layout
        self._device = torch.device(device) if device is not None else None
        self.paged: PagedKVCache | None = None
        self.allocator = BlockAllocator(self.num_blocks, block_size, enable_prefix_caching=False)
        self._allocated = False
        self.block_tables: list[list[int]] = []
        self._stored: list[int] = []  # tokens in each row's blocks (committed steps)
        self._layer_len = [0] * shape.num_layers  # transformers' length per layer (left padding included)
        self._hf_len = 0  # transformers' length after the last complete step
        # the forward in progress (None between forwards): its plan, shared by every layer, with the plans of
        # layers whose attention options differ, keyed by (scale, window, softcap); which tokens of the [B, T]
        # chunk are real; each row's length after it; how many layers have written
        self._plan: StepPlan | None = None
        self._attn_plans: dict[tuple, StepPlan] = {}
        self._rows: torch.Tensor | None = None  # int64 [n]: the real tokens' indices in the flattened chunk
        self._after: list[int] = []
        self._done = 0

    # ------------------------------------------------------------------------------------------ storage

    def _allocate(self, key_states: torch.Tensor) -> None:
        if self._allocated:
            return
        s = self.shape
        self.paged = PagedKVCache(PagedConfig(
            num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, block_size=self.block_size,
            num_blocks=self.num_blocks, dtype=key_states.dtype, kv_dtype=self.kv_dtype, layout=self.layout,
            device=self._device or key_states.device))
        self._allocated = True

    @property
    def in_place(self) -> bool:
        """True when the model's attention is ``"kvcache_paged"`` (reads the blocks in place)."""
        return getattr(self.model_config, "_attn_implementation", None) == ATTN_IMPLEMENTATION

    def _path(self) -> str:
        return "hf-paged" if self.in_place else "hf-gathered"

    def check_layer(self, i: int, module: Any, window: int | None, softcap: float | None, extra: dict) -> None:
        """What ``kvcache_paged`` is handed for layer ``i`` must be what it implements, checked once per layer:
        attention sinks only as the attention passes them (``s_aux``), and where the config gives the layer a
        window, the attention passes that window (a model that applies its window through the mask alone would
        otherwise attend over every key; a window the attention passes on its own is honoured). ValueError naming
        the property otherwise."""
        if i in self._checked_layers:
            return
        # sinks the attention passes (gpt-oss: s_aux) join the softmax in the kernel; a sinks parameter the
        # attention does not pass would be left out: refused
        sinks = [n for n, _ in module.named_parameters(recurse=False) if "sink" in n]
        if sinks and extra.get("s_aux") is None:
            raise ValueError(f"model: attention sinks (layer {i}: {sinks[0]}, not passed as s_aux) are not "
                             f"implemented by kvcache.hf's PagedCache with attn_implementation="
                             f"'{ATTN_IMPLEMENTATION}'; paths that run it: hf-gathered, hf-linear")
        want = layer_window(self.model_config, i)
        if want is not None and window != want:
            raise ValueError(f"model: sliding-window attention of layer {i} (the config gives {want}, the attention "
                             f"passes sliding_window={window}) is not implemented by kvcache.hf's PagedCache with "
                             f"attn_implementation='{ATTN_IMPLEMENTATION}'; paths that run it: hf-gathered, hf-linear")
        self._checked_layers.add(i)

    def _check_update(self, i: int, key_states: torch.Tensor) -> None:
        path = self._path()
        if path not in self._checked:
            check_supported(self.model_config, path, name="config")
            self._checked.add(path)
        self._allocate(key_states)
        B = key_states.shape[0]
        if not self.block_tables and not any(self._layer_len):
            if B > self.max_batch_size:
                raise ValueError(f"key_states: expected at most {self.max_batch_size} rows (max_batch_size), got {B}")
            self.block_tables = [[] for _ in range(B)]
            self._stored = [0] * B
        if B != len(self.block_tables):
            raise ValueError(f"key_states: expected {len(self.block_tables)} rows (the batch this cache holds), got "
                             f"{B}; call reset() before a new batch")
        if self._layer_len[i] != self._hf_len:
            raise ValueError(f"layer_idx: layer {i} was already updated in this step; every layer is updated once "
                             "per forward")
        if sum(n != self._hf_len for n in self._layer_len) != self._done:
            raise ValueError(
                f"attn_implementation: a layer updated before layer {i} in this step was never written: with "
                f"'{ATTN_IMPLEMENTATION}' the attention function writes each layer after its update; call reset()")

    def _update(self, i: int, key_states: torch.Tensor, value_states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_update(i, key_states)
        T = key_states.shape[2]
        if self.in_place:
            # the attention function writes (it sees the mask, so padding stays out of the blocks)
            self._layer_len[i] += T
            key_states._kvcache_pending = Pending(self, i)  # type: ignore[attr-defined]
            return key_states, value_states
        plan = self._plan or self._begin_step(T, None)
        self._write(i, key_states, value_states)
        self._layer_len[i] += T
        paged: PagedKVCache = self.paged  # type: ignore[assignment]
        k, v = paged.gather(i, plan, max_len=max(self._after, default=0))
        self._finish_layer()
        return k, v

    def _begin_step(self, T: int, valid: torch.Tensor | None, **options: Any) -> StepPlan:
        """Allocate blocks for a chunk of ``T`` tokens per row (``valid`` bool ``[B, T]``: the real ones; None: all)
        and plan where they go (``options``: the attention options of ``PagedKVCache.plan``, the first layer's).
        Raises ValueError, nothing changed, when the pool is too small."""
        B = len(self.block_tables)
        if valid is None:
            counts = [T] * B
        else:
            counts = [int(c) for c in valid.sum(dim=1).tolist()]
            if all(c == T for c in counts):
                valid = None
        before = list(self._stored)
        need = [max(self._blocks_for(n + c) - len(t), 0) for n, c, t in zip(before, counts, self.block_tables)]
        # a row writing into a block it shares (after a beam-search fork) copies it first. int4b: the block the row
        # writes next is held even when empty (the spare after a full block), and the one after it takes the second
        # halves of a partial block's key rows: both are copied when shared
        span = 2 if self._spare else 1
        shared = [(b, j) for b in range(B) if counts[b] and (before[b] % self.block_size or self._spare)
                  for j in range(before[b] // self.block_size,
                                 min(before[b] // self.block_size + span, len(self.block_tables[b])))
                  if self.allocator.ref_count(self.block_tables[b][j]) > 1]
        if sum(need) + len(shared) > self.allocator.num_free_blocks:
            raise ValueError(
                f"num_blocks: the chunk needs {sum(need) + len(shared)} more blocks, {self.allocator.num_free_blocks} "
                f"of {self.num_blocks} are free; give PagedCache a larger num_blocks or max_cache_len")
        paged: PagedKVCache = self.paged  # type: ignore[assignment]
        for b, j in shared:
            old = self.block_tables[b][j]
            new = self.allocator.copy_on_write(old)
            if new is not None and new != old:
                paged.copy_blocks([old], [new])
                self.block_tables[b][j] = new
        for b, n in enumerate(need):
            if n:
                self.block_tables[b] += self.allocator.allocate(n)  # type: ignore[operator]  # checked above
        dev = paged.device
        width = max(1, max(len(t) for t in self.block_tables))
        tables = torch.zeros((B, width), dtype=torch.int32)
        for b, t in enumerate(self.block_tables):
            tables[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
        cu = [0]
        for c in counts:
            cu.append(cu[-1] + c)
        after = [n + c for n, c in zip(before, counts)]
        # cu_q_lens and the lengths before and after in one tensor (one copy to the device), each row starting on a
        # 16-byte boundary as a tensor of its own would (the kernels specialise on their pointers' alignment)
        pad = [0] * (-(-(B + 1) // 4) * 4 - B)
        lens = torch.tensor([cu + pad[1:], before + pad, after + pad], dtype=torch.int32).to(dev)
        plan = paged.plan(tables.to(dev), lens[0, :B + 1], lens[1, :B], seq_lens=lens[2, :B], **options)
        self._plan, self._attn_plans = plan, {}
        self._rows = None if valid is None else valid.reshape(-1).nonzero().squeeze(1)
        self._after = after
        self._done = 0
        return plan

    def _attention_plan(self, scale: float, window: int | None, softcap: float | None) -> StepPlan:
        """The step's plan with a layer's attention options (the step's own when they are the first layer's; one
        plan per distinct set, shared by the layers that have it)."""
        plan: StepPlan = self._plan  # type: ignore[assignment]
        if plan.scale == scale and plan.window == window and plan.softcap == softcap:
            return plan
        key = (scale, window, softcap)
        if key not in self._attn_plans:
            self._attn_plans[key] = plan.with_options(scale=scale, window=window, softcap=softcap)
        return self._attn_plans[key]

    def _write(self, i: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append this step's real tokens of layer ``i`` (``[B, H, T, D]``) into the blocks."""
        k, v = key_states.transpose(1, 2), value_states.transpose(1, 2)  # [B, T, H, D]
        k, v = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])  # [B * T, H, D]
        if self._rows is not None:
            k, v = k.index_select(0, self._rows), v.index_select(0, self._rows)
        paged: PagedKVCache = self.paged  # type: ignore[assignment]
        paged.append(i, k, v, self._plan)  # type: ignore[arg-type]

    def _finish_layer(self) -> None:
        self._done += 1
        if self._done == len(self._layer_len):
            self._stored = list(self._after)
            self._hf_len = self._layer_len[0]
            self._end_step()

    def _end_step(self) -> None:
        self._plan, self._attn_plans, self._rows, self._after, self._done = None, {}, None, [], 0

    # ------------------------------------------------------------------------------------------ Cache API

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens of layer ``layer_idx`` as transformers counts them (left padding included)."""
        if not 0 <= layer_idx < len(self._layer_len):
            return 0
        return self._layer_len[layer_idx]

    @property
    def seq_lens(self) -> list[int]:
        """Tokens held in each row's blocks (without left padding in ``kvcache_paged`` mode)."""
        return list(self._stored)

    def reset(self) -> None:
        """Free every row's blocks: the next ``update`` starts a new batch (the pools are kept)."""
        for t in self.block_tables:
            if t:
                self.allocator.free(t)
        self.block_tables = []
        self._stored = []
        self._layer_len = [0] * len(self._layer_len)
        self._hf_len = 0
        self._end_step()

    def _reset_layer(self, i: int) -> None:
        self.reset()

    def _between_steps(self, what: str) -> None:
        if self._plan is not None or any(n != self._hf_len for n in self._layer_len):
            raise ValueError(f"{what}: expected a cache between forwards, got one in the middle of a step")

    def crop(self, tokens_to_remove: int) -> None:
        """Drop tokens from the end of every row and free the blocks no longer needed: ``crop(-n)`` removes
        ``n`` (transformers 5.x); ``crop(n)`` with ``n >= 0`` keeps the first ``n`` (the older form)."""
        self._between_steps("crop")
        keep = tokens_to_keep(self._hf_len, tokens_to_remove)
        removed = self._hf_len - keep
        if removed == 0:
            return
        if self._spare and any(
                keep_b % self.block_size and keep_b // self.block_size < n // self.block_size
                for n in self._stored for keep_b in [max(n - removed, 0)]):
            raise NotImplementedError("PagedCache: crop inside a full block of an int4b cache (its keys would need "
                                      "re-encoding as int8 rows)")
        for b, t in enumerate(self.block_tables):
            self._stored[b] = max(self._stored[b] - removed, 0)
            n = self._blocks_for(self._stored[b])
            if len(t) > n:
                self.allocator.free(t[n:])
                del t[n:]
        self._layer_len = [keep] * len(self._layer_len)
        self._hf_len = keep

    def _blocks_for(self, tokens: int) -> int:
        """Blocks a row of ``tokens`` tokens holds (int4b: a partial block keeps the block after it)."""
        return blocks_for_tokens(tokens, self.block_size) if self._spare else cdiv(tokens, self.block_size)

    def _crop_layer(self, i: int, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "PagedCache: crop the whole cache (cache.crop), its block tables are shared by layers")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``b`` continues row ``beam_idx[b]``. Block tables are forked (ref counts), no bytes
        move; a row copies only the partly filled block it writes next (int4b: and the block after it), and only if
        it is shared."""
        self._between_steps("reorder_cache")
        B = len(self.block_tables)
        if not isinstance(beam_idx, torch.Tensor) or beam_idx.dim() != 1 or beam_idx.shape[0] != B:
            raise ValueError(f"beam_idx: expected a 1-d tensor of {B} row indices, got {beam_idx!r}")
        idx = [int(x) for x in beam_idx.tolist()]
        if any(not 0 <= x < B for x in idx):
            raise ValueError(f"beam_idx: expected row indices in [0, {B}), got {idx}")
        new_tables = [self.allocator.fork(self.block_tables[x]) if self.block_tables[x] else [] for x in idx]
        for t in self.block_tables:
            if t:
                self.allocator.free(t)
        self.block_tables = new_tables
        self._stored = [self._stored[x] for x in idx]

    def _reorder_layer(self, i: int, beam_idx: torch.Tensor) -> None:
        raise NotImplementedError("PagedCache: reorder the whole cache (cache.reorder_cache), its block tables are "
                                  "shared by layers")

    def __repr__(self) -> str:
        return (f"PagedCache(layers={len(self._layer_len)}, rows={len(self.block_tables)}, kv_dtype={self.kv_dtype!r}, "
                f"block_size={self.block_size}, blocks used={self.allocator.num_used_blocks}/{self.num_blocks})")
