"""``merge_attention_states``: the log-sum-exp merge of two partial attention results over disjoint key sets
(split-KV programs, context-parallel ranks, a cached prefix and a new chunk).
"""

from __future__ import annotations

import torch

from ..._backend import use_triton
from ..._validate import fmt_shape
from . import _checks as c
from ._launch import launch_merge
from .reference import merge_attention_states_reference

__all__ = ["merge_attention_states"]


def merge_attention_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attention results of the same queries over disjoint keys.

    ``lse = log(exp(lse_a) + exp(lse_b))``, ``out = (exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b)``.
    -inf-safe: a side with ``lse = -inf`` (nothing attended) contributes nothing, whatever its ``out`` holds;
    both -inf gives zeros and ``-inf``.

    Parameters
    ----------
    out_a, out_b : torch.Tensor
        ``[..., D]`` (e.g. ``[n_tokens, Hq, D]``), float16 / bfloat16 / float32, the same shape and dtype,
        contiguous.
    lse_a, lse_b : torch.Tensor
        float32 ``[...]`` (out's shape without D), contiguous: natural-log log-sum-exps as
        :func:`kvcache.ops.paged_attention` writes them.
    out, lse : torch.Tensor, optional
        Destinations (contiguous; may be ``out_a`` / ``lse_a`` or the ``b`` tensors: merged in place).
        Allocated when not given.

    Returns
    -------
    (out, lse)

    Example
    -------
    >>> import torch
    >>> from kvcache.ops import merge_attention_states
    >>> o, l = merge_attention_states(torch.ones(3, 2, 8), torch.zeros(3, 2), torch.zeros(3, 2, 8),
    ...                               torch.full((3, 2), float("-inf")))
    >>> bool((o == 1).all()), bool((l == 0).all())
    (True, True)
    """
    if not isinstance(out_a, torch.Tensor):
        raise TypeError(f"out_a: expected a torch.Tensor, got {type(out_a).__name__}")
    c.check_tensor_arg("out_a", out_a, dtypes=c.Q_DTYPES, ndim=out_a.dim(), device=out_a.device, ref="out_a")
    c.check_tensor_arg("out_b", out_b, dtypes=c.Q_DTYPES, ndim=out_a.dim(), device=out_a.device, ref="out_a")
    if out_a.dim() < 1:
        raise ValueError(f"out_a: expected at least 1 dim [..., D], got shape {fmt_shape(out_a.shape)}")
    dev = out_a.device
    shape, lshape = tuple(out_a.shape), tuple(out_a.shape[:-1])
    if tuple(out_b.shape) != shape or out_b.dtype != out_a.dtype:
        raise ValueError(f"out_b: expected {out_a.dtype} {fmt_shape(shape)} (as out_a), got {out_b.dtype} "
                         f"{fmt_shape(out_b.shape)}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        c.check_tensor_arg(name, t, dtypes=(torch.float32,), ndim=len(lshape), device=dev, ref="out_a")
        if tuple(t.shape) != lshape:
            raise ValueError(f"{name}: expected shape {fmt_shape(lshape)}, got {fmt_shape(t.shape)}")
    if out is None:
        out = torch.empty_like(out_a)
    else:
        c.check_tensor_arg("out", out, dtypes=(out_a.dtype,), ndim=len(shape), device=dev, ref="out_a")
        if tuple(out.shape) != shape:
            raise ValueError(f"out: expected shape {fmt_shape(shape)}, got {fmt_shape(out.shape)}")
    if lse is None:
        lse = torch.empty(lshape, dtype=torch.float32, device=dev)
    else:
        c.check_tensor_arg("lse", lse, dtypes=(torch.float32,), ndim=len(lshape), device=dev, ref="out_a")
        if tuple(lse.shape) != lshape:
            raise ValueError(f"lse: expected shape {fmt_shape(lshape)}, got {fmt_shape(lse.shape)}")
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b), ("out", out),
                    ("lse", lse)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")
    if use_triton(dev):
        launch_merge(out_a, lse_a, out_b, lse_b, out, lse)
    else:
        merge_attention_states_reference(out_a, lse_a, out_b, lse_b, out, lse)
    return out, lse
