#!/usr/bin/env bash
# Set up (scripts/setup.sh, with the model) and run the main job: `kvcache demo` (SmolLM2 answers chat questions
# that share a system prompt through kvcache's engine; its greedy outputs are checked against Hugging Face
# generate). Extra arguments go to `kvcache demo` (see `kvcache demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh io,bench,hf
# shellcheck disable=SC1091
. .venv/bin/activate
echo "demo: kvcache demo $*"
exec kvcache demo "$@"
