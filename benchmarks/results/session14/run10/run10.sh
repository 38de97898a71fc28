#!/usr/bin/env bash
# session 14, GPU run 10: issue 15's workload on the final tree, the engine's default pool layout (HND): every
# kv_dtype in interleaved rounds, and transformers' generate + StaticCache warmed up in the same run
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env10.txt
timeout 560 python benchmarks/engine_interleaved.py --kv-dtypes auto,int8,int4,fp8 --layout HND --rounds 8 --static \
  --out $OUT/engine.json 2>&1 | grep -v -i warn | tee $OUT/engine.txt
echo "## done at $(( $(date +%s) - T0 )) s"
