#!/usr/bin/env bash
# session 17, GPU run 7 (final tree, after the review fix): engine / hf GPU tests, then every kv_dtype's engine in
# interleaved rounds and the warmed-up StaticCache (a second measurement of the final tree, on a fresh machine)
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env7.txt
PYTHONPATH=src timeout 100 python -m pytest -q -n 8 tests/engine tests/hf -p no:cacheprovider 2>&1 | tail -2 \
  | tee $OUT/pytest_engine_hf.txt
echo "## tests done at $(( $(date +%s) - T0 )) s"
PYTHONPATH=src timeout 360 python benchmarks/engine_interleaved.py --kv-dtypes auto,int8,int4,fp8 --layout HND \
  --rounds 10 --static --out $OUT/engine.json 2>&1 | grep -v -i warn | tee $OUT/engine.txt
echo "## done at $(( $(date +%s) - T0 )) s"
