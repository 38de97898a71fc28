"""The command line: --version, python -m kvcache, plan (config.json, folder, GGUF), info (linear and paged
smoke runs), plot (bench JSON -> PNG), demo dispatch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvcache import __version__, cache_block_bytes
from kvcache.bench.plot import bandwidth_bars, plot_bench, throughput_bars
from kvcache.cli import main
from kvcache.hf.plan import parse_memory

LLAMA_8B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "torch_dtype": "bfloat16"}


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvcache {__version__}"


def test_python_dash_m():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "kvcache", "--version"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"kvcache {__version__}"
    out = subprocess.run([sys.executable, "-m", "kvcache", "nonsense"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 2 and "invalid choice" in out.stderr


def _rows(path: str) -> dict:
    with open(path) as f:
        return {(r["cache"], r["kv_dtype"]): r for r in json.load(f)["rows"]}


@pytest.mark.parametrize("as_folder", [False, True])
def test_plan_config_json(tmp_path, capsys, as_folder):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B))
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", str(tmp_path if as_folder else cfg), "--memory", "80GiB", "--seq-len", "4096",
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "32 layers, 8 KV heads x head_dim 128, model dtype bfloat16" in text
    rows = _rows(str(out))
    mem = 80 * 2**30
    for kv in ("fp8", "int8", "int4", "fp8k"):
        block = cache_block_bytes(32, 8, 128, 16, torch.bfloat16, kv)
        r = rows[("paged", kv)]
        assert r["bytes_per_token"] == block / 16
        assert r["tokens"] == mem // block * 16 and r["sequences"] == mem // block // 256
    auto = rows[("paged", "auto (bfloat16)")]
    assert auto["bytes_per_token"] == 32 * 2 * 8 * 128 * 2 == 131072  # Llama-3-8B: 128 KiB per token
    assert auto["sequences"] == mem // (131072 * 4096)  # 4096 is whole blocks: as many as the linear cache
    lin = rows[("linear", "float8_e4m3fn")]
    assert lin["bytes_per_token"] == 65536 and lin["sequences"] == mem // (65536 * 4096)
    assert rows[("paged", "int4")]["sequences"] > rows[("paged", "int8")]["sequences"] > auto["sequences"]
    assert rows[("paged", "fp8k")]["bytes_per_token"] == 32 * 8 * (2 * 128 + 4)  # fp8 K / V, a float32 key scale


def test_plan_gguf_default_model(capsys):
    pytest.importorskip("gguf")
    assert main(["plan", "--memory", "1GiB", "--seq-len", "1000", "--block-size", "32"]) == 0
    text = capsys.readouterr().out
    assert "30 layers, 3 KV heads x head_dim 64" in text  # SmolLM2-135M
    per_token = 30 * 2 * 3 * 64 * 2
    assert f"{per_token:,}" in text


def test_plan_errors(tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path / "missing"), "--memory", "1GiB"]) == 2
    assert "model" in capsys.readouterr().err
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B))
    assert main(["plan", "--model", str(cfg), "--memory", "lots"]) == 2
    assert "memory" in capsys.readouterr().err
    assert main(["plan", "--model", str(cfg), "--memory", "1GiB", "--seq-len", "0"]) == 2
    assert "seq_len" in capsys.readouterr().err
    assert parse_memory("80GiB") == 80 * 2**30 and parse_memory("2.5 GB") == 2_500_000_000
    assert parse_memory("1000B") == 1000
    with pytest.raises(ValueError, match="memory"):
        parse_memory("-1GB")


def _one_line_error(capsys, *words: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcache: error: "), err
    assert "Traceback" not in err and all(w in lines[0] for w in words), err
    return lines[0]


def test_plan_memory_requires_a_unit(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B))
    assert main(["plan", "--model", str(cfg), "--memory", "80"]) == 2  # was read as 80 bytes: every row 0
    line = _one_line_error(capsys, "memory", "'80'")
    assert all(u in line for u in ("B,", "KB", "MB", "GB", "KiB", "MiB", "GiB"))
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="unit"):
        parse_memory("80")


def test_bad_input_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    missing = str(tmp_path / "missing")
    assert main(["plan", "--model", missing, "--memory", "1GiB"]) == 2
    _one_line_error(capsys, "model", missing)
    assert main(["plot", str(tmp_path / "missing.json")]) == 2
    _one_line_error(capsys, "missing.json")
    with pytest.raises(FileNotFoundError, match="model"):
        main(["--debug", "plan", "--model", missing, "--memory", "1GiB"])
    with pytest.raises(FileNotFoundError, match="model"):
        main(["plan", "--model", missing, "--memory", "1GiB", "--debug"])


def test_a_bug_keeps_its_traceback(monkeypatch):
    import kvcache.hf.plan

    def broken(*args, **kwargs):
        raise KeyError("a bug")  # not a validation error: it must not be folded into one line

    monkeypatch.setattr(kvcache.hf.plan, "parse_memory", broken)
    with pytest.raises(KeyError, match="a bug"):
        main(["plan", "--memory", "1GiB"])


@pytest.mark.parametrize("args, words", [
    (["--model", "/nonexistent/model"], ["model", "/nonexistent/model", "not found"]),
    (["--device", "cuda"], ["--device", "no CUDA device"]),
    (["--device", "gpu0"], ["--device", "gpu0"]),
    (["--dtype", "float64"], ["dtype", "float64"]),
])
def test_demo_bad_values_are_one_line(capsys, args, words):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    pytest.importorskip("transformers")
    assert main(["demo", *args, "--max-tokens", "1"]) == 2
    _one_line_error(capsys, *words)


def test_demo_refuses_a_gpt2_folder_in_one_line(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                                  eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    assert main(["demo", "--model", str(tmp_path), "--max-tokens", "1"]) == 2
    line = _one_line_error(capsys, "model", "GPT2LMHeadModel")
    assert "not implemented by the kvcache engine" in line  # kvcache.support's message


@pytest.mark.parametrize("suite", ["linear", "paged", "attention", "engine"])
def test_every_bench_without_a_gpu_exits_2_in_one_line(capsys, suite):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the bench runs")
    assert main(["bench", suite, "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs a CUDA device" in err and "Traceback" not in err


def test_help_is_plain_text_and_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and ":mod:" not in text and ":func:" not in text
    for cmd in ("demo", "plan", "eval", "info", "bench", "plot", "--debug"):
        assert cmd in text
    assert "linear | paged | attention | engine" in text
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "{linear,paged,attention,engine}" in capsys.readouterr().out


def test_info_smoke_runs_paged_half(capsys):
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    for name in ("PagedKVCache append -> gather (int4, HND)", "PagedKVCache append -> gather (int4b, NHD)",
                 "PagedKVCache.copy_blocks", "BlockAllocator",
                 "LinearKVCache.append"):
        assert f"ok    {name}" in text
    assert "FAIL" not in text and "all ops ok" in text


LINEAR_JSON = {"device": "H100", "copy_gbs": 3000.0, "shape": [32, 64, 8, 4096, 128], "rows": [
    {"case": "copy 2 x 1 GiB", "impl": "torch copy_", "eager_us": 700.0, "bytes": 2**31, "extra": {"gbs": 3000.0}},
    {"case": "save 1024 tok x 32 layers", "impl": "kvcache save", "eager_us": 60.0, "extra": {"gbs": 2400.0}},
    {"case": "save 1024 tok x 32 layers", "impl": "torch per-layer copy_ loop", "extra": {"gbs": 900.0}},
    {"case": "increment", "impl": "kvcache", "eager_us": 3.0, "extra": {}},
]}
PAGED_JSON = {"device": "H100", "date": "2026-11-24", "rows": [
    {"op": "decode append", "shape": "64 x 1", "impl": "kvcache", "role": "kvcache", "us": 5.0, "bytes": 10**7,
     "gbs": 2000.0},
    {"op": "decode append", "shape": "64 x 1", "impl": "torch index_put", "role": "baseline", "us": 20.0,
     "bytes": 10**7, "gbs": 500.0},
    {"op": "decode append", "shape": "64 x 1", "impl": "Triton copy", "role": "ceiling", "us": 4.0,
     "bytes": 10**7, "gbs": 2500.0},
], "throughput": [{"impl": "kvcache engine (fp16 KV)", "tok_s": 21000.0},
                  {"impl": "HF generate + StaticCache", "tok_s": 6876.0}]}


def test_plot_parses_both_formats():
    bars, copy = bandwidth_bars(LINEAR_JSON)
    assert copy == 3000.0
    assert bars == [
        ("copy 2 x 1 GiB | torch copy_", 3000.0, "ceiling", 3000.0),
        ("save 1024 tok x 32 layers | kvcache save", 2400.0, "kvcache", 3000.0),
        ("save 1024 tok x 32 layers | torch per-layer copy_ loop", 900.0, "baseline", 3000.0),
    ]  # rows without a bandwidth are left out
    bars, copy = bandwidth_bars(PAGED_JSON)
    assert copy is None and [b[2] for b in bars] == ["kvcache", "baseline", "ceiling"]
    assert all(b[3] == 2500.0 for b in bars)  # the same op and shape's (fastest) ceiling row
    assert throughput_bars(PAGED_JSON) == [("kvcache engine (fp16 KV)", 21000.0), ("HF generate + StaticCache", 6876.0)]
    with pytest.raises(ValueError, match="rows"):
        bandwidth_bars({"device": "x"})


@pytest.mark.parametrize("result", [LINEAR_JSON, PAGED_JSON], ids=["linear", "paged"])
def test_plot_writes_png(tmp_path, capsys, result):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(result))
    assert main(["plot", str(path)]) == 0
    png = tmp_path / "bench.png"
    assert capsys.readouterr().out.strip() == str(png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    other = tmp_path / "x.png"
    assert plot_bench(str(path), str(other)) == [str(other)] and other.exists()


def test_plot_errors(tmp_path, capsys):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"rows": [{"case": "a", "impl": "b"}]}))
    assert main(["plot", str(path)]) == 2
    _one_line_error(capsys, "no rows")
    assert main(["plot", str(tmp_path / "missing.json")]) == 2


def test_demo_dispatches_to_the_engine(capsys):
    try:
        rc = main(["demo", "--help"])  # every option after `demo` is the demo's own
    except SystemExit as e:  # argparse's --help exits
        rc = e.code
    assert rc == 0
    out = capsys.readouterr().out
    assert "usage: kvcache demo" in out and "--kv-dtype" in out
