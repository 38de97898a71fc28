#!/usr/bin/env bash
# session 12, GPU run 1: the tree's GPU tests (attention, engine, hf), then the engine's kv_dtypes in interleaved rounds
# with a warmed-up HF StaticCache baseline in the same run
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; git log --oneline -1 2>/dev/null; date -u; } | tee $OUT/env1.txt
# timeout 300 python -m pytest -q -n 8 tests/attention tests/engine tests/hf -p no:cacheprovider --timeout 280 2>&1 | tail -30 | tee $OUT/pytest_gpu.txt
echo "## tests done at $(( $(date +%s) - T0 )) s"
timeout $(( 580 - ($(date +%s) - T0) )) python benchmarks/engine_interleaved.py --kv-dtypes auto,int8,int4,fp8 --rounds 9 --static --out $OUT/engine_interleaved.json 2>&1 | grep -v Warning | tee $OUT/engine_interleaved.log
echo "## engine done at $(( $(date +%s) - T0 )) s"
