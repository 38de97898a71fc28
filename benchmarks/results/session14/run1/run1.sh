#!/usr/bin/env bash
# session 14, GPU run 1: decode tiles with num_stages >= 5, the first depth at which Triton 3.6's pipeliner gives the
# K / V tiles of a paged (indirect) load two shared-memory buffers (offline TTGIR: 1 buffer at stages 2-4)
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env1.txt
S=benchmarks/attention_sweep.py
D=64x16384,64x4096
python $S --formats int8 --decode $D --splits 1,8 --verbose --out $OUT/int8.json \
  --plans "4,32,1,3;4,32,1,5;4,32,1,6;4,16,1,5;4,64,1,5;4,64,1,4;4,128,4,5;4,64,4,5" 2>&1 | grep -v Warn | tee $OUT/int8.txt
echo "## int8 done at $(( $(date +%s) - T0 )) s"
python $S --formats int4 --decode $D --splits 1,8 --verbose --out $OUT/int4.json \
  --plans "4,64,1,2;4,32,1,5;4,64,1,5;4,32,1,6;4,16,1,5;4,128,4,5,1;4,64,4,5" 2>&1 | grep -v Warn | tee $OUT/int4.txt
echo "## int4 done at $(( $(date +%s) - T0 )) s"
python $S --formats fp8,auto --decode $D --splits 1,2 --verbose --out $OUT/fp8.json \
  --plans "4,128,4,3;4,128,4,5;4,64,4,5;4,64,4,6;4,32,4,5;4,32,4,4;4,32,1,5;4,64,2,5" 2>&1 | grep -v Warn | tee $OUT/fp8.txt
echo "## fp8 done at $(( $(date +%s) - T0 )) s"
python $S --formats int8,auto --head-dim 64 --qdtype bf16 --decode 64x640,64x2048 --splits 1,2 --verbose --out $OUT/hd64.json \
  --plans "4,64,1,3;4,64,1,5;4,32,1,5;4,64,4,2;4,64,4,5;4,32,4,5" 2>&1 | grep -v Warn | tee $OUT/hd64.txt
echo "## hd64 done at $(( $(date +%s) - T0 )) s"
python $S --formats int8,int4,fp8 --decode 1x131072 --splits 33,64 --verbose --out $OUT/long.json \
  --plans "4,64,1,2;4,64,1,5;4,32,1,5;4,128,4,3;4,64,4,5" 2>&1 | grep -v Warn | tee $OUT/long.txt
echo "## long done at $(( $(date +%s) - T0 )) s"
