#!/usr/bin/env bash
# session 14, GPU run 3: tiles for few long sequences (1 x 128k) on the magic-number tree, then the attention bench
# at block 16 (the issue-14 table)
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env3.txt
S=benchmarks/attention_sweep.py
python $S --formats int8,int4,fp8 --decode 1x131072,2x40960 --splits 33,64 --verbose --out $OUT/few.json \
  --plans "4,64,1,2;4,32,1,2;4,32,1,3;4,32,1,4;4,32,1,5;4,64,1,3" 2>&1 | grep -v Warn | tee $OUT/few.txt
echo "## few done at $(( $(date +%s) - T0 )) s"
timeout 420 python -m kvcache.bench.attention --block-sizes 16 --json $OUT/attention.json 2>&1 | tee $OUT/attention.md
echo "## bench done at $(( $(date +%s) - T0 )) s"
