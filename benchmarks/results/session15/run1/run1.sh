#!/usr/bin/env bash
# session 15, GPU run 1: decode tiles with fewer instructions per KV tile (int8 / int4 accumulators kept in the dots'
# units, rows' maxima of unscaled scores for every format but fp8; n3 adds the magic offset's row sums by a dot),
# trees carried in .devout/{old,n2,n3}: policy plans side by side; then the GPU attention tests on n3 (src)
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env1.txt
R=$PWD
sw() { local t=$1; shift; (cd $R/.devout/$t && PYTHONPATH=src python benchmarks/attention_sweep.py "$@" 2>&1 | grep -v -i warn | grep -v compiled | sed "s/^/$t /"); }
for t in old n2 n3; do
  sw $t --formats auto,int8,int4 --decode 64x16384,64x4096,1x131072 --plans "4,32,4,4" --splits 1 --out $OUT/d_$t.json | tee -a $OUT/sweep.txt
  sw $t --formats int8 --qdtype bf16 --decode 64x16384 --plans "4,32,1,3" --splits 8 --out /dev/null | tee -a $OUT/sweep.txt
  sw $t --formats auto,int8,int4 --head-dim 64 --qdtype bf16 --layout HND --decode 64x640 --plans "4,64,1,3" --splits 1 --out /dev/null | tee -a $OUT/sweep.txt
done
echo "## decode done at $(( $(date +%s) - T0 )) s"
for t in old n3; do
  sw $t --mode prefill --formats auto --plans "32,128,8,2" --out $OUT/p_$t.json | tee -a $OUT/sweep.txt
  sw $t --mode prefill --formats auto,int8 --head-dim 64 --qdtype bf16 --prefill 16x512x0,16x512x512 --plans "32,64,4,2" --out /dev/null | tee -a $OUT/sweep.txt
done
echo "## prefill done at $(( $(date +%s) - T0 )) s"
for t in n3 n2 old; do
  sw $t --formats int8,int4 --decode 64x16384,64x4096 --plans "4,32,4,4" --splits 1 --out /dev/null | tee -a $OUT/sweep.txt
done
echo "## repeat done at $(( $(date +%s) - T0 )) s"
cd $R && PYTHONPATH=src timeout 200 python -m pytest -q -n 8 tests/attention -p no:cacheprovider --timeout 180 2>&1 | tail -4 | tee $OUT/pytest_gpu.txt
echo "## tests done at $(( $(date +%s) - T0 )) s"
