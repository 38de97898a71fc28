"""``benchmarks/admission_replay.py``: the capacity workload replayed through the scheduler alone, a small case: the
default admission preempts nothing and runs the requests in waves of what the pool holds; ``decode_reserve=0``
packs more rows a step and preempts."""

from __future__ import annotations

import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "admission_replay.py"


def _module():
    spec = importlib.util.spec_from_file_location("admission_replay", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_replay_of_a_small_workload(capsys):
    mod = _module()
    kv_bytes = 2**29  # 512 MiB of bf16 KV at 128 KiB a token: 4,096 tokens, 4 requests of 1,024 at once
    default = mod.replay("auto", None, requests=12, kv_bytes=kv_bytes)
    eager = mod.replay("auto", 0.0, requests=12, kv_bytes=kv_bytes)
    assert default["num_blocks"] == 256 and default["preemptions"] == 0
    assert 3 * 512 <= default["steps"] <= 3 * 512 + 2  # 3 waves of 4 requests (a wave may start a step late)
    assert default["prompt_tokens_fed"] == 12 * 512
    assert eager["preemptions"] > 0 and eager["steps"] < default["steps"]
    assert eager["prompt_tokens_fed"] > default["prompt_tokens_fed"]  # the preempted requests' recompute
    assert mod.estimate_s(default, default) == 0
    args = ["--kv-dtypes", "auto", "--decode-reserves", "default,0", "--requests", "12", "--kv-gib", "0.5"]
    assert mod.main(args) == 0
    assert "| auto | 0.0 | 256 |" in capsys.readouterr().out
