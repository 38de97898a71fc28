#!/usr/bin/env bash
# session 17, GPU run 5 (final tree): the attention, argmax, engine and hf GPU test suites, then the engine bench with
# the long-context row (8 x 16k prompt tokens) for every kv_dtype
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env5.txt
PYTHONPATH=src timeout 260 python -m pytest -q -n 12 tests/attention tests/ops/test_argmax.py -p no:cacheprovider 2>&1 \
  | tail -2 | tee $OUT/pytest_attention.txt
echo "## attention tests done at $(( $(date +%s) - T0 )) s"
PYTHONPATH=src timeout 100 python -m pytest -q -n 8 tests/engine tests/hf tests/test_cuda_graph.py -p no:cacheprovider \
  2>&1 | tail -2 | tee $OUT/pytest_engine_hf.txt
echo "## engine tests done at $(( $(date +%s) - T0 )) s"
PYTHONPATH=src timeout 200 python -m kvcache.bench.engine --long --no-hf --kv-dtypes auto,fp8,int8,int4 \
  --out $OUT/engine_long.json 2>&1 | grep -v -i warn | tail -20 | tee $OUT/engine_long.txt
echo "## done at $(( $(date +%s) - T0 )) s"
