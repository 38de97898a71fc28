#!/usr/bin/env bash
# session 13, GPU run 7: GPU time per kernel of one engine generate per kv_dtype (where int8 loses against bf16)
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env7.txt
timeout 500 python benchmarks/engine_kernel_profile.py --kv-dtypes auto,int8,int4 --top 24 2>&1 | grep -v Warn | tee $OUT/profile.md
