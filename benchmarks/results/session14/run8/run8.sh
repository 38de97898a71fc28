#!/usr/bin/env bash
# session 14, GPU run 8: one-warp int8 / int4 decode tiles are held to 7-8 warps per SM (255 registers, ~30 KB of
# shared memory each): shorter tiles (less shared memory) under register caps (ptxas maxnreg) at 64 x 16k
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env8.txt
for cap in 0 168 128; do
  echo "### maxnreg $cap" | tee -a $OUT/cap.txt
  python benchmarks/attention_sweep.py --formats int8,int4 --decode 64x16384 --splits 8,16 --maxnreg $cap --verbose \
    --plans "4,16,1,3;4,16,1,2;4,32,1,3;4,32,1,2;4,64,1,2" --out $OUT/cap$cap.json 2>&1 | grep -v Warn | tee -a $OUT/cap.txt
done
echo "## done at $(( $(date +%s) - T0 )) s"
