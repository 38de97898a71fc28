"""``kvcache eval`` from the command line: a saved small model end to end (table, JSON, plot) and bad
arguments refused with one line and exit code 2 before any model is loaded."""

from __future__ import annotations

import json
import os

import pytest

from kvcache.cli import main

from .conftest import PROMPTS


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, tiny_llama, char_tokenizer) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama.save_pretrained(folder)
    char_tokenizer.save_pretrained(folder)
    return str(folder)


def test_end_to_end(model_folder, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:3]) + "\n\n")
    out_json, out_png = tmp_path / "eval.json", tmp_path / "eval.png"
    rc = main(["eval", "--model", model_folder, "--text", "as-you-like-it", "--kv-dtype", "auto,int4",
               "--kv-dtype", "int8", "--max-tokens", "120", "--window", "64", "--chunk", "16", "--max-new-tokens", "8",
               "--prompts", str(prompts), "--json", str(out_json), "--plot", str(out_png)])
    shown = capsys.readouterr().out
    assert rc == 0
    d = json.loads(out_json.read_text())
    assert [f["kv_dtype"] for f in d["formats"]] == ["auto", "int4", "int8"]
    assert d["text"] == "as-you-like-it" and d["scored_tokens"] == 120 and d["prompts"] == 3
    assert d["model"] == os.path.basename(model_folder) and d["window"] == 64 and d["chunk"] == 16
    assert d["formats"][0]["greedy_identical"] == 3
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "int4" in shown and "3/3" in shown  # the table: auto's greedy answers all identical


@pytest.mark.parametrize("args, message", [
    (["--kv-dtype", "int8,int3"], "kv_dtypes: expected names from"),
    (["--max-tokens", "lots"], "max_tokens: expected an int or 'all', got 'lots'"),
    (["--chunk", "0"], "chunk: expected an int >= 1, got 0"),
    (["--text", "no-such-text"], "text: expected one of"),
    (["--prompts", "/no/such/file"], "No such file"),
])
def test_bad_arguments(args, message, capsys) -> None:
    assert main(["eval", "--model", "/no/such/model", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvcache: error: eval: ") and message in err[0]


def test_missing_model(capsys) -> None:
    assert main(["eval", "--model", "/no/such/model"]) == 2
    assert "model: expected a local model folder or .gguf file" in capsys.readouterr().err
