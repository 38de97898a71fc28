#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: `kvcache info` (backend, devices, a smoke run of every op).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh io,bench
# shellcheck disable=SC1091
. .venv/bin/activate
exec kvcache info "$@"
