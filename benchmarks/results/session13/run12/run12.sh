#!/usr/bin/env bash
# session 13, GPU run 12: fp8 decode tiles on HND pools (64 x 16k / 4k); int8 prefill tiles at head_dim 64 (the engine's)
set -uo pipefail
S=$(pwd)/benchmarks/attention_sweep.py
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env12.txt
timeout 250 python $S --mode decode --formats fp8 --bs 16 --layout HND --decode 64x16384,64x4096 \
  --plans "4,64,4,3;4,64,4,4;4,128,4,2;4,256,4,2;4,128,8,3;4,128,8,2;4,64,2,3" --splits 1,2 --verbose --out $OUT/fp8_hnd.json 2>&1 | grep -v "^# " | tee -a $OUT/sweeps.log
timeout 250 python $S --mode prefill --formats auto,int8 --bs 16 --head-dim 64 --qdtype bf16 --layout HND --prefill 16x512x0,16x512x512,4x2048x8192 \
  --plans "32,64,4,3;32,64,8,3;32,64,8,2;32,128,8,2;16,64,4,3;32,32,4,3" --verbose --out $OUT/pf_d64.json 2>&1 | grep -v "^# " | tee -a $OUT/sweeps.log
