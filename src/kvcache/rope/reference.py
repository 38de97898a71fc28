"""Pure-torch RoPE: rotate (or un-rotate) heads the way transformers does, in float32."""

from __future__ import annotations

import torch

from .._validate import check_tensor, fmt_shape
from .config import RopeConfig, _check_positions

__all__ = ["apply_rope_reference"]


def _rotate_pairs(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """For each pair (a, b): (-b, a), in the pair layout of ``interleaved``."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_reference(
    x: torch.Tensor,
    positions: torch.Tensor,
    config: RopeConfig,
    seq_len: int | None = None,
    *,
    inverse: bool = False,
) -> torch.Tensor:
    """Rotate (or un-rotate) the first ``config.rotary_dim`` dims of every head; pure torch, float32 math.

    Forward: ``y = x * cos + rotate(x) * sin`` with ``cos``, ``sin`` from :meth:`RopeConfig.cos_sin`
    (attention scaling included), the same float32 expression as transformers' ``apply_rotary_pos_emb``.
    Inverse: ``x = (y * cos - rotate(y) * sin) / attention_scaling`` with unscaled ``cos``, ``sin``, so
    ``apply_rope_reference(apply_rope_reference(x, p, c), p, c, inverse=True)`` returns ``x`` up to float32
    rounding (and the output dtype's rounding).

    Parameters
    ----------
    x : torch.Tensor
        ``shape: [n, num_heads, head_dim]``, any floating dtype, any device.
    positions : torch.Tensor
        ``shape: [n]``, integer dtype, same device as ``x``: the position of each token.
    config : RopeConfig
        ``config.head_dim`` must equal ``x.shape[-1]``.
    seq_len : int | None
        ``"dynamic"`` only; ``None``: ``max(positions) + 1``.
    inverse : bool
        Undo the rotation and the attention scaling.

    Returns
    -------
    torch.Tensor
        ``shape: [n, num_heads, head_dim]``, ``x.dtype``. Dims ``[rotary_dim, head_dim)`` are copied
        unchanged (bit-identical).
    """
    if not isinstance(config, RopeConfig):
        raise TypeError(f"config: expected a RopeConfig, got {type(config).__name__}")
    x = check_tensor("x", x)
    if x.dim() != 3 or x.shape[-1] != config.head_dim:
        raise ValueError(f"x: expected shape [n, num_heads, {config.head_dim}], got {fmt_shape(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating dtype, got {x.dtype}")
    _check_positions("positions", positions)
    if positions.shape[0] != x.shape[0]:
        raise ValueError(
            f"positions: expected shape [{x.shape[0]}] (one per token of x), got {fmt_shape(positions.shape)}"
        )
    if positions.device != x.device:
        raise ValueError(f"positions: expected device {x.device} (the device of x), got {positions.device}")
    if not isinstance(inverse, bool):
        raise TypeError(f"inverse: expected a bool, got {type(inverse).__name__}")

    rd = config.rotary_dim
    scaling = config.attention_scaling
    cos, sin = config._cos_sin(positions, seq_len, 1.0 if inverse else scaling)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot = x[..., :rd].float()
    if inverse:
        out = rot * cos - _rotate_pairs(rot, config.interleaved) * sin
        if scaling != 1.0:
            out = out / scaling
    else:
        out = rot * cos + _rotate_pairs(rot, config.interleaved) * sin
    if rd == config.head_dim:
        return out.to(x.dtype)
    return torch.cat((out.to(x.dtype), x[..., rd:]), dim=-1)
