#!/usr/bin/env bash
# session 14, GPU run 7: int8 decode tiles at head_dim 64 inside the engine (HND pools): the one-warp 64-key tile
# (policy) against warp-split tiles of 2 and 4 warps (each warp its own keys: more warps per SM for the same 512
# programs) and a one-warp 32-key tile; interleaved rounds, bf16 the base
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env7.txt
timeout 540 python benchmarks/engine_interleaved.py --kv-dtypes auto,int8 --hnd --kv-gib 4 \
  --tile int8-ws2=int8:64,3,2,1 --tile int8-ws4=int8:64,3,4,1 --tile int8-32=int8:32,3,1 \
  --rounds 14 --out $OUT/inter.json 2>&1 | grep -v -i warn | tee $OUT/inter.txt
echo "## done at $(( $(date +%s) - T0 )) s"
