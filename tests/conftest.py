"""Shared fixtures: every test that takes ``device`` runs once per backend.

* ``torch``: CPU tensors run the library's pure-torch path (on a CUDA machine: the compiled kernels).
* ``interpreter``: CPU tensors run the Triton kernels through Triton's interpreter
  (``KVCACHE_TRITON_INTERPRET=1``, read by the library at call time). Skipped where CUDA is available:
  there the kernels run compiled on the GPU instead.

Tests marked ``slow`` (GPU-sized) run where CUDA is available, or with ``--run-slow``.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow without a GPU too")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA or config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow (GPU-sized): runs where CUDA is available, or with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["torch", "interpreter"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "interpreter" and HAS_CUDA:
        pytest.skip("CUDA is available: the kernels run compiled on the GPU, the CPU interpreter is not used")
    monkeypatch.setenv("KVCACHE_TRITON_INTERPRET", "1" if request.param == "interpreter" else "0")
    if request.param == "torch":
        # TRITON_INTERPRET=1 in the environment would also route CPU tensors to the interpreter.
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return request.param


@pytest.fixture
def device(backend: str) -> torch.device:
    """Where test tensors live: the GPU when there is one, else the CPU (backend chosen by ``backend``)."""
    return torch.device("cuda") if HAS_CUDA else torch.device("cpu")


@pytest.fixture
def other_device(device: torch.device) -> torch.device:
    """A device different from ``device``, for device-mismatch errors (``meta`` on a CPU-only machine)."""
    return torch.device("cpu") if device.type == "cuda" else torch.device("meta")
