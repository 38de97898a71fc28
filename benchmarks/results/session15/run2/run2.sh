#!/usr/bin/env bash
# session 15, GPU run 2: issue 15's workload on the tree with fewer instructions per attention tile (8d31482): every
# kv_dtype on the engine's default HND pools in interleaved rounds, transformers' generate + StaticCache warmed up in
# the same run; then the engine and hf GPU tests
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; git log --oneline -1 2>/dev/null; } | tee $OUT/env2.txt
timeout 380 python benchmarks/engine_interleaved.py --kv-dtypes auto,int8,int4,fp8 --layout HND --rounds 6 --static \
  --out $OUT/engine.json 2>&1 | grep -v -i warn | tee $OUT/engine.txt
echo "## engine done at $(( $(date +%s) - T0 )) s"
timeout 190 python -m pytest -q -n 8 tests/engine tests/hf -p no:cacheprovider --timeout 180 2>&1 | tail -3 | tee $OUT/pytest_engine_hf.txt
echo "## tests done at $(( $(date +%s) - T0 )) s"
