#!/usr/bin/env bash
# session 16, GPU run 5: fp8 head_dim-64 decode ran 32% slower with the decode tiles' checked guess (run 4). Trees:
# old (41994fe), new (the guess, as in run 4), nb (the guess except fp8), nc (the guess, then one load of cu_q[b]
# outside the branch); two passes each
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env5.txt
R=$PWD
sw() { local t=$1; shift; (cd $R/.devout/$t && PYTHONPATH=src timeout 120 python benchmarks/attention_sweep.py "$@" 2>&1 \
  | grep -v -i warn | grep default | sed "s/^/$t /"); }
for pass in 1 2; do
  for t in old new nb nc; do
    sw $t --mode decode --head-dim 64 --qdtype bf16 --layout HND --decode 64x576,64x2048 --formats fp8,auto,int8 \
      --plans "4,64,4,3" --splits 1 --out /dev/null | tee -a $OUT/decode.txt
  done
done
echo "## done at $(( $(date +%s) - T0 )) s"
