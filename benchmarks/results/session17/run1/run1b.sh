#!/usr/bin/env bash
# session 17, GPU run 1b: engine A/B old / mid / new (see run1.sh), the argmax bench, the new tree's phases and gaps
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env1b.txt
R=$PWD
for t in .devout/old .devout/mid . .devout/old .devout/mid . ; do
  (cd $R/$t && PYTHONPATH=src timeout 45 python benchmarks/engine_interleaved.py --kv-dtypes auto,int8 --layout HND \
    --rounds 3 --out /dev/null 2>&1 | grep -v -i warn | grep median | sed "s|^|$t |") | tee -a $OUT/engine.txt
done
echo "## engine A/B done at $(( $(date +%s) - T0 )) s"
PYTHONPATH=src timeout 60 python benchmarks/argmax_bench.py 2>&1 | grep -v -i warn | tee $OUT/argmax.txt
echo "## argmax done at $(( $(date +%s) - T0 )) s"
PYTHONPATH=src timeout 150 python benchmarks/engine_kernel_profile.py --kv-dtypes auto --phases --gaps --top 16 2>&1 \
  | grep -v -i warn | tee $OUT/profile.md
echo "## done at $(( $(date +%s) - T0 )) s"
