#!/usr/bin/env bash
# session 12, GPU run 3: head_dim-64 decode tiles of int4 / int8 / fp8 again (64 vs 128 keys), quantized prefill tiles
# at head_dim 128 (64-row tiles of 4 warps against the policy's 128 rows of 8 warps), and the engine with int4 on
# 128-key decode tiles beside the policy's, in interleaved rounds
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1 2>/dev/null; date -u; } | tee $OUT/env3.txt
timeout 90 python benchmarks/attention_sweep.py --mode decode --head-dim 64 --qdtype bf16 --decode 64x576,64x640 --formats int4,int8,fp8 \
  --bs 16 --plans "4,64,4,2;4,64,4,3;4,128,4,2;4,128,4,3" --splits 1 --rep 100 --verbose --out $OUT/d64.json 2>&1 | tee $OUT/sweeps.log
timeout 120 python benchmarks/attention_sweep.py --mode prefill --formats int4,fp8,int8 --bs 16 --plans "32,128,8,2;16,128,4,2;16,128,4,3;16,64,4,2" \
  --verbose --out $OUT/pf.json 2>&1 | tee -a $OUT/sweeps.log
echo "## sweeps done at $(( $(date +%s) - T0 )) s"
PYTHONPATH=src timeout $(( 560 - ($(date +%s) - T0) )) python benchmarks/engine_interleaved.py --kv-dtypes auto,int8,int4 --tile int4-128=int4:128,2 \
  --rounds 7 --out $OUT/engine_tiles.json 2>&1 | grep -v Warn | tee $OUT/engine_tiles.log
echo "## engine done at $(( $(date +%s) - T0 )) s"
