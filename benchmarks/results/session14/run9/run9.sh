#!/usr/bin/env bash
# session 14, GPU run 9: the final tree (int8 V as magic numbers, int4 K exact again, one-warp few-sequence tiles with
# fp8): GPU tests of attention, engine and hf; the attention bench at block 16
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env9.txt
timeout 240 python -m pytest -q -n 8 tests/attention -p no:cacheprovider --timeout 220 2>&1 | tail -3 | tee $OUT/pytest_attention.txt
echo "## attention tests done at $(( $(date +%s) - T0 )) s"
timeout 200 python -m pytest -q -n 8 tests/engine tests/hf -p no:cacheprovider --timeout 180 2>&1 | tail -3 | tee $OUT/pytest_engine_hf.txt
echo "## engine / hf tests done at $(( $(date +%s) - T0 )) s"
timeout 240 python -m kvcache.bench.attention --block-sizes 16 --json $OUT/attention.json > $OUT/attention.md 2>&1
grep "kvcache" $OUT/attention.md | head -24
echo "## bench done at $(( $(date +%s) - T0 )) s"
