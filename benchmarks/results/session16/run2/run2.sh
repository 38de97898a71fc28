#!/usr/bin/env bash
# session 16, GPU run 2: prefill tiles of 16-bit / fp8 caches over whole rows (FULL) against the two halves
# (old = HEAD's tree in .devout/old, new = the working tree), alternating, same plans
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env2.txt
R=$(pwd)
P="32,128,8,2;32,128,8,3;32,128,8,5;32,64,8,3;32,64,8,4;16,128,4,2"
for pass in 1 2; do
  for t in old new; do
    if [ $t = old ]; then D=$R/.devout/old; else D=$R; fi
    echo "## pass $pass tree $t at $(( $(date +%s) - T0 )) s"
    (cd $D && PYTHONPATH=src timeout 200 python benchmarks/attention_sweep.py --mode prefill --formats auto,fp8 \
      --plans "$P" --verbose --out $OUT/hd128_${t}_$pass.json 2>&1 | grep -v -i warn | tee $OUT/hd128_${t}_$pass.txt)
  done
done
for t in old new; do
  if [ $t = old ]; then D=$R/.devout/old; else D=$R; fi
  echo "## hd64 tree $t at $(( $(date +%s) - T0 )) s"
  (cd $D && PYTHONPATH=src timeout 150 python benchmarks/attention_sweep.py --mode prefill --formats auto,fp8 \
    --head-dim 64 --qdtype bf16 --layout HND --prefill 16x512x0,16x512x512 \
    --plans "32,64,4,2;32,64,4,3;32,64,8,3;32,128,8,2" --verbose --out $OUT/hd64_$t.json 2>&1 | grep -v -i warn \
    | tee $OUT/hd64_$t.txt)
done
echo "## done at $(( $(date +%s) - T0 )) s"
