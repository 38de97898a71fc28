"""Independent reference of the paged KV ops, written from the documents, not from the library's code.

Sources: the byte-format docstring of :mod:`kvcache.paged.config` (layouts, TurboMind asymmetric int8 / int4
quantization, int4 nibble order (planar halves), fp8 with per-layer scales) and the docstrings of
:func:`kvcache.ops.append_paged_kv` / :func:`kvcache.ops.gather_paged_kv` (which row goes where: ragged batch
with ``kv_lens`` or ``cu_k_lens``, slot mapping with ``-1`` = skip, context parallel ``cp_rank`` / ``cp_size``).

Everything here is a plain Python loop per (token, head) over CPU tensors; nothing is imported from
:mod:`kvcache.ops`. Keys are rotated with :func:`kvcache.rope.apply_rope_reference` (compared with Hugging Face
transformers in ``tests/test_rope.py``), evaluated on the device of the data so that the ``inv_freq`` of a
``"dynamic"`` rope is computed where the kernel's is.

Tolerances (derived once here, used by every test):

* RoPE, float32. The kernel and the reference compute the same angle ``float32(pos) * inv_freq[i]`` (one
  correctly rounded product, same ``inv_freq`` tensor), then ``cos`` / ``sin`` with different implementations
  (libdevice on the GPU, numpy under the interpreter, torch here): at most a few float32 ulps of 1 apart,
  ``|dc|, |ds| <= 2^-21``. Times ``attention_scaling`` ``a`` (same rounding on both sides up to that), then
  ``x * c - x' * s``: two products and a sum, each rounded (or fused into an FMA on the GPU), at most
  ``3 * 2^-24 * a * (|x| + |x'|)`` per side. So ``|y_kernel - y_ref| <= a * (|x| + |x'|) * (2^-21 + 6 * 2^-24)
  <= 2^-19 * a * max|x_row|`` (:func:`rope_slack`).
* A float32 value rounded to the output dtype (fp16 / bf16 / float32 / fp8): two float32 values ``e`` apart
  round to values at most ``e + ulp`` apart (ulp of the larger magnitude), so RoPE'd fp16 keys are compared
  within ``ulp_fp16(|y|) + rope_slack`` (:func:`ulp`).
* int8 / int4: the documented bound ``|dequant(q) - x| <= scale / 2``, plus float32 rounding of ``x - zero``,
  of the division, of ``q * scale + zero`` (each at most an ulp of values bounded by ``max|x_row|``):
  ``2^-20 * max|x_row|`` covers them (:func:`quant_bound`).
* fp8k keys: the documented bound ``max(|x| / 16, scale / 1024)`` (half a step of e4m3's 3 mantissa bits, or of
  its subnormals, times the row's scale), plus float32 rounding of ``x * (1 / scale)`` and of ``code * scale``:
  ``2^-20 * max|x_row|`` covers them (:func:`fp8k_bound`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import torch

from kvcache._validate import bits
from kvcache.rope import RopeConfig, apply_rope_reference

SENTINEL = 0x5A
FP8_MAX = 448.0
# bits of keys and of values per integer format (k8v4: int8 keys in planes 0 / 1, int4 values in plane 2)
BITS = {"int8": (8, 8), "int4": (4, 4), "k8v4": (8, 4)}
QUANTIZED = tuple(BITS)


def qmax_of(kv_dtype: str, kv: int) -> int:
    """Largest code of keys (``kv`` 0) or values (1) of an integer format."""
    return 2 ** BITS[kv_dtype][kv] - 1


# (explicit mantissa bits, smallest normal exponent) of each floating dtype used here
_FLOAT_FORMAT = {
    torch.float16: (10, -14),
    torch.bfloat16: (7, -126),
    torch.float32: (23, -126),
    torch.float8_e4m3fn: (3, -6),
}


# ---------------------------------------------------------------------------------------------------------
# bits and sentinels


def fill_sentinel(t: torch.Tensor) -> torch.Tensor:
    """Fill every byte of the contiguous tensor ``t`` with :data:`SENTINEL`; returns ``t``."""
    if not t.is_contiguous():
        raise ValueError("fill_sentinel: fill the contiguous base tensor, then take the view")
    if t.numel():
        bits(t).view(torch.uint8).fill_(SENTINEL)
    return t


def sentinel_value(dtype: torch.dtype) -> torch.Tensor:
    """A 0-d CPU tensor of ``dtype`` whose bytes are all :data:`SENTINEL`."""
    return torch.full((_elt(dtype),), SENTINEL, dtype=torch.uint8).view(dtype)[0]


def _elt(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit-exact comparison (CPU copies), with the first mismatching index and both values in the message."""
    a, e = bits(actual.detach().cpu()), bits(expected.detach().cpu())
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    if torch.equal(a, e):
        return
    diff = (a != e).nonzero()
    first = tuple(int(x) for x in diff[0])
    av, ev = actual.detach().cpu()[first], expected.detach().cpu()[first]
    raise AssertionError(
        f"{what}: {diff.shape[0]} of {a.numel()} elements differ; first at {first}: got {av} "
        f"(bits {int(a[first])}), expected {ev} (bits {int(e[first])})"
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    """``|actual - expected| <= tol`` elementwise (float64 on the CPU; NaN fails)."""
    a = actual.detach().cpu().double()
    e = expected.detach().cpu().double()
    t = tol.detach().cpu().double().expand(e.shape) if tol.dim() else tol.double().expand(e.shape)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    err = (a - e).abs()
    bad = ~(err <= t)
    if bool(bad.any()):
        idx = bad.nonzero()
        first = tuple(int(x) for x in idx[0])
        raise AssertionError(
            f"{what}: {idx.shape[0]} of {a.numel()} elements outside the bound; first at {first}: got "
            f"{a[first].item()!r}, expected {e[first].item()!r}, |diff| {err[first].item():.3g} > bound "
            f"{t[first].item():.3g}"
        )


# ---------------------------------------------------------------------------------------------------------
# tolerances


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at ``|x|`` (float64 tensor): ``2^(floor(log2|x|) - mantissa_bits)``, never below
    the subnormal spacing."""
    mant, emin = _FLOAT_FORMAT[dtype]
    _, e = torch.frexp(x.detach().cpu().double().abs())  # |x| = m * 2^e, m in [0.5, 1)
    exp = torch.clamp(e - 1, min=emin)
    return torch.pow(2.0, (exp - mant).double())


def rope_slack(x_rows: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """float32 RoPE difference bound per (token, head): ``2^-19 * max(a, 1) * max|x_row|``, shape ``[n, H, 1]``
    for ``x_rows`` ``[n, H, D]`` (see the module docstring)."""
    a = max(float(rope.attention_scaling), 1.0)
    return x_rows.detach().cpu().double().abs().amax(dim=-1, keepdim=True) * a * 2.0**-19


def quant_bound(scale: torch.Tensor, x_rows: torch.Tensor) -> torch.Tensor:
    """Documented int8 / int4 bound ``scale / 2`` plus float32 rounding, shape ``[..., 1]`` for rows ``x``."""
    return scale.detach().cpu().double()[..., None] / 2 + (
        x_rows.detach().cpu().double().abs().amax(dim=-1, keepdim=True) * 2.0**-20
    )


# ---------------------------------------------------------------------------------------------------------
# where tokens go


@dataclasses.dataclass(frozen=True)
class Target:
    """Row ``row`` of k / v goes to block ``block``, offset ``offset``; its (global) RoPE position."""

    row: int
    block: int
    offset: int
    position: int


def ragged_targets(
    n_rows: int,
    block_tables: Sequence[Sequence[int]],
    cu_q_lens: Sequence[int],
    *,
    block_size: int,
    num_blocks: int,
    kv_lens: Sequence[int] | None = None,
    cu_k_lens: Sequence[int] | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> list[Target]:
    """Rows written by a ragged append: sequence ``b`` owns rows ``cu_q_lens[b] .. cu_q_lens[b + 1]``; its
    ``i``-th new token has position ``p = kv_lens[b] + i`` (or ``total_b - q_len_b + i`` with cu_k_lens);
    rank ``p % cp_size`` stores it at local position ``p // cp_size``: block
    ``block_tables[b][local // block_size]``, offset ``local % block_size``. Rows past ``n_rows``, past the
    block table or with a block id outside the pool are not written."""
    out: list[Target] = []
    for b in range(len(cu_q_lens) - 1):
        q_len = cu_q_lens[b + 1] - cu_q_lens[b]
        if kv_lens is not None:
            first = kv_lens[b]
        else:
            first = (cu_k_lens[b + 1] - cu_k_lens[b]) - q_len  # type: ignore[index]
        for i in range(q_len):
            row = cu_q_lens[b] + i
            pos = first + i
            if row >= n_rows or pos < 0 or pos % cp_size != cp_rank:
                continue
            local = pos // cp_size
            j, off = local // block_size, local % block_size
            if j >= len(block_tables[b]):
                continue
            blk = block_tables[b][j]
            if 0 <= blk < num_blocks:
                out.append(Target(row, blk, off, pos))
    return out


def slot_targets(
    slot_mapping: Sequence[int], *, block_size: int, num_blocks: int, positions: Sequence[int] | None = None
) -> list[Target]:
    """Rows written in slot-mapping mode: row ``n`` to slot ``slot_mapping[n]`` = ``block * block_size +
    offset``; ``-1`` (any negative) skips the row."""
    out = []
    for n, slot in enumerate(slot_mapping):
        if slot < 0 or slot // block_size >= num_blocks:
            continue
        out.append(Target(n, slot // block_size, slot % block_size, 0 if positions is None else positions[n]))
    return out


def row_index(layout: str, block: int, kv: int, offset: int, head: int) -> tuple[int, int, int, int]:
    """Index of one stored (token, head) row in a layer pool (or its params): NHD ``[blk, kv, off, h]``,
    HND ``[blk, kv, h, off]``."""
    return (block, kv, offset, head) if layout == "NHD" else (block, kv, head, offset)


# ---------------------------------------------------------------------------------------------------------
# quantization (float32, per (token, head) row)


def quantize_row(x: torch.Tensor, bits_: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """TurboMind asymmetric quantization of one float32 row: codes, scale, zero (0-d float32 tensors).

    ``scale = (max - min) / (2^b - 1)``, ``zero = min``, ``q = clamp(round_half_even((x - zero) * (1 / scale)),
    0, 2^b - 1)`` (one IEEE float32 reciprocal per row, then float32 multiplies); ``q = 0`` when
    ``scale == 0``. Rounding: Python's ``round`` (half to even) of each float32 product.
    """
    x = x.float()
    qmax = 2**bits_ - 1
    mn, mx = x.min(), x.max()
    scale = (mx - mn) / torch.tensor(float(qmax), dtype=torch.float32)
    if float(scale) == 0.0:
        return [0] * x.numel(), scale, mn
    inv = torch.tensor(1.0, dtype=torch.float32) / scale
    ys = ((x - mn) * inv).tolist()  # float32 results, exactly representable as Python floats
    return [min(max(round(y), 0), qmax) for y in ys], scale, mn


def pack_int4(codes: Sequence[int]) -> list[int]:
    """Planar halves: element ``i`` in the low nibble of byte ``i``, element ``D/2 + i`` in the high nibble
    (``byte[i] = q[i] | q[D/2 + i] << 4``)."""
    half = len(codes) // 2
    return [codes[i] | (codes[half + i] << 4) for i in range(half)]


def unpack_int4(row: torch.Tensor) -> list[int]:
    """Inverse of :func:`pack_int4`: the ``D`` codes of one stored row of ``D / 2`` bytes."""
    data = row.tolist()
    return [b & 15 for b in data] + [b >> 4 for b in data]


def fp8k_key_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8k's encoding of one key row (float32 ``[D]``): (stored float8_e4m3fn ``[D]``, scale float32 ``[1]``).

    ``scale = max(amax / 448, 2^-126)`` (one IEEE float32 division; 0 for a zero row), ``inv = 1 / scale`` (one
    IEEE reciprocal; 0 when ``scale == 0``), stored ``float8_e4m3fn(clamp(x * inv, -448, 448))``. A row holding a
    NaN or an infinity stores scale NaN and ``inv = 0``: its finite elements become (signed) zeros, the others NaN.
    """
    x = x.float()
    if not bool(torch.isfinite(x).all()):
        y = x * torch.tensor(0.0, dtype=torch.float32)
        stored = torch.where(torch.isfinite(y), y, torch.tensor(float("nan"))).to(torch.float8_e4m3fn)
        return stored, torch.tensor([float("nan")], dtype=torch.float32)
    scale = x.abs().max() / torch.tensor(FP8_MAX, dtype=torch.float32)
    if float(scale) < 2.0**-126 and float(x.abs().max()) > 0.0:  # the floor: a normal scale, a finite reciprocal
        scale = torch.tensor(2.0**-126, dtype=torch.float32)
    if float(scale) == 0.0:
        inv = torch.tensor(0.0, dtype=torch.float32)
    else:
        inv = torch.tensor(1.0, dtype=torch.float32) / scale
    return torch.clamp(x * inv, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.reshape(1)


def fp8k_bound(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Documented fp8k key bound ``max(|x| / 16, scale / 1024)`` elementwise, plus float32 rounding
    (``2^-20 * max|x_row|``), float64 of ``x``'s shape; ``scale`` broadcasts against ``x[..., :1]``."""
    xd = x.detach().cpu().double()
    s = scale.detach().cpu().double()
    return torch.maximum(xd.abs() / 16, s / 1024) + xd.abs().amax(dim=-1, keepdim=True) * 2.0**-20


def fp8_encode(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``float8_e4m3fn(clamp(x * (1 / scale), -448, 448))``: one float32 reciprocal, a float32 product, torch's
    round-to-nearest-even conversion."""
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32)
    return torch.clamp(x.float() * inv, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def stored_codes(pool: torch.Tensor, idx: tuple[int, ...], kv_dtype: str) -> list[int]:
    """The ``D`` integer codes of one stored row of an integer format; ``idx`` is the row's (scale, zero) index
    (:func:`row_index`; k8v4: keys in planes 0 and 1, values in plane 2)."""
    if kv_dtype == "k8v4":
        if idx[1] == 0:
            return pool[(idx[0], 0, *idx[2:])].tolist() + pool[(idx[0], 1, *idx[2:])].tolist()
        return unpack_int4(pool[(idx[0], 2, *idx[2:])])
    return unpack_int4(pool[idx]) if kv_dtype == "int4" else pool[idx].tolist()


def decode_row(
    pool: torch.Tensor, params: torch.Tensor | None, idx: tuple[int, ...], kv_dtype: str, fp8_scale: float
) -> torch.Tensor:
    """float32 values of one stored row (CPU tensors): model dtype as is, fp8 times its scale (fp8k keys: times
    the row's own scale in ``params``), int8 / int4 ``q * scale + zero`` (float32 product, then float32 sum)."""
    raw = pool[idx]
    if kv_dtype == "auto":
        return raw.float()
    if kv_dtype == "fp8k" and idx[1] == 0:
        return raw.float() * params[idx][0]  # type: ignore[index]
    if kv_dtype in ("fp8", "fp8k"):
        return raw.float() * torch.tensor(fp8_scale, dtype=torch.float32)
    codes = stored_codes(pool, idx, kv_dtype)
    scale, zero = params[idx][0], params[idx][1]  # type: ignore[index]
    q = torch.tensor(codes, dtype=torch.float32)
    return q * scale + zero


# ---------------------------------------------------------------------------------------------------------
# append and gather


@dataclasses.dataclass
class Expected:
    """Expected state after an append: ``pool`` / ``params`` (CPU copies of the pool after the write), and
    the float32 values each written (row, kv) was meant to store, keys rotated (``values[(row, kv)]``
    ``[H, D]``)."""

    pool: torch.Tensor
    params: torch.Tensor | None
    values: dict[tuple[int, int], torch.Tensor]
    targets: list[Target]


def rotate_keys(
    k: torch.Tensor, targets: Sequence[Target], rope: RopeConfig | None, rope_seq_len: int | None = None
) -> dict[int, torch.Tensor]:
    """float32 keys of the target rows, rotated at their positions (CPU tensors ``[H, D]`` by row)."""
    if not targets:
        return {}
    rows = torch.tensor([t.row for t in targets], dtype=torch.long, device=k.device)
    x = k.index_select(0, rows).float()
    if rope is not None:
        pos = torch.tensor([t.position for t in targets], dtype=torch.int64, device=k.device)
        x = apply_rope_reference(x, pos, rope, rope_seq_len)
    x = x.cpu()
    return {t.row: x[i] for i, t in enumerate(targets)}


def append_expected(
    pool: torch.Tensor,
    params: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    targets: Sequence[Target],
    *,
    kv_dtype: str,
    layout: str,
    rope: RopeConfig | None = None,
    rope_seq_len: int | None = None,
    fp8_scales: tuple[float, float] = (1.0, 1.0),
) -> Expected:
    """The pool (and params) after writing ``targets``, per the byte format; inputs are left alone."""
    out = pool.detach().cpu().clone()
    par = None if params is None else params.detach().cpu().clone()
    keys = rotate_keys(k, targets, rope, rope_seq_len)
    vals_v = v.detach().cpu().float()
    values: dict[tuple[int, int], torch.Tensor] = {}
    H = k.shape[1]
    for t in targets:
        for kv in (0, 1):
            x = keys[t.row] if kv == 0 else vals_v[t.row]
            values[(t.row, kv)] = x
            for h in range(H):
                idx = row_index(layout, t.block, kv, t.offset, h)
                if kv_dtype == "auto":
                    out[idx] = x[h].to(out.dtype)
                elif kv_dtype == "fp8k" and kv == 0:
                    out[idx], par[idx] = fp8k_key_encode(x[h])  # type: ignore[index]
                elif kv_dtype in ("fp8", "fp8k"):
                    out[idx] = fp8_encode(x[h], fp8_scales[kv])
                else:
                    bits = BITS[kv_dtype][kv]
                    codes, scale, zero = quantize_row(x[h], bits)
                    par[idx] = torch.stack([scale, zero])  # type: ignore[index]
                    if kv_dtype == "k8v4" and kv == 0:  # a key's halves in planes 0 and 1
                        half = len(codes) // 2
                        out[(idx[0], 0, *idx[2:])] = torch.tensor(codes[:half], dtype=torch.uint8)
                        out[(idx[0], 1, *idx[2:])] = torch.tensor(codes[half:], dtype=torch.uint8)
                        continue
                    stored = pack_int4(codes) if bits == 4 else codes
                    at = (idx[0], 2, *idx[2:]) if kv_dtype == "k8v4" else idx
                    out[at] = torch.tensor(stored, dtype=torch.uint8)
    return Expected(out, par, values, list(targets))


@dataclasses.dataclass
class GatherExpected:
    """Expected gather outputs (CPU): ``k`` / ``v`` ``[B, H, S_out, D]`` in the output dtype, ``k32`` / ``v32`` the
    float32 values before the cast (tolerances), ``valid`` ``[B, S_out]`` (False: padded tail, must be zero)."""

    k: torch.Tensor
    v: torch.Tensor
    k32: torch.Tensor
    v32: torch.Tensor
    valid: torch.Tensor


def local_len(total: int, cp_rank: int, cp_size: int) -> int:
    """Tokens of a ``total``-token sequence held by ``cp_rank``: positions ``p < total`` with ``p % cp_size ==
    cp_rank`` (counted one by one)."""
    return sum(1 for p in range(total) if p % cp_size == cp_rank)


def gather_expected(
    pool: torch.Tensor,
    params: torch.Tensor | None,
    block_tables: Sequence[Sequence[int]],
    totals: Sequence[int],
    *,
    kv_dtype: str,
    layout: str,
    s_out: int,
    dtype: torch.dtype,
    rope: RopeConfig | None = None,
    rope_seq_len: int | None = None,
    fp8_scales: tuple[float, float] = (1.0, 1.0),
    cp_rank: int = 0,
    cp_size: int = 1,
    device: torch.device | str = "cpu",
) -> GatherExpected:
    """Expected gather of sequences holding ``totals[b]`` tokens (global count).

    This rank holds local tokens ``t`` with ``t * cp_size + cp_rank < totals[b]``; token ``t`` is at block
    ``block_tables[b][t // block_size]``, offset ``t % block_size``, output index ``t``; RoPE (if given)
    rotates key ``t`` at position ``t * cp_size + cp_rank`` (on ``device``). Everything past a sequence's
    local length is zero.
    """
    p = pool.detach().cpu()
    par = None if params is None else params.detach().cpu()
    if layout == "NHD":
        _, _, bs, H, dp = p.shape
    else:
        _, _, H, bs, dp = p.shape
    D = dp * 2 if kv_dtype in ("int4", "k8v4") else dp  # fp8k: one fp8 per element, as fp8
    B = len(totals)
    k32 = torch.zeros((B, H, s_out, D), dtype=torch.float32)
    v32 = torch.zeros((B, H, s_out, D), dtype=torch.float32)
    k_out = torch.zeros((B, H, s_out, D), dtype=dtype)
    v_out = torch.zeros((B, H, s_out, D), dtype=dtype)
    valid = torch.zeros((B, s_out), dtype=torch.bool)
    for b in range(B):
        n = min(local_len(totals[b], cp_rank, cp_size), s_out)
        if n == 0:
            continue
        valid[b, :n] = True
        kk = torch.zeros((n, H, D), dtype=torch.float32)
        for t in range(n):
            blk, off = block_tables[b][t // bs], t % bs
            for h in range(H):
                idx_k = row_index(layout, blk, 0, off, h)
                idx_v = row_index(layout, blk, 1, off, h)
                kk[t, h] = decode_row(p, par, idx_k, kv_dtype, fp8_scales[0])
                v32[b, h, t] = decode_row(p, par, idx_v, kv_dtype, fp8_scales[1])
                if kv_dtype == "auto":  # a copy of the stored element
                    v_out[b, h, t] = p[idx_v].to(dtype)
                    k_out[b, h, t] = p[idx_k].to(dtype)
                else:
                    v_out[b, h, t] = v32[b, h, t].to(dtype)
        if rope is not None:
            pos = torch.tensor([t * cp_size + cp_rank for t in range(n)], dtype=torch.int64, device=device)
            kk = apply_rope_reference(kk.to(device), pos, rope, rope_seq_len).cpu()
        k32[b, :, :n] = kk.transpose(0, 1)
        if kv_dtype != "auto" or rope is not None:
            k_out[b, :, :n] = kk.transpose(0, 1).to(dtype)
    return GatherExpected(k_out, v_out, k32, v32, valid)


# ---------------------------------------------------------------------------------------------------------
# assertions


def assert_append_matches(
    pool: torch.Tensor,
    params: torch.Tensor | None,
    exp: Expected,
    *,
    kv_dtype: str,
    layout: str,
    rope: RopeConfig | None = None,
    fp8_scales: tuple[float, float] = (1.0, 1.0),
    what: str = "pool",
) -> None:
    """The pool after an append against :func:`append_expected`.

    Bit-exact: every byte not written (it must keep its old value), every value row, every key row when
    there is no RoPE (int8 / int4 codes and float32 scale / zero included: the documented float32 formula).
    With RoPE, key rows are bounded (module docstring): auto / fp8 within one ulp of the stored format plus
    the float32 RoPE slack, dims past ``rotary_dim`` bit-exact (auto); fp8k ``scale`` within ``slack / 448`` (plus
    a float32 rounding) of ``max|x| / 448`` and every dequantized element within :func:`fp8k_bound` (+ slack) of
    the rotated key; int8 / int4 ``zero`` within the
    slack of the rotated row's min, ``scale`` within ``2 * slack / qmax`` of ``(max - min) / qmax``, and
    every dequantized element within ``scale / 2`` (+ float32 rounding + slack) of the rotated key.
    """
    p = pool.detach().cpu()
    par = None if params is None else params.detach().cpu()
    loose = torch.zeros(p.shape[:4], dtype=torch.bool)
    loose_par = None if par is None else torch.zeros(par.shape[:4], dtype=torch.bool)
    H = p.shape[3] if layout == "NHD" else p.shape[2]
    if rope is not None:
        for t in exp.targets:
            for h in range(H):
                idx = row_index(layout, t.block, 0, t.offset, h)
                for plane in ((0, 1) if kv_dtype == "k8v4" else (0,)):  # a k8v4 key spans planes 0 and 1
                    loose[(idx[0], plane, *idx[2:])] = True
                if loose_par is not None:
                    loose_par[idx] = True
    assert_bits_equal(p[~loose], exp.pool[~loose], f"{what} (rows compared bit-exactly)")
    if par is not None:
        assert_bits_equal(par[~loose_par], exp.params[~loose_par], f"{what} params (rows compared bit-exactly)")  # type: ignore[index]
    if rope is None:
        return
    for t in exp.targets:
        x = exp.values[(t.row, 0)]  # [H, D] rotated float32 keys
        slack = rope_slack(x[None], rope)[0]  # [H, 1]
        for h in range(H):
            idx = row_index(layout, t.block, 0, t.offset, h)
            where = f"{what}: key of row {t.row} (position {t.position}), head {h}"
            if kv_dtype == "auto":
                got = p[idx].double()
                tol = ulp(torch.maximum(got.abs(), x[h].double().abs()), p.dtype) + slack[h]
                assert_close(got, x[h], tol, where)
                rd = rope.rotary_dim
                assert_bits_equal(p[idx][rd:], exp.pool[idx][rd:], where + " (dims past rotary_dim)")
            elif kv_dtype == "fp8":
                s = fp8_scales[0]
                got = p[idx].double()
                want = (x[h].double() / s).clamp(-FP8_MAX, FP8_MAX)
                tol = ulp(torch.maximum(got.abs(), want.abs()), torch.float8_e4m3fn) + slack[h] / s
                tol = tol + want.abs() * 2.0**-22  # x * (1 / s) vs x / s
                assert_close(got, want, tol, where)
            elif kv_dtype == "fp8k":
                scale = par[idx].double()  # type: ignore[index]
                want_scale = x[h].double().abs().amax() / FP8_MAX
                tol = slack[h] / FP8_MAX + want_scale * 2.0**-22  # amax moves by the slack at most
                assert_close(scale, want_scale.reshape(1), tol, where + " scale")
                deq = decode_row(p, par, idx, kv_dtype, 1.0).double()
                # the kernel encodes its own rotation x' (|x' - x| <= slack): bound of x' plus slack (1 + 1/16)
                bound = fp8k_bound(par[idx], x[h]) + slack[h] * (1 + 2.0**-4)  # type: ignore[index]
                assert_close(deq, x[h], bound, where + " dequantized")
            else:
                qmax = qmax_of(kv_dtype, 0)
                scale, zero = par[idx][0].double(), par[idx][1].double()  # type: ignore[index]
                xmin, xmax = x[h].double().min(), x[h].double().max()
                assert_close(zero, xmin, slack[h][0], where + " zero")
                want_scale = (xmax - xmin) / qmax
                assert_close(scale, want_scale, 2 * slack[h][0] / qmax + want_scale * 2.0**-22, where + " scale")
                deq = decode_row(p, par, idx, kv_dtype, 1.0).double()
                bound = quant_bound(par[idx][0], x[h][None])[0] + slack[h]  # type: ignore[index]
                assert_close(deq, x[h], bound, where + " dequantized")


def _fma_slack(x32: torch.Tensor) -> torch.Tensor:
    """int8 / int4 dequantization ``q * scale + zero``: the GPU may fuse it into one FMA (one rounding instead
    of two). The two results differ by at most half an ulp of the product ``q * scale`` plus one ulp of the
    result, in float32; with ``|q * scale| <= max - min <= 2 max|x_row|`` and ``|result| <= max|x_row|``:
    ``2^-22 * max|x_row|`` per (token, head) row (``x32`` ``[..., D]``; shape ``[..., 1]``). Without it a
    result near zero (cancellation) would be held to the ulp of its own tiny magnitude."""
    return x32.detach().cpu().double().abs().amax(dim=-1, keepdim=True) * 2.0**-22


def assert_gather_matches(
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    exp: GatherExpected,
    *,
    kv_dtype: str,
    rope: RopeConfig | None = None,
    what: str = "gather",
) -> None:
    """Gather outputs against :func:`gather_expected`: padded tails exactly zero; ``auto`` without RoPE and
    ``fp8`` values (one float32 product, then the cast) bit-exact; int8 / int4 (``q * scale + zero``, which
    the GPU may fuse into one FMA) within one ulp of the model dtype plus :func:`_fma_slack`; RoPE'd keys
    within one ulp plus the float32 RoPE slack (plus the FMA slack for int8 / int4)."""
    k, v = k_out.detach().cpu(), v_out.detach().cpu()
    dtype = k.dtype
    pad = ~exp.valid
    quant = kv_dtype in QUANTIZED
    for name, got in (("k", k), ("v", v)):
        tail = got.transpose(1, 2)[pad]  # [n_pad, H, D]
        assert_bits_equal(tail, torch.zeros_like(tail), f"{what}: {name} padded tail (must be zero)")
    if not quant:
        assert_bits_equal(v, exp.v, f"{what}: v")
    else:
        tol = ulp(torch.maximum(v.double().abs(), exp.v32.double().abs()), dtype) + _fma_slack(exp.v32)
        assert_close(v, exp.v32, tol, f"{what}: v")
    if rope is None:
        if not quant:
            assert_bits_equal(k, exp.k, f"{what}: k")
        else:
            tol = ulp(torch.maximum(k.double().abs(), exp.k32.double().abs()), dtype) + _fma_slack(exp.k32)
            assert_close(k, exp.k32, tol, f"{what}: k")
        return
    B, H, S, D = k.shape
    slack = rope_slack(exp.k32.reshape(B * H, S, D).transpose(0, 1), rope).transpose(0, 1).reshape(B, H, S, 1)
    if quant:
        slack = slack + 4 * _fma_slack(exp.k32)  # x and its partner dequantized, then times cos / sin
    tol = ulp(torch.maximum(k.double().abs(), exp.k32.double().abs()), dtype) + slack
    assert_close(k, exp.k32, tol, f"{what}: k (RoPE applied)")


# ---------------------------------------------------------------------------------------------------------
# test data


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator, device, scale: float = 1.0):  # type: ignore[no-untyped-def]
    """Fresh normal random values (never all zeros) of ``dtype`` on ``device``."""
    x = torch.randn(tuple(shape), generator=gen, dtype=torch.float32) * scale
    return x.to(dtype).to(device)


def block_tables_for(
    gen: torch.Generator, totals: Sequence[int], *, block_size: int, num_blocks: int, cp_size: int = 1,
    extra: int = 0, pad: int = -1,
) -> list[list[int]]:
    """Tables of distinct block ids taken from a shuffled pool, each long enough for ``ceil(total / cp_size)``
    local tokens, padded to one width with ``pad`` (plus ``extra`` padding columns)."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for total in totals:
        local = -(-total // cp_size)
        need = -(-local // block_size)
        if need > len(perm):
            raise ValueError("not enough blocks for the test case")
        tables.append(perm[:need])
        perm = perm[need:]
    width = max([len(t) for t in tables] + [1]) + extra
    return [t + [pad] * (width - len(t)) for t in tables]


def long_position_batch(device, gen, H: int, D: int, bs: int, dtype: torch.dtype,  # type: ignore[no-untyped-def]
                        q_lens: Sequence[int] = (5, 1, 3), kv_lens: Sequence[int] = (0, 3070, 11),
                        num_blocks: int = 16):
    """A ragged batch whose positions reach 3000+ (large RoPE angles) through a wide, mostly -1 block table:
    only the blocks the new rows land in are given (distinct, from ``num_blocks``). Returns (k, v, tables,
    cu_q_lens, kv_lens), k / v ``[sum(q_lens), H, D]`` of ``dtype``."""
    cu = cumsum0(q_lens)
    totals = [a + b for a, b in zip(kv_lens, q_lens)]
    width = -(-max(totals) // bs)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[-1] * width for _ in totals]
    for b, (first, total) in enumerate(zip(kv_lens, totals)):
        for j in range(first // bs, -(-total // bs)):
            tables[b][j] = perm.pop()
    k = randn((cu[-1], H, D), dtype, gen, device)
    v = randn((cu[-1], H, D), dtype, gen, device)
    return k, v, tables, cu, list(kv_lens)


def cumsum0(xs: Sequence[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def i32(xs, device) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.tensor(xs, dtype=torch.int32, device=device)


def sentinel_cache(device, *, num_layers: int = 1, num_kv_heads: int = 2, head_dim: int = 8, block_size: int = 4,
                   num_blocks: int = 16, dtype: torch.dtype = torch.float16, kv_dtype: str = "auto",
                   layout: str = "NHD", rope: RopeConfig | None = None):  # type: ignore[no-untyped-def]
    """A PagedKVCache whose data and params pools hold :data:`SENTINEL` in every byte."""
    from kvcache.paged import PagedConfig, PagedKVCache

    cache = PagedKVCache(
        PagedConfig(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                    num_blocks=num_blocks, dtype=dtype, kv_dtype=kv_dtype, layout=layout, device=device),
        rope=rope,
    )
    fill_sentinel(cache.buffer)
    if cache.params_buffer is not None:
        fill_sentinel(cache.params_buffer)
    return cache


def is_all_sentinel(t: torch.Tensor) -> bool:
    """True when every byte of ``t`` is :data:`SENTINEL`."""
    b = bits(t.detach().cpu().contiguous()).view(torch.uint8)
    return bool((b == SENTINEL).all())


def names(argument: str) -> str:
    """``pytest.raises(..., match=names("k"))``: the message starts with the argument's name."""
    return "^" + re.escape(argument) + r"(?!\w)"
