"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["SamplingParams", "sample"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request (vLLM's names and defaults).

    Parameters
    ----------
    max_tokens : int
        New tokens at most (>= 1); a request that reaches it finishes with ``finish_reason="length"``.
    temperature : float
        0 picks the most likely token (greedy); > 0 samples from ``softmax(logits / temperature)``.
    top_p : float
        Nucleus sampling: keep the smallest set of most likely tokens whose probability reaches ``top_p``
        (0 < top_p <= 1; 1 keeps all).
    top_k : int
        Keep the ``top_k`` most likely tokens (0 or -1: all).
    seed : int, optional
        Seeds the request's own generator (on the CPU): its random draws are its own, whatever else runs in the
        batch (other requests' seeds do not change them; two seeds in one batch share no draws). Its tokens are
        the same only where its logits are, and those are bit-identical only when every step has the same
        shapes: BLAS and cuBLAS pick matrix-multiply kernels by the row count (MKL rounds 1, 2-3 and >= 4 rows
        differently), a long decode's attention is split by the batch on the GPU, and prefix-cache hits leave
        fewer prompt rows to compute. So alone and in a batch, or the same batch again on an engine whose prefix
        cache holds its prompts, the logits can differ: in the last bits with ``kv_dtype="auto"``, while a
        quantized cache (int8 / int4 / fp8) can turn that into another token within tens of tokens. With the same
        prompt lengths in the same places, every request finishing at the same step, prefix caching off and no
        preemption, the tokens are the same for every kv_dtype (docs/engine.md, "Seeds and the batch").
        None: drawn from torch's global generator.
    stop : str or list of str, optional
        Strings that end generation (``finish_reason="stop"``); the text is cut before the stop string.
    stop_token_ids : list of int, optional
        Token ids that end generation besides the model's EOS tokens (kept in ``token_ids``).
    ignore_eos : bool
        Keep generating past EOS tokens (benchmarks).

    Example
    -------
    >>> SamplingParams(max_tokens=32, temperature=0.0).greedy
    True
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if type(self.max_tokens) is not int:
            raise TypeError(f"max_tokens: expected an int, got {type(self.max_tokens).__name__}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an int >= 1, got {self.max_tokens}")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{name}: expected a float, got {type(v).__name__}")
            if not math.isfinite(v):
                raise ValueError(f"{name}: expected a finite float, got {v}")
        if self.temperature < 0:
            raise ValueError(f"temperature: expected a float >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a float in (0, 1], got {self.top_p}")
        if type(self.top_k) is not int:
            raise TypeError(f"top_k: expected an int, got {type(self.top_k).__name__}")
        if self.top_k < -1:
            raise ValueError(f"top_k: expected an int >= 1, or 0 / -1 for all tokens, got {self.top_k}")
        if self.seed is not None and type(self.seed) is not int:
            raise TypeError(f"seed: expected an int or None, got {type(self.seed).__name__}")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if stop is not None:
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
                raise TypeError(f"stop: expected a non-empty str or a list of non-empty str, got {self.stop!r}")
            stop = tuple(stop)
        object.__setattr__(self, "stop", stop or ())
        ids = self.stop_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not all(type(t) is int and t >= 0 for t in ids):
                raise TypeError(f"stop_token_ids: expected a list of token ids (ints >= 0), got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids or ()))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos: expected a bool, got {type(self.ignore_eos).__name__}")

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax (``temperature == 0``)."""
        return self.temperature == 0


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` ``[V]`` float32 with tokens outside top-k / top-p set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already reach top_p (the first token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per row.

    Parameters
    ----------
    logits : torch.Tensor
        ``shape: [n, vocab]``, any float dtype, any device (read as float32).
    params : list of SamplingParams
        One per row.
    generators : list of torch.Generator or None
        One per row, on the CPU: the request's seeded generator (None: torch's global one). Random draws are
        made on the CPU, so a seed gives the same tokens on every device.

    Returns
    -------
    list of int
        The picked token ids.

    Example
    -------
    >>> sample(torch.tensor([[0.0, 2.0, 1.0]]), [SamplingParams(temperature=0.0)], [None])
    [1]
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(generators) != len(params):
        raise ValueError(f"logits: expected shape [{len(params)}, vocab] (one row per params and generator), "
                         f"got {list(logits.shape)} with {len(generators)} generators")
    out: list[int] = [0] * len(params)
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy_rows) == len(params):
        return logits.argmax(-1).tolist()
    if greedy_rows:
        picked = logits[greedy_rows].argmax(-1).tolist()
        for i, t in zip(greedy_rows, picked):
            out[i] = t
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = _filter(logits[i].float().cpu() / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
