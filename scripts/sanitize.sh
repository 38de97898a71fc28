#!/usr/bin/env bash
# Run a small case of every kvcache kernel (benchmarks/sanitize_cases.py) under NVIDIA compute-sanitizer:
# memcheck (out-of-bounds / misaligned accesses, with torch's caching allocator off so that every tensor is
# its own allocation), racecheck (shared-memory hazards) and initcheck (reads of uninitialised device memory).
# Prints one summary line per tool with its error count; logs go to $OUT (or .devout/sanitize).
#
#   bash scripts/sanitize.sh            # all three tools
#   TOOLS="memcheck" bash scripts/sanitize.sh
#
# compute-sanitizer is looked up in PATH, then /usr/local/cuda*/bin (newest first); COMPUTE_SANITIZER=/path
# overrides. Kernels are compiled once by a plain warm-up run into a private Triton cache, so the sanitized
# runs load them instead of compiling under the tool. Exit status: 0 when every tool reports 0 errors and
# every case ran, 1 otherwise, 2 when compute-sanitizer or CUDA is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUTDIR="${OUT:-.devout}/sanitize"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"
TOOLS="${TOOLS:-memcheck racecheck initcheck}"
PER_TOOL_TIMEOUT="${PER_TOOL_TIMEOUT:-80}"  # exit 124 in the summary line: raise it, or run one tool (TOOLS=)

CS="${COMPUTE_SANITIZER:-}"
if [ -z "$CS" ]; then
  CS="$(command -v compute-sanitizer || true)"
fi
if [ -z "$CS" ]; then
  CS="$(ls -1d /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | sort -V | tail -n 1 || true)"
fi
if [ -z "$CS" ] || [ ! -x "$CS" ]; then
  echo "sanitize.sh: compute-sanitizer not found (PATH, /usr/local/cuda*/bin); install the CUDA toolkit or set COMPUTE_SANITIZER" >&2
  exit 2
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "sanitize.sh: CUDA is not available to $PY" >&2
  exit 2
fi

{
  date -u
  "$CS" --version | tail -n 1
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
} | tee "$OUTDIR/env.txt"

export TRITON_CACHE_DIR="$OUTDIR/triton-cache"
start=$(date +%s)
"$PY" benchmarks/sanitize_cases.py > "$OUTDIR/warmup.log" 2>&1
warm_rc=$?
echo "warm-up (compiles, no tool): $(tail -n 1 "$OUTDIR/warmup.log") in $(( $(date +%s) - start )) s"
if [ $warm_rc -ne 0 ]; then
  grep "^FAIL" "$OUTDIR/warmup.log"
fi

status=$warm_rc
for tool in $TOOLS; do
  log="$OUTDIR/$tool.log"
  env_extra=(CUDA_MODULE_LOADING=LAZY)
  if [ "$tool" = "memcheck" ]; then env_extra+=(PYTORCH_NO_CUDA_MEMORY_CACHING=1); fi
  t0=$(date +%s)
  env "${env_extra[@]}" timeout "$PER_TOOL_TIMEOUT" "$CS" --tool "$tool" --log-file "$log" --print-limit 200 \
    "$PY" benchmarks/sanitize_cases.py > "$OUTDIR/$tool.stdout" 2>&1
  rc=$?
  cases="$(grep '^cases:' "$OUTDIR/$tool.stdout" | tail -n 1)"
  # memcheck / initcheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: N hazards displayed
  # (E errors, W warnings)"
  errors="$(grep -Eo 'ERROR SUMMARY: [0-9]+ error' "$log" | grep -Eo '[0-9]+' | tail -n 1)"
  if [ "$tool" = "racecheck" ]; then
    race="$(grep -Eo '\([0-9]+ errors?, [0-9]+ warnings?\)' "$log" | tail -n 1)"
    [ -n "$race" ] && errors="$(echo "$race" | grep -Eo '[0-9]+' | head -n 1)"
    [ -z "$errors" ] && errors="$(grep -Ec 'Race reported|Error: Race' "$log")"
  fi
  [ -z "$errors" ] && errors="?"
  echo "$tool: ${errors} errors; ${cases:-no case summary (exit $rc)}; $(( $(date +%s) - t0 )) s; log $log"
  if [ "$errors" != "0" ] || [ $rc -ne 0 ]; then
    status=1
    grep "^FAIL" "$OUTDIR/$tool.stdout" | head -n 20
  fi
done
echo "total $(( $(date +%s) - start )) s"
exit $status
