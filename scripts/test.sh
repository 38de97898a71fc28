#!/usr/bin/env bash
# Set up (scripts/setup.sh, with the default model: the hf tests run it) and run the test suite. Without a
# GPU every kernel runs twice: through its pure-torch reference and through Triton's interpreter. Long
# sweeps, and the combinations of a kernel sweep outside its cover (tests/sweeps.py), are marked `slow`
# and skipped here unless KVCACHE_TEST_SLOW=1 (scripts/gpu_check.sh sets it). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,io,hf
# shellcheck disable=SC1091
. .venv/bin/activate
MARK=(-m "not slow")
if [ "${KVCACHE_TEST_SLOW:-0}" = "1" ]; then MARK=(); fi
SLOW="skipped (KVCACHE_TEST_SLOW=1 runs them)"
if [ ${#MARK[@]} -eq 0 ]; then SLOW="included"; fi
echo "test: pytest on ${KVCACHE_TEST_WORKERS:-auto} workers, slow tests ${SLOW}: several minutes on 2 cores"
exec python -m pytest -n "${KVCACHE_TEST_WORKERS:-auto}" --timeout=900 "${MARK[@]}" "$@"
