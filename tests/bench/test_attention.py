"""kvcache bench attention on the CPU: the FLOP formula, the bytes, the ceiling rule of the rows (the faster of
the two copies of the same kv_dtype), the prefill rows against SDPA, the JSON fields, and the exit without a GPU.
No timing: rows are built from given microseconds."""

from __future__ import annotations

import json

import pytest
import torch

import kvcache.bench.attention as ba
from kvcache.bench.attention import HQ, Result, attention_flops, kv_bytes, main, summarize, table, write_json
from kvcache.cli import main as cli_main
from kvcache.ops.paged.format import KV_FORMAT_TABLE


def _visible_pairs(q_len: int, cached: int) -> int:
    """(query, key) pairs a bottom-right causal mask lets through, counted on the mask itself."""
    return int(torch.ones(q_len, cached + q_len).tril(diagonal=cached).sum())


@pytest.mark.parametrize("batch, q_len, cached", [(1, 1, 0), (64, 1, 16383), (8, 2048, 0), (8, 2048, 4096),
                                                  (3, 5, 7)])
def test_attention_flops(batch, q_len, cached):
    flops = attention_flops(batch, q_len, cached, num_q_heads=32, head_dim=128)
    assert flops == 4 * 32 * 128 * batch * _visible_pairs(q_len, cached)
    if q_len == 1:  # decode: the full 4 * q_tokens * kv_tokens * Hq * D
        assert flops == 4 * batch * (cached + 1) * 32 * 128
    if cached == 0 and q_len > 1:  # causal: about half of the full square
        full = 4 * batch * q_len * q_len * 32 * 128
        assert flops == pytest.approx(full / 2, rel=1.0 / q_len)
    assert attention_flops(batch, q_len, cached) == 4 * HQ * ba.D * batch * _visible_pairs(q_len, cached)


def test_attention_flops_validation():
    with pytest.raises(ValueError, match="q_len: expected an int >= 1, got 0"):
        attention_flops(1, 0, 0)
    with pytest.raises(ValueError, match="cached"):
        attention_flops(1, 1, -1)


def test_kv_bytes_and_formats_from_the_table():
    assert ba.FORMATS == tuple(k for k in KV_FORMAT_TABLE if k != "int4b")
    n, h, d = 1000, ba.H, ba.D
    assert kv_bytes(n, "auto") == 2 * n * h * d * 2
    assert kv_bytes(n, "fp8") == 2 * n * h * d
    assert kv_bytes(n, "int8") == 2 * n * h * (d + 8)  # codes + float32 (scale, zero)
    assert kv_bytes(n, "int4") == 2 * n * h * (d // 2 + 8)


def _decode_rows() -> list[Result]:
    s, nb = "64 x 16k", 4_000_000_000
    return [
        Result("decode", s, 16, "kvcache auto", "kvcache", "auto", 1000.0, nb),
        Result("decode", s, 16, "kvcache int4", "kvcache", "int4", 400.0, nb // 4),
        Result("decode", s, 16, "copy contiguous", "ceiling", "auto", 2000.0, 2 * nb),  # 4000 GB/s
        Result("decode", s, 16, "copy same blocks", "ceiling", "auto", 2500.0, 2 * nb),  # 3200 GB/s
        Result("decode", s, 16, "copy contiguous", "ceiling", "int4", 1250.0, nb // 2),  # 1600 GB/s
        Result("decode", s, 16, "copy same blocks", "ceiling", "int4", 1000.0, nb // 2),  # 2000 GB/s
        Result("decode", s, 16, "sdpa contiguous", "baseline", "auto", 2000.0, nb),
        Result("decode", s, 64, "kvcache auto", "kvcache", "auto", 1000.0, nb),  # no copies at block 64
    ]


def _prefill_rows() -> list[Result]:
    s = "8 x 2048 new, 0 cached"
    f = attention_flops(8, 2048, 0)
    return [Result("prefill", s, 16, "kvcache auto", "kvcache", "auto", 200.0, 10**9, f),
            Result("prefill", s, 16, "kvcache fp8", "kvcache", "fp8", 250.0, 10**9, f),
            Result("prefill", s, 16, "torch gather + sdpa", "baseline", "auto", 400.0, 10**9, f),
            Result("prefill", s, 16, "sdpa contiguous", "baseline", "auto", 180.0, 10**9, f)]


def test_decode_rows_against_the_faster_copy_of_their_kv_dtype():
    rows = {(r["block_size"], r["impl"], r["kv_dtype"]): r for r in summarize(_decode_rows())}
    auto = rows[(16, "kvcache auto", "auto")]
    assert auto["gbs"] == pytest.approx(4000.0)
    assert auto["ceiling_gbs"] == pytest.approx(4000.0)  # max(contiguous 4000, same blocks 3200)
    assert auto["pct_ceiling"] == pytest.approx(100.0)
    int4 = rows[(16, "kvcache int4", "int4")]
    assert int4["ceiling_gbs"] == pytest.approx(2000.0)  # its own bytes: max(1600, 2000), not the fp16 copies
    assert int4["pct_ceiling"] == pytest.approx(125.0)
    assert int4["x_auto"] == pytest.approx(2.5)
    assert rows[(16, "sdpa contiguous", "auto")]["pct_ceiling"] == pytest.approx(50.0)
    assert rows[(16, "copy same blocks", "auto")]["pct_ceiling"] == pytest.approx(80.0)
    assert rows[(64, "kvcache auto", "auto")]["ceiling_gbs"] is None  # no ceiling of another block size
    assert all(r["sdpa_tflops"] is None and r["pct_sdpa"] is None for r in rows.values())


def test_prefill_rows_against_sdpa():
    rows = {r["impl"]: r for r in summarize(_prefill_rows())}
    flops = attention_flops(8, 2048, 0)
    assert rows["kvcache auto"]["tflops"] == pytest.approx(flops / 200e-6 / 1e12)
    assert rows["kvcache auto"]["sdpa_tflops"] == pytest.approx(flops / 180e-6 / 1e12)
    assert rows["kvcache auto"]["pct_sdpa"] == pytest.approx(90.0)
    assert rows["torch gather + sdpa"]["pct_sdpa"] == pytest.approx(45.0)
    assert rows["sdpa contiguous"]["pct_sdpa"] == pytest.approx(100.0)
    assert all(r["ceiling_gbs"] is None and r["pct_ceiling"] is None for r in rows.values())
    text = table(summarize(_prefill_rows() + _decode_rows()))
    line = next(x for x in text.splitlines() if "| prefill |" in x and "kvcache fp8" in x)
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[5] == "" and cells[7] == f"{flops / 250e-6 / 1e12:.0f}" and cells[8] == "72"  # no GB/s
    line = next(x for x in text.splitlines() if "| decode |" in x and "kvcache int4" in x)
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[5] == "2500" and cells[6] == "125" and cells[7] == ""  # GB/s and % ceiling, no TFLOP/s


def test_json_fields(tmp_path):
    path = tmp_path / "attention.json"
    write_json(str(path), _decode_rows() + _prefill_rows(), device="H200", date="2026-11-28 12:00 UTC", quick=False)
    data = json.loads(path.read_text())
    assert {k: data[k] for k in ("command", "suite", "device", "date", "quick")} == {
        "command": "kvcache bench attention", "suite": "attention", "device": "H200",
        "date": "2026-11-28 12:00 UTC", "quick": False}
    assert len(data["rows"]) == 12
    for row in data["rows"]:
        assert {"op", "shape", "block_size", "impl", "role", "kv_dtype", "us", "bytes", "flops", "gbs", "tflops",
                "ceiling_gbs", "pct_ceiling", "sdpa_tflops", "pct_sdpa", "x_auto", "max_err", "graph"} <= set(row)


def test_without_a_gpu_exits_2_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([]) == 2
    out = capsys.readouterr().out
    assert out == "kvcache bench attention: needs a CUDA device\n"
    assert cli_main(["bench", "attention", "--json", "unused.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the CLI checks first, in its one-line error form
    assert len(err) == 1 and err[0].startswith("kvcache: error: bench attention: needs a CUDA device")
    with pytest.raises(SystemExit) as e:
        main(["--formats", "auto,fp16"])
    assert e.value.code == 2 and "--formats" in capsys.readouterr().err
