"""Worlds of 2 and 3 ranks: gloo on the CPU (CI), NCCL where there are that many CUDA devices (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from .world import World, Worlds

_GPUS = torch.cuda.device_count()


def world_params(*sizes: int) -> list:
    """``pytest.param((backend, size))`` for gloo and NCCL worlds of each size (NCCL skipped without the GPUs)."""
    out = [pytest.param(("gloo", s), id=f"gloo{s}") for s in sizes]
    out += [pytest.param(("nccl", s), id=f"nccl{s}", marks=[pytest.mark.gpu, pytest.mark.skipif(
        _GPUS < s, reason=f"NCCL world of {s} needs {s} CUDA devices, found {_GPUS}")]) for s in sizes]
    return out


@pytest.fixture(scope="session")
def worlds():  # type: ignore[no-untyped-def]
    w = Worlds()
    yield w
    w.close()


@pytest.fixture
def world(request: pytest.FixtureRequest, worlds: Worlds) -> World:
    backend, size = request.param
    return worlds.get(backend, size)
