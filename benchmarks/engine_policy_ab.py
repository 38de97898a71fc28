"""Run the engine bench with the decode tiles a sweep of the same run found fastest (an experiment, not the library).

Reads a decode sweep's JSON (``attention_sweep.py --mode decode --head-dim 64 --out SWEEP``), takes per kv_dtype
the fastest (block_n, stages, warp_split) at ``--shape`` among one-split plans, writes them into
``policy.DECODE_TILE_SMALL`` of this process, prints the table it used, then runs ``kvcache.bench.engine`` with the
remaining arguments. Run the bench on the unpatched tree beside it for the before / after.

    python benchmarks/engine_policy_ab.py --sweep sw_d64.json --shape "64 x 640" -- --no-hf --out after.json
"""

from __future__ import annotations

import argparse
import json
import sys


def best_tiles(rows: list[dict], shape: str) -> dict[str, tuple[int, int, bool]]:
    """kv_dtype -> (block_n, stages, warp_split) of the fastest one-split plan measured at ``shape``."""
    best: dict[str, dict] = {}
    for r in rows:
        if r.get("shape") != shape or "block_n" not in r or r.get("splits") != 1 or r.get("warps") != 4:
            continue
        if r["fmt"] not in best or r["us"] < best[r["fmt"]]["us"]:
            best[r["fmt"]] = r
    return {f: (r["block_n"], r["stages"], r["warps"], bool(r["warp_split"])) for f, r in best.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", required=True)
    ap.add_argument("--shape", default="64 x 640")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    sys.path.insert(0, "src")
    from kvcache.bench import engine
    from kvcache.ops.attention import policy

    with open(args.sweep) as f:
        tiles = best_tiles(json.load(f), args.shape)
    policy.DECODE_TILE_SMALL.update(tiles)
    print("# decode tiles (head_dim <= 64) for this run:", policy.DECODE_TILE_SMALL, flush=True)
    rest = [a for a in args.rest if a != "--"]
    return engine.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
