#!/usr/bin/env bash
# session 17, GPU run 4 (final tree): the fused query RoPE's GPU tests, then every kv_dtype's engine in interleaved
# rounds with two variants of the bf16 engine in the same rounds (step-by-step: eager steps not overlapped;
# rope-kernel: queries rotated by their own kernel), and the warmed-up StaticCache
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; git log --oneline -1 2>/dev/null; } \
  | tee $OUT/env4.txt
PYTHONPATH=src timeout 90 python -m pytest -q -n 8 tests/attention/test_q_rope.py tests/engine/test_fused.py \
  tests/engine/test_overlap.py -p no:cacheprovider 2>&1 | tail -2 | tee $OUT/pytest.txt
echo "## tests done at $(( $(date +%s) - T0 )) s"
PYTHONPATH=src timeout 420 python benchmarks/engine_interleaved.py --kv-dtypes auto,int8,int4,fp8 --layout HND \
  --variant auto-sbs=auto:step-by-step --variant auto-rk=auto:rope-kernel --rounds 12 --kv-gib 4 --static \
  --out $OUT/engine.json 2>&1 | grep -v -i warn | tee $OUT/engine.txt
echo "## done at $(( $(date +%s) - T0 )) s"
