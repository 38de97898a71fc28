"""Every python block of docs/*.md runs as written on the CPU and gives the answer it promises."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
BLOCKS = [(path.name, block) for path in sorted(DOCS.glob("*.md"))
          for block in re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)]


def _run(name: str, block: str) -> tuple[dict, str]:
    namespace: dict = {"__name__": "docs"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(DOCS / name), "exec"), namespace)  # noqa: S102
    return namespace, out.getvalue()


def check_hf(ns: dict, printed: str) -> None:
    out, cache = ns["out"], ns["cache"]
    assert out.shape == (1, 12) and cache.get_seq_length() == 11
    assert printed.strip() == "torch.Size([1, 12]) 11"
    assert ns["lin"].get_seq_length() == 0  # allocated lazily, nothing written


def check_tiers(ns: dict, printed: str) -> None:
    assert printed.strip() == "20 160"  # 4 revisited prompts x 5 blocks of 8 tokens from the host tier
    assert {(type(e).__name__, e.medium) for e in ns["events"]} >= {("BlockStored", "host"), ("BlockRemoved", "device")}


CHECKS = {"hf.md": check_hf, "tiers.md": check_tiers}


def test_every_python_block_is_checked() -> None:
    assert BLOCKS, "docs/*.md has no python block"
    assert sorted({name for name, _ in BLOCKS}) == sorted(CHECKS), "a docs page with python blocks needs a check"


@pytest.mark.parametrize(("name", "block"), BLOCKS, ids=[name for name, _ in BLOCKS])
def test_block_runs_as_written(name: str, block: str) -> None:
    pytest.importorskip("transformers")
    ns, printed = _run(name, block)
    CHECKS[name](ns, printed)
