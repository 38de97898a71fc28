#!/usr/bin/env bash
# session 15, GPU run 5: where the engine's GPU sits idle in one generate of issue 15's workload (bf16, HND pools):
# gaps between consecutive GPU activities in the profiler's trace, and the GPU time per kernel
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env5.txt
timeout 300 python benchmarks/engine_kernel_profile.py --kv-dtypes auto --gaps --top 22 2>&1 | grep -v -i warn \
  | tee $OUT/profile.md
echo "## done at $(( $(date +%s) - T0 )) s"
