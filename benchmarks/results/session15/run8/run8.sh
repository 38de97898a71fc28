#!/usr/bin/env bash
# session 15, GPU run 8: the final tree after the review fixes (accumulator unit for tiny / missing V scales, aligned
# eager-step inputs): GPU tests of attention, engine and hf; int8 / int4 decode at the policy's plans; the engine's
# bf16 / int8 in interleaved rounds
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env8.txt
timeout 240 python -m pytest -q -n 8 tests/attention -p no:cacheprovider --timeout 220 2>&1 | tail -2 | tee $OUT/pytest_attention.txt
echo "## attention tests done at $(( $(date +%s) - T0 )) s"
timeout 190 python -m pytest -q -n 8 tests/engine tests/hf -p no:cacheprovider --timeout 180 2>&1 | tail -2 | tee $OUT/pytest_engine_hf.txt
echo "## engine / hf tests done at $(( $(date +%s) - T0 )) s"
python benchmarks/attention_sweep.py --formats int8,int4 --decode 64x16384,1x131072 --plans "4,32,4,4" --splits 1 \
  --out $OUT/decode.json 2>&1 | grep default | tee $OUT/decode.txt
echo "## decode done at $(( $(date +%s) - T0 )) s"
timeout 200 python benchmarks/engine_interleaved.py --kv-dtypes auto,int8 --layout HND --rounds 4 --out $OUT/engine.json \
  2>&1 | grep median | tee $OUT/engine.txt
echo "## engine done at $(( $(date +%s) - T0 )) s"
