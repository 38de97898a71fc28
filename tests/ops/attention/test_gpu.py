"""Attention compiled on the GPU at realistic sizes: decode and extend batches over every kv_dtype, layout and
block size against the float32 torch reference (itself checked against the independent float64 reference in the
CPU tests), the flash-decoding split of a long sequence, CUDA-graph capture and replay with new lengths, and the
quantized formats' error against the fp16 cache (printed per format)."""

from __future__ import annotations

import math

import pytest
import torch

from kvcache.ops import paged_attention
from kvcache.ops.attention import attention_plan, attention_workspace_size
from kvcache.ops.attention.reference import paged_attention_reference

from .attn_reference import assert_attn_close, i32, make_paged

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = torch.device("cuda")
HQ, H, D = 32, 8, 128


def _both(cache, bt, q, q_lens, kv_lens, **kw):  # type: ignore[no-untyped-def]
    """(kernel out, lse) and (reference out, lse) as float64 on the CPU."""
    cfg = cache.config
    cu = i32([0] + [sum(q_lens[: i + 1]) for i in range(len(q_lens))], DEV)
    kl = i32(list(kv_lens), DEV)
    args = dict(kv_dtype=cfg.kv_dtype, layout=cfg.layout, block_tables=bt, cu_q_lens=cu, kv_lens=kl)
    scales = cache.kv_scales[0] if cfg.kv_dtype in ("fp8", "fp8k") else None
    lse = torch.empty(q.shape[:2], device=DEV)
    out = paged_attention(q, cache.pool(0), cache.params(0), scales, lse=lse, **args, **kw)
    ref_out = torch.empty_like(q, dtype=torch.float32)
    ref_lse = torch.empty_like(lse)
    opts = {k: kw.get(k) for k in ("window", "softcap", "sinks")}
    paged_attention_reference(q.float(), cache.pool(0), cache.params(0), scales, out=ref_out, lse=ref_lse,
                              scale=kw.get("scale") or 1 / math.sqrt(q.shape[-1]), cp_rank=0, cp_size=1, **opts,
                              **args)
    torch.cuda.synchronize()
    return (out, lse), (ref_out.double().cpu(), ref_lse.double().cpu())


@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8", "int4", "fp8k"])
def test_decode_realistic(kv_dtype, layout, bs):
    kv_lens = [1, 17, 300, 1024, 2047, 4000, 64, 129]
    cache, bt, _ = make_paged(DEV, kv_dtype=kv_dtype, layout=layout, H=H, D=D, bs=bs, lens=kv_lens, seed=1)
    q = torch.randn((len(kv_lens), HQ, D), device=DEV, dtype=torch.float16)
    (o, l_), (ro, rl) = _both(cache, bt, q, [1] * len(kv_lens), kv_lens)
    assert_attn_close(o, l_, ro, rl, torch.float16, what=f"decode {kv_dtype} {layout} bs {bs}")


@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_int4_warp_split_realistic(layout, bs):
    """int4 decode over contexts past WARP_SPLIT_MIN_KV runs the warp-split tiles (asserted on the plan)."""
    kv_lens = [1, 17, 300, 5000, 4096, 129, 8191]
    cache, bt, _ = make_paged(DEV, kv_dtype="int4", layout=layout, H=H, D=D, bs=bs, lens=kv_lens, seed=2)
    assert attention_plan(num_q_heads=HQ, num_kv_heads=H, head_dim=D, n_tokens=len(kv_lens), num_seqs=len(kv_lens),
                          max_kv_len=bt.shape[1] * bs, kv_dtype="int4").warp_split
    q = torch.randn((len(kv_lens), HQ, D), device=DEV, dtype=torch.float16)
    (o, l_), (ro, rl) = _both(cache, bt, q, [1] * len(kv_lens), kv_lens)
    assert_attn_close(o, l_, ro, rl, torch.float16, what=f"int4 warp split {layout} bs {bs}")


@pytest.mark.parametrize("kv_dtype,D_,per_sm", [("int8", 128, 5), ("int4", 128, 5), ("k8v4", 128, 5), ("int8", 64, 2),
                                                 ("int8", 128, 2), ("k8v4", 128, 2)])
def test_one_warp_decode_realistic(kv_dtype, D_, per_sm):
    """The one-warp decode tiles over a block table past LONG_MIN_KV tokens: int8 / int4 / k8v4 at head_dim 128
    with five programs per SM (KV ranges split), int8 / k8v4 with two (five stages, unsplit), and int8 at
    head_dim 64 (asserted on the plan)."""
    n_sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    n = -(-per_sm * n_sms // H) + 3
    gen = torch.Generator().manual_seed(4)
    kv_lens = [9000, 1, 17, 8192, 4100] + torch.randint(1, 9001, (n - 5,), generator=gen).tolist()
    qdt = torch.bfloat16 if D_ == 64 else torch.float16
    cache, bt, _ = make_paged(DEV, kv_dtype=kv_dtype, layout="NHD", H=H, D=D_, bs=16, lens=kv_lens, dtype=qdt, seed=5)
    plan = attention_plan(num_q_heads=HQ, num_kv_heads=H, head_dim=D_, n_tokens=n, num_seqs=n,
                          max_kv_len=bt.shape[1] * 16, kv_dtype=kv_dtype, num_sms=n_sms)
    assert plan.num_warps == 1 and (plan.num_splits > 1) == (D_ == 128 and per_sm == 5)
    assert (plan.num_stages == 5) == (D_ == 128 and per_sm == 2)
    q = torch.randn((n, HQ, D_), device=DEV, dtype=qdt)
    (o, l_), (ro, rl) = _both(cache, bt, q, [1] * n, kv_lens)
    assert_attn_close(o, l_, ro, rl, qdt, what=f"one-warp {kv_dtype} D {D_}")


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int4", "fp8k"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_extend_realistic(kv_dtype, dtype):
    q_lens, kv_lens = [512, 1, 333, 700], [512, 900, 1333, 1700]
    cache, bt, _ = make_paged(DEV, kv_dtype=kv_dtype, layout="NHD", H=H, D=D, bs=16, lens=kv_lens, dtype=dtype)
    q = torch.randn((sum(q_lens), HQ, D), device=DEV, dtype=dtype)
    (o, l_), (ro, rl) = _both(cache, bt, q, q_lens, kv_lens)
    assert_attn_close(o, l_, ro, rl, dtype, what=f"extend {kv_dtype}")


def test_options_realistic():
    q_lens, kv_lens = [1, 200, 1], [3000, 700, 5]
    cache, bt, _ = make_paged(DEV, kv_dtype="int8", layout="HND", H=H, D=D, bs=32, lens=kv_lens)
    q = torch.randn((sum(q_lens), HQ, D), device=DEV, dtype=torch.float16) * 2
    sinks = torch.randn(HQ, device=DEV)
    (o, l_), (ro, rl) = _both(cache, bt, q, q_lens, kv_lens, window=256, softcap=30.0, sinks=sinks)
    assert_attn_close(o, l_, ro, rl, torch.float16)


@pytest.mark.parametrize("D_", [64, 80, 96, 256])
def test_head_dims_gpu(D_):
    kv_lens, q_lens = [1500, 33], [1, 33]
    cache, bt, _ = make_paged(DEV, kv_dtype="auto", layout="NHD", H=2, D=D_, bs=16, lens=kv_lens)
    q = torch.randn((sum(q_lens), 12, D_), device=DEV, dtype=torch.float16)
    (o, l_), (ro, rl) = _both(cache, bt, q, q_lens, kv_lens)
    assert_attn_close(o, l_, ro, rl, torch.float16, what=f"D {D_}")


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8", "int4", "fp8k"])
def test_one_warp_few_long_sequences(kv_dtype):
    """Two sequences over a 40k-token table: one-warp tiles, the KV range split for four programs per SM (asserted
    on the plan); the shorter sequence leaves the last splits empty."""
    kv_lens = [40000, 33333]
    cache, bt, _ = make_paged(DEV, kv_dtype=kv_dtype, layout="HND", H=H, D=D, bs=64, lens=kv_lens, seed=6)
    plan = attention_plan(num_q_heads=HQ, num_kv_heads=H, head_dim=D, n_tokens=2, num_seqs=2,
                          max_kv_len=bt.shape[1] * 64, kv_dtype=kv_dtype,
                          num_sms=torch.cuda.get_device_properties(DEV).multi_processor_count)
    assert plan.num_warps == 1 and plan.num_splits > 8
    q = torch.randn((2, HQ, D), device=DEV, dtype=torch.float16)
    (o, l_), (ro, rl) = _both(cache, bt, q, [1, 1], kv_lens)
    assert_attn_close(o, l_, ro, rl, torch.float16, what=f"one-warp few {kv_dtype}")


def test_long_sequence_split():
    """1 x 32k decode: the default plan splits the KV range; the result matches the reference and num_splits=1."""
    kv_lens = [32768]
    cache, bt, _ = make_paged(DEV, kv_dtype="fp8", layout="NHD", H=H, D=D, bs=64, lens=kv_lens)
    plan = attention_plan(num_q_heads=HQ, num_kv_heads=H, head_dim=D, n_tokens=1, num_seqs=1, max_kv_len=32768,
                          num_sms=torch.cuda.get_device_properties(DEV).multi_processor_count)
    assert plan.num_splits > 1
    q = torch.randn((1, HQ, D), device=DEV, dtype=torch.float16)
    (o, l_), (ro, rl) = _both(cache, bt, q, [1], kv_lens)
    assert_attn_close(o, l_, ro, rl, torch.float16)
    (o1, l1), _ = _both(cache, bt, q, [1], kv_lens, num_splits=1)
    assert (o1.float() - o.float()).abs().max() < 2e-3 and (l1 - l_).abs().max() < 1e-4


def test_cuda_graph_replay_with_new_lengths():
    """Captured with out and workspace given (no allocation, no sync), replayed after the lengths, queries and
    block tables change in place: equals eager calls on the new values."""
    kv_lens = [4000, 100, 2500, 9]
    cache, bt, _ = make_paged(DEV, kv_dtype="int4", layout="NHD", H=H, D=D, bs=16, lens=kv_lens, spare=2)
    n = len(kv_lens)
    q = torch.randn((n, HQ, D), device=DEV, dtype=torch.float16)
    cu, kl = i32(list(range(n + 1)), DEV), i32(kv_lens, DEV)
    out = torch.empty_like(q)
    lse = torch.empty((n, HQ), device=DEV)
    splits = 4
    ws = torch.empty(attention_workspace_size(n, HQ, D, splits), device=DEV)
    args = dict(kv_dtype="int4", layout="NHD", block_tables=bt, cu_q_lens=cu, kv_lens=kl, out=out, lse=lse,
                num_splits=splits, workspace=ws)

    def step() -> None:
        paged_attention(q, cache.pool(0), cache.params(0), **args)

    step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    kl.copy_(i32([4001, 130, 17, 40], DEV))
    q.normal_()
    g.replay()
    torch.cuda.synchronize()
    got, got_lse = out.clone(), lse.clone()
    eager_out = torch.empty_like(q)
    eager_lse = torch.empty_like(lse)
    paged_attention(q, cache.pool(0), cache.params(0), **dict(args, out=eager_out, lse=eager_lse))
    assert torch.equal(got, eager_out) and torch.equal(got_lse, eager_lse)


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8", "int4", "fp8k"])
def test_quantized_error_against_fp16(kv_dtype):
    """The same K / V in an fp16 cache and a quantized one: the output error per format (printed; -s shows it),
    bounded loosely by the format's precision."""
    kv_lens = [2048] * 4
    gen = torch.Generator().manual_seed(7)
    ks = [torch.randn((n, H, D), generator=gen).half() for n in kv_lens]
    vs = [torch.randn((n, H, D), generator=gen).half() for n in kv_lens]
    ref, rbt, _ = make_paged(DEV, kv_dtype="auto", layout="NHD", H=H, D=D, bs=16, lens=kv_lens, kv=(ks, vs))
    qc, qbt, _ = make_paged(DEV, kv_dtype=kv_dtype, layout="NHD", H=H, D=D, bs=16, lens=kv_lens, kv=(ks, vs))
    q = torch.randn((4, HQ, D), device=DEV, dtype=torch.float16)
    (o16, _), _ = _both(ref, rbt, q, [1] * 4, kv_lens)
    (oq, _), _ = _both(qc, qbt, q, [1] * 4, kv_lens)
    err = (oq.float() - o16.float()).abs()
    print(f"\n{kv_dtype} vs fp16 cache: max abs error {err.max().item():.4f}, mean {err.mean().item():.5f}")
    assert err.max().item() < {"fp8": 0.05, "int8": 0.02, "int4": 0.3, "fp8k": 0.05}[kv_dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn], ids=["fp16", "bf16", "fp8"])
@pytest.mark.parametrize("q_len", [1, 64])
def test_linear_realistic(dtype, q_len):
    """A LinearKVCache layer (16 slots x 4096, 8 KV heads) against the float32 reference; slot 0 ends at S."""
    import kvcache
    from kvcache.ops import linear_attention
    from kvcache.ops.attention.reference import linear_attention_reference

    cache = kvcache.LinearKVCache(kvcache.CacheConfig(num_layers=1, max_batch_size=16, max_seq_len=4096,
                                                      num_kv_heads=H, head_dim=D, dtype=dtype, device=DEV))
    cache.layer(0).copy_(torch.randn(cache.layer(0).shape, device=DEV).to(dtype))
    qdt = torch.float16 if dtype == torch.float8_e4m3fn else dtype
    lengths = torch.randint(0, 4096 - q_len, (16,), device=DEV, dtype=torch.int32)
    lengths[0] = 4096 - q_len
    q = torch.randn((16, HQ, q_len, D), device=DEV, dtype=qdt)
    lse = torch.empty((16, HQ, q_len), device=DEV)
    out = linear_attention(q, cache.layer(0), lengths, lse=lse)
    ref = torch.empty_like(q, dtype=torch.float32)
    ref_lse = torch.empty_like(lse)
    linear_attention_reference(q.float(), cache.layer(0), lengths, None, out=ref, lse=ref_lse, scale=1 / math.sqrt(D),
                               window=None, softcap=None, sinks=None)
    torch.cuda.synchronize()
    flat = (lambda t: t.transpose(1, 2).reshape(-1, HQ, *t.shape[3:]))  # noqa: E731 - [B, Hq, q, ...] -> rows
    assert_attn_close(flat(out), flat(lse[..., None])[..., 0], flat(ref).double().cpu(),
                      flat(ref_lse[..., None])[..., 0].double().cpu(), qdt, what=f"linear {dtype}")
