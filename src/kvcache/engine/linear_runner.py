"""The engine's linear-cache mode: one ``LinearKVCache`` slot per running request (TensorRT Edge-LLM's design).

* Slots ``0 .. active - 1`` hold the running requests in arrival order; a request joins at the end as soon as
  a slot is free (``reset_for_new_sequences`` with the host lengths of every active slot: the data stay).
* When requests finish, ``LinearKVCache.evict`` compacts every layer and the lengths in place (order kept).
* A shared prompt prefix (the longest common prefix of a ``generate`` call's prompts, a system prompt) is
  prefilled once, saved with ``cache.save`` into a :class:`~kvcache.KVSnapshot`, and restored into the slots of
  later requests; those requests reuse ``min(N, len(prompt) - 1)`` tokens and prefill from there (the reuse
  ``N - 1`` rule when the prompt is the prefix itself: the last prompt token's logits are recomputed). Requests
  that share the prefix wait while it is being prefilled, so it is prefilled once.
* Attention reads the slots in place: ``kvcache.ops.linear_attention`` for decode steps (every slot one
  token); steps with prefill chunks run SDPA over the views ``kv(layer)[b, :, :length]`` (no gather), except
  layers with a sliding window, a logit soft-cap or sinks, which run ``linear_attention`` per slot with them. Keys
  are rotated in torch with each layer's ``RopeConfig`` tables before they are written.
* Window layers hold only their window: where twice the largest window is shorter than ``max_model_len`` they
  live in a second cache of ``span = 2 x window`` tokens a slot (``window_cache``); a slot whose new rows would pass
  ``span`` first keeps the ``window - 1`` tokens before them, moved to the front (``offsets``: tokens dropped).
* Chunked prefill mixed with decode, with the same token budget as the paged mode. No preemption: a slot
  holds ``max_seq_len`` tokens, so a request that fits at admission always finishes.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import ops
from ..linear import CacheConfig, KVSnapshot, LinearKVCache
from ..support import check_supported, layer_window
from .config import EngineConfig, check_config
from .core import EngineStats, FinishReason, Progress
from .model import LlamaForward
from .sampling import sample
from .sequence import Sequence, SequenceStatus

__all__ = ["LinearEngineCore"]

MIN_SHARED_PREFIX = 8  # shorter common prefixes are not worth a snapshot
MIN_DEFAULT_LEN = 16  # the default max_model_len is never below this, however little memory is given


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _cache_bytes(c: CacheConfig) -> int:
    return c.num_layers * c.max_batch_size * 2 * c.num_kv_heads * c.max_seq_len * c.head_dim * _itemsize(c.dtype)


class _Prefix(NamedTuple):
    """A saved shared prefix: ``seq_len`` tokens, one snapshot per cache (``window_cache``'s from ``offset``)."""

    seq_len: int
    parts: list[KVSnapshot]
    offset: int


def _slot_lengths(model: LlamaForward, config: EngineConfig, windows: list[int | None]) -> tuple[int, int]:
    """``(max_model_len, span)``: the tokens a slot holds in full-attention layers and in window layers (2 x the
    largest window; 0: window layers hold max_model_len too, a window not shorter than half of it). The default
    max_model_len is what ``config.cache_memory(model)`` holds for ``max_num_seqs`` slots once the window layers'
    fixed ``span`` is counted (at least 16)."""
    per_layer = 2 * model.num_kv_heads * model.head_dim * _itemsize(model.dtype)  # bytes of one token in a layer
    seqs = config.max_num_seqs
    n_win = sum(w is not None for w in windows)
    span = 2 * max((w for w in windows if w), default=0)
    max_len = config.max_model_len
    if max_len is None:
        mem, longest = config.cache_memory(model), config.model_len(model)
        max_len = min(longest, mem // (len(windows) * per_layer * seqs))  # every layer at max_model_len
        if n_win:  # window layers at span, the others at what the rest of the memory holds
            rest = mem - n_win * per_layer * span * seqs
            n_full = len(windows) - n_win
            split = min(longest, rest // (n_full * per_layer * seqs) if n_full else (longest if rest >= 0 else 0))
            max_len = split if split > span else max_len
        max_len = max(MIN_DEFAULT_LEN, max_len)
    return max_len, span if n_win and span < max_len else 0


class LinearEngineCore:
    """The linear cache mode as one :class:`~kvcache.engine.core.EngineCore`: scheduler and runner in one (the paged
    mode's ``Scheduler`` + ``PagedRunner`` + ``PagedLoop``).

    Parameters
    ----------
    model : LlamaForward
    config : EngineConfig
        ``max_num_seqs`` (slots: ``max_batch_size`` of the cache), ``max_model_len`` (tokens per slot:
        ``max_seq_len``; default ``config.model_len(model)``, at most what ``config.cache_memory(model)`` holds for
        ``max_num_seqs`` slots, window layers counted at ``span``, at least 16), ``max_num_batched_tokens`` (token
        budget of a step) and ``enable_prefix_caching`` (the shared prompt prefix saved once and restored) are read.

    Attributes
    ----------
    cache : LinearKVCache
        The full-attention layers' slots (every layer's where no layer holds only its window; the window layers'
        where all of them do).
    window_cache : LinearKVCache or None
        The window layers' slots, ``span`` tokens each, where ``span`` (twice the largest window) is shorter than
        ``max_model_len``; slot ``b`` holds the sequence's tokens from ``offsets[b]`` on.
    window, span : int or None, int
        The largest window and the window layers' tokens per slot (None and 0 without ``window_cache``).
    max_model_len, num_blocks, cache_bytes : int
        ``num_blocks`` is the number of slots.
    attention : str
        ``"slot-sdpa"``.

    Example
    -------
    >>> core = LinearEngineCore(LlamaForward(hf_model), EngineConfig(cache="linear", max_num_seqs=4))  # doctest: +SKIP
    >>> core.num_blocks, core.cache.config.max_batch_size                                            # doctest: +SKIP
    (4, 4)
    """

    attention = "slot-sdpa"

    def __init__(self, model: LlamaForward, config: EngineConfig) -> None:
        check_config(config)
        check_supported(model.hf_model, "engine-linear")  # what the linear cache does not run, by name
        self.model = model
        # each layer's (sliding window as transformers applies it, attention logit soft-cap)
        windows = [layer_window(model.config, i) for i in range(model.num_layers)]
        self._kinds = [(windows[i], model.softcaps[i]) for i in range(model.num_layers)]
        max_num_seqs = config.max_num_seqs
        max_model_len, span = _slot_lengths(model, config, windows)
        # window layers hold only their last ``span`` tokens per slot (2 x the window) where that is shorter than
        # max_model_len: a second cache (``window_cache``), its slots in the same order; the other layers ``cache``
        groups = ([i for i, w in enumerate(windows) if w is None or not span],
                  [i for i, w in enumerate(windows) if w is not None and span])
        self._store: list[tuple[LinearKVCache, int]] = [None] * model.num_layers  # type: ignore[list-item]
        caches = []
        for layers, seq_len in zip(groups, (max_model_len, span)):
            cache = None
            if layers:
                cache = LinearKVCache(CacheConfig(
                    num_layers=len(layers), max_batch_size=max_num_seqs, max_seq_len=seq_len,
                    num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, dtype=model.dtype, device=model.device))
                for j, i in enumerate(layers):
                    self._store[i] = (cache, j)
            caches.append(cache)
        self._caches = [c for c in caches if c is not None]
        self.cache = self._caches[0]
        self.window_cache = caches[1]
        self.window = max(w for w in windows if w) if span else None
        self.span = span
        # per slot: the tokens before the first one window_cache holds (dropped: no later row sees them)
        self.offsets: list[int] = []
        model.rope_tables(max_model_len + 1)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.num_blocks = max_num_seqs
        self.budget = config.batched_tokens(model.device)
        self.share_prefix = config.enable_prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.slots: list[Sequence] = []
        self.prefix: tuple[int, ...] = ()
        self.snapshots: dict[tuple[int, ...], KVSnapshot] = {}
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.snapshots_saved = 0
        self.snapshots_restored = 0

    # ---------------------------------------------------------------------------------- requests

    def set_shared_prefix(self, prompts: list[list[int]]) -> None:
        """Take the longest common prefix of ``prompts`` (two or more) as the prefix to prefill once."""
        if len(prompts) < 2:
            return
        first = prompts[0]
        n = min(len(p) for p in prompts)
        for p in prompts[1:]:
            k = 0
            while k < n and p[k] == first[k]:
                k += 1
            n = k
        if n >= MIN_SHARED_PREFIX:
            self.prefix = tuple(first[:n])

    def check(self, seq: Sequence) -> None:
        """Raise ValueError if ``seq`` does not fit in a slot."""
        need = seq.num_prompt_tokens + seq.params.max_tokens
        if need > self.max_model_len:
            raise ValueError(f"prompts: request {seq.request_id} needs up to {need} tokens, expected at most "
                             f"{self.max_model_len} (max_model_len of the linear cache's slots)")

    def add(self, seq: Sequence) -> None:
        """Queue a request (validated first by :meth:`check`)."""
        self.check(seq)
        self.waiting.append(seq)

    def abort_all(self) -> None:
        """Drop every request and empty the slots (after an error in a step)."""
        self.waiting.clear()
        for s in self.slots:
            s.status = SequenceStatus.FINISHED
        self.slots = []
        self.offsets = []
        for cache in self._caches:
            cache.reset_for_new_sequences([])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.slots)

    @property
    def running(self) -> list[Sequence]:
        return self.slots

    def _snapshot_for(self, seq: Sequence) -> _Prefix | None:
        best = None
        for toks, snap in self.snapshots.items():
            if len(toks) <= len(seq.token_ids) and tuple(seq.token_ids[:len(toks)]) == toks:
                if best is None or snap.seq_len > best.seq_len:
                    best = snap
        return best

    def _lengths(self, cache: LinearKVCache, computed: list[int]) -> list[int]:
        """The tokens ``cache`` holds per slot when the slots have ``computed`` tokens."""
        if cache is self.window_cache:
            return [c - o for c, o in zip(computed, self.offsets)]
        return computed

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """Whether ``seq`` should wait for the shared prefix: a slot with it is still to save its snapshot (one
        that has not reached its end yet, or has and still holds the window before it)."""
        p = self.prefix
        if not p or p in self.snapshots or tuple(seq.token_ids[:len(p)]) != p:
            return False
        return any(tuple(s.token_ids[:len(p)]) == p and (s.num_computed < len(p) or self._holds_window(b, len(p)))
                   for b, s in enumerate(self.slots))

    def _holds_window(self, b: int, n: int) -> bool:
        """Whether slot ``b`` holds the window layers' keys a snapshot of its first ``n`` tokens needs: a request
        restoring it prefills from ``n - 1`` at the earliest, whose row sees positions ``n - W .. n - 1``, so the
        slot's ``window_cache`` must start at or before ``max(0, n - W)``."""
        return self.window_cache is None or self.offsets[b] <= max(0, n - self.window)  # type: ignore[operator]

    def _admit(self) -> None:
        joined = False
        deferred = []
        while self.waiting and len(self.slots) < self.max_num_seqs:
            seq = self.waiting.popleft()
            if self._prefix_in_flight(seq):
                deferred.append(seq)
                continue
            b = len(self.slots)
            snap = self._snapshot_for(seq)
            offset = 0
            if snap is not None:
                for cache, part in zip(self._caches, snap.parts):
                    cache.restore(part, b)
                seq.num_computed = min(snap.seq_len, len(seq.token_ids) - 1)
                offset = snap.offset
                self.snapshots_restored += 1
            else:
                seq.num_computed = 0
            self.offsets.append(offset)
            seq.num_cached_tokens = seq.num_computed
            self.num_cached_tokens += seq.num_computed
            seq.slot = b
            seq.status = SequenceStatus.RUNNING
            self.slots.append(seq)
            joined = True
        self.waiting.extendleft(reversed(deferred))
        if joined:
            computed = [s.num_computed for s in self.slots]
            for cache in self._caches:
                cache.reset_for_new_sequences(self._lengths(cache, computed))

    # ---------------------------------------------------------------------------------- the step

    def step(self) -> tuple[list[Sequence], torch.Tensor]:
        """Run one step; returns the requests that sample a token and their logits ``[n, vocab]`` (model dtype)."""
        self._admit()
        budget = self.budget
        counts = []
        # a slot of window_cache takes at most span - (window - 1) new rows a step (after the window before them)
        chunk = self.span - self.window + 1 if self.window_cache is not None else budget
        for seq in self.slots:
            n = min(seq.num_uncomputed, budget, chunk)
            counts.append(n)
            budget -= n
        dev = self.model.device
        ids: list[int] = []
        pos: list[int] = []
        for seq, n in zip(self.slots, counts):
            c = seq.num_computed
            ids.extend(seq.token_ids[c:c + n])
            pos.extend(range(c, c + n))
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        # each rope's cos / sin at the step's positions (Gemma 3: the global and the local one)
        rows = [tuple(t[positions] for t in self.model.rope_tables(self.max_model_len + 1, k))
                for k in range(len(self.model.ropes))]
        before = [s.num_computed for s in self.slots]
        if self.window_cache is not None:
            self._slide(before, counts)
        attend = self._attention(counts, before, rows)
        hidden = self.model.forward(torch.tensor(ids, dtype=torch.int64, device=dev), positions, attend)
        added = torch.tensor(counts, dtype=torch.int32)
        for cache in self._caches:
            cache.commit(added)
        rows, sampled = [], []
        acc = 0
        for seq, n in zip(self.slots, counts):
            acc += n
            seq.num_computed += n
            if n and seq.num_computed == len(seq.token_ids):
                rows.append(acc - 1)
                sampled.append(seq)
        self._save_prefix()
        if not rows:
            return [], hidden.new_empty((0, self.model.vocab_size), dtype=torch.float32)
        return sampled, self.model.logits(hidden[torch.tensor(rows, device=dev)])

    def _attention(self, counts: list[int], before: list[int], rows: list[tuple[torch.Tensor, ...]]):  # type: ignore[no-untyped-def]
        model = self.model
        kinds, store = self._kinds, self._store
        starts = []
        acc = 0
        for n in counts:
            starts.append(acc)
            acc += n
        all_decode = all(n == 1 for n in counts)
        # per cache: the tokens each slot holds before the step (host ints) and as an int32 device tensor
        held = {id(c): (h, torch.tensor(h, dtype=torch.int32, device=model.device))
                for c in self._caches for h in [self._lengths(c, before)]}
        sdpa = self._sdpa(counts, before, starts)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k = model.rotate(k, *rows[model.rope_of[i]])
            cache, j = store[i]
            bef, lengths = held[id(cache)]
            if all_decode:  # one token per slot, at each slot's length
                cache.append(j, k[:, :, None, :], v[:, :, None, :])
            else:  # ragged chunks: each slot's rows at its own length
                kc, vc = cache.kv(j)  # [B, H, S, D] views of the slots
                for b, n in enumerate(counts):
                    if n:
                        c, s = bef[b], starts[b]
                        kc[b, :, c:c + n] = k[s:s + n].transpose(0, 1)
                        vc[b, :, c:c + n] = v[s:s + n].transpose(0, 1)
            window, softcap = kinds[i]
            sinks = model.layer_sinks(i)
            if all_decode:
                # every active slot feeds one token: attention over the slots in place
                o = ops.linear_attention(q[:, :, None, :], cache.layer(j), lengths, scale=model.scale,
                                         window=window, softcap=softcap, sinks=sinks)
                return o[:, :, 0, :]
            if window is not None or softcap is not None or sinks is not None:
                return self._attend_slots(cache.layer(j), q, counts, starts, lengths, window, softcap, sinks)
            return sdpa(q, *cache.kv(j))

        return attend

    def _sdpa(self, counts: list[int], before: list[int], starts: list[int]):  # type: ignore[no-untyped-def]
        """Attention of a plain layer (no window, soft-cap or sinks) in a step with prefill chunks: SDPA over the
        slot views ``kv(layer)[b, :, :length]``, a leading run of decode rows in one call."""
        dev = self.model.device
        scale = self.model.scale
        decode = [b for b, n in enumerate(counts) if n == 1]
        batched = len(decode) > 1 and decode == list(range(len(decode)))  # a leading run of decodes: one SDPA
        nd = len(decode) if batched else 0
        if batched:
            lens = torch.tensor([before[b] + 1 for b in decode], device=dev)
            s_max = max(before[b] + 1 for b in decode)
            dmask = (torch.arange(s_max, device=dev)[None, :] < lens[:, None])[:, None, None, :]

        def run(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(q)
            if batched:
                o = F.scaled_dot_product_attention(q[:nd, :, None, :], kc[:nd, :, :s_max], vc[:nd, :, :s_max],
                                                   attn_mask=dmask, scale=scale, enable_gqa=True)
                out[:nd] = o[:, :, 0, :]
            for b in range(nd, len(counts)):
                n = counts[b]
                if not n:
                    continue
                L, s = before[b] + n, starts[b]
                qs = q[s:s + n].transpose(0, 1)[None]
                ks, vs = kc[b:b + 1, :, :L], vc[b:b + 1, :, :L]
                if n == 1:
                    o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True)
                elif n == L:
                    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
                else:
                    mask = torch.arange(L, device=dev)[None, :] <= torch.arange(L - n, L, device=dev)[:, None]
                    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
                out[s:s + n] = o[0].transpose(0, 1)
            return out

        return run

    def _attend_slots(self, layer: torch.Tensor, q: torch.Tensor, counts: list[int], starts: list[int],
                      lengths: torch.Tensor, window: int | None, softcap: float | None,
                      sinks: torch.Tensor | None) -> torch.Tensor:
        """Attention of a layer with a window, soft-cap or sinks (what SDPA does not take) in a step with prefill
        chunks: ``linear_attention`` over each slot's rows of ``layer`` ``[B, 2, H, S, D]`` in place (its chunk's
        K / V already written, ``lengths`` the tokens the slot held before); returns ``[N, Hq, D]``."""
        out = torch.empty_like(q)
        for b, n in enumerate(counts):
            if n:
                s = starts[b]
                ops.linear_attention(q[s:s + n].transpose(0, 1)[None], layer[b:b + 1], lengths[b:b + 1],
                                     scale=self.model.scale, window=window, softcap=softcap, sinks=sinks,
                                     out=out[s:s + n].transpose(0, 1)[None])
        return out

    def _slide(self, before: list[int], counts: list[int]) -> None:
        """Make room in ``window_cache`` for the step's rows: a slot whose rows would pass ``span`` keeps the
        ``window - 1`` tokens before its first row (all that its rows and later ones see), moved to the front of
        every window layer (about once per window of progress: each token is moved at most once or twice)."""
        keep = self.window - 1  # type: ignore[operator]
        cache = self.window_cache
        moved = False
        for b, (c, n) in enumerate(zip(before, counts)):
            held = c - self.offsets[b]
            if held + n <= self.span:
                continue
            drop = held - keep
            for j in range(cache.num_layers):  # type: ignore[union-attr]
                layer = cache.layer(j)  # type: ignore[union-attr]
                layer[b, :, :, :keep] = layer[b, :, :, drop:held].clone()
            self.offsets[b] += drop
            moved = True
        if moved:
            cache.reset_for_new_sequences(self._lengths(cache, before))  # type: ignore[union-attr, arg-type]

    def _save_prefix(self) -> None:
        p = self.prefix
        if not p or p in self.snapshots:
            return
        for b, seq in enumerate(self.slots):
            # a slot that crossed the prefix's end in this step holds the window before it (it kept the W - 1
            # tokens before its first row <= N - 1); one that restored a longer snapshot may start past N - W: skip
            if seq.num_computed >= len(p) and tuple(seq.token_ids[:len(p)]) == p and self._holds_window(b, len(p)):
                # window_cache's part: the slot's tokens from its offset to the prefix's end
                offset = self.offsets[b] if self.window_cache is not None else 0
                parts = [c.save(b, len(p) - (offset if c is self.window_cache else 0)) for c in self._caches]
                self.snapshots[p] = _Prefix(len(p), parts, offset)
                self.snapshots_saved += 1
                return

    def finish(self, seqs: list[Sequence]) -> None:
        """Drop finished requests: one ``evict`` compacts every layer and the lengths."""
        done = {id(s) for s in seqs}
        if not done:
            return
        gone = [id(s) in done for s in self.slots]
        for cache in self._caches:
            cache.evict(gone)
        self.offsets = [o for o, g in zip(self.offsets, gone) if not g]
        self.slots = [s for s in self.slots if id(s) not in done]
        for b, s in enumerate(self.slots):
            s.slot = b

    @property
    def cache_bytes(self) -> int:
        """Bytes of the slots (K and V of every layer; window layers at ``span`` tokens a slot)."""
        return sum(_cache_bytes(c.config) for c in self._caches)

    # ---------------------------------------------------------------------------------- the loop

    def run(self, seqs: list[Sequence], stats: EngineStats, finish_reason: FinishReason,
            progress: Progress | None) -> None:
        """Queue ``seqs`` and run them to the end (see :class:`~kvcache.engine.core.EngineCore`): with prefix
        caching on, their longest common prompt prefix is prefilled once and restored for the others.

        Example
        -------
        >>> core.run(seqs, EngineStats(), llm._finish_reason, None)   # doctest: +SKIP
        """
        cached0 = self.num_cached_tokens
        for s in seqs:
            self.add(s)
        if self.share_prefix:
            self.set_shared_prefix([s.token_ids for s in seqs])
        finished = generated = 0
        while self.has_unfinished():
            sampled, logits = self.step()
            stats.blocks_used = max(stats.blocks_used, len(self.slots))
            stats.steps += 1
            toks = sample(logits, [s.params for s in sampled], [s.generator for s in sampled]) if sampled else []
            for s, t in zip(sampled, toks):
                s.token_ids.append(t)
            done = [(s, r) for s in sampled if (r := finish_reason(s)) is not None]
            generated += len(sampled)
            for s, reason in done:
                s.status, s.finish_reason = SequenceStatus.FINISHED, reason
            self.finish([s for s, _ in done])
            finished += len(done)
            if progress is not None:
                progress(finished, len(seqs), generated)
        stats.cached_prompt_tokens = self.num_cached_tokens - cached0
