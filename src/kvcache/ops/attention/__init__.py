"""Attention over the caches: paged (every kv_dtype and layout, read in place) and linear, plus the
log-sum-exp merge of partial results.

* :func:`paged_attention` / :func:`linear_attention` / :func:`merge_attention_states`: the public ops
  (validate, then launch; CPU tensors run the float32 torch reference of :mod:`.reference`).
* :func:`attention_plan` / :func:`attention_workspace_size`: the launch policy (pure functions of shapes).
"""

from .linear import linear_attention
from .merge import merge_attention_states
from .paged import paged_attention
from .policy import AttentionPlan, attention_plan, attention_workspace_size

__all__ = [
    "paged_attention",
    "linear_attention",
    "merge_attention_states",
    "AttentionPlan",
    "attention_plan",
    "attention_workspace_size",
]
