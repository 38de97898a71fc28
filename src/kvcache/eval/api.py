"""``kvcache.eval.evaluate``: the quality of the stored KV formats on a model and a text, as a user meets it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._validate import check_int
from ..paged.config import KV_FORMATS
from .greedy import answers, first_divergence
from .perplexity import score_windows
from .prompts import PROMPTS
from .report import EvalReport, FormatResult
from .runner import Runner
from .texts import DEFAULT_TEXT, load_text
from .tokens import prompt_ids, text_ids, windows

__all__ = ["evaluate", "check_options", "DEFAULT_KV_DTYPES"]

DEFAULT_KV_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8k", "int8", "k8v4", "int4")

Progress = Callable[[str, int, int], None]


def _check_kv_dtypes(kv_dtypes: object) -> tuple[str, ...]:
    if isinstance(kv_dtypes, str) or not isinstance(kv_dtypes, Sequence):
        raise TypeError(f"kv_dtypes: expected a sequence of names from {KV_FORMATS}, got {kv_dtypes!r}")
    out = tuple(kv_dtypes)
    if not out:
        raise ValueError(f"kv_dtypes: expected at least one of {KV_FORMATS}, got none")
    for kv in out:
        if kv not in KV_FORMATS:
            raise ValueError(f"kv_dtypes: expected names from {KV_FORMATS}, got {kv!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"kv_dtypes: expected each format once, got {list(out)}")
    return out


def check_options(*, kv_dtypes: object, chunk: object, window: object, max_tokens: object, max_new_tokens: object,
                  block_size: object, batch_size: object) -> tuple[str, ...]:
    """Validate :func:`evaluate`'s options (TypeError / ValueError naming the argument); returns the formats.

    Example
    -------
    >>> check_options(kv_dtypes=["int8"], chunk=128, window=1024, max_tokens=None, max_new_tokens=64,
    ...               block_size=16, batch_size=8)
    ('int8',)
    """
    kinds = _check_kv_dtypes(kv_dtypes)
    for name, value, lo in (("chunk", chunk, 1), ("window", window, 2), ("max_new_tokens", max_new_tokens, 1),
                            ("block_size", block_size, 1), ("batch_size", batch_size, 1)):
        check_int(name, value, lo)
    if max_tokens is not None:
        check_int("max_tokens", max_tokens, 1)
    return kinds


def _check_model(model: Any, window: int, max_new_tokens: int, greedy: bool) -> None:
    if not callable(model) or not hasattr(model, "config") or not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model: expected a transformers causal LM (PreTrainedModel), got {type(model).__name__}")
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and window > limit:
        raise ValueError(f"window: expected at most the model's max_position_embeddings ({limit}), got {window}")
    if greedy and isinstance(limit, int) and max_new_tokens >= limit:
        raise ValueError(f"max_new_tokens: expected fewer than the model's max_position_embeddings ({limit}), "
                         f"got {max_new_tokens}")


def _model_name(model: Any) -> str:
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    return os.path.basename(str(name).rstrip("/")) or str(name)


def evaluate(
    model: Any,
    tokenizer: Any = None,
    *,
    kv_dtypes: Sequence[str] = DEFAULT_KV_DTYPES,
    text: str | torch.Tensor | Sequence[int] | None = None,
    text_name: str | None = None,
    chunk: int = 128,
    window: int = 1024,
    max_tokens: int | None = None,
    prompts: Sequence[str] | Sequence[Sequence[int]] | None = None,
    max_new_tokens: int = 64,
    block_size: int = 16,
    batch_size: int = 8,
    progress: Progress | None = None,
) -> EvalReport:
    """Measure each stored KV format against transformers' full-precision DynamicCache on the same inputs.

    Perplexity with the cache in the loop: the text is cut into windows of ``window`` tokens, each fed ``chunk``
    tokens per forward through a :class:`kvcache.hf.PagedCache` storing ``kv_dtype`` with attention
    ``"kvcache_paged"``, so every scored token's attention reads the stored K / V (its own chunk included).
    The same chunks run through a DynamicCache under the model's own attention (sdpa when the model uses
    ``"kvcache_paged"``): KL(reference || format) and top-1 agreement of the next-token predictions come from
    the two. Then each prompt is answered greedily both ways (chat template applied) and compared.

    Parameters
    ----------
    model : transformers PreTrainedModel
        A causal LM in eval mode (any dtype and device; its attention implementation is restored afterwards).
    tokenizer : transformers tokenizer, optional
        Needed when ``text`` or a prompt is a str.
    kv_dtypes : sequence of str
        Formats to measure, from :data:`kvcache.paged.config.KV_FORMATS`.
    text : str, torch.Tensor or list of int, optional
        The text (str), or its token ids (int ``[n]``). Default: the shipped ``"alice"`` (see
        :mod:`kvcache.eval.texts`).
    text_name : str, optional
        Name of the text in the report (default: ``"alice"`` for the default text, else ``"custom"``).
    chunk : int
        Tokens per forward (the prefill chunk): attention of a chunk's tokens reads the chunk from the cache.
    window : int
        Tokens per sequence (the context length measured); at most the model's ``max_position_embeddings``.
    max_tokens : int, optional
        Cap on the scored tokens (None: the whole text).
    prompts : sequence of str or of token-id lists, optional
        Greedy prompts (default :data:`kvcache.eval.prompts.PROMPTS`, 24 chat questions); empty: no greedy check.
    max_new_tokens : int
        New tokens per greedy answer at most.
    block_size : int
        Tokens per paged block.
    batch_size : int
        Windows (or prompts) per forward.
    progress : callable, optional
        ``progress(phase, done, total)`` after every forward (``"perplexity"``) or prompt batch (``"greedy"``).

    Returns
    -------
    EvalReport
        The reference's perplexity and, per format, perplexity, KL, top-1 agreement, greedy agreement and bytes
        per token and layer (:meth:`EvalReport.to_dict`, :func:`kvcache.eval.format_table`).

    Raises
    ------
    TypeError, ValueError
        A bad argument (the message names it), before any forward.

    Example
    -------
    >>> from kvcache.engine.loader import load_model                       # doctest: +SKIP
    >>> model, tok = load_model()                                           # doctest: +SKIP
    >>> report = evaluate(model, tok, kv_dtypes=("int8", "int4"), max_tokens=2048)  # doctest: +SKIP
    >>> report.result("int4").perplexity_delta(report.reference_perplexity)  # doctest: +SKIP
    9.4
    """
    kinds = check_options(kv_dtypes=kv_dtypes, chunk=chunk, window=window, max_tokens=max_tokens,
                          max_new_tokens=max_new_tokens, block_size=block_size, batch_size=batch_size)
    if text_name is not None and not isinstance(text_name, str):
        raise TypeError(f"text_name: expected a str or None, got {type(text_name).__name__}")
    if prompts is None:
        prompts = PROMPTS
    elif isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts: expected a sequence of str or of token-id lists, got {type(prompts).__name__}")
    _check_model(model, window, max_new_tokens, bool(prompts))
    if text is None:
        text, text_name = load_text(DEFAULT_TEXT), text_name or DEFAULT_TEXT
    ids = text_ids(text, tokenizer)
    wins = windows(ids, window, max_tokens)
    if not wins:
        raise ValueError(f"text: expected at least 2 tokens, got {len(ids)}")
    pids = prompt_ids(prompts, tokenizer)
    return _run(model, tokenizer, kinds, ids, wins, pids, text_name or "custom", chunk=chunk, window=window,
                max_new_tokens=max_new_tokens, block_size=block_size, batch_size=batch_size, progress=progress)


def _kv_bytes(config: Any, element_size: int) -> float:
    """Bytes per token and layer of a full-precision cache: K and V, ``num_kv_heads x head_dim`` each."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2.0 * kv_heads * head_dim * element_size


def _special_ids(model: Any, tokenizer: Any) -> tuple[int, set[int]]:
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    eos_set = set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if pad is None:
        pad = getattr(gen, "pad_token_id", None)
    if pad is None:
        pad = min(eos_set) if eos_set else 0
    return int(pad), eos_set


def _run(model: Any, tokenizer: Any, kinds: tuple[str, ...], ids: list[int], wins: list[list[int]],
         pids: list[list[int]], text_name: str, *, chunk: int, window: int, max_new_tokens: int, block_size: int,
         batch_size: int, progress: Progress | None) -> EvalReport:
    t0 = time.perf_counter()
    runner = Runner(model, block_size)
    try:
        ref, scores = score_windows(runner, wins, kinds, chunk=chunk, batch_size=batch_size,
                                    progress=None if progress is None else lambda d, t: progress("perplexity", d, t))
        divergence: dict[str, list[int | None]] = {kv: [] for kv in kinds}
        if pids:
            pad, eos = _special_ids(model, tokenizer)
            steps = [0]
            total = -(-len(pids) // batch_size) * (1 + len(kinds))

            def tick() -> None:
                steps[0] += 1
                if progress is not None:
                    progress("greedy", steps[0], total)

            kw = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, pad_token_id=pad, eos=eos, progress=tick)
            reference = answers(runner, pids, None, **kw)  # type: ignore[arg-type]
            for kv in kinds:
                got = answers(runner, pids, kv, **kw)  # type: ignore[arg-type]
                divergence[kv] = [first_divergence(a, r) for a, r in zip(got, reference)]
    finally:
        runner.close()
    p = next(model.parameters())
    results = [FormatResult(kv_dtype=kv, bytes_per_token=scores[kv].bytes_per_token,
                            perplexity=scores[kv].perplexity, kl=scores[kv].kl / scores[kv].tokens,
                            top1=scores[kv].top1 / scores[kv].tokens,
                            greedy_identical=sum(d is None for d in divergence[kv]), first_divergence=divergence[kv])
               for kv in kinds]
    return EvalReport(
        model=_model_name(model), dtype=str(p.dtype).removeprefix("torch."), device=str(p.device), text=text_name,
        text_tokens=len(ids), scored_tokens=ref.tokens, window=window, chunk=chunk, block_size=block_size,
        reference_perplexity=ref.perplexity, prompts=len(pids), max_new_tokens=max_new_tokens,
        reference_bytes_per_token=_kv_bytes(model.config, p.element_size()),
        formats=results, seconds=time.perf_counter() - t0)
