#!/usr/bin/env bash
# session 13, GPU run 18: the final tree (one-warp int8 / int4 decode tiles for every batch with two programs per SM, and for few sequences over 32k+ token tables): GPU
# attention tests, the attention bench at block 16
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env18.txt
timeout 200 python -m pytest -q -n 8 tests/attention -p no:cacheprovider --timeout 180 2>&1 | tail -3 | tee $OUT/pytest_gpu.txt
echo "## tests done at $(( $(date +%s) - T0 )) s"
timeout 300 python -m kvcache.bench.attention --block-sizes 16 --json $OUT/attention.json 2>&1 | tee $OUT/attention.md
echo "## bench done at $(( $(date +%s) - T0 )) s"
