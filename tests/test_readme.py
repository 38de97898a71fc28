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


def test_readme_paged_quick_start_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2, "README has no paged example"
    namespace: dict = {}
    exec(compile(blocks[1], str(README), "exec"), namespace)  # noqa: S102
    keys, values = namespace["keys"], namespace["values"]
    assert keys.shape == (2, 8, 40, 128)
    # values were stored as int8 per (token, head): within half a quantization step of the input
    v = namespace["v"]
    err = (values[0].transpose(0, 1).float() - v[:40].float()).abs()
    step = (v[:40].float().amax(-1) - v[:40].float().amin(-1)) / 255
    assert bool((err <= step[..., None] / 2 + 1e-2).all())
    assert bool((values[1, :, 7:] == 0).all())  # padded tail
    out = namespace["out"]  # the decode step's attention over the blocks, read in place
    assert out.shape == (2, 32, 128) and bool(torch.isfinite(out).all())
