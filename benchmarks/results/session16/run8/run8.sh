#!/usr/bin/env bash
# session 16, GPU run 8 (a command line, on the warm machine after run 7): bf16 and int8 engines again
export PYTHONPATH=src
timeout 200 python benchmarks/engine_interleaved.py --kv-dtypes auto,int8 --layout HND --rounds 6 --out $OUT/engine_b.json 2>&1 | grep -v -i warn | tee $OUT/engine_b.txt
