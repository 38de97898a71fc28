"""GPU timing as a server runs: a call captured in a CUDA graph, replayed with L2 flushed before every replay."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["graph_replay_us"]


def graph_replay_us(fn: Callable[[], object], *, rep: int = 150, warmup: int = 25,
                    eager_fallback: bool = False) -> tuple[float, bool]:
    """Median microseconds of ``fn`` captured in a CUDA graph and replayed with L2 flushed before every replay
    (``triton.testing.do_bench``); returns ``(us, graphed)``.

    ``fn`` runs once eagerly and once on a side stream before the capture (compiles, allocator warm-up). With
    ``eager_fallback``, a ``fn`` that cannot be captured (a baseline that syncs) is timed by eager calls
    instead and ``graphed`` is False; otherwise the capture error propagates.

    Example
    -------
    >>> us, graphed = graph_replay_us(lambda: x.add_(1))  # doctest: +SKIP
    """
    import triton

    fn()
    torch.cuda.synchronize()
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run, graphed = g.replay, True
    except Exception:
        if not eager_fallback:
            raise
        torch.cuda.synchronize()
        run, graphed = fn, False
    ms = triton.testing.do_bench(run, warmup=warmup, rep=rep, return_mode="median")
    return ms * 1e3, graphed
