#!/usr/bin/env bash
# session 16, GPU run 1: pipeline depth of head_dim-64 decode tiles at the engine's shape (Triton gives a paged tile
# two shared-memory buffers from num_stages=5; the policy's head_dim-64 tiles run on one)
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env1.txt
P="4,64,4,2;4,64,4,5;4,32,4,5;4,64,4,6;4,128,4,5;4,32,4,3;4,64,1,3;4,64,1,5;4,32,1,5;4,128,4,2"
timeout 420 python benchmarks/attention_sweep.py --mode decode --head-dim 64 --qdtype bf16 --layout HND \
  --decode 64x576,64x2048 --formats auto,int8,int4,fp8 --plans "$P" --splits 1 --verbose \
  --out $OUT/hd64.json 2>&1 | grep -v -i warn | tee $OUT/hd64.txt
echo "## done at $(( $(date +%s) - T0 )) s"
