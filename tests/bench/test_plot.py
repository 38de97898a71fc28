"""kvcache.bench.plot: one figure per case family of the attention bench, each of a readable size, beside the
JSON; the bandwidth figure of the other benches stays within the same size however many rows it has."""

from __future__ import annotations

import json
import struct

import pytest

pytest.importorskip("matplotlib")

from kvcache.bench.attention import Result, attention_flops, write_json  # noqa: E402
from kvcache.bench.plot import MAX_INCHES, attention_groups, plot_bench  # noqa: E402
from kvcache.cli import main  # noqa: E402

LIMIT_PX = 1600


def _png_size(path) -> tuple[int, int]:
    data = open(path, "rb").read(24)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def _full_run() -> list[Result]:
    """The rows of a full attention run (4 decode and 2 prefill shapes x blocks 16 and 64, 4 kv_dtypes)."""
    rows = []
    for bs in (16, 64):
        for shape in ("64 x 1k", "64 x 4k", "64 x 16k", "1 x 128k"):
            for i, fmt in enumerate(("auto", "fp8", "int8", "int4")):
                rows.append(Result("decode", shape, bs, f"kvcache {fmt}", "kvcache", fmt, 100.0 + i, 4 * 10**8))
                rows.append(Result("decode", shape, bs, "copy contiguous", "ceiling", fmt, 190.0, 8 * 10**8))
                rows.append(Result("decode", shape, bs, "copy same blocks", "ceiling", fmt, 200.0, 8 * 10**8))
            rows.append(Result("decode", shape, bs, "torch gather + sdpa", "baseline", "auto", 400.0, 4 * 10**8))
            rows.append(Result("decode", shape, bs, "sdpa contiguous", "baseline", "auto", 150.0, 4 * 10**8))
        for cached in (0, 4096):
            shape, f = f"8 x 2048 new, {cached} cached", attention_flops(8, 2048, cached)
            for i, fmt in enumerate(("auto", "fp8", "int8", "int4")):
                rows.append(Result("prefill", shape, bs, f"kvcache {fmt}", "kvcache", fmt, 300.0 + 10 * i, 1, f))
            rows.append(Result("prefill", shape, bs, "torch gather + sdpa", "baseline", "auto", 500.0, 1, f))
            rows.append(Result("prefill", shape, bs, "sdpa contiguous", "baseline", "auto", 280.0, 1, f))
    return rows


def test_attention_one_figure_per_family_beside_the_json(tmp_path, capsys):
    path = tmp_path / "attention.json"
    write_json(str(path), _full_run(), device="NVIDIA H200", date="2026-11-28 12:00 UTC", quick=False)
    pngs = plot_bench(str(path))
    assert pngs == [str(tmp_path / "attention.decode.png"), str(tmp_path / "attention.prefill.png")]
    for png in pngs:
        w, h = _png_size(png)
        assert 600 <= w <= LIMIT_PX and 600 <= h <= LIMIT_PX, (png, w, h)
    assert main(["plot", str(path), "--png", str(tmp_path / "other.png")]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "other.decode.png"), str(tmp_path / "other.prefill.png")]
    decode_only = tmp_path / "decode.json"
    write_json(str(decode_only), [r for r in _full_run() if r.op == "decode"], device="x", date="d", quick=True)
    assert plot_bench(str(decode_only)) == [str(tmp_path / "decode.decode.png")]


def test_attention_groups_bars():
    path_rows = {"suite": "attention", "rows": []}
    from kvcache.bench.attention import summarize

    path_rows["rows"] = summarize(_full_run())
    groups = attention_groups(path_rows)
    assert sorted(groups) == ["decode", "prefill"]
    decode = dict(groups["decode"])
    assert len(decode) == 8 and len(dict(groups["prefill"])) == 4  # (shape, block) cases
    bars = decode["64 x 16k, block 16"]
    assert sorted(bars) == ["kvcache auto", "kvcache fp8", "kvcache int4", "kvcache int8", "sdpa contiguous",
                            "torch gather + sdpa"]  # copies are the ceiling, not bars
    gbs, pct, ceiling = bars["kvcache auto"]
    assert gbs == pytest.approx(4000.0) and ceiling == pytest.approx(8 * 10**8 / 190e3)
    assert pct == pytest.approx(100 * gbs / ceiling)
    tflops, pct_sdpa, _ = dict(groups["prefill"])["8 x 2048 new, 0 cached, block 64"]["kvcache auto"]
    assert pct_sdpa == pytest.approx(100 * 280.0 / 300.0)
    assert tflops == pytest.approx(attention_flops(8, 2048, 0) / 300e-6 / 1e12)


def test_bandwidth_figure_stays_readable_with_many_rows(tmp_path):
    rows = [{"op": "gather", "shape": f"shape {i}", "impl": f"impl {i}", "role": "kvcache", "us": 1.0,
             "gbs": 1000.0 + i} for i in range(120)]
    path = tmp_path / "paged.json"
    path.write_text(json.dumps({"device": "H200", "rows": rows}))
    (png,) = plot_bench(str(path))
    w, h = _png_size(png)
    assert h <= MAX_INCHES * 100 + 50 and w <= LIMIT_PX


def test_attention_without_figures(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"suite": "attention", "rows": [{"op": "decode", "role": "ceiling", "gbs": 1.0}]}))
    with pytest.raises(ValueError, match="no decode or prefill rows"):
        plot_bench(str(path))
