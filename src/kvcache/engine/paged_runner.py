"""Runs one scheduled step of the paged engine: the step's plan, the model, the sampled rows' logits.

Per step, the cache's :class:`~kvcache.paged.StepPlan` is built once (``PagedKVCache.plan``: block tables,
``cu_q_lens``, the lengths before and after the step, the model's softmax scale, the query RoPE tables and the
launch hints), once more for each other rope of the model (Gemma 3's sliding layers: the same tensors, the keys'
RoPE their own), and derived per (window, soft-cap) the layers use; each layer's sinks (gpt-oss) go to its
attention. Each layer's attention then only launches: ``PagedKVCache.append(layer, k, v, plan)`` writes the
new keys and values (RoPE rotates the keys inside the append, with the cache's ``RopeConfig``) and
``PagedKVCache.attention(layer, q, plan)`` attends over the blocks in place (on the fused path it also rotates
the queries, with the plan's ``q_rope``).

On CUDA, pure decode steps (one token per request) run as CUDA graphs captured per batch-size bucket (1, 2,
4, 8, then multiples of 8) over static buffers, the bucket's plan built from views of them; padded rows of a
bucket write into one scratch block the runner holds for itself and attend to it, so every row of a graph is a
well-defined sequence.

Layer groups (:mod:`kvcache.paged.groups`): layers with different sliding windows may live in caches of their own,
one per group, each with its own block ids, scratch block and block-table tensor (a static buffer of its own under
CUDA graphs); a step builds each group's plans from its table, and each layer appends and attends in its group's
cache (its index there). A model of one group runs exactly the one-cache path.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from ..paged import PagedKVCache, StepPlan
from ..rope import RopeConfig, RopeKernelParams
from ..support import layer_window
from . import kernels as fused
from .model import AttentionFn, LlamaForward
from .scheduler import ScheduledBatch
from .sequence import Sequence

__all__ = ["PagedRunner", "DecodeStep", "PendingTokens", "PLACEHOLDER"]


class DecodeStep:
    """A launched decode step (:meth:`PagedRunner.launch_decode`).

    Attributes
    ----------
    batch : ScheduledBatch
        The step's requests, one row each.
    logits : torch.Tensor
        ``[len(batch.seqs), vocab]`` in the model dtype: on CUDA a view of the graph's static output, valid once
        the step completes and until the next launch (read it before launching another step).
    """

    __slots__ = ("batch", "logits", "_host", "_event")

    def __init__(self, batch: ScheduledBatch, logits: torch.Tensor, host: torch.Tensor,
                 event: torch.cuda.Event | None) -> None:
        self.batch = batch
        self.logits = logits
        self._host = host
        self._event = event

    def greedy_tokens(self) -> list[int]:
        """The argmax token of every row, in batch order (waits for the step; the host copy stays valid until
        the step after next is launched)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


class PendingTokens:
    """The greedy tokens of an eager step, picked on the device (:meth:`PagedRunner.pick_greedy`) and not yet read
    by the host. Until :meth:`tokens` is read, each sampled request ends in :data:`PLACEHOLDER` at ``index``;
    a step launched meanwhile takes such a token from ``device`` (``run`` / ``launch_decode`` with ``pending=``).

    Attributes
    ----------
    rows : list of (Sequence, int)
        The sampled requests in row order, each with the index of its placeholder in ``token_ids``.
    device : torch.Tensor
        int64 ``[len(rows)]`` on the model's device.

    Example
    -------
    >>> pend = runner.pick_greedy(logits, rows)               # doctest: +SKIP
    >>> nxt = runner.run(next_batch, pending=pend)            # doctest: +SKIP
    >>> tokens = pend.tokens()                                # doctest: +SKIP
    """

    __slots__ = ("rows", "device", "_host", "_event", "_row_of")

    def __init__(self, rows: list, device: torch.Tensor, host: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self.rows = rows
        self.device = device
        self._host = host
        self._event = event
        self._row_of = {id(seq): i for i, (seq, _) in enumerate(rows)}

    def row_of(self, seq: object) -> int | None:
        """The device row holding ``seq``'s pending token (None: ``seq`` has none here)."""
        return self._row_of.get(id(seq))

    def tokens(self) -> list[int]:
        """The tokens, in row order (waits for the step)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


PLACEHOLDER = -1  # a sampled token the host has not read yet (PendingTokens)


class PagedRunner:
    """Executes :class:`~kvcache.engine.scheduler.ScheduledBatch` es on a :class:`~kvcache.PagedKVCache`.

    Parameters
    ----------
    model : LlamaForward
    cache : PagedKVCache
        Built with the model's ``RopeConfig`` (keys are rotated by the append).
    max_blocks_per_seq : int
        Width of the block tables.
    max_model_len : int
        Longest sequence (sizes the RoPE tables).
    scratch_block : int
        A block id no request ever holds: padded rows of CUDA graphs write and read it.
    cuda_graphs : bool
        Run decode steps as CUDA graphs. On the CPU:
        the same static, padded buffers without capture (a check of the graph path's batch layout).
    max_graph_batch : int
        Largest decode batch run as a graph.
    groups : sequence of (PagedKVCache, sequence of int, int), optional
        The layer groups: each group's cache, the model layers it holds (layer ``layers[j]`` is the cache's layer
        ``j``) and its scratch block; ``Sequence.block_tables[g]`` indexes group ``g``'s cache. Default: one group,
        ``cache`` holding every layer, with ``scratch_block``.

    Example
    -------
    >>> runner = PagedRunner(model, cache, max_blocks_per_seq=16, max_model_len=256, scratch_block=64,
    ...                      cuda_graphs=False, max_graph_batch=1)                                  # doctest: +SKIP
    >>> logits = runner.run(scheduler.schedule())                                                   # doctest: +SKIP
    """

    def __init__(self, model: LlamaForward, cache: PagedKVCache, *, max_blocks_per_seq: int, max_model_len: int,
                 scratch_block: int, cuda_graphs: bool, max_graph_batch: int,
                 groups: Seq[tuple[PagedKVCache, Seq[int], int]] | None = None) -> None:
        self.model = model
        self.cache = cache
        self.width = max_blocks_per_seq
        self.device = cache.device
        self.scratch_block = scratch_block
        groups = [(cache, range(model.num_layers), scratch_block)] if groups is None else list(groups)
        placed = sorted(i for _, layers, _ in groups for i in layers)
        if placed != list(range(model.num_layers)):
            raise ValueError(f"groups: expected every layer 0..{model.num_layers - 1} in exactly one group, got "
                             f"{[list(layers) for _, layers, _ in groups]}")
        self._caches = [c for c, _, _ in groups]
        self._scratch = [b for _, _, b in groups]
        self.num_groups = len(groups)
        self._scratch_col = np.array(self._scratch, dtype=np.int32)[:, None]  # padded graph rows, per group
        group_of, self._local = [0] * model.num_layers, list(range(model.num_layers))
        for g, (_, layers, _) in enumerate(groups):
            for j, i in enumerate(layers):
                group_of[i], self._local[i] = g, j
        # on the CPU, cuda_graphs=True runs decode steps through the same static, padded buffers uncaptured: the
        # graph path's batch layout (buckets, scratch-block padding) is then checked without a GPU
        self.use_graphs = bool(cuda_graphs)
        cos, sin = model.rope_tables(max_model_len + 1)
        # the fused decoder leaves the query rotation to the attention kernel (rotate-half over all of head_dim)
        full = not model.rope.interleaved and cos.shape[-1] == model.head_dim
        self._q_rope = (cos.contiguous(), sin.contiguous()) if model.fused and full else None
        # each layer's (group, rope, sliding window as transformers applies it (None: full attention), soft-cap);
        # the keys of a layer whose rope is not the cache's own (Gemma 3's sliding layers) are rotated with theirs
        self._kinds = [(group_of[i], model.rope_of[i], layer_window(model.config, i), model.softcaps[i])
                       for i in range(model.num_layers)]
        self._plan_keys = sorted({kind[:2] for kind in self._kinds})  # (group, rope): one plan each per step
        self._ropes = [None] + [_static_rope(r, self.device) for r in model.ropes[1:]]
        self.max_graph_batch = max_graph_batch
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_pool = None
        self._static: dict[str, torch.Tensor] | None = None
        self.graph_steps = 0
        self._flip = 0

    # ---------------------------------------------------------------------------------- attention

    def _plan(self, block_tables: list[torch.Tensor], cu_q_lens: torch.Tensor, before: torch.Tensor,
              after: torch.Tensor, *, max_kv_len: int, num_decode: int) -> dict[tuple[int, int], StepPlan]:
        """The step's plans, one per (group, rope) the layers use (rope 0: the cache's own): each group's int32
        ``block_tables[g]`` ``[B, W]``, ``cu_q_lens`` ``[B + 1]``, lengths ``before`` / ``after`` the step ``[B]``
        (device tensors); ``max_kv_len``, ``num_decode``: host hints of the launch."""
        return {(g, r): self._caches[g].plan(block_tables[g], cu_q_lens, before, seq_lens=after, scale=self.model.scale,
                                             q_rope=self._q_rope, max_kv_len=max_kv_len, num_decode=num_decode,
                                             rope=self._ropes[r])
                for g, r in self._plan_keys}

    def _attention(self, plans: dict[tuple[int, int], StepPlan]) -> AttentionFn:
        """Every layer's attention for one step: the append and the attention of its group's and rope's plan
        (``plans``), with the layer's window, soft-cap and sinks; nothing built per layer."""
        model, kinds = self.model, self._kinds
        # one plan per (group, rope, window, soft-cap) the layers use (launches derived once per step)
        by_kind = {kind: _with_options(plans[kind[:2]], kind[2], kind[3]) for kind in set(kinds)}
        if self.num_groups == 1:
            cache = self.cache

            def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                plan = by_kind[kinds[i]]
                cache.append(i, k, v, plan)
                return cache.attention(i, q, plan, sinks=model.layer_sinks(i))
        else:
            caches, local = self._caches, self._local

            def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                kind = kinds[i]
                plan, cache, j = by_kind[kind], caches[kind[0]], local[i]
                cache.append(j, k, v, plan)
                return cache.attention(j, q, plan, sinks=model.layer_sinks(i))

        attend.rotates_queries = next(iter(plans.values())).q_rope is not None  # type: ignore[attr-defined]
        return attend

    # ---------------------------------------------------------------------------------- the step

    def _host_inputs(self, batch: ScheduledBatch, pending: PendingTokens | None
                     ) -> tuple[torch.Tensor, torch.Tensor, list[slice], list[int], list[tuple[int, int]]]:
        """The step's host inputs in two buffers (pinned on CUDA, so each reaches the device in one asynchronous
        copy): int64 ``[2, N']`` (token ids, positions; ``N'`` the token count rounded up to even) and int32
        segments ``cu_q_lens``, lengths before, lengths after, then each group's block tables (row after row), at
        the returned slices.
        Every segment starts on a 16-byte boundary, as a tensor of its own would (the kernels specialise on their
        pointers' alignment). Also returns the lengths after the step as ints, and (token row, ``pending`` row) for
        each input token that is still a placeholder."""
        b, w, n_groups = len(batch.seqs), self.width, self.num_groups
        n_tok = sum(batch.num_tokens)
        pin = self.device.type == "cuda"
        tok_t = torch.empty((2, n_tok + n_tok % 2), dtype=torch.int64, pin_memory=pin)
        spans, start = [], 0
        for n in (b + 1, b, b) + (b * w,) * n_groups:
            spans.append(slice(start, start + n))
            start += -(-n // 4) * 4
        int_t = torch.zeros(start, dtype=torch.int32, pin_memory=pin)
        tok, ints = tok_t.numpy(), int_t.numpy()
        cu, before, after = (ints[sp] for sp in spans[:3])
        tables = ints[spans[3]].reshape(b, w)
        group_tables = [ints[sp].reshape(b, w) for sp in spans[3:]]
        o = 0
        fix: list[tuple[int, int]] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            c = seq.num_computed
            tok[0, o:o + n] = seq.token_ids[c:c + n]
            if c + n == len(seq.token_ids) and seq.token_ids[-1] == PLACEHOLDER:
                fix.append((o + n - 1, _pending_row(pending, seq)))
            tok[1, o:o + n] = np.arange(c, c + n)
            o += n
            cu[i + 1] = o
            before[i] = c
            after[i] = c + n
            if n_groups == 1:
                t = seq.block_table
                tables[i, :len(t)] = t
            else:
                for tab, t in zip(group_tables, seq.block_tables):
                    tab[i, :len(t)] = t
        return tok_t, int_t, spans, after.tolist(), fix

    def run(self, batch: ScheduledBatch, *, pending: PendingTokens | None = None) -> torch.Tensor:
        """Run the step; returns logits ``[num sampled rows, vocab]`` (model dtype) (rows in batch order of
        ``batch.sample``). ``pending``: the step before, whose tokens the host has not read; an input token that
        is still a placeholder is taken from it on the device."""
        if self.use_graphs and batch.is_decode and len(batch.seqs) <= self.max_graph_batch:
            return self.launch_decode(batch, pending=pending).logits
        tok_h, int_h, spans, after, fix = self._host_inputs(batch, pending)
        dev, n_tok = self.device, sum(batch.num_tokens)
        tok, ints = tok_h.to(dev, non_blocking=True), int_h.to(dev, non_blocking=True)
        if fix:
            self._patch_ids(tok[0], fix, pending)
        cu_q, before, after_d = (ints[sp] for sp in spans[:3])
        tables = [ints[sp].view(len(batch.seqs), self.width) for sp in spans[3:]]
        # mixed steps: the leading one-token sequences (the scheduler puts running requests first) take decode tiles
        num_decode = 0
        for n in batch.num_tokens:
            if n != 1:
                break
            num_decode += 1
        # a host bound of the lengths for the launch plan (never read from the device)
        max_kv = max(after) if after else self.width * self.cache.config.block_size
        plans = self._plan(tables, cu_q, before, after_d, max_kv_len=max_kv, num_decode=num_decode)
        hidden = self.model.forward(tok[0, :n_tok], tok[1, :n_tok], self._attention(plans))
        if all(batch.sample):  # every request's last row (the common case: no index from the host)
            return self.model.logits(hidden[cu_q[1:].long() - 1])
        cu = int_h[spans[0]].tolist()
        rows = [cu[i + 1] - 1 for i, s in enumerate(batch.sample) if s]
        if not rows:
            return hidden.new_empty((0, self.model.vocab_size), dtype=torch.float32)
        return self.model.logits(hidden[torch.tensor(rows, device=dev)])

    def _patch_ids(self, ids: torch.Tensor, fix: list[tuple[int, int]], pending: PendingTokens | None) -> None:
        """``ids[t] = pending.device[r]`` for each (t, r) of ``fix``, on the device (no host sync)."""
        idx = torch.tensor([[t for t, _ in fix], [r for _, r in fix]], dtype=torch.int64,
                           pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)
        ids.index_copy_(0, idx[0], pending.device.index_select(0, idx[1]))

    def pick_greedy(self, logits: torch.Tensor, rows: list[tuple[Sequence, int]]) -> PendingTokens:
        """The greedy token of each row of ``logits`` ``[len(rows), vocab]``, picked on the device and copied to
        the host asynchronously: read them with :meth:`PendingTokens.tokens`. ``rows``: the sampled requests in
        row order, each with the index its token will take in ``token_ids`` (-1: a row whose result is dropped).

        Example
        -------
        >>> pend = runner.pick_greedy(runner.run(batch), rows)            # doctest: +SKIP
        """
        if logits.shape[0] != len(rows):
            raise ValueError(f"logits: expected one row per sampled request ({len(rows)}), got {logits.shape[0]}")
        dev_tokens = fused.argmax(logits)
        host = torch.empty(dev_tokens.shape, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        host.copy_(dev_tokens, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        return PendingTokens(rows, dev_tokens, host, event)

    # ---------------------------------------------------------------------------------- CUDA graphs

    def _bucket(self, n: int) -> int:
        for b in (1, 2, 4, 8):
            if n <= b:
                return b
        return -(-n // 8) * 8

    def _static_buffers(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        if self._static is None:
            m, dev = self._bucket(self.max_graph_batch), self.device
            pin = dev.type == "cuda"
            self._static = {
                "ids": torch.zeros(m, dtype=torch.int64, device=dev),
                "pos": torch.zeros(m, dtype=torch.int64, device=dev),
                # one block-table tensor per layer group (each its own allocation: aligned as the kernels expect)
                "bt": [torch.zeros((m, self.width), dtype=torch.int32, device=dev) for _ in range(self.num_groups)],
                "cu": torch.arange(m + 1, dtype=torch.int32, device=dev),
                "before": torch.zeros(m, dtype=torch.int32, device=dev),
                "after": torch.zeros(m, dtype=torch.int32, device=dev),
                # host staging (pinned on CUDA), two of each, alternating by step: the copies of a step read their
                # buffer when the device reaches them, and the host writes the step after next only once that
                # step's event has fired. ids / pos as int64 rows, before / after as int32 rows, the tables
                "h_tok": torch.zeros((2, 2, m), dtype=torch.int64, pin_memory=pin),
                "h_len": torch.zeros((2, 2, m), dtype=torch.int32, pin_memory=pin),
                "h_bt": torch.empty((2, self.num_groups, m, self.width), dtype=torch.int32, pin_memory=pin),
                # the graph's greedy token per row, and its host copies (same alternation)
                "next": torch.zeros(m, dtype=torch.int64, device=dev),
                "h_next": torch.zeros((2, m), dtype=torch.int64, pin_memory=pin),
            }
            for g, block in enumerate(self._scratch):  # each group's table starts on its own scratch block
                self._static["h_bt"][:, g] = block
        return self._static

    def can_launch_decode(self, batch: ScheduledBatch) -> bool:
        """True when ``batch`` runs as a graph step (:meth:`launch_decode`): a pure decode step of at most
        ``max_graph_batch`` requests, with graphs on.

        Example
        -------
        >>> runner.can_launch_decode(batch)                    # doctest: +SKIP
        True
        """
        return self.use_graphs and batch.is_decode and len(batch.seqs) <= self.max_graph_batch

    def launch_decode(self, batch: ScheduledBatch, *, ahead: bool = False,
                      pending: PendingTokens | None = None) -> DecodeStep:
        """Launch a decode step as a graph (asynchronously on CUDA); returns its :class:`DecodeStep`.

        ``ahead=True``: ``batch`` is the step after the one in flight (same requests, same rows: from
        :meth:`Scheduler.schedule_next_decode`); its input tokens are the in-flight step's greedy tokens, taken
        on the device, and every request is one token further on than its host state says. At most two steps
        may be in flight: wait for the older one (:meth:`DecodeStep.greedy_tokens`) before the next launch.
        ``pending``: an eager step before this one whose tokens the host has not read (see :meth:`run`).

        Example
        -------
        >>> step = runner.launch_decode(batch)                 # doctest: +SKIP
        >>> nxt = runner.launch_decode(sched.schedule_next_decode(batch), ahead=True)   # doctest: +SKIP
        >>> tokens = step.greedy_tokens()                      # doctest: +SKIP
        """
        n = len(batch.seqs)
        bs = self._bucket(n)
        st = self._static_buffers()
        slot = self._flip
        self._flip ^= 1
        h_tok, h_len, h_bt = st["h_tok"][slot], st["h_len"][slot], st["h_bt"][slot]
        tok, lens, bt = h_tok.numpy(), h_len.numpy(), h_bt.numpy()
        fix: list[tuple[int, int]] = []
        for b, seq in enumerate(batch.seqs):
            c = seq.num_computed + ahead
            tok[0, b] = 0 if ahead else seq.token_ids[c]
            if not ahead and tok[0, b] == PLACEHOLDER:
                fix.append((b, _pending_row(pending, seq)))
            tok[1, b] = c
            lens[0, b] = c
            lens[1, b] = c + 1
            if self.num_groups == 1:
                t = seq.block_table
                bt[0, b, :len(t)] = t
            else:
                for g, t in enumerate(seq.block_tables):
                    bt[g, b, :len(t)] = t
        # padded rows: a one-token sequence at position 0 of the scratch block. Columns past a row's length are
        # never read, but int4b's partial first block writes its key rows' second halves into the next entry:
        # both entries are reset (a stale id there would be a live request's block)
        tok[:, n:bs] = 0
        lens[0, n:bs] = 0
        lens[1, n:bs] = 1
        bt[:, n:bs, :2] = self._scratch_col[:, :, None]
        if ahead:
            st["ids"][:bs].copy_(st["next"][:bs])
        else:
            st["ids"][:bs].copy_(h_tok[0, :bs], non_blocking=True)
            if fix:
                self._patch_ids(st["ids"], fix, pending)
        st["pos"][:bs].copy_(h_tok[1, :bs], non_blocking=True)
        st["before"][:bs].copy_(h_len[0, :bs], non_blocking=True)
        st["after"][:bs].copy_(h_len[1, :bs], non_blocking=True)
        for g, table in enumerate(st["bt"]):
            table[:bs].copy_(h_bt[g, :bs], non_blocking=True)
        graph = self._graphs.get(bs)
        if self.device.type != "cuda":
            logits = self._forward_static(bs)
        elif graph is None:
            logits = self._capture(bs)
        else:
            graph[0].replay()
            logits = graph[1]
        self.graph_steps += 1
        host = st["h_next"][slot, :n]
        host.copy_(st["next"][:n], non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        return DecodeStep(batch, logits[:n], host, event)

    def _forward_static(self, bs: int) -> torch.Tensor:
        st = self._static_buffers()
        # views of the static buffers; the lengths are the graph's inputs, so the launch is planned for the block
        # table's capacity (a shape, not a value)
        plans = self._plan([table[:bs] for table in st["bt"]], st["cu"][:bs + 1], st["before"][:bs],
                           st["after"][:bs], max_kv_len=self.width * self.cache.config.block_size, num_decode=bs)
        hidden = self.model.forward(st["ids"][:bs], st["pos"][:bs], self._attention(plans))
        logits = self.model.logits(hidden)
        fused.argmax(logits, out=st["next"][:bs])
        return logits

    def _capture(self, bs: int) -> torch.Tensor:
        """Run bucket ``bs`` once eagerly on a side stream (its result is this step's), then capture it."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            logits = self._forward_static(bs).clone()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = self._forward_static(bs)
        self._graphs[bs] = (graph, out)
        return logits


def _static_rope(rope: RopeConfig, device: torch.device) -> RopeKernelParams:
    """The kernel parameters of a layer rope other than the cache's own (made once: a plan built inside a CUDA
    graph capture only reads them)."""
    if rope.is_dynamic:
        raise ValueError(f"model: a second rope with 'dynamic' scaling (its frequencies grow with the length) is "
                         f"not implemented by the kvcache engine (rope_type={rope.rope_type!r})")
    return rope.kernel_params(device=device)


def _with_options(plan: StepPlan, window: int | None, softcap: float | None) -> StepPlan:
    """``plan`` for a layer with ``window`` / ``softcap`` (itself where they are the plan's)."""
    if (plan.window, plan.softcap) == (window, softcap):
        return plan
    return plan.with_options(window=window, softcap=softcap)


def _pending_row(pending: PendingTokens | None, seq: object) -> int:
    row = pending.row_of(seq) if pending is not None else None
    if row is None:
        raise RuntimeError(f"runner: request {getattr(seq, 'request_id', '?')} has an unread token and no pending "
                           "step holds it")
    return row
