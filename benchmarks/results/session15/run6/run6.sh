#!/usr/bin/env bash
# session 15, GPU run 6: the engine's eager (prefill) steps with their host inputs built in numpy into two pinned
# buffers (one asynchronous copy each) and the fused-weight check by address (.devout/new) against the tree before
# (.devout/old): issue 15's workload, bf16 KV, HND pools, trees alternating; StaticCache on the new tree; the GPU
# timeline's idle gaps on the new tree; engine / hf GPU tests on the new tree (src)
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env6.txt
R=$PWD
ei() { local t=$1; shift; (cd $R/.devout/$t && PYTHONPATH=src python benchmarks/engine_interleaved.py "$@" 2>&1 | grep -v -i warn | sed "s/^/$t /"); }
for t in old new old new; do
  ei $t --kv-dtypes auto,int8 --layout HND --rounds 4 --out /dev/null | grep median | tee -a $OUT/engine.txt
done
echo "## A/B done at $(( $(date +%s) - T0 )) s"
ei new --kv-dtypes auto --layout HND --rounds 2 --static --out /dev/null | tail -2 | tee -a $OUT/engine.txt
echo "## static done at $(( $(date +%s) - T0 )) s"
(cd $R/.devout/new && PYTHONPATH=src timeout 200 python benchmarks/engine_kernel_profile.py --kv-dtypes auto --gaps --top 4 2>&1 \
  | grep -v -i warn | head -14) | tee $OUT/gaps.md
echo "## gaps done at $(( $(date +%s) - T0 )) s"
cd $R && PYTHONPATH=src timeout 190 python -m pytest -q -n 8 tests/engine tests/hf -p no:cacheprovider --timeout 180 2>&1 | tail -2 | tee $OUT/pytest_engine_hf.txt
echo "## tests done at $(( $(date +%s) - T0 )) s"
