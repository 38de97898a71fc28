#!/usr/bin/env bash
# session 13, GPU run 17: one-warp decode tiles on 2 stages for fp8 and for int4 / int8 at 1k and 1 x 128k (64 splits)
set -uo pipefail
S=$(pwd)/benchmarks/attention_sweep.py
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env17.txt
timeout 250 python $S --mode decode --formats fp8,int4,int8 --bs 16 --decode 64x16384,64x1024,1x131072 \
  --plans "4,64,1,2;4,32,1,2;4,128,1,2" --splits 1,2,8,64 --verbose --out $OUT/w1b.json 2>&1 | grep -v "^# " | tee -a $OUT/sweeps.log
