#!/usr/bin/env bash
# session 13, GPU run 9: the engine's default pool layout now HND: engine GPU tests, the kv_dtypes in interleaved rounds
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env9.txt
timeout 200 python -m pytest -q -n 8 tests/engine -p no:cacheprovider --timeout 180 2>&1 | tail -3 | tee $OUT/pytest_gpu.txt
echo "## tests done at $(( $(date +%s) - T0 )) s"
timeout $(( 560 - ($(date +%s) - T0) )) python benchmarks/engine_interleaved.py --kv-dtypes auto,int8,int4,fp8 --rounds 5 \
  --out $OUT/engine.json 2>&1 | grep -v Warn | tee $OUT/engine.log
