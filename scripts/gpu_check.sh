#!/usr/bin/env bash
# On a GPU machine whose python3 already has torch + triton (the `device` tool's H100): the whole test
# suite compiled on the GPU (slow sweeps included), then `kvcache bench linear` and `kvcache bench paged`.
# Logs go to $OUT
# (or .devout/). Usage: bash scripts/gpu_check.sh [--quick] [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUTDIR="${OUT:-.devout}"
mkdir -p "$OUTDIR"
QUICK=""
if [ "${1:-}" = "--quick" ]; then QUICK="--quick"; shift; fi
date -u | tee "$OUTDIR/env.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee -a "$OUTDIR/env.txt"
python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)" | tee -a "$OUTDIR/env.txt"
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  python3 -m pytest tests -q -n "${WORKERS:-4}" --timeout 900 -p no:cacheprovider "$@" 2>&1 | tee "$OUTDIR/pytest.log" | tail -n 60
fi
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  python3 -m kvcache.cli bench linear $QUICK --json "$OUTDIR/bench.json" 2>&1 | tee "$OUTDIR/bench.log"
  python3 -m kvcache.cli bench paged $QUICK --json "$OUTDIR/paged.json" 2>&1 | tee "$OUTDIR/paged.log"
fi
