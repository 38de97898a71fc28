#!/usr/bin/env bash
# session 16, GPU run 3: the engine's attention shapes (head_dim 64, bf16, HND) at block sizes 16 / 32 / 64
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env3.txt
for bs in 16 32 64; do
  echo "## decode bs $bs at $(( $(date +%s) - T0 )) s"
  timeout 150 python benchmarks/attention_sweep.py --mode decode --head-dim 64 --qdtype bf16 --layout HND --bs $bs \
    --decode 64x576,64x2048 --formats auto,int8 --plans "4,64,4,2;4,32,4,2;4,128,4,2;4,64,1,3" --splits 1 --verbose \
    --out $OUT/dec_bs$bs.json 2>&1 | grep -v -i warn | grep -v "^#"
  echo "## prefill bs $bs at $(( $(date +%s) - T0 )) s"
  timeout 150 python benchmarks/attention_sweep.py --mode prefill --head-dim 64 --qdtype bf16 --layout HND --bs $bs \
    --prefill 16x512x0,16x512x512 --formats auto,int8 --plans "32,64,4,2;32,64,4,3" --verbose \
    --out $OUT/pre_bs$bs.json 2>&1 | grep -v -i warn | grep -v "^#"
done
echo "## done at $(( $(date +%s) - T0 )) s"
