"""The step plan of a paged cache: :class:`StepPlan` (one step's batch, its attention options and the launches
derived from them) and how :meth:`kvcache.PagedKVCache.plan` builds one from the cache's geometry and RoPE.

The class itself lives with the ops that read it (:mod:`kvcache.ops.paged.step`), as the format table does
(:mod:`kvcache.ops.paged.format`): kernels never import cache classes.
"""

from __future__ import annotations

from ..ops.paged.step import Geometry, StepPlan
from ..rope import RopeConfig, RopeKernelParams

__all__ = ["StepPlan", "Geometry", "resolve_rope"]


def resolve_rope(own: RopeConfig | None, own_params: RopeKernelParams | None,
                 rope: RopeConfig | RopeKernelParams | bool | None, seq_len: int | None,
                 device: object) -> RopeKernelParams | RopeConfig | bool | None:
    """The kernel parameters of a ``rope`` argument for a cache whose own RoPE is ``own`` (kernel parameters
    ``own_params``, None for dynamic scaling): None uses the cache's (if any), False none, True the cache's
    (required), a RopeConfig / RopeKernelParams itself; anything else is passed on, for the op to reject.
    ``seq_len``: the current length, required for ``"dynamic"`` scaling."""
    if rope is False:
        return None
    if rope is None or rope is True:
        if own is None:
            if rope is True:
                raise ValueError("rope: True needs a RopeConfig given to the cache")
            return None
        if own_params is not None:
            return own_params
        config = own
    elif isinstance(rope, RopeConfig):
        config = rope
    else:
        return rope
    if config.is_dynamic and seq_len is None:
        # transformers grows the base from max(position_ids) + 1 in every forward pass; here that length
        # is the caller's to give (reading it from the device would sync every call)
        raise ValueError("rope_seq_len: required with 'dynamic' RoPE scaling (the current length, "
                         "max(positions) + 1), got None")
    return config.kernel_params(seq_len, device=device)
