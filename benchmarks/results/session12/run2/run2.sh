#!/usr/bin/env bash
# session 12, GPU run 2: Triton 3.6 on dense causal prefill (contiguous K/V, the helper's structural variants) beside
# the paged kernel's prefill on the same shapes, before (.devout/before: the session's first tree) / after (launch
# order reversed: heavy query tiles first); decode at the engine's shape (head_dim 64, 64 x 576) with KV splits and
# register caps (more programs per SM)
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1 2>/dev/null; date -u; } | tee $OUT/env2.txt
PF="32,128,8,2;32,128,8,3;32,64,8,3;32,64,8,2;16,128,4,2"
timeout 100 python benchmarks/attention_sweep.py --mode prefill --formats auto,int8 --bs 16 --plans "$PF" --verbose --out $OUT/pf_after.json 2>&1 | tee $OUT/pf.log
(cd .devout/before && timeout 100 python ../../benchmarks/attention_sweep.py --mode prefill --formats auto,int8 --bs 16 --plans "$PF" --verbose --out $OUT/pf_before.json 2>&1 | sed 's/^/before: /' | tee -a $OUT/pf.log)
echo "## prefill sweeps done at $(( $(date +%s) - T0 )) s"
timeout 200 python benchmarks/dense_triton_attention.py --variants plain,tma-host,pack --repeat 3 --out $OUT/dense.json 2>&1 | grep -v Warning | tee $OUT/dense.log
echo "## dense done at $(( $(date +%s) - T0 )) s"
for R in 0 64 80; do
  timeout 70 python benchmarks/attention_sweep.py --mode decode --head-dim 64 --qdtype bf16 --decode 64x576 --formats auto,int8,int4 \
    --bs 16 --plans "4,64,4,2;4,64,4,3;4,32,4,3;4,128,4,2" --splits 1,2,4 --maxnreg $R --verbose --out $OUT/d64_r$R.json 2>&1 | tee -a $OUT/d64.log
done
echo "## decode sweeps done at $(( $(date +%s) - T0 )) s"
