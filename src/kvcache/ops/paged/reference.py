"""Pure-torch references of the paged kernels: the CPU backend, and what the kernels are tested against."""

from __future__ import annotations

import torch

from ...rope import RopeKernelParams
from .block_keys import read_sequence, write_sequence
from .format import KV_FORMAT_TABLE, pack_codes, stored_planes, unpack_codes
from .layer import PagedLayer
from .step import StepPlan

__all__ = ["append_paged_kv_reference", "gather_paged_kv_reference", "quantize_rows_reference",
           "dequantize_rows_reference", "key_scales_reference"]

_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_rows_reference(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization of the last dim: returns (codes uint8 [..., D], scale f32 [...], zero f32 [...])."""
    x = x.float()
    qmax = float(2**bits - 1)
    bad = ~torch.isfinite(x).all(dim=-1)  # a NaN or an infinity: codes 0, scale and zero NaN (reads back NaN)
    xf = torch.where(bad[..., None], torch.zeros_like(x), x)
    mn = xf.amin(dim=-1)
    mx = xf.amax(dim=-1)
    scale = (mx - mn) / qmax
    inv = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(scale))
    q = torch.round((xf - mn[..., None]) * inv[..., None]).clamp(0, qmax)  # round half to even
    nan = torch.full_like(scale, float("nan"))
    return q.to(torch.uint8), torch.where(bad, nan, scale), torch.where(bad, nan, mn)


def key_scales_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8k's key scales: (scale f32 [...], its reciprocal f32 [...]) of rows ``x`` [..., D], ``scale = max(amax / 448,
    2^-126)``. A zero row has scale and reciprocal 0; a row with a NaN or an infinity has scale NaN and reciprocal 0."""
    x = x.float()
    bad = ~torch.isfinite(x).all(dim=-1)
    amax = torch.where(bad[..., None], torch.zeros_like(x), x).abs().amax(dim=-1)
    # at least float32's smallest normal for a non-zero row (a subnormal scale has no finite reciprocal)
    scale = torch.where(amax > 0, (amax / _FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny), amax)
    inv = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(scale))
    inv = torch.where(bad, torch.zeros_like(inv), inv)  # the row's finite elements store 0, the others NaN
    return torch.where(bad, torch.full_like(scale, float("nan")), scale), inv


def dequantize_rows_reference(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``q * scale + zero`` in float32."""
    return q.float() * scale[..., None] + zero[..., None]


def _rope_rows(x: torch.Tensor, pos: torch.Tensor, rope, inverse: bool = False) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Rotate float32 rows x [n, H, D] at positions [n] the way the kernels do (float32)."""
    rot, inter, scale = int(rope.rotary_dim), bool(rope.interleaved), float(rope.attention_scaling)
    inv = rope.inv_freq.to(device=x.device, dtype=torch.float32)
    ang = pos.to(torch.float32)[:, None] * inv[None, :]  # [n, rot / 2]
    c = torch.cos(ang) * scale
    s = torch.sin(ang) * scale
    if inverse:
        s = -s
    out = x.clone()
    if inter:
        x1, x2 = x[..., 0:rot:2], x[..., 1:rot:2]
        out[..., 0:rot:2] = x1 * c[:, None] - x2 * s[:, None]
        out[..., 1:rot:2] = x2 * c[:, None] + x1 * s[:, None]
    else:
        half = rot // 2
        x1, x2 = x[..., :half], x[..., half:rot]
        out[..., :half] = x1 * c[:, None] - x2 * s[:, None]
        out[..., half:rot] = x2 * c[:, None] + x1 * s[:, None]
    return out


def _token_targets(n_tokens: int, plan: StepPlan, block_size: int, num_blocks: int
                   ) -> list[tuple[int, int, int, int]]:
    """(row, block, offset, global position) of every row that is written."""
    slot_mapping, positions, cp_rank, cp_size = plan.slot_mapping, plan.positions, plan.cp_rank, plan.cp_size
    out = []
    if slot_mapping is not None:
        slots = slot_mapping.tolist()
        pos = positions.tolist() if positions is not None else [0] * n_tokens
        for n, slot in enumerate(slots):
            if slot >= 0 and slot // block_size < num_blocks:
                out.append((n, slot // block_size, slot % block_size, int(pos[n])))
        return out
    cu = plan.cu_q_lens.tolist()  # type: ignore[union-attr]
    tables = plan.block_tables.tolist()  # type: ignore[union-attr]
    width = plan.block_tables.shape[1]  # type: ignore[union-attr]
    if plan.kv_lens is not None:
        starts = plan.kv_lens.tolist()
    else:
        ck = plan.cu_k_lens.tolist()  # type: ignore[union-attr]
        starts = [(ck[b + 1] - ck[b]) - (cu[b + 1] - cu[b]) for b in range(len(cu) - 1)]
    for b in range(len(cu) - 1):
        for n in range(max(cu[b], 0), min(cu[b + 1], n_tokens)):  # rows are >= 0: no index wraps around
            p = starts[b] + (n - cu[b])
            if p < 0 or p % cp_size != cp_rank:
                continue
            lp = p // cp_size
            bi = lp // block_size
            if bi >= width:
                continue
            blk = tables[b][bi]
            if 0 <= blk < num_blocks:
                out.append((n, blk, lp % block_size, p))
    return out


def append_paged_kv_reference(k: torch.Tensor, v: torch.Tensor, layer: PagedLayer, plan: StepPlan) -> None:
    """Pure-torch reference of the append kernel (same arguments as :func:`append_paged_kv_launch`, already
    validated: ``k`` / ``v`` ``[N, H, D]`` model dtype into ``layer`` where ``plan`` says)."""
    pool, params, fp8_scales, kv_dtype = layer.pool, layer.params, layer.scales, layer.kv_dtype
    hnd = layer.layout == "HND"
    rope = plan.rope
    if kv_dtype == "int4b":
        _append_int4b(k, v, layer, plan)
        return
    targets = _token_targets(k.shape[0], plan, layer.geometry[1], layer.geometry[0])
    if not targets:
        return
    rows = torch.tensor([t[0] for t in targets], dtype=torch.long, device=k.device)
    blks = torch.tensor([t[1] for t in targets], dtype=torch.long, device=k.device)
    offs = torch.tensor([t[2] for t in targets], dtype=torch.long, device=k.device)
    pos = torch.tensor([t[3] for t in targets], dtype=torch.long, device=k.device)
    for kv, src in ((0, k), (1, v)):
        x = src[rows]  # [n, H, D]
        if kv == 0 and rope is not None:
            x = _rope_rows(x.float(), pos, rope)
        if kv_dtype == "auto":
            data = x.to(pool.dtype)
        elif kv_dtype in ("fp8", "fp8k"):
            if kv_dtype == "fp8k" and kv == 0:  # a scale per key row, into the params pool
                scale, inv = key_scales_reference(x)
                if hnd:
                    params[blks, 0, :, offs] = scale[..., None]
                else:
                    params[blks, 0, offs] = scale[..., None]
                inv = inv[..., None]
            else:
                inv = 1.0 / fp8_scales[kv].float()
            y = x.float() * inv  # finite values saturate; NaN and +-inf are stored as NaN (e4m3fn has no infinity)
            data = torch.where(torch.isfinite(y), y.clamp(-_FP8_MAX, _FP8_MAX), float("nan")).to(pool.dtype)
        else:
            fmt = KV_FORMAT_TABLE[kv_dtype]
            q, scale, zero = quantize_rows_reference(x, fmt.key_bits if kv == 0 else fmt.value_bits)
            par = torch.stack([scale, zero], dim=-1)  # [n, H, 2]
            if hnd:
                params[blks, kv, :, offs] = par
            else:
                params[blks, kv, offs] = par
            for plane, data in zip(stored_planes(kv_dtype, kv), pack_codes(kv_dtype, kv, q)):
                if hnd:
                    pool[blks, plane, :, offs] = data
                else:
                    pool[blks, plane, offs] = data
            continue
        if hnd:
            pool[blks, kv, :, offs] = data
        else:
            pool[blks, kv, offs] = data


def _sequences(plan: StepPlan) -> list[tuple[int, int, int]]:
    """(first row, rows, start position) of each sequence of a ragged plan."""
    cu = plan.cu_q_lens.tolist()  # type: ignore[union-attr]
    if plan.kv_lens is not None:
        starts = plan.kv_lens.tolist()
    else:
        ck = plan.cu_k_lens.tolist()  # type: ignore[union-attr]
        starts = [(ck[b + 1] - ck[b]) - (cu[b + 1] - cu[b]) for b in range(len(cu) - 1)]
    return [(cu[b], cu[b + 1] - cu[b], starts[b]) for b in range(len(cu) - 1)]


def _append_int4b(k: torch.Tensor, v: torch.Tensor, layer: PagedLayer, plan: StepPlan) -> None:
    """int4b rows sequence by sequence (:mod:`.block_keys`): a block's key form follows from its sequence's length."""
    tables = plan.block_tables.tolist()  # type: ignore[union-attr]
    n_rows = k.shape[0]
    for b, (r0, n, start) in enumerate(_sequences(plan)):
        r1 = min(r0 + n, n_rows)
        if r1 <= r0:
            continue
        x = k[r0:r1].float()
        if plan.rope is not None:
            x = _rope_rows(x, torch.arange(start, start + (r1 - r0), device=k.device), plan.rope)
        write_sequence(layer.pool, layer.params, layer.layout, tables[b], start, x, v[r0:r1].float())


def gather_paged_kv_reference(k_out: torch.Tensor, v_out: torch.Tensor, layer: PagedLayer, plan: StepPlan,
                              rope: RopeKernelParams | None) -> None:
    """Pure-torch reference of the gather kernel (arguments as :func:`gather_paged_kv_launch`, validated):
    fills ``k_out`` / ``v_out`` ``[B, H, S_out, D]``."""
    pool, params, fp8_scales, kv_dtype = layer.pool, layer.params, layer.scales, layer.kv_dtype
    hnd = layer.layout == "HND"
    bs = layer.geometry[1]
    cp_rank, cp_size, block_tables = plan.cp_rank, plan.cp_size, plan.block_tables
    B, H, s_out, D = k_out.shape
    lens, by_cu = (plan.cu_k_lens, True) if plan.cu_k_lens is not None else (plan.seq_lens, False)
    totals = [b - a for a, b in zip(lens.tolist()[:-1], lens.tolist()[1:])] if by_cu else lens.tolist()
    tables = block_tables.tolist()
    width = block_tables.shape[1]
    k_out.zero_()
    v_out.zero_()
    if kv_dtype == "int4b":
        for b in range(B):
            n = min(totals[b], s_out)
            # a block's form follows from the sequence's whole length, not from the rows gathered
            k, v, ok = read_sequence(pool, params, layer.layout, tables[b], totals[b])
            k, v, ok = k[:n], v[:n], ok[:n]
            if rope is not None:
                k = _rope_rows(k, torch.arange(n, device=pool.device), rope)
            k_out[b, :, :n] = torch.where(ok[:, None, None], k, 0).to(k_out.dtype).transpose(0, 1)
            v_out[b, :, :n] = torch.where(ok[:, None, None], v, 0).to(v_out.dtype).transpose(0, 1)
        return
    for b in range(B):
        local = max(totals[b] - cp_rank + cp_size - 1, 0) // cp_size
        ts = [t for t in range(min(local, s_out)) if t // bs < width and 0 <= tables[b][t // bs] < pool.shape[0]]
        if not ts:
            continue
        t_idx = torch.tensor(ts, dtype=torch.long, device=pool.device)
        blks = torch.tensor([tables[b][t // bs] for t in ts], dtype=torch.long, device=pool.device)
        offs = t_idx % bs
        for kv, out in ((0, k_out), (1, v_out)):
            rows = [pool[blks, p, :, offs] if hnd else pool[blks, p, offs] for p in stored_planes(kv_dtype, kv)]
            data = rows[0]  # [n, H, DP]: the row itself, but for k8v4 keys (two planes)
            if kv_dtype == "auto":
                x = data.float()
            elif kv_dtype == "fp8k" and kv == 0:
                x = data.float() * (params[blks, 0, :, offs] if hnd else params[blks, 0, offs])  # [n, H, 1] scales
            elif kv_dtype in ("fp8", "fp8k"):
                x = data.float() * fp8_scales[kv].float()
            else:
                par = params[blks, kv, :, offs] if hnd else params[blks, kv, offs]  # [n, H, 2]
                x = dequantize_rows_reference(unpack_codes(kv_dtype, kv, rows), par[..., 0], par[..., 1])
            if kv == 0 and rope is not None:
                x = _rope_rows(x, t_idx * cp_size + cp_rank, rope)
            if kv_dtype == "auto" and not (kv == 0 and rope is not None):
                x = data  # exact copy
            out[b].index_copy_(1, t_idx, x.to(out.dtype).transpose(0, 1))


# ------------------------------------------------------------------------------------------------------------
# public ops (validate, then launch)

