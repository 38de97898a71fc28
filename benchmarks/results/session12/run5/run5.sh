#!/usr/bin/env bash
# session 12, GPU run 5: deeper K/V pipelines for prefill tiles. The paged kernel's block-table load takes one of the
# pipeline's stages (offline sm_90: 128-key fp16 tiles keep two K/V buffers at 2-4 stages; 64-key tiles get a third
# at 5-6 stages, 132 KB, a fourth at 7), and dense Triton gained 12% from two to three buffers. head_dim 128 (fp16
# queries) and the engine's head_dim 64 (bf16 queries, 16 x 512 new)
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1 2>/dev/null; date -u; } | tee $OUT/env5.txt
timeout 150 python benchmarks/attention_sweep.py --mode prefill --formats auto --bs 16 --rep 60 \
  --plans "32,128,8,2;32,64,8,3;32,64,8,5;32,64,8,7;32,32,8,6;32,32,8,8" --verbose --out $OUT/pf_auto.json 2>&1 | tee $OUT/sweeps.log
timeout 150 python benchmarks/attention_sweep.py --mode prefill --formats fp8,int8,int4 --bs 16 --rep 60 \
  --plans "16,128,4,2;16,128,4,3;16,128,4,4;16,64,4,4;16,64,4,6" --verbose --out $OUT/pf_quant.json 2>&1 | tee -a $OUT/sweeps.log
echo "## hd128 sweeps done at $(( $(date +%s) - T0 )) s"
timeout 150 python benchmarks/attention_sweep.py --mode prefill --head-dim 64 --qdtype bf16 --prefill 16x512x0,16x512x512 --formats auto,int8,int4 --bs 16 \
  --rep 60 --plans "32,64,4,2;32,64,4,3;32,64,4,5;16,64,4,2;16,64,4,5" --verbose --out $OUT/pf_d64.json 2>&1 | tee -a $OUT/sweeps.log
echo "## hd64 sweeps done at $(( $(date +%s) - T0 )) s"
