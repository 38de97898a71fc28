#!/usr/bin/env bash
# session 17, GPU run 6: the long-context row (8 x 16k) of the session's first tree (.devout/old, decc267) and of the
# final tree, alternating: is the final tree's 1.51 s (run 5) a change or the machine?
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
R=$PWD
for t in .devout/old . .devout/old . ; do
  (cd $R/$t && PYTHONPATH=src timeout 60 python -m kvcache.bench.engine --long --no-hf --kv-dtypes auto \
    --out /dev/null 2>&1 | grep -v -i warn | grep '"kind"' | python -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print('$t', r.get('long_context', '64 x 512'), r['kv_dtype'], round(r['elapsed_s'], 4), r['runs_tok_s'])
") | tee -a $OUT/long_ab.txt
done
echo "## done at $(( $(date +%s) - T0 )) s"
