#!/usr/bin/env bash
# session 17, GPU run 1: the GPU tests of the new tree (a512937: PDL on attention / RMSNorm / SiLU-mul / q RoPE,
# ops.decoder.argmax, the overlapped eager steps), then the engine A/B: old = .devout/old (decc267), mid =
# .devout/mid (the new tree with the eager steps not overlapped), new = the working tree
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env1.txt
PYTHONPATH=src timeout 330 python -m pytest -q -n 8 tests/attention tests/ops/test_argmax.py -p no:cacheprovider 2>&1 \
  | tail -3 | tee $OUT/pytest_attention.txt
echo "## attention tests done at $(( $(date +%s) - T0 )) s"
PYTHONPATH=src timeout 200 python -m pytest -q -n 8 tests/engine tests/hf tests/test_cuda_graph.py \
  -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/pytest_engine_hf.txt
echo "## done at $(( $(date +%s) - T0 )) s"
