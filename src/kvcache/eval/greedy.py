"""Greedy agreement: each prompt answered greedily through the reference cache and through each format's paged
cache; an answer is compared token by token up to its end (the first end-of-sequence token, included, or
``max_new_tokens``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .runner import Runner

__all__ = ["answers", "first_divergence"]


def _trim(row: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(row):
        if t in eos:
            return row[: i + 1]
    return row


def answers(runner: Runner, prompts: Sequence[list[int]], kv_dtype: str | None, *, max_new_tokens: int,
            batch_size: int, pad_token_id: int, eos: set[int],
            progress: Callable[[], None] | None = None) -> list[list[int]]:
    """Greedy answers (token ids, trimmed at the first ``eos``) of every prompt; ``kv_dtype=None``: the reference.
    Prompts run ``batch_size`` at a time, left-padded."""
    out: list[list[int]] = []
    for s in range(0, len(prompts), batch_size):
        group = prompts[s : s + batch_size]
        T = max(len(p) for p in group)
        ids = torch.full((len(group), T), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(group), T), dtype=torch.long)
        for i, p in enumerate(group):
            ids[i, T - len(p):] = torch.tensor(p)
            mask[i, T - len(p):] = 1
        cache = runner.cache(kv_dtype, len(group), T + max_new_tokens)
        new = runner.generate(ids.to(runner.device), mask.to(runner.device), cache, kv_dtype is not None,
                              max_new_tokens, pad_token_id)
        out += [_trim(row, eos) for row in new.tolist()]
        if progress is not None:
            progress()
    return out


def first_divergence(answer: list[int], reference: list[int]) -> int | None:
    """Index of the first token where ``answer`` and ``reference`` differ (one ending before the other counts);
    None when they are equal.

    Example
    -------
    >>> first_divergence([1, 2, 3], [1, 2, 4]), first_divergence([1, 2], [1, 2]), first_divergence([1], [1, 2])
    (2, None, 1)
    """
    if answer == reference:
        return None
    n = min(len(answer), len(reference))
    return next((i for i in range(n) if answer[i] != reference[i]), n)
