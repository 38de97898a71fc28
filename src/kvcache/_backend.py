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

The library's environment is read here only: the two variables above, ``KVCACHE_PDL`` and ``XDG_CACHE_HOME``
(:func:`user_cache_dir`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton
from triton.runtime.jit import JITFunction

INTERPRET_ENV = "KVCACHE_TRITON_INTERPRET"
PDL_ENV = "KVCACHE_PDL"
# KVCACHE_PDL=0 turns programmatic dependent launch off (read once, at import: launches are planned from it)
_PDL_ON = os.environ.get(PDL_ENV, "1") != "0"


def pdl_enabled() -> bool:
    """False when ``KVCACHE_PDL=0`` was set at import: no kernel is launched with programmatic dependent
    launch (kernels that support it use it on compute capability >= 9.0 otherwise)."""
    return _PDL_ON


_forced_interpreter = 0  # > 0 inside force_interpreter()


def interpret_requested() -> bool:
    """True when CPU tensors should run the Triton kernels through Triton's interpreter."""
    return (_forced_interpreter > 0 or os.environ.get(INTERPRET_ENV, "0") == "1"
            or os.environ.get("TRITON_INTERPRET", "0") == "1")


@contextlib.contextmanager
def force_interpreter() -> Iterator[None]:
    """Inside the block, CPU tensors run the Triton kernels through Triton's interpreter, as with
    ``KVCACHE_TRITON_INTERPRET=1`` (``kvcache info`` smoke-tests both CPU paths with it)."""
    global _forced_interpreter
    _forced_interpreter += 1
    try:
        yield
    finally:
        _forced_interpreter -= 1


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

    Use as a decorator in place of ``@triton.jit``: ``@kernel(ints=("n", ...))`` where ``ints`` names the
    integer parameters. Launch with ``kernel.launch(device, grid, *runtime_args, **constexprs)``; runtime
    arguments come first in the signature, ``tl.constexpr`` parameters last.

    Launch path on CUDA. ``JITFunction.run`` re-binds and re-keys every argument on every call (tens of
    microseconds in triton 3.6). Here integer parameters are not value-specialised (``do_not_specialize``;
    the kernels take strides in units of a constexpr vector width, or state divisibility with
    ``tl.multiple_of``, to keep vector loads and stores), so a compiled kernel depends only on
    the pointer dtypes, the 16-byte alignment of each pointer, whether each int fits in 32 bits, and the
    constexpr values. That key is computed here; the first launch of a key goes through ``JITFunction.run``
    (compiling if needed) and later launches call the compiled kernel's launcher directly. Launch hooks
    (profilers) disable the direct path; where triton exposes it, the direct path calls the launcher's C entry
    point (see :func:`_c_launch`), else its launcher object. ``launch`` returns the
    :class:`PreparedLaunch` of the key, for callers that relaunch it with raw pointers.
    """

    def __init__(self, fn: Callable[..., Any], ints: tuple[str, ...] = ()) -> None:
        self.fn = fn
        params = list(inspect.signature(fn).parameters.values())
        is_const = ["constexpr" in str(p.annotation) for p in params]
        n_rt = is_const.index(True) if True in is_const else len(params)
        if any(is_const[:n_rt]) or not all(is_const[n_rt:]):
            raise TypeError(f"{fn.__name__}: constexpr parameters must come last")
        names = [p.name for p in params]
        unknown = set(ints) - set(names[:n_rt])
        if unknown:
            raise TypeError(f"{fn.__name__}: ints {sorted(unknown)} are not runtime parameters")
        self._const_names = tuple(names[n_rt:])
        self._ptr_pos = tuple(i for i in range(n_rt) if names[i] not in ints)
        self._int_pos = tuple(i for i in range(n_rt) if names[i] in ints)
        self.compiled = triton.jit(fn, do_not_specialize=list(ints))
        self._fast: dict[tuple, tuple] = {}
        self._allow_fast = True  # False once triton lacks the attributes of the direct path
        functools.update_wrapper(self, fn)

    def launch(
        self, device: torch.device, grid: tuple[int, ...], *args: Any, **constexprs: Any
    ) -> PreparedLaunch | None:
        """Launch on ``grid``. On CUDA, returns the :class:`PreparedLaunch` of this specialisation (None on the
        interpreter, or where triton lacks the direct path)."""
        if device.type != "cuda":
            with _interpreting():
                _interpreted(self.fn)[grid](*args, **constexprs)
            return None
        index = device.index if device.index is not None else _current_device()
        key = (
            index,
            tuple([(args[i].dtype, args[i].data_ptr() & 15 == 0) for i in self._ptr_pos]),
            tuple([-2147483648 <= args[i] <= 2147483647 for i in self._int_pos]),
            tuple(constexprs.items()),
        )
        entry = self._fast.get(key)
        switch = _current_device() != index
        if entry is None or not self._allow_fast or _hooks_active():
            with torch.cuda.device(index) if switch else contextlib.nullcontext():
                compiled = self.compiled.run(*args, grid=grid, warmup=False, **constexprs)
            if entry is None and compiled is not None and self._allow_fast:
                try:
                    consts = tuple(constexprs[n] for n in self._const_names)
                    entry = _prepare(compiled.run, compiled.function, compiled.packed_metadata, consts)
                    self._fast[key] = entry
                except Exception:  # a triton without these attributes: stay on the slow path
                    self._allow_fast = False
            return entry
        gx = grid[0]
        gy = grid[1] if len(grid) > 1 else 1
        gz = grid[2] if len(grid) > 2 else 1
        if switch:
            with torch.cuda.device(index):
                entry.run(gx, gy, gz, _current_stream(index), *entry.head, *args, *entry.consts)
        else:
            entry.run(gx, gy, gz, _current_stream(index), *entry.head, *args, *entry.consts)
        return entry


class PreparedLaunch:
    """One compiled specialisation of a :class:`Kernel`, launched directly through triton's launcher.

    Valid for arguments of the same kind as those it was compiled for: the same dtypes, 16-byte alignment of
    every pointer, int arguments in the same 32/64-bit range, the same constexprs. Pointers may be passed as
    ``data_ptr()`` ints (the launcher then skips its per-tensor lookups). The caller checks all of that;
    nothing is checked here. Launch, on the device it was compiled for:
    ``run(gx, gy, gz, stream, *head, *args, *consts)``.

    ``run`` is triton's launcher object, or, where :func:`_c_launch` recognises the launcher (triton 3.6), the
    C function it forwards to; ``head`` holds the arguments between the stream and the kernel's own for that
    callee. ``direct`` says which.
    """

    __slots__ = ("run", "head", "consts", "direct")

    def __init__(self, run: Any, head: tuple, consts: tuple, direct: bool) -> None:
        self.run = run
        self.head = head
        self.consts = consts
        self.direct = direct


def _c_launch(launcher: Any) -> tuple[Any, tuple] | None:
    """(C launch function, its fixed flags) behind triton 3.6's ``CudaLauncher``, or None.

    That launcher's ``__call__`` allocates the global and profile scratch buffers a kernel asks for (ours ask
    for none) and forwards ``(grid, stream, function, cooperative-grid flag, PDL flag, global scratch, profile
    scratch, *args)`` to ``launch``, its compiled C module's entry point. Calling that entry point directly saves
    the Python frame and the scratch logic (about 1 us per launch on a slow host). Other triton versions lay
    their launchers out differently: None, and launches go through ``__call__``.
    """
    if not triton.__version__.startswith("3.6."):
        return None
    launch = getattr(launcher, "launch", None)
    coop = getattr(launcher, "launch_cooperative_grid", None)
    pdl = getattr(launcher, "launch_pdl", None)
    if (not callable(launch) or coop is None or pdl is None or getattr(launcher, "global_scratch_size", 1) != 0
            or getattr(launcher, "profile_scratch_size", 1) != 0):
        return None
    return launch, (coop, pdl, None, None)


def _prepare(launcher: Any, function: Any, packed: Any, consts: tuple) -> PreparedLaunch:
    c = _c_launch(launcher)
    if c is not None:
        launch, flags = c
        # C entry point: function, cooperative, PDL, global scratch, profile scratch, then what __call__ forwards
        return PreparedLaunch(launch, (function, *flags, packed, None, None, None), consts, True)
    return PreparedLaunch(launcher, (function, packed, None, None, None), consts, False)


def _hooks_active() -> bool:
    """True when a launch hook is installed (a profiler): such launches take triton's own path."""
    rt = triton.knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is None:
            continue
        calls = getattr(hook, "calls", None)  # triton >= 3.5: a HookChain, empty when no hook is installed
        if calls is None or calls:
            return True
    return False


try:  # the C entry points torch.cuda and triton use (a fraction of a microsecond each)
    from torch._C import _cuda_getCurrentRawStream as _current_stream
    from torch._C import _cuda_getDevice as _current_device
except ImportError:  # pragma: no cover

    def _current_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream

    def _current_device() -> int:
        return torch.cuda.current_device()


def kernel(fn: Callable[..., Any] | None = None, *, ints: tuple[str, ...] = ()) -> Any:
    """Decorator: ``@kernel`` or ``@kernel(ints=("n", ...))`` makes a :class:`Kernel`."""
    if fn is None:
        return lambda f: Kernel(f, ints=ints)
    return Kernel(fn, ints=ints)


def user_cache_dir() -> str:
    """Where kvcache keeps what it can rebuild (a GGUF file's conversion): ``$XDG_CACHE_HOME/kvcache``, or
    ``~/.cache/kvcache`` where the variable is unset or empty. Read per call; nothing is created."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "kvcache")
