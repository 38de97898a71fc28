"""Teacher-forced scoring with the cache in the loop: perplexity, KL and top-1 agreement of each stored format.

Each batch of windows is fed ``chunk`` tokens per forward, once through the full-precision reference and once
through each format's paged cache, in lockstep: a chunk's reference log-probabilities are computed once and
compared with every format's at once (nothing the size of text x vocabulary is kept).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from .runner import Runner

__all__ = ["Scores", "score_windows"]


@dataclasses.dataclass
class Scores:
    """Sums over scored tokens (float64 on the host): negative log-likelihood, KL(reference || format), top-1
    matches, and the count."""

    nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    tokens: int = 0
    bytes_per_token: float = 0.0

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")


def _batches(wins: Sequence[list[int]], batch_size: int) -> list[list[list[int]]]:
    """Windows grouped by length (a batch is rectangular: no padding in the scored run)."""
    out: list[list[list[int]]] = []
    for w in wins:
        if out and len(out[-1]) < batch_size and len(out[-1][0]) == len(w):
            out[-1].append(w)
        else:
            out.append([w])
    return out


def score_windows(runner: Runner, wins: Sequence[list[int]], kv_dtypes: Sequence[str], *, chunk: int,
                  batch_size: int, progress: Callable[[int, int], None] | None = None
                  ) -> tuple[Scores, dict[str, Scores]]:
    """Score every window with the reference and each format; returns ``(reference, {kv_dtype: scores})``."""
    batches = _batches(wins, batch_size)
    total = sum(-(-(len(b[0]) - 1) // chunk) for b in batches) * (1 + len(kv_dtypes))
    done = 0
    ref = Scores()
    out = {kv: Scores() for kv in kv_dtypes}
    for batch in batches:
        x = torch.tensor(batch, dtype=torch.long, device=runner.device)  # [B, n]
        B, n = x.shape
        ref_cache = runner.cache(None, B, n)
        caches = {kv: runner.cache(kv, B, n) for kv in kv_dtypes}
        for s in range(0, n, chunk):
            ids = x[:, s : s + chunk]
            targets = x[:, s + 1 : s + chunk + 1]  # the last chunk has one target fewer than inputs
            m = targets.shape[1]
            if m == 0:  # the window's last token alone: it predicts nothing scored
                continue
            ref_lp = torch.log_softmax(runner.forward(ids, ref_cache, paged=False)[:, :m], dim=-1)
            ref_p = ref_lp.exp()
            ref_top = ref_lp.argmax(dim=-1)
            ref.nll -= float(ref_lp.gather(-1, targets[..., None]).double().sum())
            ref.tokens += targets.numel()
            done += 1
            if progress is not None:
                progress(done, total)
            for kv, cache in caches.items():
                lp = torch.log_softmax(runner.forward(ids, cache, paged=True)[:, :m], dim=-1)
                sc = out[kv]
                sc.nll -= float(lp.gather(-1, targets[..., None]).double().sum())
                # per-token KL, clamped at 0: a format equal to the reference up to float32 rounding gives +-1e-9
                sc.kl += float((ref_p * (ref_lp - lp)).sum(dim=-1).clamp_min(0).double().sum())
                sc.top1 += int((lp.argmax(dim=-1) == ref_top).sum())
                sc.tokens += targets.numel()
                done += 1
                if progress is not None:
                    progress(done, total)
        for kv, cache in caches.items():
            out[kv].bytes_per_token = runner.bytes_per_token(cache)
    return ref, out
