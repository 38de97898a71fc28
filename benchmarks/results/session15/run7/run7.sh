#!/usr/bin/env bash
# session 15, GPU run 7: issue 15's workload on the final tree (bdfd517: fewer instructions per attention tile, the
# eager steps' host inputs in numpy + pinned copies): every kv_dtype on the engine's default HND pools in interleaved
# rounds, transformers' generate + StaticCache warmed up in the same run
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env7.txt
timeout 380 python benchmarks/engine_interleaved.py --kv-dtypes auto,int8,int4,fp8 --layout HND --rounds 8 --static \
  --out $OUT/engine.json 2>&1 | grep -v -i warn | tee $OUT/engine.txt
echo "## engine done at $(( $(date +%s) - T0 )) s"
echo "## (engine and hf GPU tests: run 6, same src)"

