"""The append kernel's branch-free cos / sin (``_sincos`` in kvcache/ops/paged/kernels/numerics.py) against
float64, over its whole range: compiled on the GPU, through Triton's interpreter on the CPU."""

from __future__ import annotations

import math

import pytest
import torch
import triton.language as tl

from kvcache._backend import kernel, use_triton
from kvcache.ops.paged.kernels.numerics import _SINCOS_MAX, _sincos

from . import paged_reference as pr


@kernel(ints=("n",))
def _sincos_probe(x, cos_out, sin_out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    c, s = _sincos(tl.load(x + offs, mask=m, other=0.0))
    tl.store(cos_out + offs, c, mask=m)
    tl.store(sin_out + offs, s, mask=m)


def _angles(gen: torch.Generator) -> torch.Tensor:
    """float32 angles in [-1e5, 1e5]: random at every scale, RoPE's own (positions x default frequencies), and the
    float32 neighbours of multiples of pi / 4 (quadrant edges and the polynomial's interval ends)."""
    scales = torch.logspace(-6, 5, 4000, dtype=torch.float64)
    rand = torch.rand(4000, generator=gen, dtype=torch.float64) * scales
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    pos = torch.randint(0, 100000, (64,), generator=gen).double()
    rope = (pos[:, None].float() * inv_freq[None, :].float()).double().flatten()
    k = torch.arange(0, int(1e5 / (math.pi / 4)), 997, dtype=torch.float64)
    edges = (k * math.pi / 4).float()
    near = torch.cat([torch.nextafter(edges, edges + 1), edges, torch.nextafter(edges, edges - 1)]).double()
    x = torch.cat([rand, rope, near, torch.tensor([0.0, 1e-30, 1e5], dtype=torch.float64)]).float()
    x = x[(x >= 0) & (x <= _SINCOS_MAX.value)]
    return torch.cat([x, -x])  # negative angles too (slot mapping takes negative positions)


def test_sincos_matches_float64_within_2_pow_minus_22(device):
    if device.type == "cpu" and not use_triton(device):
        pytest.skip("the torch backend launches no kernel")
    x = _angles(pr.generator(77)).to(device)
    n = x.numel()
    c = torch.full_like(x, float("nan"))
    s = torch.full_like(x, float("nan"))
    _sincos_probe.launch(device, (triton_cdiv(n, 256),), x, c, s, n, BLOCK=256)
    xd = x.double().cpu()
    err_c = (c.double().cpu() - torch.cos(xd)).abs()
    err_s = (s.double().cpu() - torch.sin(xd)).abs()
    worst = max(err_c.max().item(), err_s.max().item())
    assert worst <= 2.0**-22, f"worst |error| {worst:.3g} at x = {xd[torch.argmax(torch.maximum(err_c, err_s))]:.9g}"


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
