#!/usr/bin/env bash
# session 14, GPU run 5: where int8 loses to bf16 in the engine (head_dim 64): the attention kernel's time per
# launch shape inside one generate, and the head_dim-64 decode kernels on NHD / HND pools with random or contiguous
# block tables
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env5.txt
timeout 300 python benchmarks/engine_kernel_profile.py --kv-dtypes auto,int8 --top 6 --split-attention 2>&1 \
  | grep -v "warn" | tee $OUT/profile.md
echo "## profile done at $(( $(date +%s) - T0 )) s"
for layout in HND NHD; do for table in contiguous random; do
  echo "### $layout $table" | tee -a $OUT/hd64.txt
  python benchmarks/attention_sweep.py --formats auto,int8,int4 --head-dim 64 --qdtype bf16 --decode 64x576,64x640 \
    --splits 1 --layout $layout --table $table --verbose --plans "4,64,4,2;4,64,1,3;4,128,4,2" --out /dev/null 2>&1 \
    | grep -v Warn | tee -a $OUT/hd64.txt
done; done
echo "## sweep done at $(( $(date +%s) - T0 )) s"
