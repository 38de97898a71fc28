"""The engine's own kernels, around the cache: add + RMSNorm, SiLU-and-multiply, query RoPE and the greedy pick
over logits rows (:mod:`.decoder`, :mod:`.argmax`). The KV-cache kernels live in :mod:`kvcache.ops`."""

from .argmax import argmax
from .decoder import rms_norm, rope_rotate, silu_mul

__all__ = ["rms_norm", "silu_mul", "rope_rotate", "argmax"]
