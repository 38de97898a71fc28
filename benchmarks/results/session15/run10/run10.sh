#!/usr/bin/env bash
# session 15, GPU run 10: GPU tests of attention, engine and hf on the final tree (after the simplification commit)
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env10.txt
timeout 240 python -m pytest -q -n 8 tests/attention -p no:cacheprovider --timeout 220 2>&1 | tail -1 | tee $OUT/pytest_attention.txt
timeout 190 python -m pytest -q -n 8 tests/engine tests/hf -p no:cacheprovider --timeout 180 2>&1 | tail -1 | tee $OUT/pytest_engine_hf.txt
