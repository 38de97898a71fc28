#!/usr/bin/env bash
# session 17, GPU run 2: decode-step GEMMs, cuBLAS against a split-K Triton kernel (benchmarks/skinny_gemm.py); the
# prefill phase with and without the overlapped eager steps (mid = .devout/mid: the new tree, not overlapped), and
# the new tree's largest GPU gaps
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env2.txt
R=$PWD
PYTHONPATH=src timeout 300 python benchmarks/skinny_gemm.py --out $OUT/skinny.json 2>&1 | grep -v -i warn \
  | tee $OUT/skinny.txt
echo "## skinny done at $(( $(date +%s) - T0 )) s"
for t in .devout/mid . ; do
  (cd $R/$t && PYTHONPATH=src timeout 100 python benchmarks/engine_kernel_profile.py --kv-dtypes auto --phases --top 3 \
    2>&1 | grep -v -i warn | grep "##" | sed "s|^|$t |") | tee -a $OUT/phases.txt
done
PYTHONPATH=src timeout 100 python benchmarks/engine_kernel_profile.py --kv-dtypes auto --phases --gaps --largest 40 \
  --top 3 2>&1 | grep -v -i warn | tee $OUT/gaps.md
echo "## done at $(( $(date +%s) - T0 )) s"
