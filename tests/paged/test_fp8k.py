"""kv_dtype="fp8k" through the public API: fp8 values with the layer's v_scale, fp8 keys with a float32 scale per
(token, head) (``max(amax / 448, 2^-126)``), as the byte-format docstring of :mod:`kvcache.paged.config` states it.

Checked here, on both CPU backends (and compiled on a GPU): the stored bytes and scales against an encoding
computed in the test (``float8_e4m3fn(clamp(x * (1 / scale), -448, 448))``, scale ``amax / 448``), the
values' bytes with v_scale and without k_scale, the row's largest element stored as +-448 (read back exactly in
the model dtype), the documented error bound ``max(|x| / 16, scale / 1024)`` after a gather, zero rows, rows of
magnitude ~1e-37 (the scale's floor), rows with a NaN or an infinity (NaN scale, NaN read back, other rows
untouched), both layouts, the torch path against the
Triton kernels (bit-exact without RoPE; with RoPE within the RoPE rounding), attention over the pool against
attention over the gathered K / V, bytes per (token, head) ``2 D + 4``, copy_blocks and swap_out / swap_in with
the scales, and a params pool of the wrong shape.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvcache import PagedConfig, PagedKVCache, RopeConfig, cache_block_bytes
from kvcache.ops import append_paged_kv, gather_paged_kv, paged_attention

from . import paged_reference as pr

FP8_MAX = 448.0
H, D, BS, NB = 3, 20, 4, 6  # head_dim 20: the kernels run 32 lanes, 12 of them masked
K_SCALE, V_SCALE = 4.0, 0.25  # k_scale must not change fp8k's bytes; v_scale does
HAS_CUDA = torch.cuda.is_available()


def _cache(device, layout: str = "NHD", dtype: torch.dtype = torch.float16, rope: RopeConfig | None = None,
           k_scale: float = K_SCALE) -> PagedKVCache:  # type: ignore[no-untyped-def]
    """A one-layer fp8k cache whose data and params pools hold the sentinel byte in every byte."""
    cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=NB,
                                     dtype=dtype, kv_dtype="fp8k", layout=layout, device=device), rope=rope)
    cache.kv_scales[0] = torch.tensor([k_scale, V_SCALE])
    pr.fill_sentinel(cache.buffer)
    pr.fill_sentinel(cache.params_buffer)
    return cache


def _encode_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented key encoding of finite float32 rows ``x`` [..., D]: (fp8 codes [..., D], scales [..., 1]);
    ``scale = max(amax / 448, 2^-126)`` (one IEEE float32 division; the floor for a non-zero row), 0 for a zero
    row."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, torch.clamp(amax / torch.tensor(FP8_MAX), min=2.0**-126), amax)
    nonzero = scale > 0
    inv = torch.where(nonzero, 1.0 / torch.where(nonzero, scale, torch.ones_like(scale)), torch.zeros_like(scale))
    return (x * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _encode_values(x: torch.Tensor, v_scale: float) -> torch.Tensor:
    """fp8 values: ``float8_e4m3fn(clamp(x * (1 / v_scale), -448, 448))``."""
    inv = 1.0 / torch.tensor(v_scale, dtype=torch.float32)
    return (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _rows(t: torch.Tensor, layout: str, slots: list[int], plane: int) -> torch.Tensor:
    """The stored rows of ``slots`` in plane ``plane`` of a layer's pool or params: ``[n, H, R]`` on the CPU."""
    t = t.detach().cpu()
    blk = torch.tensor([s // BS for s in slots])
    off = torch.tensor([s % BS for s in slots])
    return t[blk, plane, off] if layout == "NHD" else t[blk, plane, :, off]


def _append_slots(cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor, slots: list[int],
                  positions: list[int] | None = None) -> None:
    dev = cache.device
    kw = {} if positions is None else dict(positions=torch.tensor(positions, device=dev))
    cache.append(0, k.to(dev), v.to(dev), cache.plan(slot_mapping=torch.tensor(slots, device=dev), **kw))


def _gather_one(cache: PagedKVCache, blocks: list[int], n: int,  # type: ignore[no-untyped-def]
                dtype: torch.dtype | None = None):
    """One sequence of ``n`` tokens in ``blocks`` read back through the public gather: K, V ``[n, H, D]`` (CPU)."""
    cfg, dev = cache.config, cache.device
    k, v = gather_paged_kv(cache.pool(0), cache.params(0), kv_dtype="fp8k", layout=cfg.layout,
                           block_tables=torch.tensor([blocks], dtype=torch.int32, device=dev),
                           kv_lens=torch.tensor([n], dtype=torch.int32, device=dev), dtype=dtype or cfg.dtype,
                           max_len=n, fp8_scales=cache.kv_scales[0])
    return k[0].transpose(0, 1).cpu(), v[0].transpose(0, 1).cpu()


def _spread_rows(gen: torch.Generator, n: int, scale_spread: float = 3.0) -> torch.Tensor:
    """float32 ``[n, H, D]`` rows of very different magnitudes (a log-normal factor per row, within e^-8 .. e^5:
    float16 holds them)."""
    x = torch.randn((n, H, D), generator=gen)
    return x * torch.exp((torch.randn((n, H, 1), generator=gen) * scale_spread).clamp(-8.0, 5.0))


# ---------------------------------------------------------------------------------------------------------
# the byte format


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_stored_bytes_and_scales(device, layout):
    """Keys: fp8 codes of ``x * (1 / (amax / 448))`` and scale ``amax / 448`` per (token, head), bit-exact, the
    largest element stored as +-448; values: fp8 of ``x / v_scale`` (saturating), bit-exact; k_scale unused (the
    same bytes with k_scale 1); a zero row stores scale 0 and zero codes. Keys come as a slice of a wider tensor
    whose lanes past head_dim and past the heads hold 1e4: they never enter amax. Skipped slots, other slots and
    their scales keep the sentinel."""
    gen = pr.generator(801)
    n = 8  # row 4 goes to slot -1: skipped
    slots = [5, 0, 22, 13, -1, 9, 18, 2]
    written = [s for s in slots if s >= 0]
    rows = [i for i, s in enumerate(slots) if s >= 0]
    x = _spread_rows(gen, n)
    x[2, 1] = torch.randn(D, generator=gen)
    x[2, 1, 5] = 1000.0  # an outlier channel: the rest of its row on small codes
    x[3, 0] = 0.0  # a zero row
    k = x.to(torch.float16)
    wide = torch.full((n, H + 1, 32), 1e4, dtype=torch.float16)
    wide[:, :H, :D] = k
    v = (torch.randn((n, H, D), generator=gen) * 3).to(torch.float16)
    v[1, 2, :2] = torch.tensor([500.0, -1000.0])  # past 448 * v_scale: saturate
    k_in = wide.to(device)[:, :H, :D]
    assert not k_in.is_contiguous()
    cache = _cache(device, layout)
    _append_slots(cache, k_in, v, slots)

    assert cache.config.has_params and cache.params(0).shape == cache.config.params_shape()
    assert cache.params(0).shape == ((NB, 1, BS, H, 1) if layout == "NHD" else (NB, 1, H, BS, 1))
    assert cache.pool(0).dtype == torch.float8_e4m3fn
    xk = k[rows].float()  # the written rows, float32
    want_codes, want_scale = _encode_keys(xk)
    pr.assert_bits_equal(_rows(cache.pool(0), layout, written, 0), want_codes, "key codes")
    pr.assert_bits_equal(_rows(cache.params(0), layout, written, 0), want_scale, "key scales")
    assert bool((want_scale[xk.abs().amax(-1) > 0] > 0).all())
    xv = v[rows].float()
    pr.assert_bits_equal(_rows(cache.pool(0), layout, written, 1), _encode_values(xv, V_SCALE), "value codes")
    # the row's largest element is +-448 exactly; the zero row: scale 0, codes 0
    got = _rows(cache.pool(0), layout, written, 0).float()
    top = xk.abs().argmax(-1, keepdim=True)
    nonzero = xk.abs().amax(-1) > 0
    assert torch.equal(got.gather(-1, top)[nonzero].abs(), torch.full_like(got.gather(-1, top)[nonzero], FP8_MAX))
    z = rows.index(3)  # the zero row's place among the written ones
    assert _rows(cache.params(0), layout, written, 0)[z, 0].item() == 0.0 and not got[z, 0].any()
    assert bool((xv.abs() >= FP8_MAX * V_SCALE).any()), "no value saturates: the case lost its point"
    # nothing else written: the other slots of the pool and of the params pool hold the sentinel
    others = [s for s in range(NB * BS) if s not in written]
    for plane in (0, 1):
        assert pr.is_all_sentinel(_rows(cache.pool(0), layout, others, plane))
    assert pr.is_all_sentinel(_rows(cache.params(0), layout, others, 0))
    # k_scale is not read: a cache with k_scale 1 stores the same bytes
    other = _cache(device, layout, k_scale=1.0)
    _append_slots(other, k_in, v, slots)
    pr.assert_bits_equal(other.buffer, cache.buffer, "pool with k_scale 1 vs 4")
    pr.assert_bits_equal(other.params_buffer, cache.params_buffer, "scales with k_scale 1 vs 4")


@pytest.mark.parametrize("dtype,layout", [(torch.float32, "NHD"), (torch.float16, "HND")], ids=["fp32-NHD",
                                                                                                 "fp16-HND"])
def test_gather_within_the_documented_bound(device, dtype, layout):
    """Gathered keys are within ``max(|x| / 16, scale / 1024)`` (+ float32 rounding) of the appended ones, with
    ``scale`` the stored one; the row's largest element reads back as ``448 * scale`` (one float32 product: the
    element itself in fp16, within one float32 rounding of it in float32); a zero row reads back zeros; values
    within ``|x| / 16 + 2^-10 v_scale`` (half a step of e4m3, normal or subnormal)."""
    gen = pr.generator(802)
    n = 2 * BS + 1  # three blocks, the last partly filled
    x = _spread_rows(gen, n, 4.0)
    x[1, 2, :] *= torch.exp(torch.linspace(-12, 0, D))  # one row spanning 5 decades: subnormal codes
    x[4, 1] = 0.0
    k = x.to(dtype)
    v = (torch.randn((n, H, D), generator=gen) * 2).to(dtype)
    blocks = [4, 1, 3]
    slots = [blocks[t // BS] * BS + t % BS for t in range(n)]
    cache = _cache(device, layout, dtype)
    _append_slots(cache, k, v, slots)
    gk, gv = _gather_one(cache, blocks, n)
    assert gk.dtype == dtype
    xk = k.float()
    scale = _rows(cache.params(0), layout, slots, 0)  # [n, H, 1]
    rounding = pr.ulp(torch.maximum(gk.float().abs(), xk.abs()), dtype)  # of the model-dtype output
    pr.assert_close(gk, xk, pr.fp8k_bound(scale, xk) + rounding, "keys after gather")
    sub = (xk.abs() < scale * 2.0**-6) & (xk != 0)  # codes below 2^-6: e4m3's subnormals
    assert bool(sub.any()), "no key reached e4m3's subnormals: the case lost its point"
    top = xk.abs().argmax(-1, keepdim=True)
    want_top = (torch.tensor(FP8_MAX) * scale) * torch.sign(xk.gather(-1, top))  # 448 * scale, float32
    pr.assert_bits_equal(gk.gather(-1, top), want_top.to(dtype), "the rows' largest elements (448 * scale)")
    if dtype == torch.float16:
        pr.assert_bits_equal(gk.gather(-1, top), k.gather(-1, top), "the rows' largest elements")
    else:
        pr.assert_close(gk.gather(-1, top), xk.gather(-1, top), pr.ulp(xk.gather(-1, top), dtype),
                        "the rows' largest elements")
    assert not gk[4, 1].any(), "a zero row reads back zeros"
    rounding = pr.ulp(torch.maximum(gv.float().abs(), v.float().abs()), dtype)
    pr.assert_close(gv, v.float(), v.double().abs() / 16 + 2.0**-10 * V_SCALE + rounding, "values after gather")


def test_rows_with_nan_or_inf(device):
    """A key (token, head) holding a NaN or an infinity stores scale NaN, its finite elements as (signed) zeros and
    the others as NaN, and reads back NaN in every element; the other rows' bytes and scales are those of the
    encoding, as if the bad rows were not there. Values: NaN where the value is not finite, nothing else."""
    gen = pr.generator(803)
    n = 6
    x = _spread_rows(gen, n, 1.0)
    bad = {(1, 0): float("nan"), (2, 2): float("inf"), (4, 1): float("-inf")}
    for (t, h), val in bad.items():
        x[t, h, 7] = val
    k = x.to(torch.float16)
    v = k.clone()
    slots = list(range(3, 3 + n))
    cache = _cache(device)
    _append_slots(cache, k, v, slots)
    codes = _rows(cache.pool(0), "NHD", slots, 0)
    scale = _rows(cache.params(0), "NHD", slots, 0)[..., 0]  # [n, H]
    is_bad = torch.zeros(n, H, dtype=torch.bool)
    for t, h in bad:
        is_bad[t, h] = True
    assert bool(torch.isnan(scale[is_bad]).all()) and bool(torch.isfinite(scale[~is_bad]).all())
    raw = pr.bits(codes).view(torch.uint8) & 0x7F  # magnitude bits: 0x7F is e4m3fn's NaN, 0x00 zero
    finite = torch.isfinite(k.float())
    assert bool((raw[is_bad][finite[is_bad]] == 0).all()), "finite elements of a bad row store zeros"
    assert bool((raw[is_bad][~finite[is_bad]] == 0x7F).all()), "non-finite elements store NaN"
    want_codes, want_scale = _encode_keys(torch.where(is_bad[..., None], 0.0, k.float()))
    pr.assert_bits_equal(codes[~is_bad], want_codes[~is_bad], "codes of the finite rows")
    pr.assert_bits_equal(scale[~is_bad], want_scale[..., 0][~is_bad], "scales of the finite rows")
    gk, gv = _gather_one(cache, [0, 1, 2], 3 + n)
    gk, gv = gk[3:].float(), gv[3:].float()
    assert bool(torch.isnan(gk[is_bad]).all()), "a bad key row reads back NaN, every element"
    assert bool(torch.isfinite(gk[~is_bad]).all())
    assert torch.equal(torch.isnan(gv), ~finite), "values: NaN exactly where the value was not finite"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rows_of_tiny_magnitude_take_the_scale_floor(device, dtype):
    """Keys whose largest magnitude is 1e-37 (bfloat16 and float32 hold it; amax / 448 would be a float32
    subnormal, without a finite reciprocal): scale 2^-126, codes of ``x * 2^126`` (the largest 8.5, not 448), and a
    round trip within ``max(|x| / 16, scale / 1024)``, finite; a row of 1e-30 keeps ``amax / 448``."""
    x = torch.tensor([1e-37, -4e-38, 0.0, 2e-38] * (D // 4)).reshape(1, 1, D).repeat(2, H, 1)
    x[1] *= 1e7  # 1e-30: above the floor
    k = x.to(dtype)
    cache = _cache(device, dtype=dtype)
    _append_slots(cache, k, k, [0, 1])
    want_codes, want_scale = _encode_keys(k.float())
    assert want_scale[0, 0, 0].item() == 2.0**-126 and want_scale[1, 0, 0].item() > 2.0**-126
    pr.assert_bits_equal(_rows(cache.params(0), "NHD", [0, 1], 0), want_scale, "key scales")
    pr.assert_bits_equal(_rows(cache.pool(0), "NHD", [0, 1], 0), want_codes, "key codes")
    gk, _ = _gather_one(cache, [0], 2, dtype=torch.float32)
    assert bool(torch.isfinite(gk).all()), f"finite tiny rows read back {gk[0, 0, :4].tolist()}"
    pr.assert_close(gk, k.float(), pr.fp8k_bound(want_scale, k.float()), "tiny keys after gather")


# ---------------------------------------------------------------------------------------------------------
# the torch path against the kernels


def _paths() -> list[tuple[str, str]]:
    """(name, device) of the kernels compared with the CPU torch path: the interpreter on a CPU-only machine,
    the compiled kernels where CUDA is available."""
    return [("compiled", "cuda")] if HAS_CUDA else [("interpreter", "cpu")]


@pytest.mark.parametrize("use_rope", [False, True], ids=["no-rope", "rope"])
def test_torch_path_and_kernels_agree(monkeypatch, use_rope):
    """The same ragged append (both layouts, positions up to 3000 with RoPE) through the CPU torch path and the
    Triton kernels. Without RoPE: pools and scales bit-exact. With RoPE (cos / sin rounded differently): scales
    within ``rope_slack / 448`` (+ a float32 rounding), codes within one e4m3 step of each other, values
    bit-exact."""
    gen = pr.generator(804)
    # positions up to 3000 through a wide table of -1 but for the blocks the new rows land in
    k, v, tables, cu, kv_lens = pr.long_position_batch("cpu", gen, H, D, BS, torch.float16, q_lens=(5, 1, 3),
                                                       kv_lens=(0, 2990, 11), num_blocks=NB)
    k = (k.float() * torch.exp(torch.randn((cu[-1], H, 1), generator=gen) * 2)).to(torch.float16)
    rope = RopeConfig(head_dim=D, base=10000.0) if use_rope else None
    for layout in ("NHD", "HND"):
        got = {}
        for name, dev in [("torch", "cpu"), *_paths()]:
            monkeypatch.setenv("KVCACHE_TRITON_INTERPRET", "1" if name == "interpreter" else "0")
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
            cache = _cache(dev, layout, rope=rope)
            cache.append(0, k.to(dev), v.to(dev), cache.plan(pr.i32(tables, dev), pr.i32(cu, dev),
                                                             pr.i32(kv_lens, dev)))
            got[name] = (cache.buffer.cpu(), cache.params_buffer.cpu())
        ref_pool, ref_par = got.pop("torch")
        unwritten = pr.bits(ref_par) == pr.bits(pr.fill_sentinel(torch.empty_like(ref_par)))
        assert int((~unwritten).sum()) == cu[-1] * H, "every new row writes one scale per head"
        for name, (pool, par) in got.items():
            what = f"{name} vs torch ({layout}, {'RoPE' if use_rope else 'no RoPE'})"
            if not use_rope:
                pr.assert_bits_equal(pool, ref_pool, what + ": pool")
                pr.assert_bits_equal(par, ref_par, what + ": scales")
                continue
            pr.assert_bits_equal(pool[:, :, 1], ref_pool[:, :, 1], what + ": values")
            assert torch.equal(pr.bits(par) == pr.bits(pr.fill_sentinel(torch.empty_like(par))), unwritten)
            s_ref, s_got = ref_par[~unwritten].double(), par[~unwritten].double()
            # |amax' - amax| <= the RoPE slack 2^-19 * amax, so |scale' - scale| <= 2^-19 * scale (+ a rounding)
            pr.assert_close(s_got, s_ref, s_ref * (2.0**-19 + 2.0**-23), what + ": scales")
            # codes: the rotated keys differ by <= 2^-19 * amax, 448 * 2^-19 < 2^-10 in code units, under half
            # of e4m3's smallest step: the two roundings land at most one step apart
            c_ref, c_got = ref_pool[:, :, 0].float(), pool[:, :, 0].float()
            step = pr.ulp(torch.maximum(c_ref.abs(), c_got.abs()), torch.float8_e4m3fn)
            pr.assert_close(c_got, c_ref, step, what + ": key codes")


# ---------------------------------------------------------------------------------------------------------
# attention


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int]) -> torch.Tensor:
    """float64 causal attention of one sequence: q [n, Hq, D], k / v [S, H, D] (GQA), positions of q given."""
    qd, kd, vd = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    kd, vd = kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", qd, kd) / math.sqrt(q.shape[-1])
    mask = torch.arange(k.shape[0])[None, :] > torch.tensor(q_pos)[:, None]
    p = torch.softmax(s.masked_fill(mask, -math.inf), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, vd)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_attention_matches_attention_over_the_gathered_kv(device, layout):
    """cache.attention over an fp8k pool (a prefill chunk, a decode row, an extend chunk; GQA 4 / 2, head_dim 32)
    equals float64 attention over the K / V the pool dequantizes to (the public gather, float32), within the fp16
    flash-attention tolerance; the op with kv_scales (1, v_scale) gives the same bytes as with (4, v_scale): k_scale
    is not read."""
    hkv, hq, d = 2, 4, 32
    gen = pr.generator(805)
    lens, q_lens = [11, 6, 9], [11, 1, 4]
    cache = PagedKVCache(PagedConfig(num_layers=1, num_kv_heads=hkv, head_dim=d, block_size=BS, num_blocks=12,
                                     dtype=torch.float16, kv_dtype="fp8k", layout=layout, device=device))
    cache.kv_scales[0] = torch.tensor([K_SCALE, V_SCALE])
    tables = pr.block_tables_for(gen, lens, block_size=BS, num_blocks=12, pad=0)
    bt = pr.i32(tables, device)
    cu_all = pr.cumsum0(lens)
    ks = (torch.randn((cu_all[-1], hkv, d), generator=gen) * torch.exp(torch.randn((cu_all[-1], hkv, 1),
                                                                                      generator=gen))).half()
    vs = torch.randn((cu_all[-1], hkv, d), generator=gen).half()
    cache.append(0, ks.to(device), vs.to(device), cache.plan(bt, pr.i32(cu_all, device), pr.i32([0, 0, 0], device)))
    q = torch.randn((sum(q_lens), hq, d), generator=gen).half()
    cu_q = pr.cumsum0(q_lens)
    kv_before = [n - m for n, m in zip(lens, q_lens)]
    plan = cache.plan(bt, pr.i32(cu_q, device), pr.i32(kv_before, device))
    out = cache.attention(0, q.to(device), plan).cpu()
    gk, gv = gather_paged_kv(cache.pool(0), cache.params(0), kv_dtype="fp8k", layout=layout, block_tables=bt,
                             kv_lens=pr.i32(lens, device), dtype=torch.float32, fp8_scales=cache.kv_scales[0])
    for b, (n, m) in enumerate(zip(lens, q_lens)):
        kk, vv = gk[b, :, :n].transpose(0, 1).cpu(), gv[b, :, :n].transpose(0, 1).cpu()
        assert bool((kk - ks[cu_all[b]:cu_all[b + 1]].float()).abs().max() > 0), "keys stored exactly: no test"
        want = _dense(q[cu_q[b]:cu_q[b + 1]], kk, vv, list(range(n - m, n)))
        got = out[cu_q[b]:cu_q[b + 1]].double()
        err = (got - want).abs() - 6e-3 * want.abs()
        assert err.max().item() <= 6e-3, f"sequence {b}: max error {(got - want).abs().max().item():.3g}"
    by_op = [paged_attention(q.to(device), cache.pool(0), cache.params(0), torch.tensor([ks_, V_SCALE], device=device),
                             kv_dtype="fp8k", layout=layout, block_tables=bt, cu_q_lens=pr.i32(cu_q, device),
                             kv_lens=pr.i32(lens, device)) for ks_ in (K_SCALE, 1.0)]
    pr.assert_bits_equal(by_op[1], by_op[0], "attention with k_scale 1 vs 4")


# ---------------------------------------------------------------------------------------------------------
# bytes, block copies, validation


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_bytes_per_token_and_head(dtype):
    """``2 D + 4`` bytes per (token, head): fp8 K and V and one float32 key scale, whatever the model dtype; fp8's
    plus 4; the allocation of a cache agrees."""
    for L, h, d, bs, nb in ((1, 1, 8, 1, 1), (3, 5, 80, 4, 7), (2, 8, 128, 16, 3)):
        got = cache_block_bytes(L, h, d, bs, dtype, "fp8k")
        assert got == L * bs * h * (2 * d + 4)
        assert got == cache_block_bytes(L, h, d, bs, dtype, "fp8") + L * bs * h * 4
        cfg = PagedConfig(num_layers=L, num_kv_heads=h, head_dim=d, block_size=bs, num_blocks=nb, dtype=dtype,
                          kv_dtype="fp8k")
        cache = PagedKVCache(cfg)
        assert cfg.block_bytes == got and cache.nbytes == got * nb
        allocated = cache.buffer.numel() * cache.buffer.element_size() + cache.params_buffer.numel() * 4
        assert allocated == cache.nbytes


def _filled(device, layout: str) -> tuple[PagedKVCache, list[int]]:
    """An fp8k cache holding 2 blocks of appended K / V (blocks 1 and 4) and its slots."""
    gen = pr.generator(806)
    slots = [4, 5, 6, 7, 16, 17, 18]
    k = _spread_rows(gen, len(slots)).half()
    v = torch.randn((len(slots), H, D), generator=gen).half()
    cache = _cache(device, layout)
    _append_slots(cache, k, v, slots)
    return cache, slots


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_copy_blocks_copies_the_scales(device, layout):
    """copy_blocks: the destination blocks hold the source's codes and scales bit for bit, and gather back the
    same K / V; nothing else changes."""
    cache, _ = _filled(device, layout)
    before = (cache.buffer.cpu().clone(), cache.params_buffer.cpu().clone())
    cache.copy_blocks([1, 4], [3, 0])
    want, want_p = before[0].clone(), before[1].clone()
    want[:, [3, 0]] = before[0][:, [1, 4]]
    want_p[:, [3, 0]] = before[1][:, [1, 4]]
    pr.assert_bits_equal(cache.buffer, want, "pool after copy_blocks")
    pr.assert_bits_equal(cache.params_buffer, want_p, "scales after copy_blocks")
    a = _gather_one(cache, [1, 4], 7)
    b = _gather_one(cache, [3, 0], 7)
    for x, y, name in zip(a, b, "kv"):
        pr.assert_bits_equal(y, x, f"{name} gathered from the copies")


def test_swap_out_swap_in_keeps_the_scales(device):
    """swap_out takes the scales with the codes (params [n, L, 1, ...]); swap_in into other blocks restores both
    bit for bit, and the sequence gathers back the same."""
    cache, _ = _filled(device, "HND")
    before = (cache.buffer.cpu().clone(), cache.params_buffer.cpu().clone())
    swapped = cache.swap_out([1, 4])
    swapped.synchronize()
    assert swapped.params is not None and swapped.params.shape == (2, 1, *cache.params_buffer.shape[2:])
    pr.assert_bits_equal(swapped.params, before[1][:, [1, 4]].transpose(0, 1), "swapped scales")
    a = _gather_one(cache, [1, 4], 7)
    pr.fill_sentinel(cache.buffer)
    pr.fill_sentinel(cache.params_buffer)
    cache.swap_in(swapped, [5, 2])
    pr.assert_bits_equal(cache.params_buffer[:, [5, 2]], before[1][:, [1, 4]], "scales after swap_in")
    pr.assert_bits_equal(cache.buffer[:, [5, 2]], before[0][:, [1, 4]], "codes after swap_in")
    b = _gather_one(cache, [5, 2], 7)
    for x, y, name in zip(a, b, "kv"):
        pr.assert_bits_equal(y, x, f"{name} gathered after swap_in")


def test_params_of_the_wrong_shape_are_rejected(device):
    """append_paged_kv / gather_paged_kv / paged_attention over an fp8k pool: a params pool of the integer formats'
    shape ([nb, 2, bs, H, 2]), of width 2, of another dtype, or none, raises naming ``params`` (ValueError, or
    TypeError for None in the paged ops); missing v_scale raises naming ``fp8_scales`` / ``kv_scales``; nothing
    is written."""
    cache, _ = _filled(device, "NHD")
    pool, par, scales = cache.pool(0), cache.params(0), cache.kv_scales[0]
    k = torch.zeros((2, H, D), dtype=torch.float16, device=device)
    slots = torch.tensor([0, 1], device=device)
    bad = {
        "int8-shaped": torch.zeros((NB, 2, BS, H, 2), device=device),
        "width-2": torch.zeros((NB, 1, BS, H, 2), device=device),
        "float16": torch.zeros((NB, 1, BS, H, 1), dtype=torch.float16, device=device),
        "blocks": torch.zeros((NB - 1, 1, BS, H, 1), device=device),
    }
    before = (pr.bits(cache.buffer).cpu().clone(), pr.bits(cache.params_buffer).cpu().clone())
    common = dict(kv_dtype="fp8k", layout="NHD")
    bt, lens = pr.i32([[1, 4]], device), pr.i32([7], device)
    q = torch.zeros((1, 2 * H, D), dtype=torch.float16, device=device)
    ops = (  # each op over params p, and the error a missing params pool raises in it
        (lambda p: append_paged_kv(k, k, pool, p, slot_mapping=slots, fp8_scales=scales, **common), TypeError),
        (lambda p: gather_paged_kv(pool, p, block_tables=bt, kv_lens=lens, dtype=torch.float16, fp8_scales=scales,
                                   **common), TypeError),
        (lambda p: paged_attention(q, pool, p, scales, block_tables=bt, cu_q_lens=pr.i32([0, 1], device),
                                   kv_lens=lens, **common), ValueError),
    )
    for op, missing in ops:
        for p in bad.values():
            with pytest.raises(ValueError, match=pr.names("params")):
                op(p)
        with pytest.raises(missing, match=pr.names("params")):
            op(None)
    with pytest.raises(ValueError, match=pr.names("fp8_scales")):
        append_paged_kv(k, k, pool, par, slot_mapping=slots, **common)
    with pytest.raises(ValueError, match=pr.names("kv_scales")):
        paged_attention(q, pool, par, block_tables=bt, cu_q_lens=pr.i32([0, 1], device), kv_lens=lens, **common)
    pr.assert_bits_equal(cache.buffer, before[0], "pool after the rejected calls")
    pr.assert_bits_equal(cache.params_buffer, before[1], "scales after the rejected calls")
