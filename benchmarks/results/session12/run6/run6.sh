#!/usr/bin/env bash
# session 12, GPU run 6: int8 decode at head_dim 64 on 128-key tiles. With bf16 queries (rescaled to fp16 for the int8
# dots) the tile takes 153 registers, three programs per SM (int4's and fp16-query int8's take 128: four); a 128
# register cap brings it to four
set -uo pipefail
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env6.txt
for R in 0 128; do
  for Q in bf16 fp16; do
    timeout 60 python benchmarks/attention_sweep.py --mode decode --head-dim 64 --qdtype $Q --decode 64x576,64x640 --formats int8,int4 \
      --bs 16 --plans "4,64,4,2;4,128,4,2;4,128,4,3" --splits 1 --rep 100 --maxnreg $R --verbose --out $OUT/d64_${Q}_r$R.json 2>&1 | sed "s/^/$Q r$R: /" | tee -a $OUT/d64.log
  done
done
