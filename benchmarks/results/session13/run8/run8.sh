#!/usr/bin/env bash
# session 13, GPU run 8: the engine on NHD and HND pools, bf16 and int8 KV, interleaved rounds (final kernel tree)
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $OUT/env8.txt
timeout 420 python benchmarks/engine_interleaved.py --kv-dtypes auto,int8 --hnd --rounds 6 \
  --out $OUT/engine_hnd.json 2>&1 | grep -v Warn | tee $OUT/engine_hnd.log
