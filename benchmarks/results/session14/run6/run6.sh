#!/usr/bin/env bash
# session 14, GPU run 6: the engine's int8 decode at head_dim 64 runs one-warp programs, 512 of them for 64 sequences x
# 8 KV heads (3.9 warps per SM; run 5: 34.4 us per launch against bf16's 34.8 inside generate). Interleaved rounds:
# bf16 / int8 on NHD and HND pools, and int8 (HND) with its decode KV range split 2 and 4 ways
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env6.txt
timeout 540 python benchmarks/engine_interleaved.py --kv-dtypes auto,int8 --hnd --split int8-s2=int8:2 \
  --split int8-s4=int8:4 --rounds 12 --out $OUT/inter.json 2>&1 | grep -v -i warn | tee $OUT/inter.txt
echo "## done at $(( $(date +%s) - T0 )) s"
