"""Fused elementwise ops of a Llama-family decoder, what :mod:`kvcache.engine` runs around the cache: RMSNorm
with its residual add, SiLU-and-multiply, query RoPE, the greedy pick over logits (``kvcache.engine.kernels.rms_norm``
etc.).

Each is one Triton kernel on CUDA (or under the interpreter, ``KVCACHE_TRITON_INTERPRET=1``) and the same
formula in torch elsewhere. The kernels keep transformers' roundings where they are observable: the residual
sum and the normalized row are rounded to the model dtype before the weight multiplies them, SiLU's output is
rounded before the product, so a fused step differs from the modules' only by the order of the float32 sum of
squares (and by RoPE computing ``x * cos + rot(x) * sin`` in float32 with one rounding).
Where the device has it (Hopper and later), the kernels are launched as programmatic dependents: each waits for
the previous kernel before its first read and releases its own dependents right after.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._backend import kernel, use_triton
from ..._validate import next_pow2
from ...ops._pdl import pdl_enter, pdl_options
from .argmax import argmax

__all__ = ["rms_norm", "silu_mul", "rope_rotate", "argmax"]


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a float16 / bfloat16 / float32 tensor, got {got}")


@kernel(ints=("n_cols", "s_x", "s_r", "s_o"))
def _rms_norm_kernel(x, res, w, out, res_out, n_cols, s_x, s_r, s_o, EPS: tl.constexpr, HAS_RES: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    # the weight first: its load does not wait for the row's reduction
    wv = tl.load(w + cols, mask=ok, other=0.0).to(tl.float32)
    h = tl.load(x + row * s_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        h = (h.to(tl.float32) + tl.load(res + row * s_r + cols, mask=ok, other=0.0).to(tl.float32))
        h = h.to(out.dtype.element_ty)
        tl.store(res_out + row * s_o + cols, h, mask=ok)
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / n_cols + EPS)
    y = (hf * inv).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + row * s_o + cols, (wv * y).to(out.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x + residual`` (or of ``x``): returns ``(normed, x + residual)``.

    ``normed = weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)`` with ``h = (x + residual).to(dtype)``, in float32
    inside (transformers' ``LlamaRMSNorm`` after the decoder's residual add).

    Parameters
    ----------
    x : torch.Tensor
        ``[N, hidden]``, float16 / bfloat16 / float32, rows contiguous.
    weight : torch.Tensor
        ``[hidden]``, x's dtype and device, contiguous: the norm's weight.
    eps : float
        Added to the mean of squares.
    residual : torch.Tensor, optional
        ``[N, hidden]``, same dtype: added to ``x`` first.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``normed`` ``[N, hidden]`` and the new residual stream ``[N, hidden]`` (``x`` itself without a residual).

    Example
    -------
    >>> y, h = rms_norm(torch.randn(4, 8), torch.ones(8), 1e-6, residual=torch.randn(4, 8))
    >>> y.shape, h.shape
    (torch.Size([4, 8]), torch.Size([4, 8]))
    """
    _check_float("x", x)
    if x.ndim != 2 or x.stride(1) != 1:
        raise ValueError(f"x: expected [N, hidden] with contiguous rows, got shape {tuple(x.shape)} strides "
                         f"{tuple(x.stride())}")
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype or weight.device != x.device \
            or not weight.is_contiguous():
        raise ValueError(f"weight: expected a contiguous {x.dtype} tensor of shape ({x.shape[1]},) on {x.device}, "
                         f"got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1
                                 or residual.device != x.device):
        raise ValueError(f"residual: expected {tuple(x.shape)} {x.dtype} on {x.device} with contiguous rows, got "
                         f"{tuple(residual.shape)} {residual.dtype} on {residual.device}")
    if not use_triton(x.device):
        h = x if residual is None else x + residual
        hf = h.float()
        y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * y.to(x.dtype), h
    n, d = x.shape
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else x
    if n:
        block = next_pow2(d)
        _rms_norm_kernel.launch(x.device, (n,), x, residual if residual is not None else x, weight, out, res_out, d,
                                x.stride(0), residual.stride(0) if residual is not None else 0, d,
                                EPS=float(eps), HAS_RES=residual is not None, BLOCK=block,
                                num_warps=min(16, max(1, block // 256)), **pdl_options(x.device))
    return out, res_out


@kernel(ints=("n_cols", "s_x"))
def _silu_mul_kernel(x, out, n_cols, s_x, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(x + row * s_x + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x + row * s_x + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + row * n_cols + cols, (a * u).to(out.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the gate and up projections stored side by side.

    Parameters
    ----------
    gate_up : torch.Tensor
        ``[N, 2 * I]`` (gate in the first ``I`` columns, up in the last), float16 / bfloat16 / float32, rows
        contiguous.

    Returns
    -------
    torch.Tensor
        ``[N, I]``, same dtype; SiLU's output rounded to it before the product (as ``act(gate) * up`` in torch).

    Example
    -------
    >>> silu_mul(torch.randn(3, 8)).shape
    torch.Size([3, 4])
    """
    _check_float("gate_up", gate_up)
    if gate_up.ndim != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up: expected [N, 2 * I] with contiguous rows, got shape {tuple(gate_up.shape)}")
    n, i2 = gate_up.shape
    inter = i2 // 2
    if not use_triton(gate_up.device):
        g, u = gate_up[:, :inter], gate_up[:, inter:]
        return torch.nn.functional.silu(g) * u
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    if n and inter:
        block = min(1024, next_pow2(inter))
        _silu_mul_kernel.launch(gate_up.device, (n, triton.cdiv(inter, block)), gate_up, out, inter,
                                gate_up.stride(0), BLOCK=block, num_warps=4, **pdl_options(gate_up.device))
    return out


@kernel(ints=("n_heads", "s_t", "s_h", "rot_dim", "max_pos"))
def _rope_kernel(x, out, pos, cos, sin, n_heads, s_t, s_h, rot_dim, max_pos, D: tl.constexpr, HALF_P: tl.constexpr,
                 TAIL_P: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok_h = hh < n_heads
    half = rot_dim // 2
    cc = tl.arange(0, HALF_P)
    p = tl.load(pos + t + cc * 0)  # the token's position, on every lane
    ok_c = (cc < half) & (p >= 0) & (p < max_pos)
    c = tl.load(cos + p * rot_dim + cc, mask=ok_c, other=0.0).to(tl.float32)
    s = tl.load(sin + p * rot_dim + cc, mask=ok_c, other=0.0).to(tl.float32)
    src = x + t * s_t + hh[:, None] * s_h
    ok = ok_h[:, None] & ok_c[None, :]
    a = tl.load(src + cc[None, :], mask=ok, other=0.0).to(tl.float32)
    b = tl.load(src + half + cc[None, :], mask=ok, other=0.0).to(tl.float32)
    dst = out + t * (n_heads * D) + hh[:, None] * D
    # rotate-half: [a, b] -> [a cos - b sin, b cos + a sin] (cos / sin repeat over both halves)
    tl.store(dst + cc[None, :], (a * c[None, :] - b * s[None, :]).to(out.dtype.element_ty), mask=ok)
    tl.store(dst + half + cc[None, :], (b * c[None, :] + a * s[None, :]).to(out.dtype.element_ty), mask=ok)
    if TAIL_P > 0:  # dimensions past rot_dim pass through
        tt = tl.arange(0, TAIL_P)
        ok_t = ok_h[:, None] & (rot_dim + tt[None, :] < D)
        tl.store(dst + rot_dim + tt[None, :], tl.load(src + rot_dim + tt[None, :], mask=ok_t, other=0.0), mask=ok_t)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` at ``positions`` (transformers' ``apply_rotary_pos_emb`` for one tensor).

    Parameters
    ----------
    x : torch.Tensor
        ``[N, heads, D]`` (head_dim contiguous; other strides free), float16 / bfloat16 / float32.
    cos, sin : torch.Tensor
        ``[max_pos, rot_dim]`` tables (rot_dim even, <= D), contiguous; each row holds its frequencies twice.
    positions : torch.Tensor
        int64 ``[N]``, each in ``[0, max_pos)`` (device data, not checked: the kernel reads no table row outside
        it and leaves such a token's rotated part zero; the torch path raises or wraps).

    Returns
    -------
    torch.Tensor
        ``[N, heads, D]`` contiguous, x's dtype; dimensions past ``rot_dim`` are copied.

    Example
    -------
    >>> cos, sin = torch.ones(8, 4), torch.zeros(8, 4)
    >>> bool((rope_rotate(torch.randn(2, 3, 4), cos, sin, torch.tensor([0, 5])) != 0).any())
    True
    """
    _check_float("x", x)
    if x.ndim != 3 or x.stride(2) != 1:
        raise ValueError(f"x: expected [N, heads, D] with head_dim contiguous, got shape {tuple(x.shape)}")
    n, heads, d = x.shape
    rd = cos.shape[-1]
    if cos.ndim != 2 or sin.shape != cos.shape or rd % 2 or rd > d or not cos.is_contiguous() \
            or not sin.is_contiguous() or not cos.is_floating_point() or sin.dtype != cos.dtype \
            or cos.device != x.device or sin.device != x.device:
        raise ValueError(f"cos / sin: expected contiguous float [max_pos, rot_dim] tables on {x.device} with an even "
                         f"rot_dim <= {d}, got {cos.dtype} {tuple(cos.shape)} / {sin.dtype} {tuple(sin.shape)}")
    if positions.shape != (n,) or positions.dtype != torch.int64 or positions.device != x.device:
        raise ValueError(f"positions: expected int64 [{n}] on {x.device}, got {positions.dtype} "
                         f"{tuple(positions.shape)} on {positions.device}")
    if not use_triton(x.device):
        c, s = cos[positions][:, None, :].to(x.dtype), sin[positions][:, None, :].to(x.dtype)
        xr = x[..., :rd]
        half = rd // 2
        rot = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
        o = xr * c + rot * s
        return o if rd == d else torch.cat((o, x[..., rd:]), dim=-1)
    out = torch.empty((n, heads, d), dtype=x.dtype, device=x.device)
    if n and heads:
        block_h = min(16, next_pow2(heads))
        tail = d - rd
        _rope_kernel.launch(x.device, (n, triton.cdiv(heads, block_h)), x, out, positions, cos, sin, heads,
                            x.stride(0), x.stride(1), rd, cos.shape[0], D=d, HALF_P=max(2, next_pow2(rd // 2)),
                            TAIL_P=next_pow2(tail) if tail else 0, BLOCK_H=block_h, num_warps=4,
                            **pdl_options(x.device))
    return out
