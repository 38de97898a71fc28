#!/usr/bin/env bash
# session 12, GPU run 7: int8 / int4 decode tiles with V dequantized per element (packed 16-bit fma, as prefill tiles)
# instead of the V fold, K still by the per-score affine (.devout/vdq: an experimental copy of src) against the tree
set -uo pipefail
S=$(pwd)/benchmarks/attention_sweep.py
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env7.txt
for T in main vdq; do
  D=.; [ $T = vdq ] && D=.devout/vdq
  (cd $D && timeout 90 python $S --mode decode --formats int8,int4 --bs 16 --decode 64x16384,64x4096,64x1024 \
    --plans "4,128,4,3;4,128,4,2;4,64,4,3" --splits 1 --verbose --out $OUT/d128_$T.json 2>&1 | sed "s/^/$T: /" | tee -a $OUT/sweeps.log)
  (cd $D && timeout 60 python $S --mode decode --head-dim 64 --qdtype bf16 --decode 64x576 --formats int8,int4 \
    --bs 16 --plans "4,64,4,2;4,128,4,2" --splits 1 --rep 100 --verbose --out $OUT/d64_$T.json 2>&1 | sed "s/^/$T: /" | tee -a $OUT/sweeps.log)
done
