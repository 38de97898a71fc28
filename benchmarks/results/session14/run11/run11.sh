#!/usr/bin/env bash
# session 14, GPU run 11: an experimental head-dim-split decode tile (tree in .devout/dsplit: 2 warps per program,
# both compute the whole tile's scores from the shared K tile, warp w accumulates output half w; selected by
# warp_split with 2 warps there): the bench sweep at head_dim 128 / 64, and int8 inside the engine
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env11.txt
cd .devout/dsplit
export PYTHONPATH=src
python benchmarks/attention_sweep.py --formats int8,int4 --decode 64x16384,64x4096 --splits 4,8 --verbose \
  --plans "4,32,1,3;4,64,1,2;4,32,2,3,1;4,32,2,2,1;4,64,2,2,1" --out $OUT/d128.json 2>&1 | grep -v Warn | tee $OUT/d128.txt
echo "## hd128 done at $(( $(date +%s) - T0 )) s"
python benchmarks/attention_sweep.py --formats int8 --head-dim 64 --qdtype bf16 --decode 64x576,64x640 --splits 1 \
  --layout HND --verbose --plans "4,64,1,3;4,32,2,3,1;4,64,2,3,1;4,32,2,2,1" --out $OUT/d64.json 2>&1 | grep -v Warn | tee $OUT/d64.txt
echo "## hd64 done at $(( $(date +%s) - T0 )) s"
timeout 400 python benchmarks/engine_interleaved.py --kv-dtypes auto,int8 --layout HND --kv-gib 4 \
  --tile int8-d32=int8:32,3,2,1 --tile int8-d64=int8:64,3,2,1 --rounds 10 --out $OUT/engine.json 2>&1 \
  | grep -v -i warn | tee $OUT/engine.txt
echo "## engine done at $(( $(date +%s) - T0 )) s"
