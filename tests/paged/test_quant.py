"""Quantized paged pools (int8, int4, fp8, fp8k): the byte format of kvcache.paged.config, checked against the
independent reference (bit-exact without RoPE: the documented float32 formula) and against the documented
properties (error bound scale / 2, scale == (max - min) / (2^b - 1), zero == min, constant rows exact, masked
lanes never in min / max, int4 nibble order, fp8 = clamp(x / scale, +-448) with per-layer scales).
"""

from __future__ import annotations

import pytest
import torch

from kvcache.rope import RopeConfig
from sweeps import each_value, named, pairwise

from . import paged_reference as pr

INT_DTYPES = ["int8", "int4"]
ALL_INT_DTYPES = [*INT_DTYPES, "k8v4"]  # k8v4: int8 keys, int4 values
# (head_dim, layout): power-of-two and padded head dims (BLOCK_D > D: masked lanes), both layouts
SHAPES = [
    pytest.param((8, "NHD"), id="d8-NHD"),
    pytest.param((64, "HND"), id="d64-HND"),
    pytest.param((80, "NHD"), id="d80-NHD"),
    pytest.param((96, "HND"), id="d96-HND"),
]


def _batch(device, gen, H, D, bs, dtype=torch.float16, q_lens=(5, 1, 0, 3), kv_lens=(0, 6, 2, 9), scale=1.0):  # type: ignore[no-untyped-def]
    cu = pr.cumsum0(q_lens)
    totals = [a + b for a, b in zip(kv_lens, q_lens)]
    tables = pr.block_tables_for(gen, totals, block_size=bs, num_blocks=16, extra=1)
    # per-row offsets so that rows do not all share one range: x = offset + scale * normal
    k = pr.randn((cu[-1], H, D), torch.float32, gen, "cpu", scale) + pr.randn((cu[-1], H, 1), torch.float32, gen,
                                                                            "cpu", 3.0)
    v = pr.randn((cu[-1], H, D), torch.float32, gen, "cpu", scale)
    return k.to(dtype).to(device), v.to(dtype).to(device), tables, cu, list(kv_lens)


def _append(cache, k, v, tables, cu, kv_lens, device, **kw):  # type: ignore[no-untyped-def]
    cache.append(0, k, v, cache.plan(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                                     kv_lens=pr.i32(kv_lens, device), **kw))


def _check_quant_properties(cache, exp, kv_dtype, layout, rope):  # type: ignore[no-untyped-def]
    """The documented properties, per written (token, head) row of K and V, from the stored bytes alone and
    the values the reference says were meant to be stored (keys rotated)."""
    p, par = cache.pool(0).cpu(), cache.params(0).cpu()
    H = cache.config.num_kv_heads
    for t in exp.targets:
        for kv in (0, 1):
            qmax = pr.qmax_of(kv_dtype, kv)
            x = exp.values[(t.row, kv)]
            slack = pr.rope_slack(x[None], rope)[0] if (rope is not None and kv == 0) else torch.zeros(H, 1)
            for h in range(H):
                idx = pr.row_index(layout, t.block, kv, t.offset, h)
                where = f"row {t.row} kv {kv} head {h}"
                scale, zero = par[idx][0], par[idx][1]
                assert torch.isfinite(scale) and torch.isfinite(zero) and float(scale) >= 0.0, where
                codes = pr.stored_codes(p, idx, kv_dtype)
                assert all(0 <= c <= qmax for c in codes), where
                deq = pr.decode_row(p, par, idx, kv_dtype, 1.0)
                assert not torch.isnan(deq).any(), where
                # |dequant - x| <= scale / 2 (+ float32 rounding, + the RoPE slack for keys)
                bound = pr.quant_bound(scale, x[h][None])[0] + slack[h]
                pr.assert_close(deq, x[h], bound, where + ": |dequant - x| <= scale / 2")
                if float(x[h].max()) > float(x[h].min()):
                    # the row's min maps to code 0 and its max to 2^b - 1 (no range wasted)
                    assert min(codes) == 0 and max(codes) == qmax, f"{where}: codes span {min(codes)}..{max(codes)}"


# ---------------------------------------------------------------------------------------------------------
# int8 / int4 append


@pytest.mark.parametrize(("kv_dtype", "shape", "use_rope"),
                         pairwise(ALL_INT_DTYPES, SHAPES, named([False, True], ["no-rope", "rope"])))
def test_int_append(device, kv_dtype, shape, use_rope):
    """Without RoPE: codes, scale and zero bit-exact against the reference's float32 formula. With RoPE
    (partial rotary on the padded shapes): within the derived bounds. Both: the documented properties."""
    D, layout = shape
    H, bs = 3, 4
    rope = None
    if use_rope:
        rope = RopeConfig(head_dim=D, rotary_dim=D if D in (8, 64) else D // 2, interleaved=D == 96)
    gen = pr.generator(100 + D)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, kv_dtype=kv_dtype, layout=layout)
    k, v, tables, cu, kv_lens = _batch(device, gen, H, D, bs)
    targets = pr.ragged_targets(cu[-1], tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=16)
    exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout=layout,
                             rope=rope)
    _append(cache, k, v, tables, cu, kv_lens, device, rope=rope if rope is not None else False)
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout=layout, rope=rope)
    _check_quant_properties(cache, exp, kv_dtype, layout, rope)


@pytest.mark.parametrize("kv_dtype", ALL_INT_DTYPES)
def test_int_append_bf16_and_fp32_models(device, kv_dtype):
    for dtype in (torch.bfloat16, torch.float32):
        gen = pr.generator(110)
        cache = pr.sentinel_cache(device, num_kv_heads=2, head_dim=16, block_size=2, kv_dtype=kv_dtype, dtype=dtype)
        k, v, tables, cu, kv_lens = _batch(device, gen, 2, 16, 2, dtype=dtype, q_lens=(3, 2), kv_lens=(1, 0))
        targets = pr.ragged_targets(cu[-1], tables, cu, kv_lens=kv_lens, block_size=2, num_blocks=16)
        exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout="NHD")
        _append(cache, k, v, tables, cu, kv_lens, device)
        pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD",
                                 what=str(dtype))
        _check_quant_properties(cache, exp, kv_dtype, "NHD", None)


def _write_rows(cache, rows_k, rows_v, device, rope=None, positions=None):  # type: ignore[no-untyped-def]
    """Append rows [n, H, D] at slots 0..n-1 (slot mapping)."""
    n = rows_k.shape[0]
    kw = {}
    if rope is not None:
        kw = dict(rope=rope, positions=torch.tensor(positions, device=device))
    cache.append(0, rows_k.to(device), rows_v.to(device), cache.plan(slot_mapping=torch.arange(n, device=device), **kw))


def test_int4_nibble_order_and_exact_codes(device):
    """Rows of integers 0..15 with both ends present: scale 1, zero 0, codes equal the values, and (planar
    halves) byte i holds element i in its low nibble and element D/2 + i in its high nibble."""
    D = 16
    vals = [[0, 15, 1, 14, 2, 13, 3, 12, 4, 11, 5, 10, 6, 9, 7, 8],
            [15, 0, 7, 7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13]]
    x = torch.tensor(vals, dtype=torch.float16)[:, None, :]  # [2, 1, 16]
    cache = pr.sentinel_cache(device, num_kv_heads=1, head_dim=D, block_size=4, kv_dtype="int4")
    _write_rows(cache, x, x + 100, device)
    p, par = cache.pool(0).cpu(), cache.params(0).cpu()
    for r, row in enumerate(vals):
        want = [row[i] | (row[D // 2 + i] << 4) for i in range(D // 2)]
        assert p[0, 0, r, 0].tolist() == want, f"row {r}: bytes {p[0, 0, r, 0].tolist()} != {want}"
        assert par[0, 0, r, 0].tolist() == [1.0, 0.0]
        assert p[0, 1, r, 0].tolist() == want  # values: same codes, zero 100
        assert par[0, 1, r, 0].tolist() == [1.0, 100.0]
    assert p[0, 0, 0, 0, 0].item() == 0x40  # element 0 = 0 (low nibble), element 8 = 4 (high nibble)
    assert p[0, 0, 1, 0, 1].item() == 0x60  # row 1: element 1 = 0, element 9 = 6


def test_int8_exact_codes(device):
    """Integer rows spanning 0..255: scale 1, zero = min, codes equal x - min."""
    gen = pr.generator(111)
    D = 32
    rows = []
    for lo in (0, -100, 1000):
        r = torch.randint(0, 256, (D,), generator=gen)
        r[3], r[17] = 0, 255
        rows.append(r + lo)
    x = torch.stack(rows).to(torch.float16)[:, None, :]  # integers up to 1255: exact in fp16
    cache = pr.sentinel_cache(device, num_kv_heads=1, head_dim=D, block_size=4, kv_dtype="int8")
    _write_rows(cache, x, x, device)
    p, par = cache.pool(0).cpu(), cache.params(0).cpu()
    for i, lo in enumerate((0, -100, 1000)):
        for kv in (0, 1):
            assert p[0, kv, i, 0].tolist() == (rows[i] - lo).tolist()
            assert par[0, kv, i, 0].tolist() == [1.0, float(lo)]


@pytest.mark.parametrize("kv_dtype", INT_DTYPES)
def test_round_half_to_even(device, kv_dtype):
    """(x - zero) / scale exactly k + 0.5 rounds to the even neighbour."""
    qmax = pr.qmax_of(kv_dtype, 0)
    halves = [0.5, 1.5, 2.5, 3.5, 6.5, 7.5, 12.5, 13.5]
    want = [0, 2, 2, 4, 6, 8, 12, 14]
    if kv_dtype == "int8":
        halves += [100.5, 101.5, 253.5, 254.5]
        want += [100, 102, 254, 254]
    row = [0.0, float(qmax)] + halves
    row += [1.0] * (-len(row) % 4)
    D = len(row)
    x = torch.tensor(row, dtype=torch.float32)[None, None, :]  # exact halves need float32 past fp16's 2048
    cache = pr.sentinel_cache(device, num_kv_heads=1, head_dim=D, block_size=4, kv_dtype=kv_dtype,
                              dtype=torch.float32)
    _write_rows(cache, x, x, device)
    raw = cache.pool(0)[0, 0, 0, 0].cpu()
    codes = pr.unpack_int4(raw) if kv_dtype == "int4" else raw.tolist()
    assert cache.params(0)[0, 0, 0, 0].tolist() == [1.0, 0.0]
    assert codes[2:2 + len(want)] == want, f"codes of {halves}: {codes[2:2 + len(want)]}, expected {want}"


@pytest.mark.parametrize("kv_dtype", INT_DTYPES)
def test_constant_rows_round_trip_exactly(device, kv_dtype):
    """max == min: scale 0, zero = the value, codes 0, and gather returns the value exactly (never NaN)."""
    H, D = 4, 80
    consts = [-2.5, 0.0, 1000.0, 3.140625]
    x = torch.tensor(consts, dtype=torch.float16)[None, :, None].expand(6, H, D).contiguous()
    rope = RopeConfig(head_dim=D)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=4, kv_dtype=kv_dtype, rope=rope)
    gen = pr.generator(112)
    k = pr.randn((6, H, D), torch.float16, gen, "cpu")
    # slots 0..5: K random and rotated, V constant (V is never rotated)
    first = torch.arange(6, device=device)
    cache.append(0, k.to(device), x.to(device), cache.plan(slot_mapping=first, positions=first))
    # slots 6..11: constant keys written without RoPE
    cache.append(0, x.to(device), x.to(device), cache.plan(slot_mapping=first + 6, rope=False))
    par = cache.params(0).cpu()
    p = cache.pool(0).cpu()
    for slot in range(12):
        blk, off = divmod(slot, 4)
        for h in range(H):
            for kv in (1,) if slot < 6 else (0, 1):
                assert par[blk, kv, off, h].tolist() == [0.0, consts[h]], (slot, kv, h, par[blk, kv, off, h])
                assert not p[blk, kv, off, h].any(), "codes of a constant row must be 0"
    k_out, v_out = cache.gather(0, cache.plan(pr.i32([[0, 1, 2]], device), seq_lens=pr.i32([12], device)))
    assert not torch.isnan(k_out).any() and not torch.isnan(v_out).any()
    for slot in range(12):
        pr.assert_bits_equal(v_out[0, :, slot].cpu(), x[0], f"gathered constant V at slot {slot}")
    for slot in range(6, 12):
        pr.assert_bits_equal(k_out[0, :, slot].cpu(), x[0], f"gathered constant K at slot {slot}")


@pytest.mark.parametrize("use_rope", [False, True], ids=["no-rope", "rope"])
@pytest.mark.parametrize("D", [80, 96])
@pytest.mark.parametrize("kv_dtype", INT_DTYPES)
def test_masked_lanes_never_enter_min_max(device, kv_dtype, D, use_rope):
    """head_dim 80 / 96 run with a power-of-two lane count: the lanes past D (and the head past H) read memory
    that here holds 1e4 (k, v are slices of wider tensors). Scales, zeros and codes must be those of the D
    real values alone."""
    H, width, n = 3, 128, 6
    gen = pr.generator(113 + D)
    rope = RopeConfig(head_dim=D, rotary_dim=D - 16) if use_rope else None
    wide_k = torch.full((n, H + 1, width), 1e4, dtype=torch.float16)
    wide_v = torch.full((n, H + 1, width), -1e4, dtype=torch.float16)
    wide_k[:, :H, :D] = pr.randn((n, H, D), torch.float16, gen, "cpu")
    wide_v[:, :H, :D] = pr.randn((n, H, D), torch.float16, gen, "cpu")
    wide_k, wide_v = wide_k.to(device), wide_v.to(device)
    k, v = wide_k[:, :H, :D], wide_v[:, :H, :D]
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=4, kv_dtype=kv_dtype)
    slots = [4, 0, 13, 7, 2, 9]
    positions = [4, 0, 13, 7, 2, 900]
    targets = pr.slot_targets(slots, block_size=4, num_blocks=16, positions=positions)
    exp = pr.append_expected(cache.pool(0), cache.params(0), k.contiguous(), v.contiguous(), targets,
                             kv_dtype=kv_dtype, layout="NHD", rope=rope)
    kw = dict(rope=rope, positions=torch.tensor(positions, device=device)) if use_rope else {}
    cache.append(0, k, v, cache.plan(slot_mapping=torch.tensor(slots, device=device), **kw))
    pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout="NHD", rope=rope)
    scales = torch.stack([cache.params(0)[s // 4, :, s % 4, :, 0] for s in slots]).cpu()
    assert float(scales.max()) < 10.0 / pr.qmax_of(kv_dtype, 0), "a scale reflects the 1e4 lanes past the row"
    _check_quant_properties(cache, exp, kv_dtype, "NHD", rope)


# ---------------------------------------------------------------------------------------------------------
# fp8


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.0371, 2.5)], ids=["default-scales", "kv-scales"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("D", [64, 80])
def test_fp8_append_bit_exact(device, D, layout, scales):
    """float8_e4m3fn(clamp(x / scale, -448, 448)) with the layer's (k_scale, v_scale): bit-exact (values past
    448 * scale saturate)."""
    H, bs = 2, 4
    gen = pr.generator(120 + D)
    cache = pr.sentinel_cache(device, num_layers=2, num_kv_heads=H, head_dim=D, block_size=bs, kv_dtype="fp8",
                              layout=layout)
    cache.kv_scales[1] = torch.tensor(scales)
    k, v, tables, cu, kv_lens = _batch(device, gen, H, D, bs, scale=4.0)
    k[0, 0, :4] = torch.tensor([3000.0, -3000.0, 500.0, -17.0])  # saturate at any scale here
    v[1, 1, :3] = torch.tensor([1200.0, -1121.0, 1e-4])
    targets = pr.ragged_targets(cu[-1], tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=16)
    exp = pr.append_expected(cache.pool(1), None, k, v, targets, kv_dtype="fp8", layout=layout, fp8_scales=scales)
    cache.append(1, k, v, cache.plan(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                                     kv_lens=pr.i32(kv_lens, device)))
    pr.assert_append_matches(cache.pool(1), None, exp, kv_dtype="fp8", layout=layout, fp8_scales=scales)
    assert pr.is_all_sentinel(cache.pool(0)), "layer 0 was written"
    assert not torch.isnan(cache.pool(1).float()).any()


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.25, 3.0)], ids=["default-scales", "kv-scales"])
def test_fp8_append_with_rope(device, scales):
    H, D, bs = 2, 80, 4
    rope = RopeConfig(head_dim=D, rotary_dim=64, interleaved=True)
    gen = pr.generator(121)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, kv_dtype="fp8")
    cache.kv_scales[0] = torch.tensor(scales)
    k, v, tables, cu, kv_lens = _batch(device, gen, H, D, bs)
    targets = pr.ragged_targets(cu[-1], tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=16)
    exp = pr.append_expected(cache.pool(0), None, k, v, targets, kv_dtype="fp8", layout="NHD", rope=rope,
                             fp8_scales=scales)
    cache.append(0, k, v, cache.plan(block_tables=pr.i32(tables, device), cu_q_lens=pr.i32(cu, device),
                                     kv_lens=pr.i32(kv_lens, device), rope=rope))
    pr.assert_append_matches(cache.pool(0), None, exp, kv_dtype="fp8", layout="NHD", rope=rope, fp8_scales=scales)


def test_fp8_rounding_edge_values(device):
    """Values at and next to fp8 e4m3 rounding boundaries (ties, binade carries, subnormals), bit-exact."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # non-negative fp8 values
    mids = (grid[:-1] + grid[1:]) / 2  # ties between neighbours: round half to even
    up = torch.nextafter(mids, torch.tensor(1e9))
    down = torch.nextafter(mids, torch.tensor(-1e9))
    vals = torch.cat([grid, mids, up, down, torch.tensor([448.0, 464.0, 1e6, -0.49, -0.2402, 2.0**-10, 2.0**-9])])
    vals = torch.cat([vals, -vals])
    D = 64
    n = -(-vals.numel() // D)
    rows = torch.cat([vals, torch.ones(n * D - vals.numel())]).reshape(n, 1, D)
    cache = pr.sentinel_cache(device, num_kv_heads=1, head_dim=D, block_size=16, kv_dtype="fp8",
                              dtype=torch.float32)
    targets = pr.slot_targets(list(range(n)), block_size=16, num_blocks=16)
    exp = pr.append_expected(cache.pool(0), None, rows, rows, targets, kv_dtype="fp8", layout="NHD")
    _write_rows(cache, rows, rows, device)
    pr.assert_append_matches(cache.pool(0), None, exp, kv_dtype="fp8", layout="NHD")


# ---------------------------------------------------------------------------------------------------------
# gather of quantized pools


@pytest.mark.parametrize(("kv_dtype", "layout"), each_value(["int8", "int4", "k8v4", "fp8", "fp8k"], ["NHD", "HND"]))
def test_quantized_gather(device, kv_dtype, layout):
    """Gather dequantizes: fp8 bit-exact (x * scale, one float32 product), int8 / int4 within one ulp of the
    model dtype of q * scale + zero, and within scale / 2 (+ one model-dtype rounding) of what was appended;
    fp8k bit-exact (code * the row's scale for keys, code * v_scale for values), keys within
    max(|x| / 16, scale / 1024) and values within |x| / 16 + 2^-10 v_scale of what was appended."""
    H, D, bs = 3, 80, 4
    gen = pr.generator(130)
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, kv_dtype=kv_dtype, layout=layout)
    scales = (0.5, 0.125) if kv_dtype in ("fp8", "fp8k") else (1.0, 1.0)
    cache.kv_scales[0] = torch.tensor(scales)
    q_lens, kv_lens = (5, 7, 2), (0, 0, 0)
    k, v, tables, cu, _ = _batch(device, gen, H, D, bs, q_lens=q_lens, kv_lens=kv_lens)
    _append(cache, k, v, tables, cu, list(kv_lens), device)
    s_out = 9
    base = pr.fill_sentinel(torch.empty((2, 3, H, s_out, D), dtype=torch.float16, device=device))
    k_out, v_out = cache.gather(0, cache.plan(pr.i32(tables, device), seq_lens=pr.i32(list(q_lens), device)),
                                k_out=base[0], v_out=base[1])
    exp = pr.gather_expected(cache.pool(0), cache.params(0), tables, list(q_lens), kv_dtype=kv_dtype,
                             layout=layout, s_out=s_out, dtype=torch.float16, fp8_scales=scales)
    pr.assert_gather_matches(k_out, v_out, exp, kv_dtype=kv_dtype)
    if kv_dtype == "fp8":
        return
    par = cache.params(0).cpu()
    if kv_dtype == "fp8k":
        for name, out, src, kv in (("k", k_out.cpu(), k.cpu(), 0), ("v", v_out.cpu(), v.cpu(), 1)):
            for b in range(3):
                n, rows = q_lens[b], slice(cu[b], cu[b + 1])
                x = src[rows].float()  # [n, H, D]
                got = out[b, :, :n].transpose(0, 1)
                if kv == 0:  # the rows' own scales, [n, H, 1]
                    scale = torch.stack([par[pr.row_index(layout, tables[b][t // bs], 0, t % bs, h)]
                                         for t in range(n) for h in range(H)]).reshape(n, H, 1)
                    bound = pr.fp8k_bound(scale, x)
                else:
                    bound = x.double().abs() / 16 + 2.0**-10 * scales[1]
                bound = bound + pr.ulp(got.double().abs(), torch.float16)
                pr.assert_close(got, x, bound, f"{name} seq {b}: gather vs appended")
        return
    for name, out, src, kv in (("k", k_out.cpu(), k.cpu(), 0), ("v", v_out.cpu(), v.cpu(), 1)):
        for b in range(3):
            for t in range(q_lens[b]):
                blk, off = tables[b][t // bs], t % bs
                for h in range(H):
                    scale = par[pr.row_index(layout, blk, kv, off, h)][0]
                    x = src[cu[b] + t, h].float()
                    got = out[b, h, t]
                    bound = pr.quant_bound(scale, x[None])[0] + pr.ulp(got.double().abs(), torch.float16)
                    pr.assert_close(got, x, bound, f"{name} seq {b} token {t} head {h}: gather vs appended")


@pytest.mark.slow
@pytest.mark.parametrize("use_rope", [False, True], ids=["no-rope", "rope"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "k8v4", "fp8", "fp8k"])
def test_quantized_sweep_large(device, kv_dtype, layout, use_rope):
    """GPU-sized: 8 heads, head_dims 128 and 576 (padded to 1024 lanes), block 16."""
    for D in (128, 576):
        H, bs = 8, 16
        rope = RopeConfig(head_dim=D, rotary_dim=64 if D == 576 else D) if use_rope else None
        gen = pr.generator(140 + D)
        cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=bs, kv_dtype=kv_dtype,
                                  layout=layout, num_blocks=64)
        q_lens = torch.randint(1, 40, (8,), generator=gen).tolist()
        kv_lens = torch.randint(0, 60, (8,), generator=gen).tolist()
        cu = pr.cumsum0(q_lens)
        totals = [a + b for a, b in zip(kv_lens, q_lens)]
        tables = pr.block_tables_for(gen, totals, block_size=bs, num_blocks=64)
        k = pr.randn((cu[-1], H, D), torch.float16, gen, device, 2.0)
        v = pr.randn((cu[-1], H, D), torch.float16, gen, device, 2.0)
        targets = pr.ragged_targets(cu[-1], tables, cu, kv_lens=kv_lens, block_size=bs, num_blocks=64)
        exp = pr.append_expected(cache.pool(0), cache.params(0), k, v, targets, kv_dtype=kv_dtype, layout=layout,
                                 rope=rope)
        _append(cache, k, v, tables, cu, kv_lens, device, rope=rope if rope is not None else False)
        pr.assert_append_matches(cache.pool(0), cache.params(0), exp, kv_dtype=kv_dtype, layout=layout, rope=rope,
                                 what=f"D={D}")
