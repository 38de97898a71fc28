"""Programmatic dependent launch (Hopper and later) for the small elementwise kernels: the launch options and the
wait / release every such kernel runs first."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import pdl_enabled
from .paged.launch import pdl_supported

try:  # triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None


def pdl_options(device: torch.device) -> dict[str, bool]:
    """Launch options of a kernel that calls :func:`pdl_enter` first: launched as a programmatic dependent where
    the device has it (``KVCACHE_PDL`` not 0), so its launch overlaps the previous kernel's tail."""
    on = pdl_enabled() and pdl_supported(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        gdc_wait()  # what the previous kernel wrote is visible after this
        gdc_launch_dependents()  # the next kernel may be scheduled; it waits for this grid to finish
