#!/usr/bin/env bash
# session 15, GPU run 4: int8 one-warp decode tiles with the next tile's codes loaded into registers as int32 words
# one iteration ahead (block ids two ahead; tree .devout/pf, files prefetch.py.txt / kernel.patch.txt here) against
# the same plans on the tree without it (.devout/base): 16 / 32 keys, 1 / 2 stages, 8 splits
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env4.txt
R=$PWD
sw() { local t=$1; shift; (cd $R/.devout/$t && PYTHONPATH=src python benchmarks/attention_sweep.py "$@" 2>&1 | grep -v -i warn | sed "s/^/$t /"); }
for t in base pf; do
  sw $t --formats int8 --decode 64x16384,64x4096 --plans "4,16,1,1;4,32,1,1;4,16,1,2;4,32,1,3" --splits 8 --verbose \
    --out $OUT/pf_$t.json | tee -a $OUT/sweep.txt
done
echo "## done at $(( $(date +%s) - T0 )) s"
