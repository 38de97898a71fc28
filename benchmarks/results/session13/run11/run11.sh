#!/usr/bin/env bash
# session 13, GPU run 11: decode on HND pools against NHD with the final policy (same-run copies of each format's
# blocks as ceilings), plus the one-warp tiles' keys on HND
set -uo pipefail
S=$(pwd)/benchmarks/attention_sweep.py
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env11.txt
for L in NHD HND; do
  timeout 250 python $S --mode decode --formats auto,fp8,int8,int4 --bs 16 --layout $L --ceiling \
    --plans "4,32,1,3;4,64,1,3" --splits 8 --verbose --out $OUT/dec_$L.json 2>&1 | grep -v "^# " | sed "s/^/$L: /" | tee -a $OUT/sweeps.log
done
