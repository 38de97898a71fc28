#!/usr/bin/env bash
# session 13, GPU run 15: one-warp int8 / int4 decode tiles with fewer stages (less shared memory, more programs per SM)
# and more splits, 64 x 16k / 4k, NHD and HND
set -uo pipefail
S=$(pwd)/benchmarks/attention_sweep.py
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env15.txt
for L in NHD HND; do
  timeout 250 python $S --mode decode --formats int8,int4 --bs 16 --layout $L --decode 64x16384,64x4096 \
    --plans "4,64,1,2;4,32,1,2;4,64,1,3;4,32,1,3;4,16,1,2" --splits 8,16 --verbose --out $OUT/w1_$L.json 2>&1 | grep -v "^# " | sed "s/^/$L: /" | tee -a $OUT/sweeps.log
done
