"""The engine's paged mode as one :class:`~kvcache.engine.core.EngineCore`: the pool sized from the config, the block
allocator, the continuous-batching scheduler, the runner and the step loop.

* Pool: ``num_blocks``, else as many blocks as ``EngineConfig.cache_memory`` holds (``cache_block_bytes`` of the
  model's shape and the ``kv_dtype``), at least 2; under tensor parallel the smallest count of every rank, so the
  ranks' schedulers decide alike. One more block is allocated as the runner's scratch block (the padded rows of
  CUDA graphs write and read it), never handed to requests.
* Block tables are ``ceil(max_model_len / block_size)`` wide; CUDA graphs cover decode batches up to
  ``min(max_num_seqs, 512)`` requests; with graphs on, each step is launched before the host reads the previous
  step's tokens (:class:`~kvcache.engine.paged_loop.PagedLoop`).
* Layer groups (:mod:`kvcache.paged.groups`): layers with the same sliding window (None: full attention) share one
  ``PagedKVCache`` and one ``BlockAllocator``; a window group holds only the blocks its window still reads. The KV
  budget is split between the groups in proportion to what a sequence of ``max_model_len`` tokens needs in each
  (:func:`~kvcache.paged.groups.split_blocks`); ``num_blocks`` then stands for the memory of that many blocks of
  every layer. A model of one full-attention group is built exactly as one cache and one allocator. The memory tiers,
  KV events and tensor parallel are refused with more than one group.
"""

from __future__ import annotations

import torch

from .._validate import cdiv
from ..ops.paged.format import kv_format
from ..paged import BlockAllocator, PagedConfig, PagedKVCache, cache_block_bytes
from ..paged.events import KVEventLog
from ..paged.groups import LayerGroup, layer_groups, split_blocks
from ..paged.tiers import TieredCache, TierStats, tiers_block_bytes, weights_identity
from ..support import model_windows
from .config import EngineConfig, check_config
from .core import EngineStats, FinishReason, Progress
from .model import LlamaForward
from .paged_loop import PagedLoop
from .paged_runner import PagedRunner
from .scheduler import Scheduler
from .sequence import Sequence

__all__ = ["PagedEngineCore"]

MAX_GRAPH_BATCH = 512  # largest decode batch captured as a CUDA graph


def pool_blocks(model: LlamaForward, config: EngineConfig, groups: tuple[LayerGroup, ...] | None = None,
                max_model_len: int | None = None) -> list[int]:
    """Blocks of each layer group's pool (default: one group of every layer). One group: ``config.num_blocks``, else
    what ``config.cache_memory(model)`` holds (at least 2; under tensor parallel the smallest count over the group's
    ranks). More groups: the memory (``num_blocks`` blocks of every layer, else ``cache_memory``) split in proportion
    to what a sequence of ``max_model_len`` tokens needs in each (:func:`~kvcache.paged.groups.split_blocks`).

    Example
    -------
    >>> pool_blocks(llm.model, EngineConfig(kv_cache_memory=2**26, kv_dtype="int8"))   # doctest: +SKIP
    [2730]
    """
    groups = groups or (LayerGroup(None, tuple(range(model.num_layers))),)
    if config.num_blocks is not None and len(groups) == 1:
        return [config.num_blocks]
    sizes = [cache_block_bytes(len(g.layers), model.num_kv_heads, model.head_dim, config.block_size, model.dtype,
                               config.kv_dtype) for g in groups]
    if config.num_blocks is not None:
        budget = config.num_blocks * sum(sizes)
    else:
        budget = config.cache_memory(model)
    counts = split_blocks(groups, budget, sizes, max_model_len or config.model_len(model), config.block_size)
    if config.tp_group is not None:  # the same pool on every rank: the schedulers must decide alike
        t = torch.tensor(counts, dtype=torch.int64, device=model.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=config.tp_group)
        counts = t.tolist()
    return counts


def _check_groups(groups: tuple[LayerGroup, ...], config: EngineConfig) -> None:
    """Refuse, by name, what does not run with more than one layer group."""
    if len(groups) == 1:
        return
    used = [name for name, on in (("tp_group", config.tp_group is not None),
                                  ("host_cache_memory", config.host_cache_memory > 0),
                                  ("disk_cache_dir", config.disk_cache_dir is not None),
                                  ("kv_events", config.kv_events)) if on]
    if used:
        expected = {"tp_group": "None", "host_cache_memory": "0", "disk_cache_dir": "None", "kv_events": "False"}
        raise ValueError(f"{used[0]}: not implemented for a model whose layers have different sliding windows "
                         f"({len(groups)} layer groups, {'; '.join(map(str, groups))}: one pool each), expected "
                         f"{expected[used[0]]}")


def _tiers(model: LlamaForward, cache: PagedKVCache, config: EngineConfig) -> TieredCache | None:
    """The tiers behind the prefix cache ``config`` asks for (``host_cache_memory``, ``disk_cache_dir``,
    ``kv_events``), or None. The disk tier's model identity: ``cache_model_id`` when given (the user vouches for the
    weights, kept across ``reset_prefix_cache``), else :func:`weights_identity` of the weights, recomputed on each
    ``reset_prefix_cache`` (weights updated in place get their own fingerprint folder); either with every layer's
    key RoPE."""
    if not (config.host_cache_memory or config.disk_cache_dir is not None or config.kv_events):
        return None
    block = tiers_block_bytes(cache)
    if 0 < config.host_cache_memory < block:
        raise ValueError(f"host_cache_memory: expected 0 or at least one block ({block} bytes), got "
                         f"{config.host_cache_memory}")
    # every layer's key rope (Gemma 3's sliding layers rotate with their own)
    ropes = getattr(model, "ropes", [model.rope])
    rope_of = getattr(model, "rope_of", [0] * model.num_layers)
    suffix = f"; layer ropes {[repr(ropes[k]) for k in rope_of]}"
    model_id = None
    if config.disk_cache_dir is not None and config.cache_model_id is not None:
        model_id = config.cache_model_id + suffix
    elif config.disk_cache_dir is not None:
        hf = model.hf_model
        model_id = lambda: weights_identity([*hf.named_parameters(), *hf.named_buffers()]) + suffix  # noqa: E731
    try:
        return TieredCache(cache, host_bytes=config.host_cache_memory, disk_dir=config.disk_cache_dir,
                           disk_bytes=config.disk_cache_bytes, model_id=model_id,
                           events=KVEventLog() if config.kv_events else None)
    except OSError as e:
        raise OSError(e.errno, f"disk_cache_dir: {str(e.strerror).removeprefix('disk_dir: ')}") from e


def _graphs(model: LlamaForward, config: EngineConfig) -> bool:
    """Whether decode steps run in CUDA graphs: ``config.cuda_graphs``, by default on CUDA without tensor parallel
    unless the model cannot be captured (``model.graph_blocker``), where ``cuda_graphs=True`` is refused by name."""
    blocker = getattr(model, "graph_blocker", None) if model.device.type == "cuda" else None
    if config.cuda_graphs and blocker is not None:
        raise ValueError(f"cuda_graphs: this model's decode step cannot run in a CUDA graph: {blocker} "
                         "(expected None or False)")
    if config.cuda_graphs is None:
        return model.device.type == "cuda" and config.tp_group is None and blocker is None
    return config.cuda_graphs


class PagedEngineCore:
    """The paged cache mode: ``PagedKVCache`` + ``BlockAllocator`` + ``Scheduler`` + ``PagedRunner`` + ``PagedLoop``.

    Parameters
    ----------
    model : LlamaForward
        The engine's forward (a ``TPLlamaForward`` under tensor parallel: the cache holds this rank's KV heads).
    config : EngineConfig
        ``kv_dtype``, ``block_size``, ``layout``, ``num_blocks`` / ``kv_cache_memory`` / ``gpu_memory_utilization``,
        ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ``enable_prefix_caching``, ``cuda_graphs``,
        ``tp_group``, ``host_cache_memory``, ``disk_cache_dir``, ``disk_cache_bytes``, ``cache_model_id``,
        ``kv_events`` are read.

    Attributes
    ----------
    groups : tuple of LayerGroup
        The layer groups (one for most models), the full-attention one first.
    caches, allocators : list
        Each group's ``PagedKVCache`` (its blocks + 1: the last is the runner's scratch block) and ``BlockAllocator``.
    cache : PagedKVCache
        The first group's cache (the only one of most models).
    allocator : BlockAllocator
        The first group's allocator.
    tiers : TieredCache or None
        The host / disk tiers and the event log (``host_cache_memory``, ``disk_cache_dir``, ``kv_events``).
    scheduler : Scheduler
    runner : PagedRunner
    max_model_len, num_blocks, cache_bytes : int
        ``num_blocks`` and ``cache_bytes`` sum over the groups.
    attention : str
        ``"paged_attention"``.

    Example
    -------
    >>> core = PagedEngineCore(LlamaForward(hf_model), EngineConfig(kv_dtype="int8", num_blocks=64))  # doctest: +SKIP
    >>> core.num_blocks, core.cache.config.kv_dtype                                               # doctest: +SKIP
    (64, 'int8')
    """

    attention = "paged_attention"

    def __init__(self, model: LlamaForward, config: EngineConfig) -> None:
        check_config(config)
        self.model = model
        self.max_model_len = config.model_len(model)
        self.groups = layer_groups(model_windows(model.config, model.num_layers))
        _check_groups(self.groups, config)
        counts = pool_blocks(model, config, self.groups, self.max_model_len)
        bs = config.block_size
        spare = kv_format(config.kv_dtype).block_keys  # int4b: a partial last block keeps the block after it
        if spare and len(self.groups) > 1:
            raise ValueError(f"kv_dtype: {config.kv_dtype!r} takes models whose layers all attend in full (its "
                             "scheduler keeps the block after a partial one in one pool), got sliding-window layers")
        width = cdiv(self.max_model_len, bs) + spare
        self.caches = [PagedKVCache(
            PagedConfig(num_layers=len(g.layers), num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                        block_size=bs, num_blocks=n + 1, dtype=model.dtype, kv_dtype=config.kv_dtype,
                        layout=config.layout, device=model.device),
            rope=model.rope) for g, n in zip(self.groups, counts)]
        self.allocators = [BlockAllocator(n, bs, enable_prefix_caching=config.enable_prefix_caching) for n in counts]
        self.cache, self.allocator = self.caches[0], self.allocators[0]
        self.tiers = _tiers(model, self.cache, config)
        self.allocator.set_listener(self.tiers)
        one = len(self.groups) == 1
        self.scheduler = Scheduler(self.allocator if one else self.allocators, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.batched_tokens(model.device), max_blocks_per_seq=width,
                                   tiers=self.tiers, windows=[g.window for g in self.groups],
                                   decode_reserve=config.decode_reserve, spare_block=spare)
        graphs = _graphs(model, config)
        self.runner = PagedRunner(model, self.cache, max_blocks_per_seq=width, max_model_len=self.max_model_len,
                                  scratch_block=counts[0], cuda_graphs=graphs,
                                  max_graph_batch=min(config.max_num_seqs, MAX_GRAPH_BATCH),
                                  groups=None if one else [(c, g.layers, n) for c, g, n in
                                                           zip(self.caches, self.groups, counts)])
        self.num_blocks = sum(counts)
        self.cache_bytes = sum(c.nbytes for c in self.caches)

    def check(self, seq: Sequence) -> None:
        """Raise ValueError if ``seq`` needs more blocks than a block table or the pool hold."""
        self.scheduler.check(seq)

    def run(self, seqs: list[Sequence], stats: EngineStats, finish_reason: FinishReason,
            progress: Progress | None) -> None:
        """Queue ``seqs`` and run them to the end (see :class:`~kvcache.engine.core.EngineCore`).

        Example
        -------
        >>> core.run(seqs, EngineStats(), llm._finish_reason, None)   # doctest: +SKIP
        """
        sched, runner = self.scheduler, self.runner
        cached0, pre0, graph0 = sched.num_cached_tokens, sched.num_preemptions, runner.graph_steps
        tiers0 = self.tier_stats()
        for s in seqs:
            sched.add(s)
        PagedLoop(sched, runner, finish_reason, overlap=runner.use_graphs).run(seqs, stats, progress)
        groups = getattr(stats, "groups", None)
        if groups and len(self.groups) == 1:  # the loop tracks the one pool's peak in blocks_used
            groups[0].blocks_used = stats.blocks_used
        stats.cached_prompt_tokens = sched.num_cached_tokens - cached0
        stats.preemptions = sched.num_preemptions - pre0
        stats.graph_steps = runner.graph_steps - graph0
        if self.tiers is not None and self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)  # the last copies' times are known
        stats.tiers = {k: v - tiers0[k] for k, v in self.tier_stats().items()}  # type: ignore[attr-defined]

    def tier_stats(self) -> dict[str, TierStats]:
        """The tiers' counters since the core was built (``{}`` without tiers): ``"device"`` (blocks matched in the
        pool, published, evicted), then ``"host"`` / ``"disk"`` as configured.

        Example
        -------
        >>> core.tier_stats()["device"].hits, core.tier_stats()["host"].hits     # doctest: +SKIP
        (40, 20)
        """
        if self.tiers is None:
            return {}
        out = self.tiers.stats()
        out["device"].hits = self.allocator.stats.hits
        return out

    def abort_all(self) -> None:
        """Drop every request, waiting or running, and free its blocks."""
        self.scheduler.abort_all()
