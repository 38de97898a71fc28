#!/usr/bin/env bash
# session 13, GPU run 5: decode tiles with the next tile's K / V loaded into registers one iteration ahead
# (plans with num_stages=1: the kernel's PREFETCH loop) against the policy's cp.async-pipelined tiles; working tree
set -uo pipefail
S=$(pwd)/benchmarks/attention_sweep.py
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env5.txt
sweep() {  # tag, args...
  local tag=$1; shift
  timeout 200 python $S "$@" --verbose --out $OUT/${tag}.json 2>&1 | grep -v "^# " | sed "s/^/$tag: /" | tee -a $OUT/sweeps.log
}
sweep pf_d64 --mode decode --formats auto,fp8,int8,int4 --bs 16 --head-dim 64 --qdtype bf16 --decode 64x640,64x2048 \
  --plans "4,32,4,1;4,64,4,1;4,128,4,1;4,64,2,1;4,64,1,1" --splits 1,2
sweep pf_d128_16 --mode decode --formats auto --bs 16 --decode 64x16384,64x4096,64x1024,1x131072 \
  --plans "4,16,4,1;4,32,4,1;4,64,4,1;4,32,2,1;4,32,1,1" --splits 1,2,33,64
sweep pf_d128_q --mode decode --formats fp8,int8,int4 --bs 16 --decode 64x16384,64x4096,64x1024,1x131072 \
  --plans "4,32,4,1;4,64,4,1;4,32,1,1;4,16,1,1" --splits 1,2,8,33
