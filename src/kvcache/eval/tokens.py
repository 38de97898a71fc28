"""Token ids of the eval: the text cut into windows of scored tokens, and the chat prompts.

A window is one sequence fed to the model ``chunk`` tokens per forward; its first token has no context and is
not scored, every later token is (predicted from the tokens before it in the window). Windows do not overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["text_ids", "windows", "prompt_ids"]


def _ids_list(name: str, ids: object) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"{name}: expected a 1-d integer tensor of token ids, got {ids.dim()}-d {ids.dtype}")
        return [int(x) for x in ids.tolist()]
    if isinstance(ids, Sequence) and not isinstance(ids, str) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in ids):
        return list(ids)
    raise TypeError(f"{name}: expected a str, a 1-d integer tensor or a list of ints, got {type(ids).__name__}")


def text_ids(text: str | torch.Tensor | Sequence[int], tokenizer: Any) -> list[int]:
    """Token ids of ``text``: tokenized without special tokens when a str, taken as they are otherwise.

    Parameters
    ----------
    text : str, torch.Tensor or list of int
        The text, or its token ids (int tensor ``[n]`` or a list).
    tokenizer : transformers tokenizer or None
        Needed when ``text`` is a str.

    Returns
    -------
    list of int

    Example
    -------
    >>> text_ids(torch.tensor([5, 6, 7]), None)
    [5, 6, 7]
    """
    if isinstance(text, str):
        if not text.strip():
            raise ValueError("text: expected some text, got an empty string")
        if tokenizer is None:
            raise ValueError("tokenizer: expected a tokenizer to encode the text (a str), got None")
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return _ids_list("text", text)


def windows(ids: Sequence[int], window: int, max_tokens: int | None) -> list[list[int]]:
    """Cut ``ids`` into consecutive windows of ``window`` tokens (the last may be shorter), at most
    ``max_tokens`` scored tokens in all (``window - 1`` per full window); windows under 2 tokens are dropped.

    Example
    -------
    >>> [len(w) for w in windows(list(range(10)), 4, None)]
    [4, 4, 2]
    >>> [len(w) for w in windows(list(range(10)), 4, 4)]
    [4, 2]
    """
    out: list[list[int]] = []
    budget = max_tokens if max_tokens is not None else len(ids)
    start = 0
    while start < len(ids) - 1 and budget > 0:
        n = min(window, len(ids) - start, budget + 1)
        out.append(list(ids[start : start + n]))
        budget -= n - 1
        start += n
    return out


def prompt_ids(prompts: Sequence[str] | Sequence[Sequence[int]], tokenizer: Any) -> list[list[int]]:
    """Token ids of each prompt: a str goes through the tokenizer's chat template (one user turn, the generation
    prompt added; the plain text when the tokenizer has no template); a list of ints is taken as it is.

    Example
    -------
    >>> prompt_ids([[1, 2], [3]], None)
    [[1, 2], [3]]
    """
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"tokenizer: expected a tokenizer to encode prompts[{i}] (a str), got None")
            if getattr(tokenizer, "chat_template", None):
                p = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                  tokenize=False)
            ids = list(tokenizer(p, add_special_tokens=False)["input_ids"])
        else:
            ids = _ids_list(f"prompts[{i}]", p)
        if not ids:
            raise ValueError(f"prompts[{i}]: expected at least one token, got none")
        out.append(ids)
    return out
