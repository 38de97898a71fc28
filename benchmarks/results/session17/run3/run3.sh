#!/usr/bin/env bash
# session 17, GPU run 3: the new tree (e874edc: PDL, ops.decoder.argmax, overlapped eager steps, queries rotated in
# the attention kernel): its attention / engine / hf GPU tests, then the engine A/B against old = .devout/old
# (decc267, the session's start), trees alternating, and the new tree's phases
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env3.txt
R=$PWD
PYTHONPATH=src timeout 150 python -m pytest -q -n 8 tests/attention/test_q_rope.py tests/attention/test_paged_attention.py \
  -p no:cacheprovider 2>&1 | tail -2 | tee $OUT/pytest.txt
PYTHONPATH=src timeout 120 python -m pytest -q -n 8 tests/engine tests/hf -p no:cacheprovider 2>&1 | tail -2 \
  | tee -a $OUT/pytest.txt
echo "## tests done at $(( $(date +%s) - T0 )) s"
for t in .devout/old . .devout/old . .devout/old . ; do
  (cd $R/$t && PYTHONPATH=src timeout 45 python benchmarks/engine_interleaved.py --kv-dtypes auto,int8 --layout HND \
    --rounds 3 --out /dev/null 2>&1 | grep -v -i warn | grep median | sed "s|^|$t |") | tee -a $OUT/engine.txt
done
echo "## engine A/B done at $(( $(date +%s) - T0 )) s"
PYTHONPATH=src timeout 100 python benchmarks/engine_kernel_profile.py --kv-dtypes auto --phases --top 16 2>&1 \
  | grep -v -i warn | tee $OUT/profile.md
echo "## done at $(( $(date +%s) - T0 )) s"
