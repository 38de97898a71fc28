"""int4b in pure torch: keys as int4 codes per channel over each full block, the partial block's keys as int8 rows.

The byte format (one layer; ``bs`` = block_size, ``D`` = head_dim, ``W = ceil(D / bs)``):

* Data pool as ``int4``'s: plane 0 keys, plane 1 values, ``D / 2`` bytes per (token slot, head).
* Params pool of one float32 plane, ``2 + W`` words per (token slot, head): words ``0, 1`` the value row's (scale,
  zero) (``int4``'s value rows), words ``2 ..`` the key area. Across a block's ``bs`` slots a head's key area is
  ``bs * W >= D`` words, read in slot order.
* A **full** block (its sequence holds all ``bs`` of its tokens): key plane = int4 codes (planar nibbles as
  ``int4``), the key area's first ``D`` words read as ``2 D`` float16 values: ``[0, D)`` the channels' scales,
  ``[D, 2 D)`` their zeros (value ``2 w`` in the low half of word ``w``), so that two channels' scales (or zeros)
  sit in one word, the operand of a packed ``fma.f16x2`` as loaded. Over the
  block's ``bs`` keys (after RoPE) of one head: ``scale = fp16((max - min) / 15)``, ``zero = fp16(min)`` per
  channel, ``q = clamp(round_half_even((x - zero) * (1 / scale)), 0, 15)`` with the stored fp16 values (``q = 0``
  where ``scale == 0``), read back as ``q * scale + zero``.
* The **partial** last block of a sequence (``0 < L % bs``): its keys are int8 rows as ``int8`` stores them
  (per-row (scale, zero) in float32); row ``r``'s elements ``[0, D/2)`` in slot ``r`` of this block's key plane,
  ``[D/2, D)`` in slot ``r`` of the **next** block's key plane (the next entry of the block table, empty until the
  partial block fills); its (scale, zero) in key-area words ``2 r``, ``2 r + 1``. The append that fills the block
  reads these rows back, adds its own, and writes the block as a full one.
* A key row with a NaN or an infinity: its int8 row stores scale / zero NaN (``int8``'s rule: the whole row reads
  back NaN); once the block fills, every channel of the head in which a row is not finite gets scale and zero NaN,
  so the block's keys of that head read back NaN in those channels (all of them where the row was an int8 row).

A sequence of ``L`` tokens holds ``L // bs`` full blocks, then, when ``L % bs``, the partial block and the one after
it: :func:`blocks_for_tokens`.
"""

from __future__ import annotations

import torch

from .format import pack_codes, unpack_codes

__all__ = ["blocks_for_tokens"]  # the rest: the torch path's helpers (reference.py, the attention reference)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks an int4b sequence of ``num_tokens`` tokens holds: its full blocks, and a partial one with the block
    after it (whose key plane holds the second halves of the partial block's int8 rows).

    Example
    -------
    >>> blocks_for_tokens(32, 16), blocks_for_tokens(33, 16), blocks_for_tokens(0, 16)
    (2, 4, 0)
    """
    return num_tokens // block_size + (2 if num_tokens % block_size else 0)


def _plane(pool: torch.Tensor, blk: int, plane: int, layout: str) -> torch.Tensor:
    """``[H, bs, D / 2]`` view of one block's plane."""
    t = pool[blk, plane]
    return t.transpose(0, 1) if layout == "NHD" else t


def _words(params: torch.Tensor, blk: int, layout: str) -> torch.Tensor:
    """``[H, bs, 2 + W]`` view of one block's params plane."""
    t = params[blk, 0]
    return t.transpose(0, 1) if layout == "NHD" else t


def _key_area(params: torch.Tensor, blk: int, layout: str) -> torch.Tensor:
    """``[H, bs * W]`` float32 copy of one block's key area (slot-major)."""
    w = _words(params, blk, layout)[..., 2:]
    return w.reshape(w.shape[0], -1)


def _set_key_area(params: torch.Tensor, blk: int, layout: str, area: torch.Tensor) -> None:
    w = _words(params, blk, layout)[..., 2:]
    w.copy_(area.reshape(w.shape))


def encode_full_block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A full block's keys ``x`` ``[bs, H, D]`` (float32, after RoPE) as stored: (codes uint8 ``[H, bs, D / 2]``,
    the key area's first ``D`` words, float32 ``[H, D]``: as float16 ``[H, 2 D]``, the channels' scales then their
    zeros)."""
    x = x.float().transpose(0, 1)  # [H, bs, D]
    h, _, _ = x.shape
    bad = ~torch.isfinite(x).all(dim=1)  # [H, D]
    xf = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    mn, mx = xf.amin(dim=1), xf.amax(dim=1)
    scale = ((mx - mn) / 15.0).half().float()
    zero = mn.half().float()
    nan = torch.full_like(scale, float("nan"))
    scale, zero = torch.where(bad, nan, scale), torch.where(bad, nan, zero)
    ok = (scale > 0) & torch.isfinite(scale) & torch.isfinite(zero)
    inv = torch.where(ok, 1.0 / torch.where(ok, scale, torch.ones_like(scale)), torch.zeros_like(scale))
    q = torch.round((xf - torch.where(ok, zero, torch.zeros_like(zero))[:, None]) * inv[:, None]).clamp(0, 15)
    codes = pack_codes("int4", 0, q.to(torch.int32))[0]
    halves = torch.cat([scale.half(), zero.half()], dim=-1).contiguous()  # [H, 2 D] fp16
    return codes, halves.view(torch.float32)


def decode_full_block(codes: torch.Tensor, area: torch.Tensor, head_dim: int) -> torch.Tensor:
    """float32 keys ``[bs, H, D]`` of a full block from its codes ``[H, bs, D / 2]`` and key area ``[H, >= D]``."""
    q = unpack_codes("int4", 0, [codes]).float()  # [H, bs, D]
    halves = area[:, :head_dim].contiguous().view(torch.float16).float()  # [H, 2 D]: scales, zeros
    return (q * halves[:, None, :head_dim] + halves[:, None, head_dim:]).transpose(0, 1)


def _int8_rows(pool: torch.Tensor, blk: int, nxt: int, n: int, area: torch.Tensor, layout: str) -> torch.Tensor:
    """float32 keys ``[n, H, D]`` of a partial block's first ``n`` int8 rows: halves in the key planes of ``blk``
    and ``nxt``, (scale, zero) in key-area words ``2 r``, ``2 r + 1`` (a multiply, then an add)."""
    q = torch.cat([_plane(pool, blk, 0, layout)[:, :n], _plane(pool, nxt, 0, layout)[:, :n]], dim=-1)
    sz = area[:, : 2 * n].reshape(area.shape[0], n, 2)
    return (q.float() * sz[..., 0:1] + sz[..., 1:2]).transpose(0, 1)


def _rows8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .reference import quantize_rows_reference

    return quantize_rows_reference(x, 8)


def read_sequence(pool: torch.Tensor, params: torch.Tensor, layout: str, table: list[int], length: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stored K and V of one sequence: (k, v float32 ``[length, H, D]``, readable bool ``[length]``), tokens in
    blocks outside the pool (or a partial block whose next block is) not readable (zeros)."""
    nb = pool.shape[0]
    h, bs, half = _plane(pool, 0, 0, layout).shape
    d = 2 * half
    k = torch.zeros((length, h, d), dtype=torch.float32, device=pool.device)
    v = torch.zeros_like(k)
    ok = torch.zeros(length, dtype=torch.bool, device=pool.device)
    for bi in range(-(-length // bs)):
        n = min(bs, length - bi * bs)
        blk = table[bi] if bi < len(table) else -1
        nxt = table[bi + 1] if bi + 1 < len(table) else -1
        if not 0 <= blk < nb or (n < bs and not 0 <= nxt < nb):
            continue
        sl = slice(bi * bs, bi * bs + n)
        area = _key_area(params, blk, layout)
        if n == bs:
            k[sl] = decode_full_block(_plane(pool, blk, 0, layout), area, d)
        else:
            k[sl] = _int8_rows(pool, blk, nxt, n, area, layout)
        vw = _words(params, blk, layout)[:, :n]  # [H, n, 2 + W]
        vq = unpack_codes("int4", 1, [_plane(pool, blk, 1, layout)[:, :n]]).float()
        v[sl] = (vq * vw[..., 0:1] + vw[..., 1:2]).transpose(0, 1)
        ok[sl] = True
    return k, v, ok


def write_sequence(pool: torch.Tensor, params: torch.Tensor, layout: str, table: list[int], start: int,
                   k: torch.Tensor, v: torch.Tensor) -> None:
    """Append rows ``k`` / ``v`` ``[n, H, D]`` (float32, keys after RoPE) at positions ``start ..`` of one sequence.
    A block outside the pool, or a partial block whose next block is, is not written (as the kernels skip
    out-of-range block ids)."""
    nb = pool.shape[0]
    _, bs, half = _plane(pool, 0, 0, layout).shape
    d = 2 * half
    n_new = k.shape[0]
    pos = start
    while pos < start + n_new:
        bi, o0 = divmod(pos, bs)
        o1 = min(bs, o0 + (start + n_new - pos))  # rows o0 .. o1 - 1 of block bi come from this call
        rows = slice(pos - start, pos - start + (o1 - o0))
        blk = table[bi] if bi < len(table) else -1
        nxt = table[bi + 1] if bi + 1 < len(table) else -1
        pos += o1 - o0
        if not 0 <= blk < nb or (o1 < bs and not 0 <= nxt < nb) or (o0 > 0 and not 0 <= nxt < nb):
            continue
        vq, vs, vz = quantize_values(v[rows])
        _plane(pool, blk, 1, layout)[:, o0:o1] = pack_codes("int4", 1, vq)[0].transpose(0, 1)
        vw = _words(params, blk, layout)
        vw[:, o0:o1, 0] = vs.transpose(0, 1)
        vw[:, o0:o1, 1] = vz.transpose(0, 1)
        area = _key_area(params, blk, layout)
        if o1 == bs:  # the block fills: its earlier int8 rows and these rows, per channel
            full = k[rows].float()
            if o0:
                full = torch.cat([_int8_rows(pool, blk, nxt, o0, area, layout), full], dim=0)
            codes, words = encode_full_block(full)
            _plane(pool, blk, 0, layout).copy_(codes)
            area[:, :d] = words  # (the words past D, if any, are not read)
        else:  # int8 rows, halves in this block's and the next block's key plane
            q, s, z = _rows8(k[rows])  # [n, H, D], [n, H]
            _plane(pool, blk, 0, layout)[:, o0:o1] = q[..., :half].transpose(0, 1)
            _plane(pool, nxt, 0, layout)[:, o0:o1] = q[..., half:].transpose(0, 1)
            area[:, 2 * o0: 2 * o1: 2] = s.transpose(0, 1)  # words 2 r, 2 r + 1: row r's (scale, zero)
            area[:, 2 * o0 + 1: 2 * o1: 2] = z.transpose(0, 1)
        _set_key_area(params, blk, layout, area)


def quantize_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 value rows as ``int4`` stores them: (codes int32 ``[n, H, D]``, scale, zero float32 ``[n, H]``)."""
    from .reference import quantize_rows_reference

    q, s, z = quantize_rows_reference(x, 4)
    return q.to(torch.int32), s, z
