#!/usr/bin/env bash
# session 13, GPU run 14: the read ceiling of decode attention's access pattern (benchmarks/pattern_ceiling.py), NHD
# and HND, beside the attention's own times on the same pools (attention_sweep.py, the policy's plans)
set -uo pipefail
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env14.txt
timeout 420 python benchmarks/pattern_ceiling.py --layouts NHD,HND --out $OUT/pattern.json 2>&1 | tee $OUT/pattern.log
