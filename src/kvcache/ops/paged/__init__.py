"""Paged KV ops: append new K / V into blocks (LMDeploy TurboMind ``ProcessKV``: RoPE on K and quantization fused
into the write), gather blocks back to contiguous K / V (``FlattenKV``), copy blocks (copy-on-write).

Layout: :mod:`.step` (the step plan: one step's batch and attention options, validated once), :mod:`.layer` (one
layer's storage as the launchers take it), :mod:`.run` (a layer's append and gather under a plan: the one path of
the cache and the ops), :mod:`.api` (the loose keyword ops, built on a plan per call), :mod:`.policy` (a pure
function choosing each append's launch), :mod:`.launch` (launchers), :mod:`.reference` (pure-torch references,
the CPU backend), :mod:`.kernels` (Triton only). Engineering notes: ``docs/paged-kernels.md``.
"""

from .api import append_paged_kv, copy_blocks, gather_paged_kv
from .launch import AppendPlan, append_paged_kv_launch, copy_blocks_launch, gather_paged_kv_launch
from .layer import PagedLayer
from .policy import AppendLaunch, GatherLaunch, plan_append, plan_gather
from .reference import (
    append_paged_kv_reference,
    dequantize_rows_reference,
    gather_paged_kv_reference,
    quantize_rows_reference,
)
from .step import StepPlan

__all__ = [
    "append_paged_kv",
    "gather_paged_kv",
    "copy_blocks",
    "AppendLaunch",
    "GatherLaunch",
    "AppendPlan",
    "StepPlan",
    "PagedLayer",
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
