"""Rotary position embedding (RoPE) configuration: frequencies, cos/sin and a pure-torch reference.

:class:`RopeConfig` holds everything needed to reproduce Hugging Face transformers' rotary embeddings
(rope types ``default``, ``linear``, ``dynamic`` (dynamic NTK), ``llama3`` and ``yarn``; partial rotary
dims; rotate-half (Llama / GPT-NeoX) and interleaved (GPT-J / Cohere) pairing) bit for bit: ``cos_sin``
equals (``torch.equal``, float32) what transformers 5.17's rotary embedding modules return for the same
config and positions, before their cast to the model dtype.

Exactness comes from performing the same float32 operations in the same order as transformers: the
frequency formulas below are written so that every rounding step matches (``1.0 / t`` is
``reciprocal(t) * 1.0``, the Python scalars are rounded to float32 where transformers' are, the dynamic NTK
base is computed in float32 tensor arithmetic when the length grows past ``max_position_embeddings``, as
transformers does at run time). Each step is commented with the rounding it mirrors.

What a kernel needs (:meth:`RopeConfig.kernel_params`): the float32 ``inv_freq`` ``[rotary_dim // 2]``, the
float ``attention_scaling``, ``rotary_dim`` and the pairing. A kernel that computes, in float32,
``angle = float(position) * inv_freq[i]``, then ``cos(angle) * attention_scaling`` and
``sin(angle) * attention_scaling``, computes the same angle transformers does: its ``inv_freq @ positions``
matmul has an inner dimension of 1, so every element is one correctly rounded float32 product (tested).
Seen on an H100 (torch 2.11, triton 3.6): such a Triton kernel (``tl.cos`` / ``tl.sin`` or libdevice) equals
transformers' rotary module run on CUDA bit for bit, for every type here. CPU (torch's vectorised cos) and
CUDA results may differ from each other by an ulp; compare each device with itself.

transformers is never imported here: :meth:`RopeConfig.from_hf` reads a config object's attributes.
"""


from .config import ROPE_TYPES, RopeConfig, RopeKernelParams
from .reference import apply_rope_reference

__all__ = ["ROPE_TYPES", "RopeConfig", "RopeKernelParams", "apply_rope_reference"]
