#!/usr/bin/env bash
# session 16, GPU run 6: GPU tests of attention, engine and hf on the final tree
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env6.txt
timeout 280 python -m pytest -q -n 8 tests/attention -p no:cacheprovider --timeout 250 2>&1 | tail -3 | tee $OUT/pytest_attention.txt
echo "## attention tests done at $(( $(date +%s) - T0 )) s"
timeout 240 python -m pytest -q -n 8 tests/engine tests/hf -p no:cacheprovider --timeout 220 2>&1 | tail -3 | tee $OUT/pytest_engine_hf.txt
echo "## done at $(( $(date +%s) - T0 )) s"
