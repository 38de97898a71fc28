#!/usr/bin/env bash
# session 12, GPU run 9: the final tree (int8 / int4 prefill at head_dim 64 on 3 stages): GPU tests, the engine's
# kv_dtypes in interleaved rounds with the warmed-up StaticCache, the engine bench with the long-context row
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env9.txt
timeout 200 python -m pytest -q -n 8 tests/attention tests/engine tests/hf -p no:cacheprovider --timeout 180 2>&1 | tail -3 | tee $OUT/pytest_gpu.txt
echo "## tests done at $(( $(date +%s) - T0 )) s"
timeout 200 python benchmarks/engine_interleaved.py --kv-dtypes auto,int8,int4,fp8 --rounds 7 --static \
  --out $OUT/engine_final.json 2>&1 | grep -v Warn | tee $OUT/engine_final.log
echo "## engine rounds done at $(( $(date +%s) - T0 )) s"
timeout $(( 570 - ($(date +%s) - T0) )) python -m kvcache.bench.engine --long --no-hf --kv-dtypes auto,int8,int4 --out $OUT/engine_long.json 2>&1 | grep -v Warn | tail -8 | tee $OUT/engine_long.log
echo "## engine bench done at $(( $(date +%s) - T0 )) s"
