#!/usr/bin/env bash
# session 13, GPU run 3: decode tiles with the KV heads adjacent in the launch order (working tree; prefill tiles keep
# the tile-major order) against the session's first tree (.devout/base); Nsight Compute on int8 head_dim-64 decode in
# both; prefill tiles of the quantized formats (64 rows / 4 warps against 128 rows / 8 warps); GPU tests
set -uo pipefail
S=$(pwd)/benchmarks/attention_sweep.py
T=$(pwd)/tests
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env3.txt
sweep() {  # tree, tag, args...
  local V=$1 tag=$2; shift 2
  local D=.; [ $V = base ] && D=.devout/base
  (cd $D && timeout 240 python $S "$@" --out $OUT/${tag}_$V.json 2>&1 | grep -v "^#" | sed "s/^/$tag $V: /" | tee -a $OUT/sweeps.log)
}
for V in base head; do
  sweep $V dec --mode decode --formats auto,fp8,int8,int4 --bs 16 --plans "4,64,4,4" --splits 1
done
for V in head base; do
  sweep $V d64 --mode decode --formats int8,fp8 --bs 16 --head-dim 64 --qdtype bf16 --decode 64x640,64x2048 --plans "4,64,4,3" --splits 1
done
for V in base head; do
  D=.; [ $V = base ] && D=.devout/base
  (cd $D && timeout 120 ncu --clock-control none --kernel-name regex:_attention_kernel --launch-skip 2 --launch-count 1 --set full \
    --import-source no -f -o /tmp/i8_d64_$V python3 $(pwd)/benchmarks/ncu_attention.py int8 64 640 64 bf16 > /tmp/ncu_$V.log 2>&1;
   ncu -i /tmp/i8_d64_$V.ncu-rep --page details > /tmp/i8_d64_${V}_details.txt; ncu -i /tmp/i8_d64_$V.ncu-rep --page source --print-source sass --csv > /tmp/i8_d64_${V}_sass.csv)
done
(cd /tmp && tar czf $OUT/ncu3.tgz i8_d64_*_details.txt i8_d64_*_sass.csv ncu_*.log)
sweep head pre --mode prefill --formats fp8,int8,int4 --bs 16 --plans "32,128,8,2;16,128,4,2;16,128,4,3" --splits 1
PYTHONPATH=src timeout 200 python -m pytest -q -n 8 $T/attention/test_gpu.py -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/pytest.txt
