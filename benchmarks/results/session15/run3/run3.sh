#!/usr/bin/env bash
# session 15, GPU run 3: the attention bench at block 16 on the final tree; fp8 one-warp decode tiles for full
# batches against the policy's 4-warp tile
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env3.txt
python benchmarks/attention_sweep.py --formats fp8 --decode 64x16384,64x4096 --plans "4,32,1,3;4,64,1,2;4,32,1,5" \
  --splits 1,8 --verbose --out $OUT/fp8.json 2>&1 | grep -v -i warn | tee $OUT/fp8.txt
echo "## fp8 sweep done at $(( $(date +%s) - T0 )) s"
timeout 300 python -m kvcache.bench.attention --block-sizes 16 --json $OUT/attention.json > $OUT/attention.md 2>&1
grep "kvcache" $OUT/attention.md | head -30
echo "## bench done at $(( $(date +%s) - T0 )) s"
