#!/usr/bin/env bash
# session 16, GPU run 4: decode tiles find their sequence by a checked guess (one row per sequence) before the binary
# search; RMSNorm's weight load hoisted; the cheaper fused-weight check. old = .devout/old (41994fe), new =
# .devout/new (the working tree): attention decode and the engine, trees alternating; per-kernel GPU time of both
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env4.txt
R=$PWD
sw() { local t=$1; shift; (cd $R/.devout/$t && PYTHONPATH=src timeout 120 python benchmarks/attention_sweep.py "$@" 2>&1 \
  | grep -v -i warn | grep default | sed "s/^/$t /"); }
for t in old new old new; do
  sw $t --mode decode --head-dim 64 --qdtype bf16 --layout HND --decode 64x576,64x2048 --formats auto,int8,int4,fp8 \
    --plans "4,64,4,2" --splits 1 --out /dev/null | tee -a $OUT/decode.txt
  sw $t --mode decode --decode 64x1024,64x16384,1x131072 --formats auto,int8,int4,fp8 --plans "4,32,4,4" --splits 1 \
    --out /dev/null | tee -a $OUT/decode.txt
done
echo "## decode A/B done at $(( $(date +%s) - T0 )) s"
ei() { local t=$1; shift; (cd $R/.devout/$t && PYTHONPATH=src python benchmarks/engine_interleaved.py "$@" 2>&1 | grep -v -i warn | sed "s/^/$t /"); }
for t in old new old new; do
  ei $t --kv-dtypes auto,int8 --layout HND --rounds 4 --out /dev/null | grep median | tee -a $OUT/engine.txt
done
echo "## engine A/B done at $(( $(date +%s) - T0 )) s"
for t in old new; do
  (cd $R/.devout/$t && PYTHONPATH=src timeout 200 python benchmarks/engine_kernel_profile.py --kv-dtypes auto 2>&1 \
    | grep -v -i warn | head -24 | sed "s/^/$t /") | tee -a $OUT/profile.md
done
echo "## done at $(( $(date +%s) - T0 )) s"
