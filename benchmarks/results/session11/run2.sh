#!/usr/bin/env bash
# session 11, GPU run 2: the final tree's GPU tests (attention, engine) and the attention bench at block 16
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1 2>/dev/null; date -u; } | tee $OUT/env2.txt
timeout 330 python -m pytest -q -n 8 tests/attention tests/engine -p no:cacheprovider --timeout 300 2>&1 | tail -40 | tee $OUT/pytest_gpu.txt
echo "## tests done at $(( $(date +%s) - T0 )) s"
timeout $(( 565 - ($(date +%s) - T0) )) python -m kvcache.bench.attention --block-sizes 16 --json $OUT/attention.json 2>&1 | tee $OUT/attention.md
echo "## bench done at $(( $(date +%s) - T0 )) s"
