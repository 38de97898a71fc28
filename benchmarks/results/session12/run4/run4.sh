#!/usr/bin/env bash
# session 12, GPU run 4: the final tree: GPU tests (attention, engine), the attention bench at block 16, the engine's
# kv_dtypes in interleaved rounds with the warmed-up StaticCache baseline
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1 2>/dev/null; date -u; } | tee $OUT/env4.txt
timeout 200 python -m pytest -q -n 8 tests/attention tests/engine -p no:cacheprovider --timeout 180 2>&1 | tail -4 | tee $OUT/pytest_gpu.txt
echo "## tests done at $(( $(date +%s) - T0 )) s"
timeout 200 python -m kvcache.bench.attention --block-sizes 16 --json $OUT/attention.json 2>&1 | tee $OUT/attention.md
echo "## bench done at $(( $(date +%s) - T0 )) s"
timeout $(( 560 - ($(date +%s) - T0) )) python benchmarks/engine_interleaved.py --kv-dtypes auto,int8,int4,fp8 --rounds 7 --static \
  --out $OUT/engine_final.json 2>&1 | grep -v Warn | tee $OUT/engine_final.log
echo "## engine done at $(( $(date +%s) - T0 )) s"
