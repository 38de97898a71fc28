#!/usr/bin/env bash
# session 12, GPU run 8: prefill stages at head_dim 64 (bf16 queries) for every kv_dtype, with nothing / 512 / 8192
# tokens cached (engine chunks, long-context chunks)
set -uo pipefail
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env8.txt
timeout 200 python benchmarks/attention_sweep.py --mode prefill --head-dim 64 --qdtype bf16 --prefill 16x512x0,16x512x512,4x2048x8192 \
  --formats auto,fp8,int8,int4 --bs 16 --rep 60 --plans "32,64,4,2;32,64,4,3;32,64,4,4;32,64,4,5" --verbose --out $OUT/pf_d64.json 2>&1 | tee $OUT/sweeps.log
