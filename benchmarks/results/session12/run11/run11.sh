#!/usr/bin/env bash
# session 12, GPU run 11: fp8 decode tiles converting e4m3 -> fp16 in the load's registers (impure inline cvt, then
# ldmatrix) instead of Triton's conversion after the shared-memory read (.devout/f8, run11/f8.patch), against the tree
set -uo pipefail
S=$(pwd)/benchmarks/attention_sweep.py
T=$(pwd)/tests
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env11.txt
(cd .devout/f8 && PYTHONPATH=src timeout 150 python -m pytest -q -n 8 $T/attention/test_paged_attention.py $T/attention/test_gpu.py -k "fp8" -p no:cacheprovider 2>&1 | tail -2 | tee $OUT/pytest_f8.txt)
for V in main f8; do
  D=.; [ $V = f8 ] && D=.devout/f8
  (cd $D && timeout 120 python $S --mode decode --formats fp8 --bs 16 --decode 64x16384,64x4096,64x1024,1x131072 \
    --plans "4,128,4,3;4,128,4,2;4,64,4,3" --splits 1,33 --verbose --out $OUT/fp8_$V.json 2>&1 | sed "s/^/$V: /" | tee -a $OUT/sweeps.log)
done
