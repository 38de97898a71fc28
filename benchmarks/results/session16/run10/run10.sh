#!/usr/bin/env bash
# session 16, GPU run 10: issue 15's engine bench on the final tree with more rounds (10, every kv_dtype, HND pools)
# and the warmed-up StaticCache in the same run
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env10.txt
timeout 420 python benchmarks/engine_interleaved.py --kv-dtypes auto,int8,int4,fp8 --layout HND --rounds 10 --static \
  --out $OUT/engine.json 2>&1 | grep -v -i warn | tee $OUT/engine.txt
echo "## done at $(( $(date +%s) - T0 )) s"
