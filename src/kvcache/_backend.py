"""Execution backends: compiled Triton on CUDA, pure torch or Triton's interpreter on the CPU.

Every op in :mod:`kvcache.ops` has a Triton kernel and a pure-torch reference of the same function.
Which one runs is decided per call by the device of the tensors:

* CUDA tensors: the compiled Triton kernel.
* CPU tensors: the pure-torch reference, unless ``KVCACHE_TRITON_INTERPRET=1`` (read at call time) or
  ``TRITON_INTERPRET=1`` (read by Triton at import) is set; then the Triton kernel itself runs on the
  CPU through Triton's interpreter. The test suite uses this to run the GPU code without a GPU.

The interpreter is used in-process next to the compiled path: :class:`Kernel` keeps both forms of a
kernel, and while a kernel is interpreted, ``@triton.jit`` helpers that it calls (``tl.sum``,
``tl.cumsum``, ...) are routed through the interpreter as well.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton
from triton.runtime.jit import JITFunction

INTERPRET_ENV = "KVCACHE_TRITON_INTERPRET"


def interpret_requested() -> bool:
    """True when CPU tensors should run the Triton kernels through Triton's interpreter."""
    return os.environ.get(INTERPRET_ENV, "0") == "1" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(device: torch.device) -> bool:
    """True when ops on tensors of ``device`` run a Triton kernel (compiled or interpreted)."""
    return device.type == "cuda" or (device.type == "cpu" and interpret_requested())


def backend_name(device: torch.device) -> str:
    """Name of the backend used for tensors on ``device``: ``triton``, ``triton-interpreter`` or ``torch``."""
    if device.type == "cuda":
        return "triton"
    return "triton-interpreter" if use_triton(device) else "torch"


@functools.cache
def _interpreted(fn: Callable[..., Any]) -> Any:
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


_interp_lock = threading.Lock()


@contextlib.contextmanager
def _interpreting() -> Iterator[None]:
    """Route calls of ``@triton.jit`` helper functions through the interpreter while it runs."""
    with _interp_lock:
        original = JITFunction.__call__
        JITFunction.__call__ = lambda self, *a, **k: _interpreted(self.fn)(*a, **k)  # type: ignore[method-assign]
        try:
            yield
        finally:
            JITFunction.__call__ = original  # type: ignore[method-assign]


class Kernel:
    """A Triton kernel in both forms: compiled (CUDA) and interpreted (CPU).

    Use as a decorator in place of ``@triton.jit``; launch with ``kernel.launch(device, grid, *args, **kw)``.
    """

    def __init__(self, fn: Callable[..., Any], **jit_kwargs: Any) -> None:
        self.fn = fn
        self.compiled = triton.jit(fn, **jit_kwargs)
        functools.update_wrapper(self, fn)

    def launch(self, device: torch.device, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if device.type == "cuda":
            index = device.index
            if index is None or index == torch.cuda.current_device():
                self.compiled[grid](*args, **kwargs)
            else:
                with torch.cuda.device(index):
                    self.compiled[grid](*args, **kwargs)
        else:
            with _interpreting():
                _interpreted(self.fn)[grid](*args, **kwargs)


def kernel(fn: Callable[..., Any] | None = None, **jit_kwargs: Any) -> Any:
    """Decorator: ``@kernel`` or ``@kernel(do_not_specialize=[...])`` makes a :class:`Kernel`."""
    if fn is None:
        return lambda f: Kernel(f, **jit_kwargs)
    return Kernel(fn, **jit_kwargs)
