"""``benchmarks/hybrid_capacity.py --quick``: the window-groups capacity benchmark runs through its ``main`` on a tiny
float32 Gemma-3-shaped model (the H200 figures come from the full run) and its window-groups variant fits more
sequences in the same KV budget than the same model with every layer global."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "hybrid_capacity.py"


def test_quick_run_fits_more_sequences_with_window_groups(capsys):
    spec = importlib.util.spec_from_file_location("hybrid_capacity", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    try:
        assert mod.main(["--quick"]) == 0
    finally:  # the script sets the process's threads and seed: later tests of this worker keep theirs
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
    out = capsys.readouterr().out
    row = r"\| (window groups|every layer global) \| (\d+) \| (\d+) \|"  # variant, fits, peak running
    rows = {m[0]: (int(m[1]), int(m[2])) for m in re.findall(row, out)}
    # 56-token requests in blocks of 4: 14 blocks of each global layer, at most 5 of each window layer
    assert rows["window groups"][0] > rows["every layer global"][0] > 0
    assert "sliding window 16: 5 layers" in out
