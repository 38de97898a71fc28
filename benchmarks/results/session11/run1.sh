#!/usr/bin/env bash
# session 11, GPU run 1. Decode: warp-split tiles A/B in one sweep (warp_split 0 = the previous tiles) with the
# copy of the same blocks per format; the engine with the head_dim-64 tiles this run's sweep found fastest;
# prefill before (HEAD tree in .devout/before) / after (this tree), alternating.
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
left() { echo $(( 570 - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $OUT/env.txt
date -u | tee -a $OUT/env.txt
P128="4,32,4,4,0,0;4,128,4,3,0,0;4,128,4,2,0,0;4,64,4,2,1,0;4,64,4,3,1,0;4,128,4,2,1,0;4,128,4,3,1,0;4,256,4,2,1,0;4,128,4,3,0,168;4,128,4,3,1,168;4,128,4,2,1,168;4,64,4,3,1,128"
P64="4,64,4,2,0,0;4,64,4,3,0,0;4,128,4,3,0,0;4,64,4,2,1,0;4,64,4,3,1,0;4,128,4,2,1,0;4,128,4,3,1,0;4,64,4,2,0,128;4,64,4,2,1,128"
{
timeout 200 python benchmarks/attention_sweep.py --mode decode --formats auto,fp8,int8,int4 --bs 16 \
  --decode 64x16384,64x4096,64x1024,1x131072 --plans "$P128" --ceiling --verbose --out $OUT/sw_d128.json
echo "## d128 done at $(( $(date +%s) - T0 )) s"
timeout 100 python benchmarks/attention_sweep.py --mode decode --formats auto,fp8,int8,int4 --bs 16 --head-dim 64 \
  --qdtype bf16 --decode 64x640 --splits 1 --plans "$P64" --ceiling --verbose --out $OUT/sw_d64.json
echo "## d64 done at $(( $(date +%s) - T0 )) s"
[ -f $OUT/sw_d64.json ] || echo "[]" > $OUT/sw_d64.json
PYTHONPATH=src timeout $(( $(left) - 150 )) python benchmarks/engine_policy_ab.py --sweep $OUT/sw_d64.json --shape "64 x 640" -- \
  --no-hf --kv-dtypes auto,int8,int4,fp8 --out $OUT/engine_after.json
echo "## engine done at $(( $(date +%s) - T0 )) s"
for tree in before after; do
  if [ $tree = before ]; then cd .devout/before; else cd "$OLDPWD"; fi
  div=2; [ $tree = after ] && div=1
  timeout $(( $(left) / div - 10 )) python benchmarks/attention_sweep.py --mode prefill --formats auto,int8,int4 --plans "32,128,8,2" \
    --out $OUT/pf_$tree.json
  echo "## prefill $tree done at $(( $(date +%s) - T0 )) s"
done
} 2>&1 | tee $OUT/run1.log
{
if [ $(left) -gt 100 ]; then
  cd .devout/before && PYTHONPATH=src timeout $(( $(left) - 5 )) python -m kvcache.bench.engine --no-hf --kv-dtypes auto,int8,int4 \
    --out $OUT/engine_before.json; cd "$OLDPWD"
  echo "## engine before done at $(( $(date +%s) - T0 )) s"
fi
} 2>&1 | tee -a $OUT/run1.log
