#!/usr/bin/env bash
# session 16, GPU run 11: decode tiles launched in a permuted order (the tiles of a one-row-per-sequence batch first,
# its spare tiles last, resolved by a second one-load check); old2 = .devout/old2 (aa0a253), new = the working tree.
# GPU tests of paged attention first, then the decode A/B, then the engine A/B while time is left
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env11.txt
R=$PWD
PYTHONPATH=src timeout 170 python -m pytest -q -n 8 tests/attention/test_paged_attention.py tests/attention/test_gpu.py \
  -p no:cacheprovider 2>&1 | tail -2 | tee $OUT/pytest_attention.txt
echo "## tests done at $(( $(date +%s) - T0 )) s"
sw() { local t=$1; shift; (cd $R/$t && PYTHONPATH=src timeout 80 python benchmarks/attention_sweep.py "$@" 2>&1 \
  | grep -v -i warn | grep default | sed "s|^|$t |"); }
for t in .devout/old2 . ; do
  sw $t --mode decode --head-dim 64 --qdtype bf16 --layout HND --decode 64x576,64x2048 --formats auto,int8,int4,fp8 \
    --plans "4,64,4,2" --splits 1 --out /dev/null | tee -a $OUT/decode.txt
done
echo "## decode A/B done at $(( $(date +%s) - T0 )) s"
for t in .devout/old2 . .devout/old2 . ; do
  (cd $R/$t && PYTHONPATH=src timeout 40 python benchmarks/engine_interleaved.py --kv-dtypes auto,int8 --layout HND \
    --rounds 3 --out /dev/null 2>&1 | grep -v -i warn | grep median | sed "s|^|$t |") | tee -a $OUT/engine.txt
done
echo "## done at $(( $(date +%s) - T0 )) s"
