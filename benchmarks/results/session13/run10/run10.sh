#!/usr/bin/env bash
# session 13, GPU run 10: register prefetch with the block ids loaded two tiles ahead (.devout/pf2: one-stage plans run
# the PREFETCH loop; run10/pf2_kernel.py.txt) against the main tree's pipelined tiles, 16-bit caches
set -uo pipefail
S=$(pwd)/benchmarks/attention_sweep.py
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env10.txt
(cd .devout/pf2 && timeout 200 python $S --mode decode --formats auto,fp8 --bs 16 --head-dim 64 --qdtype bf16 --decode 64x640,64x2048 \
  --plans "4,32,4,1;4,64,4,1;4,16,4,1;4,32,2,1" --splits 1 --verbose --out $OUT/pf2_d64.json 2>&1 | grep -v "^# " | tee -a $OUT/sweeps.log)
(cd .devout/pf2 && timeout 200 python $S --mode decode --formats auto --bs 16 --decode 64x16384,64x1024,1x131072 \
  --plans "4,32,4,1;4,16,4,1" --splits 1,64 --verbose --out $OUT/pf2_d128.json 2>&1 | grep -v "^# " | tee -a $OUT/sweeps.log)
