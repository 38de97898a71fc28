#!/usr/bin/env bash
# session 13, GPU run 2: the attention grid with the KV heads of a query tile adjacent in the launch order ("head",
# the working tree) against the session's first tree ("base", .devout/base: tile-major grid (tiles, heads, splits));
# decode at head_dim 128 (NHD, and HND for the new grid), the engine's head_dim-64 shape, prefill; GPU tests
set -uo pipefail
S=$(pwd)/benchmarks/attention_sweep.py
T=$(pwd)/tests
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env2.txt
sweep() {  # tree, tag, args...
  local V=$1 tag=$2; shift 2
  local D=.; [ $V = base ] && D=.devout/base
  (cd $D && timeout 240 python $S "$@" --out $OUT/${tag}_$V.json 2>&1 | grep -v "^#" | sed "s/^/$tag $V: /" | tee -a $OUT/sweeps.log)
}
for V in base head; do
  sweep $V dec d128 --mode decode --formats auto,fp8,int8,int4 --bs 16 --plans "4,64,4,4" --splits 1
done
sweep head hnd --mode decode --formats auto,fp8,int8,int4 --bs 16 --plans "4,64,4,4" --splits 1 --layout HND
for V in base head; do
  sweep $V d64 --mode decode --formats auto,fp8,int8,int4 --bs 16 --head-dim 64 --qdtype bf16 --decode 64x640,64x2048 --plans "4,64,4,3" --splits 1
  sweep $V pre --mode prefill --formats auto,int8 --bs 16 --plans "32,128,8,2" --splits 1
done
timeout 200 python -m pytest -q -n 8 $T/attention/test_gpu.py -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/pytest.txt
