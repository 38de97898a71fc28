#!/usr/bin/env bash
# session 13, GPU run 6: the tree with heads-inner decode order, one-warp decode tiles (int8 / int4 long contexts,
# int8 head_dim 64) and int8 prefill on 128-row tiles: GPU tests, the attention bench at block 16, the engine's
# kv_dtypes in interleaved rounds with the warmed-up StaticCache baseline
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env6.txt
timeout 220 python -m pytest -q -n 8 tests/attention tests/engine -p no:cacheprovider --timeout 200 2>&1 | tail -4 | tee $OUT/pytest_gpu.txt
echo "## tests done at $(( $(date +%s) - T0 )) s"
timeout 200 python -m kvcache.bench.attention --block-sizes 16 --json $OUT/attention.json 2>&1 | tee $OUT/attention.md
echo "## bench done at $(( $(date +%s) - T0 )) s"
timeout $(( 580 - ($(date +%s) - T0) )) python benchmarks/engine_interleaved.py --kv-dtypes auto,int8,int4,fp8 --rounds 5 --static \
  --out $OUT/engine.json 2>&1 | grep -v Warn | tee $OUT/engine.log
echo "## engine done at $(( $(date +%s) - T0 )) s"
