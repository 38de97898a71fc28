"""``python -m kvcache.bench.engine``'s arguments are checked before it looks for a GPU: a bad kv_dtype or admission
policy is one usage error (exit 2), good ones without a GPU one line on stderr (exit 2)."""

from __future__ import annotations

import pytest
import torch

from kvcache.bench.engine import main


@pytest.mark.parametrize("args, name", [
    (["--capacity", "--kv-dtypes", "auto,fp16"], "--kv-dtypes"),
    (["--capacity", "--decode-reserves", "default,2"], "--decode-reserves"),
    (["--capacity", "--decode-reserves", "learned"], "--decode-reserves"),
])
def test_bad_arguments_are_one_usage_error(args, name, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and name in capsys.readouterr().err


def test_good_arguments_without_a_gpu_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--capacity", "--decode-reserves", "default,0,0.5"]) == 2
    assert capsys.readouterr().err == "kvcache.bench.engine: needs a CUDA device\n"
