"""The engine bench with and without a change to an attention launch table, alternating (an experiment).

The attention bench flushes L2 between calls; the engine does not, and the two can disagree on a tile by more than
20 points (fp8's five-stage decode tiles: 17-22% faster in the bench, 5.5% slower in the fixed-budget engine run).
A policy change is therefore A/B'd here too: ``--pairs`` times, a fresh process runs ``kvcache.bench.engine`` with the
patched table, then one with the library's, and each run's rows print as ``patched`` / ``library``.

Patches (any table of ``kvcache.ops.attention.policy``, by name):

* ``--set TABLE:FMT=V1,V2,...`` sets one entry (integers; ``true`` / ``false`` for flags), repeatable;
* ``--drop TABLE:FMT`` removes one entry (``--drop DECODE_TILE_WAVE:int8`` runs int8 without its wave tiles);
* ``--sweep JSON --shape S [--table NAME]`` fills a table (default ``DECODE_TILE_SMALL``) with the fastest one-split
  plan per kv_dtype of a decode sweep (``attention_sweep.py --mode decode --out JSON``) at shape S.

Everything after ``--`` goes to the engine bench::

    python benchmarks/engine_policy_ab.py --drop DECODE_TILE_WAVE:int8 --pairs 2 -- --capacity --kv-dtypes int8 \\
        --decode-reserves default
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def best_tiles(rows: list[dict], shape: str) -> dict[str, tuple[int, int, int, bool]]:
    """kv_dtype -> (block_n, stages, warps, warp_split) of the fastest one-split plan measured at ``shape``."""
    best: dict[str, dict] = {}
    for r in rows:
        if r.get("shape") != shape or "block_n" not in r or r.get("splits") != 1:
            continue
        if r["fmt"] not in best or r["us"] < best[r["fmt"]]["us"]:
            best[r["fmt"]] = r
    return {f: (r["block_n"], r["stages"], r["warps"], bool(r["warp_split"])) for f, r in best.items()}


def _value(text: str) -> tuple:
    return tuple(t == "true" if t in ("true", "false") else int(t) for t in text.split(","))


def apply_patches(args: argparse.Namespace) -> list[str]:
    """Patch this process's policy tables as the arguments ask; returns what was changed, one line each."""
    from kvcache.ops.attention import policy

    def table(name: str) -> dict:
        t = getattr(policy, name, None)
        if not isinstance(t, dict):
            raise SystemExit(f"no launch table named {name!r} in kvcache.ops.attention.policy")
        return t

    done = []
    if args.sweep:
        with open(args.sweep) as f:
            tiles = best_tiles(json.load(f), args.shape)
        table(args.table).update(tiles)
        done.append(f"{args.table} <- {tiles}")
    for item in args.set:
        name, _, rest = item.partition(":")
        fmt, _, value = rest.partition("=")
        table(name)[fmt] = _value(value)
        done.append(f"{name}[{fmt}] = {table(name)[fmt]}")
    for item in args.drop:
        name, _, fmt = item.partition(":")
        table(name).pop(fmt)
        done.append(f"{name}[{fmt}] dropped")
    return done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", action="append", default=[], metavar="TABLE:FMT=V1,V2")
    ap.add_argument("--drop", action="append", default=[], metavar="TABLE:FMT")
    ap.add_argument("--sweep", default=None, help="a decode sweep's JSON to take the fastest tiles from")
    ap.add_argument("--shape", default="64 x 640", help="the sweep's shape to choose at")
    ap.add_argument("--table", default="DECODE_TILE_SMALL", help="the table the sweep's tiles go into")
    ap.add_argument("--pairs", type=int, default=2, help="alternating patched / library runs")
    ap.add_argument("--child", choices=["patched", "library"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    rest = [a for a in args.rest if a != "--"]
    sys.path.insert(0, "src")
    if args.child is not None:
        if args.child == "patched":
            for line in apply_patches(args):
                print("# " + line, file=sys.stderr, flush=True)
        from kvcache.bench import engine

        return engine.main(rest)
    for _ in range(args.pairs):
        for label in ("patched", "library"):
            cmd = [sys.executable, __file__, *sys.argv[1:]]
            cmd[cmd.index("--") if "--" in cmd else len(cmd):0] = ["--child", label]
            out = subprocess.run(cmd, capture_output=True, text=True)
            rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
            if out.returncode or not rows:
                print(f"{label}: failed ({out.returncode})\n{out.stderr[-2000:]}", flush=True)
                return 1
            for r in rows:
                print(label, r.get("kv_dtype", "-"), round(r.get("generated_tok_s", 0)), r.get("steps", "-"),
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
