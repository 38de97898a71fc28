#!/usr/bin/env bash
# session 13, GPU run 13: Nsight Compute on the final tree's one-warp int8 / int4 decode kernels, one launch per case (benchmarks/ncu_attention.py):
# full section set, the details page and the per-instruction SASS page (stall reasons) of each, packed in one tarball
set -uo pipefail
export PYTHONUNBUFFERED=1
W=/tmp/ncu; mkdir -p $W
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; date -u; which ncu; ncu --version | tail -1; } | tee $OUT/env13.txt
run() {  # name, args...
  local name=$1; shift
  timeout 150 ncu --clock-control none --kernel-name regex:_attention_kernel --launch-skip 2 --launch-count 1 --set full \
    --import-source no -f -o $W/$name python3 benchmarks/ncu_attention.py "$@" > $W/$name.log 2>&1
  echo "$name rc=$?" | tee -a $OUT/summary.txt
  ncu -i $W/$name.ncu-rep --page details > $W/${name}_details.txt 2>&1
  ncu -i $W/$name.ncu-rep --page source --print-source sass --csv > $W/${name}_sass.csv 2>&1
  grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Memory Throughput|DRAM Throughput|Issue Slots Busy|Shared Memory Configuration Size|Dynamic Shared|Block Limit" $W/${name}_details.txt | sed "s/^/$name: /" | tee -a $OUT/summary.txt
}
run i8_d128 int8 64 16384 128 fp16
run i4_d128 int4 64 16384 128 fp16
(cd $W && tar czf $OUT/ncu13.tgz *.txt *.csv *.log)
ls -la $W | tee -a $OUT/summary.txt
