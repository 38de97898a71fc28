"""kvcache bench paged on the CPU: each op and shape's ceiling is the faster of its two copies (no timing)."""

from __future__ import annotations

import pytest

from kvcache.bench.paged import Result, ceilings, table


def test_ceiling_is_the_faster_copy_of_each_op_and_shape():
    rows = [Result("gather", "64 x 2048", "kvcache auto", "kvcache", 100.0, 300_000_000),  # 3000 GB/s
            Result("gather", "64 x 2048", "copy of blocks 0 .. n-1", "ceiling", 100.0, 400_000_000),  # 4000
            Result("gather", "64 x 2048", "copy of the same blocks", "ceiling", 125.0, 400_000_000),  # 3200
            Result("decode append", "256 x 1", "kvcache int4", "kvcache", 2.0, 1_000_000),  # 500
            Result("decode append", "256 x 1", "Triton copy of the rows to consecutive slots", "ceiling", 4.0,
                   2_000_000),  # 500
            Result("decode append", "256 x 1", "Triton copy of the rows to the same slots", "ceiling", 2.5,
                   2_000_000)]  # 800
    assert ceilings(rows) == {("gather", "64 x 2048"): pytest.approx(4000.0),
                              ("decode append", "256 x 1"): pytest.approx(800.0)}
    pct = {line.split("|")[3].strip(): line.split("|")[6].strip() for line in table(rows, "H200", "d").splitlines()[2:]}
    assert pct["kvcache auto"] == "75.0" and pct["copy of the same blocks"] == "80.0"
    assert pct["kvcache int4"] == "62.5" and pct["Triton copy of the rows to consecutive slots"] == "62.5"
