#!/usr/bin/env bash
# session 13, GPU run 19: the final tree (heuristic splits take at least min_split_keys of each sequence's own keys;
# one-warp tiles only for GQA groups up to 16): GPU tests of the attention's split, one-warp and graph paths
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env19.txt
timeout 400 python -m pytest -q -n 8 tests/attention -p no:cacheprovider --timeout 300 2>&1 | tail -3 | tee $OUT/pytest_gpu.txt
