"""Greedy argmax over logits rows: ``kvcache.engine.kernels.argmax`` (split rows, two Triton kernels) against
``torch.argmax(x, dim=-1)`` (one block per row), on a GPU.

For each shape, first checks that both give the same indices (on random logits, and on logits with the maximum
repeated in several chunks plus a NaN row), then times both with ``triton.testing.do_bench`` (L2 flushed before
every call; ours writes into a preallocated ``out``, as in a CUDA-graph decode step) and prints the median time
and the read bandwidth it implies (``M * V * itemsize`` bytes). The last column times ours replayed from a CUDA
graph (one replay per call, L2 flushed likewise), as the engine runs it.

Usage: PYTHONPATH=src python benchmarks/argmax_bench.py [--out FILE]   (FILE: the rows as JSON)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch
import triton
from triton.testing import do_bench

from kvcache.engine.kernels import argmax

VOCAB = 128256  # Llama 3
SHAPES: list[tuple[int, int, torch.dtype]] = [
    (1, VOCAB, torch.bfloat16),
    (8, VOCAB, torch.bfloat16),
    (64, VOCAB, torch.bfloat16),
    (256, VOCAB, torch.bfloat16),
    (64, 49152, torch.bfloat16),
    (64, VOCAB, torch.float32),
]


def check(m: int, v: int, dtype: torch.dtype, device: torch.device) -> None:
    """Raise AssertionError unless ours equals torch.argmax on random and on tie / NaN logits of this shape."""
    g = torch.Generator(device=device).manual_seed(m * 1_000_003 + v)
    x = torch.randn(m, v, generator=g, device=device).to(dtype)
    cases = {"random": x}
    ties = x.clone()
    top = torch.finfo(dtype).max
    cols = torch.tensor([v - 1, v // 2, v // 3, 5], device=device)  # first index: 5 (or v - 1 when v <= 5)
    ties[:, cols] = top
    if m > 1:
        ties[1, v - 1] = float("nan")
        ties[1, v // 2] = float("inf")
    cases["ties_nan"] = ties
    wide = torch.randn(m, v + 64, generator=g, device=device).to(dtype)
    cases["row_strided"] = wide[:, 3:v + 3]
    for name, t in cases.items():
        ours, ref = argmax(t), torch.argmax(t, dim=-1)
        if not torch.equal(ours, ref):
            bad = (ours != ref).nonzero().flatten()[:5].tolist()
            raise AssertionError(f"[{m}, {v}] {dtype} {name}: rows {bad} differ: ours {ours[bad].tolist()}, "
                                 f"torch {ref[bad].tolist()}")


def graph_of(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph (after one eager warm-up call that compiles its kernels)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the rows as JSON to this file")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=200, help="do_bench repetitions, ms")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("argmax_bench: needs a CUDA device", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'shape':>14} {'dtype':>9} {'torch us':>9} {'GB/s':>7} {'ours us':>8} {'GB/s':>7} {'speedup':>7} "
          f"{'graph us':>8}")
    rows = []
    for m, v, dtype in SHAPES:
        check(m, v, dtype, device)
        x = torch.randn(m, v, device=device).to(dtype)
        out = torch.empty(m, dtype=torch.int64, device=device)
        t_torch = do_bench(lambda x=x: torch.argmax(x, dim=-1), warmup=args.warmup, rep=args.rep,
                           return_mode="median")
        t_ours = do_bench(lambda x=x, out=out: argmax(x, out=out), warmup=args.warmup, rep=args.rep,
                          return_mode="median")
        graph = graph_of(lambda x=x, out=out: argmax(x, out=out))
        t_graph = do_bench(graph.replay, warmup=args.warmup, rep=args.rep, return_mode="median")
        nbytes = m * v * x.element_size()
        row = {
            "shape": [m, v], "dtype": str(dtype).removeprefix("torch."), "bytes": nbytes,
            "torch_us": t_torch * 1e3, "torch_gbps": nbytes / (t_torch * 1e-3) / 1e9,
            "ours_us": t_ours * 1e3, "ours_gbps": nbytes / (t_ours * 1e-3) / 1e9,
            "speedup": t_torch / t_ours, "ours_graph_us": t_graph * 1e3, "equal": True,
        }
        rows.append(row)
        print(f"{str([m, v]):>14} {row['dtype']:>9} {row['torch_us']:9.2f} {row['torch_gbps']:7.0f} "
              f"{row['ours_us']:8.2f} {row['ours_gbps']:7.0f} {row['speedup']:6.2f}x {row['ours_graph_us']:8.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
