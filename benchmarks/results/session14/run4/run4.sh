#!/usr/bin/env bash
# session 14, GPU run 4: GPU attention tests on the tree with magic-number operands and one-warp few-sequence tiles
# (fp8 too), a tile / split sweep of int8 / int4 at 64 x 16k / 4k with the new operands, the attention bench at block 16
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env4.txt
timeout 220 python -m pytest -q -n 8 tests/attention -p no:cacheprovider --timeout 200 2>&1 | tail -4 | tee $OUT/pytest_gpu.txt
echo "## tests done at $(( $(date +%s) - T0 )) s"
python benchmarks/attention_sweep.py --formats int8,int4 --decode 64x16384,64x4096 --splits 4,8,16 --verbose \
  --plans "4,32,1,3;4,32,1,2;4,64,1,2;4,64,1,3;4,32,1,4" --out $OUT/tiles.json 2>&1 | grep -v Warn | tee $OUT/tiles.txt
echo "## sweep done at $(( $(date +%s) - T0 )) s"
timeout 300 python -m kvcache.bench.attention --block-sizes 16 --json $OUT/attention.json > $OUT/attention.md 2>&1
grep "kvcache\|sdpa contiguous" $OUT/attention.md | head -40
echo "## bench done at $(( $(date +%s) - T0 )) s"
