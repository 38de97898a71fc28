"""paged_attention against the independent float64 reference (K / V read back through the public gather), on
both CPU backends (torch reference, Triton interpreter) and compiled on a GPU: every kv_dtype and layout, GQA,
head dims (non-powers of two), block sizes, window, softcap, sinks, split-KV, lse, context parallelism merged by
lse, and the edge cases of ragged batches.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvcache.ops import merge_attention_states, paged_attention
from kvcache.ops.attention import attention_plan
from sweeps import each_value, named, pairwise

from .attn_reference import assert_attn_close, dequantized, i32, make_paged, paged_expected

FORMATS = ["auto", "fp8", "int8", "int4", "k8v4", "fp8k"]


def _run(cache, bt, q, q_lens, kv_lens, device, **kw):  # type: ignore[no-untyped-def]
    cfg = cache.config
    n, hq, _ = q.shape
    out = torch.full_like(q, 7.0)
    lse = torch.full((n, hq), 7.0, dtype=torch.float32, device=device)
    cu = [0]
    for x in q_lens:
        cu.append(cu[-1] + x)
    scales = cache.kv_scales[0] if cfg.kv_dtype in ("fp8", "fp8k") else None
    res = paged_attention(q, cache.pool(0), cache.params(0), scales, kv_dtype=cfg.kv_dtype, layout=cfg.layout,
                          block_tables=bt, cu_q_lens=i32(cu, device), kv_lens=i32(list(kv_lens), device), out=out,
                          lse=lse, **kw)
    assert res is out
    return out, lse


def _q(n, hq, d, dtype, device, seed=1):  # type: ignore[no-untyped-def]
    return torch.randn((n, hq, d), generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


@pytest.mark.parametrize(("kv_dtype", "layout"), each_value(FORMATS, ["NHD", "HND"]))
def test_formats_mixed_batch(device, kv_dtype, layout):
    """Prefill chunk, decode rows, an extend chunk and an empty sequence in one batch, GQA 6 / 2, D 80."""
    H, hq, D, bs = 2, 6, 80, 16
    kv_lens, q_lens = [37, 9, 0, 20], [5, 1, 0, 20]
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout=layout, H=H, D=D, bs=bs, lens=kv_lens,
                              k_scale=0.5, v_scale=2.0)
    q = _q(sum(q_lens), hq, D, torch.float16, device)
    out, lse = _run(cache, bt, q, q_lens, kv_lens, device)
    eo, el = paged_expected(q.cpu(), cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D))
    assert_attn_close(out, lse, eo, el, torch.float16, what=f"{kv_dtype} {layout}")


@pytest.mark.parametrize("D", [64, 96, 128, 256])
def test_head_dims(device, D):
    H, hq, bs = 1, 4, 16
    kv_lens, q_lens = [19, 3], [2, 3]
    cache, bt, _ = make_paged(device, kv_dtype="auto", layout="NHD", H=H, D=D, bs=bs, lens=kv_lens)
    q = _q(sum(q_lens), hq, D, torch.float16, device)
    out, lse = _run(cache, bt, q, q_lens, kv_lens, device)
    eo, el = paged_expected(q.cpu(), cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D))
    assert_attn_close(out, lse, eo, el, torch.float16, what=f"D={D}")


@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
def test_block_sizes(device, bs, kv_dtype):
    H, hq, D = 2, 4, 64
    kv_lens, q_lens = [bs * 2 + 3, 1, bs], [1, 1, bs]
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="HND", H=H, D=D, bs=bs, lens=kv_lens)
    q = _q(sum(q_lens), hq, D, torch.float16, device)
    out, lse = _run(cache, bt, q, q_lens, kv_lens, device)
    eo, el = paged_expected(q.cpu(), cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D))
    assert_attn_close(out, lse, eo, el, torch.float16, what=f"bs={bs}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_query_dtypes(device, dtype):
    H, hq, D, bs = 2, 2, 64, 16
    kv_lens, q_lens = [23, 4], [3, 1]
    cache, bt, _ = make_paged(device, kv_dtype="auto", layout="NHD", H=H, D=D, bs=bs, lens=kv_lens, dtype=dtype)
    q = _q(sum(q_lens), hq, D, dtype, device)
    out, lse = _run(cache, bt, q, q_lens, kv_lens, device, scale=0.2)
    eo, el = paged_expected(q.cpu(), cache, bt, q_lens, kv_lens, scale=0.2)
    assert_attn_close(out, lse, eo, el, dtype)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "k8v4"])
def test_quantized_bf16_queries(device, kv_dtype):
    """bf16 queries over int8 / int4 codes: int8 codes reach 255, past the 128 + c bf16 rule of the int4 codes
    (compiled: bf16 K operands; interpreter: float32 ones)."""
    H, hq, D, bs = 2, 4, 80, 16
    kv_lens, q_lens = [37, 9], [5, 1]
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="NHD", H=H, D=D, bs=bs, lens=kv_lens,
                              dtype=torch.bfloat16)
    if kv_dtype == "int8":
        assert (cache.pool(0) >= 128).any()
    q = _q(sum(q_lens), hq, D, torch.bfloat16, device)
    out, lse = _run(cache, bt, q, q_lens, kv_lens, device)
    eo, el = paged_expected(q.cpu(), cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D))
    assert_attn_close(out, lse, eo, el, torch.bfloat16, what=kv_dtype)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "k8v4"])
def test_quantized_bf16_query_magnitudes(device, kv_dtype):
    """bf16 query rows of very different magnitudes over int8 / int4 codes in decode: rows of |q| ~ 1e-20, 1,
    3e5 (past float16's largest value) and an all-zero row each match the reference (compiled int8 decode runs
    QK^T in float16 on per-row power-of-two rescaled queries)."""
    H, hq, D, bs = 2, 4, 64, 16
    kv_lens, q_lens = [29, 40, 17, 33], [1, 1, 1, 1]
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="NHD", H=H, D=D, bs=bs, lens=kv_lens,
                              dtype=torch.bfloat16)
    q = _q(sum(q_lens), hq, D, torch.float32, "cpu")
    q = q * torch.tensor([1e-20, 1.0, 3e5, 0.0])[:, None, None]
    q = q.to(torch.bfloat16).to(device)
    out, lse = _run(cache, bt, q, q_lens, kv_lens, device)
    eo, el = paged_expected(q.cpu(), cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D))
    assert_attn_close(out, None, eo, el, torch.bfloat16, what=kv_dtype)
    # lse grows with |q| (~1e6 for the 3e5 row): relative tolerance
    torch.testing.assert_close(lse.double().cpu(), el, rtol=1e-5, atol=2e-3)


@pytest.mark.parametrize("window", [1, 5, 16, 1000], ids=lambda w: f"w{w}")
def test_sliding_window(device, window):
    """A row at position p sees exactly p - window + 1 .. p (window 1: itself; 1000: larger than the context)."""
    H, hq, D, bs = 2, 4, 64, 16
    kv_lens, q_lens = [40, 7], [6, 1]
    cache, bt, _ = make_paged(device, kv_dtype="int8", layout="NHD", H=H, D=D, bs=bs, lens=kv_lens)
    q = _q(sum(q_lens), hq, D, torch.float16, device)
    out, lse = _run(cache, bt, q, q_lens, kv_lens, device, window=window)
    eo, el = paged_expected(q.cpu(), cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D), window=window)
    assert_attn_close(out, lse, eo, el, torch.float16, what=f"window {window}")
    if window == 1000:  # larger than any context: same as no window
        full, full_lse = _run(cache, bt, q, q_lens, kv_lens, device)
        assert torch.equal(out, full) and torch.equal(lse, full_lse)


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8k"])
def test_softcap_and_sinks(device, kv_dtype):
    """Soft-cap and sinks (fp8k: each key's scale multiplies its score before the tanh)."""
    H, hq, D, bs = 2, 4, 64, 16
    kv_lens, q_lens = [33, 2], [4, 2]
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="HND", H=H, D=D, bs=bs, lens=kv_lens)
    q = _q(sum(q_lens), hq, D, torch.float16, device) * 4
    sinks = torch.tensor([0.5, -1.0, 3.0, 8.0], device=device)
    out, lse = _run(cache, bt, q, q_lens, kv_lens, device, softcap=5.0, sinks=sinks)
    eo, el = paged_expected(q.cpu(), cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D), softcap=5.0, sinks=sinks)
    assert_attn_close(out, lse, eo, el, torch.float16, what="softcap+sinks")
    plain, plain_lse = _run(cache, bt, q, q_lens, kv_lens, device, softcap=5.0)
    assert (lse > plain_lse).all()  # the sink adds a positive term to every denominator


@pytest.mark.parametrize("num_splits,kv_dtype", [(1, "int4"), (2, "int4"), (5, "int4"), (5, "fp8k")])
def test_split_kv(device, num_splits, kv_dtype):
    """Split launches (and their merge pass) give the unsplit result within float32 merge rounding."""
    H, hq, D, bs = 2, 8, 64, 16
    kv_lens, q_lens = [150, 3, 64], [1, 1, 2]
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="NHD", H=H, D=D, bs=bs, lens=kv_lens)
    q = _q(sum(q_lens), hq, D, torch.float16, device)
    sinks = torch.linspace(-2, 2, hq, device=device)
    out, lse = _run(cache, bt, q, q_lens, kv_lens, device, num_splits=num_splits, sinks=sinks, window=100)
    eo, el = paged_expected(q.cpu(), cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D), sinks=sinks, window=100)
    assert_attn_close(out, lse, eo, el, torch.float16, what=f"splits {num_splits}")
    ws = torch.empty(num_splits * 4 * hq * (D + 1) + 3, dtype=torch.float32, device=device)
    again, again_lse = _run(cache, bt, q, q_lens, kv_lens, device, num_splits=num_splits, sinks=sinks, window=100,
                            workspace=ws)
    assert torch.equal(out, again) and torch.equal(lse, again_lse)


@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
def test_heuristic_split_of_short_sequences(device, kv_dtype):
    """A block table sized for 4k+ tokens makes the policy split the KV range; sequences far shorter than it use
    only the splits their own length fills (at least min_split_keys keys each), the rest return empty: same result
    as the reference. A forced split keeps every split (min_split_keys 0)."""
    H, hq, D, bs = 2, 8, 128, 16
    kv_lens, q_lens = [700, 40], [1, 1]
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="NHD", H=H, D=D, bs=bs, lens=kv_lens, spare=256)
    plan = attention_plan(num_q_heads=hq, num_kv_heads=H, head_dim=D, n_tokens=2, num_seqs=2,
                          max_kv_len=bt.shape[1] * bs, kv_dtype=kv_dtype)
    assert plan.num_splits > 2 and plan.min_split_keys == 512
    forced = attention_plan(num_q_heads=hq, num_kv_heads=H, head_dim=D, n_tokens=2, num_seqs=2,
                            max_kv_len=bt.shape[1] * bs, kv_dtype=kv_dtype, num_splits=plan.num_splits)
    assert forced.min_split_keys == 0
    q = _q(2, hq, D, torch.float16, device)
    out, lse = _run(cache, bt, q, q_lens, kv_lens, device)
    eo, el = paged_expected(q.cpu(), cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D))
    assert_attn_close(out, lse, eo, el, torch.float16, what=f"heuristic split {kv_dtype}")


@pytest.mark.parametrize(("opts", "qdt"), each_value(
    named([{}, {"num_splits": 1}, {"window": 70, "num_splits": 3}, {"softcap": 5.0}],
          ["plain", "one-split", "window-splits", "softcap"]),
    named([torch.float16, torch.bfloat16], ["fp16", "bf16"])))
def test_int4_warp_split_decode(device, opts, qdt):
    """int4 decode at head_dim 128 over block tables of 4096+ tokens takes the warp-split tiles (each warp its own
    keys of a tile, the warps' states merged after the KV loop): the reference's result for lengths ending inside
    and at tile edges, past the first warp's keys, an empty sequence and a single token, with sinks; one split
    (several tiles per program: each warp's state rescaled from tile to tile) and several."""
    H, hq, D, bs = 2, 8, 128, 16
    kv_lens, q_lens = [300, 128, 0, 1, 161], [1, 1, 0, 1, 1]
    cache, bt, _ = make_paged(device, kv_dtype="int4", layout="NHD", H=H, D=D, bs=bs, lens=kv_lens, dtype=qdt,
                              spare=240)
    plan = attention_plan(num_q_heads=hq, num_kv_heads=H, head_dim=D, n_tokens=sum(q_lens), num_seqs=len(q_lens),
                          max_kv_len=bt.shape[1] * bs, kv_dtype="int4")
    assert plan.warp_split
    q = _q(sum(q_lens), hq, D, qdt, device)
    sinks = torch.linspace(-1, 1, hq, device=device)
    out, lse = _run(cache, bt, q, q_lens, kv_lens, device, sinks=sinks, **opts)
    eo, el = paged_expected(q.cpu(), cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D), sinks=sinks,
                            window=opts.get("window"), softcap=opts.get("softcap"))
    assert_attn_close(out, lse, eo, el, qdt, what=f"int4 warp split {opts}")


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_context_parallel_merge(device, kv_dtype):
    """Two CP ranks' partial results merged by lse equal attention over the whole sequence (sinks once)."""
    H, hq, D, bs = 2, 4, 64, 16
    kv_lens, q_lens = [29, 6, 1], [4, 1, 1]
    gen = torch.Generator().manual_seed(3)
    ks = [torch.randn((n, H, D), generator=gen).half() for n in kv_lens]
    vs = [torch.randn((n, H, D), generator=gen).half() for n in kv_lens]
    q = _q(sum(q_lens), hq, D, torch.float16, device)
    sinks = torch.tensor([0.0, 1.0, -1.0, 2.0], device=device)
    parts = []
    for rank in range(2):
        cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="NHD", H=H, D=D, bs=bs, lens=kv_lens,
                                  kv=(ks, vs), cp_rank=rank, cp_size=2, seed=rank)
        o, l_ = _run(cache, bt, q, q_lens, kv_lens, device, cp_rank=rank, cp_size=2, sinks=sinks)
        eo, el = paged_expected(q.cpu(), cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D), sinks=sinks,
                                cp_rank=rank, cp_size=2)
        assert_attn_close(o, l_, eo, el, torch.float16, what=f"rank {rank}")
        parts.append((o, l_))
    # the last sequence (one token, at position 0) lives on rank 0: rank 1 attends to nothing
    assert (parts[1][0][-1] == 0).all() and torch.isinf(parts[1][1][-1]).all()
    merged, merged_lse = merge_attention_states(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    whole, wb, _ = make_paged(device, kv_dtype=kv_dtype, layout="NHD", H=H, D=D, bs=bs, lens=kv_lens, kv=(ks, vs))
    eo, el = paged_expected(q.cpu(), whole, wb, q_lens, kv_lens, scale=1 / math.sqrt(D), sinks=sinks)
    assert_attn_close(merged, merged_lse, eo, el, torch.float16, what="merged ranks")


def test_edge_cases(device):
    """Empty sequences (q_len 0; kv_len 0), a chunk filling a block exactly, a sequence at its table's capacity,
    and padding rows past cu_q_lens[B] (left untouched)."""
    H, hq, D, bs = 2, 4, 64, 16
    kv_lens, q_lens = [0, 32, 16, 5], [0, 16, 1, 0]  # seq 1: a 16-row chunk ending on a block boundary
    cache, bt, _ = make_paged(device, kv_dtype="int8", layout="HND", H=H, D=D, bs=bs, lens=kv_lens)
    assert bt.shape[1] == 2  # seq 1 holds 32 tokens = its table's whole capacity
    n_real = sum(q_lens)
    q = _q(n_real + 3, hq, D, torch.float16, device)  # 3 padding rows
    out, lse = _run(cache, bt, q, q_lens, kv_lens, device)
    eo, el = paged_expected(q[:n_real].cpu(), cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D))
    assert_attn_close(out[:n_real], lse[:n_real], eo, el, torch.float16)
    assert (out[n_real:] == 7.0).all() and (lse[n_real:] == 7.0).all()


@pytest.mark.parametrize(("q_lens", "kv_dtype"), each_value(
    named([[1] * 13, [1, 1, 0, 3, 1, 2, 1, 1, 0, 1, 4, 1, 1], [0] * 5 + [1] * 8], ["decode", "mixed", "empty-first"]),
    ["auto", "fp8", "int8"]))
def test_decode_tiles_find_their_sequence(device, q_lens, kv_dtype):
    """Decode tiles (<= 4 rows per sequence) over 13 sequences: one row each (each tile's sequence taken from its
    index, spare tiles between them), rows of 0-4 per sequence, and five empty sequences first (the guess lands past
    the tile's sequence: the upper half of the check); every row against the reference, padding rows untouched."""
    H, hq, D, bs = 2, 8, 64, 16
    kv_lens = [q + 3 * i for i, q in enumerate(q_lens)]
    assert attention_plan(num_q_heads=hq, num_kv_heads=H, head_dim=D, n_tokens=sum(q_lens), num_seqs=len(q_lens),
                          max_kv_len=64).block_m(hq, H) <= 16
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="HND", H=H, D=D, bs=bs, lens=kv_lens)
    n_real = sum(q_lens)
    q = _q(n_real + 2, hq, D, torch.float16, device)
    out, lse = _run(cache, bt, q, q_lens, kv_lens, device)
    eo, el = paged_expected(q[:n_real].cpu(), cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D))
    assert_attn_close(out[:n_real], lse[:n_real], eo, el, torch.float16, what=kv_dtype)
    assert (out[n_real:] == 7.0).all() and (lse[n_real:] == 7.0).all()


@pytest.mark.parametrize("seed", range(6))
def test_decode_tiles_random_ragged_batches(device, seed):
    """Random batches of 0-4 rows per sequence over 1-17 sequences (decode tiles, launched in their permuted order,
    each finding its sequence by the guess, the sequence before it, or the search): every row against the
    reference, padding rows untouched."""
    rng = torch.Generator().manual_seed(seed)
    H, hq, D, bs = 1, 4, 64, 16
    n_seqs = int(torch.randint(1, 18, (1,), generator=rng))
    q_lens = torch.randint(0, 5, (n_seqs,), generator=rng).tolist()
    if seed % 2:  # mostly one-row sequences, as decode steps are
        q_lens = [1 if x else 0 for x in q_lens]
    kv_lens = [q + int(torch.randint(0, 40, (1,), generator=rng)) for q in q_lens]
    cache, bt, _ = make_paged(device, kv_dtype="int8" if seed % 3 else "auto", layout="NHD", H=H, D=D, bs=bs,
                              lens=kv_lens)
    n_real = sum(q_lens)
    q = _q(n_real + 1, hq, D, torch.float16, device, seed=seed)
    out, lse = _run(cache, bt, q, q_lens, kv_lens, device)
    eo, el = paged_expected(q[:n_real].cpu(), cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D))
    assert_attn_close(out[:n_real], lse[:n_real], eo, el, torch.float16, what=f"q_lens {q_lens}")
    assert (out[n_real:] == 7.0).all() and (lse[n_real:] == 7.0).all()


@pytest.mark.parametrize(("kv_dtype", "hint"), each_value(FORMATS, named(
    [(4, {}), (2, {}), (5, {}), (4, {"num_splits": 3}), (4, {"window": 9})],
    ["true", "short", "covers-a-chunk", "forced-splits", "window"])))
def test_num_decode_split_launch(device, kv_dtype, hint):
    """A mixed batch (decode rows first, then chunks) launched as decode tiles + prefill tiles (num_decode): the
    reference's answer for a true hint, a hint short of the decode rows, one that covers a 30-row chunk, forced
    splits (the decode launch's merge must not touch the other launch's rows) and a window; padding rows stay
    untouched; a hint outside 0..B is an error."""
    H, hq, D, bs = 2, 8, 64, 16
    kv_lens, q_lens = [40, 17, 33, 1, 70, 50], [1, 1, 1, 1, 30, 12]  # 46 rows > 4 per sequence: prefill tiles
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="NHD", H=H, D=D, bs=bs, lens=kv_lens)
    n_real = sum(q_lens)
    q = _q(n_real + 2, hq, D, torch.float16, device)  # 2 padding rows
    nd, kw = hint
    out, lse = _run(cache, bt, q, q_lens, kv_lens, device, num_decode=nd, **kw)
    eo, el = paged_expected(q[:n_real].cpu(), cache, bt, q_lens, kv_lens, scale=1 / math.sqrt(D),
                            window=kw.get("window"))
    assert_attn_close(out[:n_real], lse[:n_real], eo, el, torch.float16, what=f"{kv_dtype} num_decode {nd} {kw}")
    assert (out[n_real:] == 7.0).all() and (lse[n_real:] == 7.0).all()
    for bad in (-1, len(q_lens) + 1):
        with pytest.raises(ValueError, match="num_decode"):
            _run(cache, bt, q, q_lens, kv_lens, device, num_decode=bad)


def test_nothing_to_attend(device):
    """A query row whose position precedes every key this rank holds: zeros and lse = -inf, no NaN elsewhere;
    with sinks (rank 0) the row is still zeros and lse is the sink logit."""
    H, hq, D, bs = 1, 2, 64, 16
    kv_lens, q_lens = [1, 6], [1, 2]
    cache, bt, _ = make_paged(device, kv_dtype="auto", layout="NHD", H=H, D=D, bs=bs, lens=kv_lens, cp_rank=1,
                              cp_size=2)
    q = _q(3, hq, D, torch.float16, device)
    out, lse = _run(cache, bt, q, q_lens, kv_lens, device, cp_rank=1, cp_size=2)
    assert (out[0] == 0).all() and torch.isinf(lse[0]).all() and (lse[0] < 0).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[1:]).all()
    cache0, bt0, _ = make_paged(device, kv_dtype="auto", layout="NHD", H=H, D=D, bs=bs, lens=[0])
    sinks = torch.tensor([1.5, -0.5], device=device)
    q1 = _q(1, hq, D, torch.float16, device)
    o1, l1 = _run(cache0, bt0, q1, [1], [0], device, sinks=sinks)
    assert (o1 == 0).all() and torch.allclose(l1[0], sinks)


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8", "int4", "k8v4", "fp8k"])
def test_quantized_against_fp16_cache(device, kv_dtype):
    """A quantized cache's attention stays within the bound its quantization error implies of the fp16 cache's:
    every score moves by at most delta = scale * max |q . (k_deq - k)|, so softmax weights move by a factor within
    exp(+-2 delta); |out_q - out| <= max |v_deq - v| + (exp(2 delta) - 1) * max |v| (+ fp16 output rounding)."""
    H, hq, D, bs = 2, 4, 64, 16
    kv_lens, q_lens = [45, 12], [3, 1]
    gen = torch.Generator().manual_seed(5)
    ks = [torch.randn((n, H, D), generator=gen).half() for n in kv_lens]
    vs = [torch.randn((n, H, D), generator=gen).half() for n in kv_lens]
    q = _q(sum(q_lens), hq, D, torch.float16, device) * 0.5
    ref_cache, rbt, _ = make_paged(device, kv_dtype="auto", layout="NHD", H=H, D=D, bs=bs, lens=kv_lens, kv=(ks, vs))
    qc, qbt, _ = make_paged(device, kv_dtype=kv_dtype, layout="NHD", H=H, D=D, bs=bs, lens=kv_lens, kv=(ks, vs))
    o_ref, _ = _run(ref_cache, rbt, q, q_lens, kv_lens, device)
    o_q, _ = _run(qc, qbt, q, q_lens, kv_lens, device)
    kd, vd = dequantized(qc, qbt, kv_lens)
    scale = 1 / math.sqrt(D)
    row = 0
    for b, ql in enumerate(q_lens):
        dk = (kd[b] - ks[b].float()).repeat_interleave(hq // H, 1)  # [n, hq, D]
        delta = (torch.einsum("qhd,nhd->qhn", q[row:row + ql].float().cpu(), dk).abs().amax() * scale).item()
        dv = (vd[b] - vs[b].float()).abs().max().item()
        bound = dv + (math.exp(2 * delta) - 1) * vs[b].float().abs().max().item() + 2e-2
        err = (o_q[row:row + ql].float() - o_ref[row:row + ql].float()).abs().max().item()
        assert err <= bound, f"{kv_dtype}: error {err:.3g} > bound {bound:.3g}"
        row += ql


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8", "int4", "k8v4", "fp8k"])
@pytest.mark.parametrize("which", ["k", "v"])
def test_nan_in_cache_stays_visible(device, kv_dtype, which):
    """NaN in a key or value the row attends to reaches its output (never a finite value), in every format: fp8
    stores NaN, int8 / int4 store the token's (scale, zero) as NaN; decode tiles (the V fold) included."""
    H, hq, D, bs = 1, 1, 64, 16
    gen = torch.Generator().manual_seed(0)
    k = [torch.randn((5, H, D), generator=gen).half()]
    v = [torch.randn((5, H, D), generator=gen).half()]
    (k if which == "k" else v)[0][2, 0, 3] = float("nan")
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="NHD", H=H, D=D, bs=bs, lens=[5], kv=(k, v))
    q = _q(1, hq, D, torch.float16, device)
    out, _ = _run(cache, bt, q, [1], [5], device)
    if which == "v" and kv_dtype == "auto":
        assert torch.isnan(out[0, 0, 3])  # a NaN element of V reaches that element of the output
    else:
        assert torch.isnan(out[0, 0]).any()


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_v_scales_spanning_1000x(device, kv_dtype):
    """V scales differing 1000x inside every tile (5e-4 .. 0.5) under a peaked softmax over 8192 keys: all but one
    weight are p = 5e-5 of the peak's, so p * scale ~ 2.6e-8 would round to 0 in fp16 (below half its smallest
    subnormal), and the int8 output would lose the codes of ~30 % of its softmax mass (an error ~1.1e-2, about
    twice the tolerance); the kernel's P operand is normalised by each tile's largest scale (and scaled by
    2^15) instead."""
    H, hq, D, bs, n = 2, 2, 64, 16, 8192
    gen = torch.Generator().manual_seed(7)
    q = _q(1, hq, D, torch.float16, device)
    qf = q.float().cpu()[0]  # [H, D]: one q head per KV head
    gap = qf * (math.log(1 / 5e-5) * math.sqrt(D) / qf.square().sum(-1, keepdim=True))
    k = torch.randn((n, H, D), generator=gen) * 0.01
    k[3000] = gap  # one key scoring ln(2e4) above the rest; every 16th key as far below them
    k[5::16] = -gap
    # values in [-amp / 2, amp / 2], amp = scale * levels: scales 4.8e-4 .. 5.4e-4, every 16th 0.5
    levels = 255 if kv_dtype == "int8" else 15
    scale = torch.empty(n).uniform_(4.8e-4, 5.4e-4, generator=gen)
    scale[5::16] = 0.5
    v = (torch.rand((n, H, D), generator=gen) - 0.5) * (scale * levels)[:, None, None]
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="NHD", H=H, D=D, bs=bs, lens=[n],
                              kv=([k.half()], [v.half()]))
    vs = cache.params(0)[:, 1, ..., 0]  # [blocks, BS, H]: every stored V scale
    assert vs.max() > 900 * vs[vs > 0].min()
    out, lse = _run(cache, bt, q, [1], [n], device, num_splits=1)
    eo, el = paged_expected(q.cpu(), cache, bt, [1], [n], scale=1 / math.sqrt(D))
    assert_attn_close(out, lse, eo, el, torch.float16, what=kv_dtype)


@pytest.mark.parametrize(("kv_dtype", "D", "qdt", "offset", "opts"), pairwise(
    ["int8", "int4", "k8v4"], [80, 128], named([torch.float16, torch.bfloat16], ["fp16", "bf16"]),
    named([0.0, 4.0], ["centred", "offset"]),
    named([{}, {"num_splits": 3, "window": 100, "sinks": True}, {"softcap": 5.0}], ["plain", "splits-window-sinks",
                                                                                   "softcap"])))
def test_quantized_decode_wide_rows(device, kv_dtype, D, qdt, offset, opts):
    """Decode rows at head_dims over 64, K / V centred or offset from zero (mean ``offset``), ragged lengths with
    partial tiles, alone, with splits + window + sinks, or softcap, against the reference over the dequantized cache.
    int8 V takes the magic-number operand there (``1024 + c``, the offset taken out after the loop: a wrong
    correction shifts every output); on the CPU only float16 queries reach it (the interpreter runs bfloat16 dots in
    float32), on a GPU both."""
    H, hq, bs = 2, 8, 16
    kv_lens = [1, 33, 150]
    gen = torch.Generator().manual_seed(11)
    ks = [(offset + torch.randn((n, H, D), generator=gen)).to(qdt) for n in kv_lens]
    vs = [(offset + torch.randn((n, H, D), generator=gen)).to(qdt) for n in kv_lens]
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="NHD", H=H, D=D, bs=bs, lens=kv_lens, dtype=qdt,
                              kv=(ks, vs))
    q = _q(len(kv_lens), hq, D, qdt, device, seed=5)
    kw = dict(opts)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.linspace(-1, 2, hq, device=device)
    ones = [1] * len(kv_lens)
    out, lse = _run(cache, bt, q, ones, kv_lens, device, **kw)
    eo, el = paged_expected(q.cpu(), cache, bt, ones, kv_lens, scale=1 / math.sqrt(D), sinks=kw.get("sinks"),
                            window=kw.get("window"), softcap=kw.get("softcap"))
    assert_attn_close(out, lse, eo, el, qdt, what=f"{kv_dtype} D={D} offset {offset} {opts}")


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "k8v4"])
def test_quantized_decode_queries_with_a_mean(device, kv_dtype):
    """Decode queries far from zero mean (32 (1 + randn)): every score carries a large sum(q) term, so a kernel that
    left a constant offset in the K codes and took it out of the scores afterwards would lose the log-sum-exp to
    float32 cancellation (2e-2 measured on an H100 for int4 codes carried as 1024 + c); the exact codes stay within
    the fp16 tolerance."""
    H, hq, D, bs = 2, 8, 128, 16
    kv_lens = [700, 257]
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="NHD", H=H, D=D, bs=bs, lens=kv_lens, seed=3)
    q = (32 * (1 + _q(len(kv_lens), hq, D, torch.float32, device, seed=9))).half()
    ones = [1] * len(kv_lens)
    out, lse = _run(cache, bt, q, ones, kv_lens, device)
    eo, el = paged_expected(q.cpu(), cache, bt, ones, kv_lens, scale=1 / math.sqrt(D))
    assert_attn_close(out, lse, eo, el, torch.float16, what=f"{kv_dtype} queries with a mean")


@pytest.mark.parametrize(("dtype", "kv_dtype", "D", "splits"), pairwise(
    [torch.bfloat16, torch.float16], ["int8", "int4"], [64, 128], [None, 3]))
def test_quantized_decode_v_scales_vary_by_tile(device, kv_dtype, D, splits, dtype):
    """V magnitudes that change by up to 10^10 (bf16; 10^7 for fp16) from one KV tile to the next, in runs of 24
    tokens: the decode tiles keep their accumulators in units of each tile's largest V scale and rescale them tile by
    tile, so a wrong ratio between two tiles' units would mis-weigh every earlier tile. Queries are small, so all
    tokens carry comparable softmax weights and every tile's values reach the output. fp16 queries at D 128 take
    the int8 V operand as magic numbers (their offset's row sums by a dot) under the interpreter too."""
    H, hq, bs, n = 1, 4, 16, 600
    gen = torch.Generator().manual_seed(5)
    k = torch.randn((n, H, D), generator=gen)
    lo, hi = (-5, 6) if dtype == torch.bfloat16 else (-3, 4)
    mags = 10.0 ** torch.randint(lo, hi, (n // 24 + 1,), generator=gen).double()
    v = torch.randn((n, H, D), generator=gen).double() * mags.repeat_interleave(24)[:n, None, None]
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="NHD", H=H, D=D, bs=bs, lens=[n],
                              dtype=dtype, kv=([k.to(dtype)], [v.to(dtype)]))
    q = (0.1 * _q(1, hq, D, torch.float32, device)).to(dtype)
    kw = {} if splits is None else dict(num_splits=splits)
    out, lse = _run(cache, bt, q, [1], [n], device, **kw)
    eo, el = paged_expected(q.cpu(), cache, bt, [1], [n], scale=1 / math.sqrt(D))
    err = (out.double().cpu() - eo).abs().amax(-1) / eo.abs().amax(-1)
    assert err.max() <= 1e-2, err
    assert (lse.double().cpu() - el).abs().max() <= 1e-2


@pytest.mark.parametrize(("kv_dtype", "mag", "zero_tiles"), [("int8", 5e-37, False), ("int8", 5e-37, True),
                                                             ("int4", 3e-38, False)])
def test_quantized_decode_tiny_v_scales_over_tiles(device, kv_dtype, mag, zero_tiles):
    """V scales below 2^-128 (bf16 caches hold such values) over several decode tiles: the ratio between two tiles'
    units must not overflow (1 / s_max alone would), and tiles whose V rows are all zero (scale 0) in between must
    keep the accumulators' unit, so the tiles before them keep their weight (int8: 64-key tiles at D 16, so keys
    64..191 are two whole zero tiles; int4's scales sit so close to float32's subnormals that zero rows would pull
    the output itself below them)."""
    H, hq, D, bs, n = 1, 2, 16, 16, 320
    gen = torch.Generator().manual_seed(2)
    k = torch.randn((n, H, D), generator=gen)
    v = torch.rand((n, H, D), generator=gen) * mag
    if zero_tiles:
        v[64:192] = 0.0
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="NHD", H=H, D=D, bs=bs, lens=[n],
                              dtype=torch.bfloat16, kv=([k.bfloat16()], [v.bfloat16()]))
    q = (0.1 * _q(1, hq, D, torch.float32, device)).bfloat16()
    out, lse = _run(cache, bt, q, [1], [n], device)
    eo, _ = paged_expected(q.cpu(), cache, bt, [1], [n], scale=1 / math.sqrt(D))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    err = (out.double().cpu() - eo).abs().amax(-1) / eo.abs().amax(-1)
    assert err.max() <= 2e-2, err


@pytest.mark.parametrize("q_len", [1, 20], ids=["decode", "prefill"])
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("mag", [1e-30, 1e-36])
def test_quantized_tiny_v_scales_stay_finite(device, kv_dtype, mag, q_len):
    """bf16 caches can hold V values near float32's smallest normals; the decode tiles' P scaling by the tile's
    largest V scale must then neither overflow (R / s_max) nor turn masked lanes into NaN, and the prefill tiles'
    dequantization must keep them (bfloat16 range: in float16 they would flush to zero)."""
    H, hq, D, bs, n = 1, 2, 16, 16, 20
    gen = torch.Generator().manual_seed(0)
    k = torch.randn((n, H, D), generator=gen)
    v = torch.rand((n, H, D), generator=gen) * mag
    cache, bt, _ = make_paged(device, kv_dtype=kv_dtype, layout="NHD", H=H, D=D, bs=bs, lens=[n],
                              dtype=torch.bfloat16, kv=([k.bfloat16()], [v.bfloat16()]))
    q = _q(q_len, hq, D, torch.bfloat16, device)
    out, lse = _run(cache, bt, q, [q_len], [n], device)
    eo, el = paged_expected(q.cpu(), cache, bt, [q_len], [n], scale=1 / math.sqrt(D))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    err = (out.float().cpu() - eo).abs().max()
    assert err <= 2e-2 * eo.abs().max(), (err, eo.abs().max())
