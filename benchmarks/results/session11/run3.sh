#!/usr/bin/env bash
# session 11, GPU run 3: fp8 decode tiles (can a plan reach 1.8x?), then the final tree's full engine bench (--long)
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env3.txt
timeout 90 python benchmarks/attention_sweep.py --mode decode --formats fp8 --bs 16 --decode 64x16384,64x4096 --splits 1 \
  --plans "4,128,4,3,0;4,128,4,2,1;4,128,4,3,1;4,128,4,4,0;4,256,4,2,0;4,256,4,2,1;4,64,4,4,0;4,64,4,4,1" --verbose \
  --out $OUT/sw_fp8.json 2>&1 | tee $OUT/sw_fp8.log
echo "## fp8 sweep done at $(( $(date +%s) - T0 )) s"
PYTHONPATH=src timeout $(( 420 - ($(date +%s) - T0) )) python -m kvcache.bench.engine --long --out $OUT/engine_full.json 2>&1 | tee $OUT/engine_full.log
echo "## engine done at $(( $(date +%s) - T0 )) s"
