"""Paged KV ops: append new K / V into blocks (LMDeploy TurboMind ``ProcessKV``: RoPE on K and quantization fused
into the write), gather blocks back to contiguous K / V (``FlattenKV``), copy blocks (copy-on-write).

Layout: :mod:`.api` (the public ops: validate, then launch), :mod:`.policy` (a pure function choosing each
append's launch), :mod:`.launch` (launchers), :mod:`.reference` (pure-torch references, the CPU backend),
:mod:`.kernels` (Triton only). Engineering notes: ``docs/paged-kernels.md``.
"""

from .api import append_paged_kv, copy_blocks, gather_paged_kv
from .launch import AppendPlan, append_paged_kv_launch, copy_blocks_launch, gather_paged_kv_launch
from .policy import AppendLaunch, GatherLaunch, plan_append, plan_gather
from .reference import (
    append_paged_kv_reference,
    dequantize_rows_reference,
    gather_paged_kv_reference,
    quantize_rows_reference,
)

__all__ = [
    "append_paged_kv",
    "gather_paged_kv",
    "copy_blocks",
    "AppendLaunch",
    "GatherLaunch",
    "AppendPlan",
    "plan_append",
    "plan_gather",
    "append_paged_kv_launch",
    "gather_paged_kv_launch",
    "copy_blocks_launch",
    "append_paged_kv_reference",
    "gather_paged_kv_reference",
    "quantize_rows_reference",
    "dequantize_rows_reference",
]
