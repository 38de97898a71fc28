#!/usr/bin/env bash
# session 12, GPU run 10: paged_attention's num_decode (mixed steps on decode + prefill tiles): GPU tests of attention
# and engine, then benchmarks/mixed_step.py
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env10.txt
timeout 200 python -m pytest -q -n 8 tests/attention tests/engine -p no:cacheprovider --timeout 180 2>&1 | tail -3 | tee $OUT/pytest_gpu.txt
echo "## tests done at $(( $(date +%s) - T0 )) s"
timeout $(( 560 - ($(date +%s) - T0) )) python benchmarks/mixed_step.py --out $OUT/mixed_step.json 2>&1 | tee $OUT/mixed_step.log
echo "## mixed done at $(( $(date +%s) - T0 )) s"
