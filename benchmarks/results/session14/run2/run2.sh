#!/usr/bin/env bash
# session 14, GPU run 2: int8 / int4 decode tiles with the codes as float16 magic numbers (1024 + c) and the offset
# removed after the dots, against the tree before the change (old) and a K-only variant (konly), trees carried in
# .devout/{old,new,konly}; then the GPU attention tests on the new tree (src)
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env2.txt
R=$PWD
sw() { local t=$1; shift; (cd $R/.devout/$t && PYTHONPATH=src python benchmarks/attention_sweep.py "$@" 2>&1 | grep -v Warn | sed "s/^/$t /"); }
for t in old new konly; do
  sw $t --formats int8,int4 --decode 64x16384,64x4096 --splits 8 --plans "4,32,1,3;4,64,1,2" --out $OUT/fp16_$t.json | tee -a $OUT/sweep.txt
done
echo "## fp16 done at $(( $(date +%s) - T0 )) s"
for t in old new konly; do
  sw $t --formats int8,int4 --qdtype bf16 --decode 64x16384 --splits 8 --plans "4,32,1,3;4,64,1,2" --out /dev/null | tee -a $OUT/sweep.txt
  sw $t --formats int8 --head-dim 64 --qdtype bf16 --decode 64x640,64x2048 --splits 1 --plans "4,64,1,3" --out /dev/null | tee -a $OUT/sweep.txt
done
echo "## bf16 done at $(( $(date +%s) - T0 )) s"
for t in konly new old; do
  sw $t --formats int8,int4 --decode 64x16384,64x4096 --splits 8 --plans "4,32,1,3;4,64,1,2" --out /dev/null | tee -a $OUT/sweep.txt
done
echo "## repeat done at $(( $(date +%s) - T0 )) s"
cd $R && PYTHONPATH=src timeout 200 python -m pytest -q -n 8 tests/attention -p no:cacheprovider --timeout 180 2>&1 | tail -4 | tee $OUT/pytest_gpu.txt
echo "## tests done at $(( $(date +%s) - T0 )) s"
