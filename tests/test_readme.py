"""The README's quick start runs as written (on the CPU here, on the GPU where there is one)."""

from __future__ import annotations

import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_quick_start_runs() -> None:
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python block"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)  # noqa: S102
    cache = namespace["cache"]
    assert cache.active_batch_size == 2
    assert cache.lengths.tolist() == [240, 257]
    assert torch.equal(namespace["host_copy"].layers[0], namespace["prompt"].layers[0].cpu())
