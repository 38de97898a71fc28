#!/usr/bin/env bash
# session 13, GPU run 4: decode tiles of one or two warps (no exchange between warps per tile; more, smaller
# programs, with KV splits to fill the machine) against the 4-warp tiles, working tree (heads-inner decode order)
set -uo pipefail
S=$(pwd)/benchmarks/attention_sweep.py
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env4.txt
sweep() {  # tag, args...
  local tag=$1; shift
  timeout 280 python $S "$@" --verbose --out $OUT/${tag}.json 2>&1 | grep -v "^# " | sed "s/^/$tag: /" | tee -a $OUT/sweeps.log
}
sweep w1_d128 --mode decode --formats fp8,int8,int4 --bs 16 --decode 64x16384,64x4096,64x1024,1x131072 \
  --plans "4,16,1,4;4,32,1,3;4,32,1,4;4,64,1,3;4,32,2,3;4,64,2,3" --splits 1,2,4,8,33
sweep w1_d64 --mode decode --formats auto,fp8,int8,int4 --bs 16 --head-dim 64 --qdtype bf16 --decode 64x640,64x2048 \
  --plans "4,32,1,3;4,64,1,3;4,32,1,4;4,64,2,3" --splits 1,2,4
