#!/usr/bin/env bash
# session 16, GPU run 9 (a command line, same machine): bf16 / int8 engines, old (.devout/old = 41994fe) and new (the final tree) alternating
R=$PWD; for t in old new old new; do if [ $t = old ]; then D=$R/.devout/old; else D=$R; fi; (cd $D && PYTHONPATH=src timeout 60 python benchmarks/engine_interleaved.py --kv-dtypes auto,int8 --layout HND --rounds 4 --out /dev/null 2>&1 | grep -v -i warn | grep -E "round|median" | sed "s/^/$t /"); done | tee $OUT/ab.txt
