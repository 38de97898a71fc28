"""kvcache.hf caches on a small random Llama (fast): logits equal DynamicCache's step by step (left-padded
batch, every layout and mode, fp32 / fp16 / bf16 models), quantized keys and values within their format's
bound, crop, beam search, reset, per-layer lengths and the errors."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvcache.hf import LinearCache, PagedCache, kvcache_paged_attention

B, PROMPT, STEPS = 3, 7, 5


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=128, initializer_range=0.2)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(autouse=True)
def sdpa_between_tests(tiny) -> Iterator[None]:
    """Each test starts and ends with sdpa attention: a PagedCache decides per step from the model's config
    whether the attention function writes (``kvcache_paged``), so a test failing with another implementation
    set must not change what the next test's direct ``update`` calls do."""
    tiny.set_attn_implementation("sdpa")
    yield
    tiny.set_attn_implementation("sdpa")


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 97, (B, PROMPT), generator=g)
    mask = torch.ones(B, PROMPT, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


def _run(model, cache, steps: int = STEPS, attn: str = "sdpa") -> list[torch.Tensor]:
    """Prefill, then ``steps`` decode steps fed with fixed tokens (teacher forcing): logits of each step."""
    model.set_attn_implementation(attn)
    ids, mask = _inputs()
    g = torch.Generator().manual_seed(2)
    out = []
    with torch.no_grad():
        for _ in range(steps + 1):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                           use_cache=True).logits
            out.append(logits[:, -1].float())
            ids = torch.randint(1, 97, (B, 1), generator=g)
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], dim=1)
    return out


def _close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float) -> None:
    for s, (x, y) in enumerate(zip(a, b)):
        err = (x - y).abs().max().item()
        assert err <= tol * max(1.0, y.abs().max().item()), f"step {s}: max logit error {err}"


CASES = [
    ("linear", dict(), "sdpa"),
    ("linear", dict(kv_dtype="fp32"), "eager"),
    ("paged", dict(), "sdpa"),
    ("paged", dict(block_size=3, layout="HND"), "sdpa"),
    ("paged", dict(), "kvcache_paged"),
    ("paged", dict(block_size=5, layout="HND"), "kvcache_paged"),
]


def _make(kind: str, model, **kw):
    if kind == "linear":
        return LinearCache(model.config, max_batch_size=B, max_cache_len=PROMPT + STEPS + 2, **kw)
    return PagedCache(model.config, max_batch_size=B, max_cache_len=PROMPT + STEPS + 2, **kw)


@pytest.mark.parametrize(("kind", "kw", "attn"), CASES, ids=[f"{k}-{a}-{kw}" for k, kw, a in CASES])
def test_logits_equal_dynamic_fp32(tiny, kind, kw, attn):
    ref = _run(tiny, DynamicCache(config=tiny.config))
    cache = _make(kind, tiny, **kw)
    got = _run(tiny, cache, attn=attn)
    _close(got, ref, 1e-5)
    assert cache.get_seq_length() == PROMPT + STEPS
    if kind == "paged" and attn == "kvcache_paged":
        assert cache.seq_lens == [PROMPT + STEPS, PROMPT + STEPS - 3, PROMPT + STEPS - 1]  # padding not stored
        bs = cache.block_size
        assert cache.allocator.num_used_blocks == sum(-(-n // bs) for n in cache.seq_lens)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("kind", "attn"), [("linear", "sdpa"), ("paged", "sdpa"), ("paged", "kvcache_paged")])
def test_half_models(tiny, dtype, kind, attn):
    model = LlamaForCausalLM(tiny.config).eval()
    model.load_state_dict(tiny.state_dict())
    model.to(dtype)
    ref = _run(model, DynamicCache(config=model.config))
    got = _run(model, _make(kind, model), attn=attn)
    # same stored values; attention may round differently in half precision (one bf16 step of the logits)
    _close(got, ref, 2e-2 if dtype == torch.bfloat16 else 4e-3)


def _fp8_bound(x: torch.Tensor) -> torch.Tensor:
    return x.abs() / 16 + 2.0**-9  # e4m3 (scale 1): half a step of 3 mantissa bits, subnormal spacing 2^-9


def _fp8k_key_bound(x: torch.Tensor) -> torch.Tensor:
    """fp8k keys: scale = amax / 448 per (token, head) row, |x - dequant| <= max(|x| / 16, scale / 1024)."""
    scale = x.abs().amax(-1, keepdim=True) / 448
    return torch.maximum(x.abs() / 16, scale / 1024) * 1.001 + 1e-6


def _int_bound(x: torch.Tensor, bits: int) -> torch.Tensor:
    rng = x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)
    return rng / (2**bits - 1) / 2 * 1.001 + 1e-6  # scale / 2 per (token, head) row


@pytest.mark.parametrize(("kind", "kv_dtype"), [("paged", "fp8"), ("paged", "int8"), ("paged", "int4"),
                                                 ("paged", "k8v4"), ("paged", "fp8k"), ("linear", "fp8"),
                                                 ("linear", "bf16")])
def test_quantized_kv_within_format_bound(tiny, kind, kv_dtype):
    """After prefill, every stored key / value of the first layer (dequantized) is within its format's rounding
    bound of the model's own (DynamicCache's; later layers see different inputs); logits stay close."""
    ref_cache = DynamicCache(config=tiny.config)
    ref = _run(tiny, ref_cache, steps=0)
    cache = _make(kind, tiny, kv_dtype=kv_dtype)
    got = _run(tiny, cache, steps=0)
    for i in (0,):
        want_k, want_v = ref_cache.layers[i].keys, ref_cache.layers[i].values  # [B, H, PROMPT, D]
        if kind == "paged":
            tables = torch.tensor(cache.block_tables, dtype=torch.int32)
            lens = torch.full((B,), PROMPT, dtype=torch.int32)
            k, v = cache.paged.gather(i, cache.paged.plan(tables, seq_lens=lens), max_len=PROMPT)
        else:
            k, v = (t[:B, :, :PROMPT].float() for t in cache.store.kv(i))
        for x, y in ((want_k, k), (want_v, v)):
            if kv_dtype == "fp8" or (kv_dtype == "fp8k" and x is want_v):
                bound = _fp8_bound(x)
            elif kv_dtype == "fp8k":  # keys: a scale per (token, head)
                bound = _fp8k_key_bound(x)
            elif kv_dtype == "bf16":
                bound = x.abs() * 2.0**-8  # half a unit in the last place of 8 significant bits
            else:  # k8v4: 8-bit keys, 4-bit values
                bound = _int_bound(x, {"int8": 8, "int4": 4, "k8v4": 8 if x is want_k else 4}[kv_dtype])
            assert ((x - y).abs() <= bound).all(), f"layer {i}: max error {(x - y).abs().max().item()}"
    _close(got, ref, 0.5 if kv_dtype in ("int4", "k8v4") else 0.1)


@pytest.mark.parametrize(("kind", "attn"), [("linear", "sdpa"), ("paged", "sdpa"), ("paged", "kvcache_paged")])
def test_crop_then_continue(tiny, kind, attn):
    ids, mask = _inputs()
    caches = [DynamicCache(config=tiny.config), _make(kind, tiny, **({"block_size": 4} if kind == "paged" else {}))]
    outs = []
    for c, a in zip(caches, ("sdpa", attn)):
        tiny.set_attn_implementation(a)
        with torch.no_grad():
            tiny(input_ids=ids, attention_mask=mask, past_key_values=c)
            more = torch.full((B, 3), 5)
            m2 = torch.cat([mask, torch.ones(B, 3, dtype=torch.long)], 1)
            tiny(input_ids=more, attention_mask=m2, past_key_values=c)
            c.crop(-2)
            assert c.get_seq_length() == PROMPT + 1
            m3 = torch.cat([mask, torch.ones(B, 2, dtype=torch.long)], 1)
            outs.append(tiny(input_ids=torch.full((B, 1), 9), attention_mask=m3, past_key_values=c).logits)
    _close([outs[1][:, -1]], [outs[0][:, -1]], 1e-5)
    if kind == "paged":
        used = caches[1].allocator.num_used_blocks
        caches[1].crop(2)  # the older absolute form: keep the first 2 tokens
        assert caches[1].get_seq_length() == 2 and caches[1].allocator.num_used_blocks < used


@pytest.mark.parametrize(("kind", "attn"), [("linear", "sdpa"), ("paged", "sdpa"), ("paged", "kvcache_paged")])
def test_beam_search_equals_dynamic(tiny, kind, attn):
    ids, mask = _inputs()
    kw = dict(max_new_tokens=6, num_beams=3, do_sample=False, early_stopping=True, pad_token_id=0)
    tiny.set_attn_implementation("sdpa")
    ref = tiny.generate(input_ids=ids, attention_mask=mask, **kw)
    tiny.set_attn_implementation(attn)
    cache = LinearCache(tiny.config, max_batch_size=3 * B, max_cache_len=PROMPT + 8) if kind == "linear" else \
        PagedCache(tiny.config, max_batch_size=3 * B, max_cache_len=PROMPT + 8, block_size=4)
    got = tiny.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kw)
    assert torch.equal(got, ref)
    if kind == "paged":  # forked tables share blocks: fewer blocks than rows x length
        tiny.set_attn_implementation("sdpa")
        assert cache.allocator.num_used_blocks <= 3 * B * -(-(PROMPT + 6) // 4)


@pytest.mark.parametrize("kind", ["linear", "paged"])
def test_reset_reuses_cache_and_both_kwarg_names(tiny, kind):
    ids, mask = _inputs()
    tiny.set_attn_implementation("kvcache_paged" if kind == "paged" else "sdpa")
    cache = _make(kind, tiny)
    first = tiny.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4,
                          do_sample=False, pad_token_id=0)
    cache.reset()
    assert cache.get_seq_length() == 0
    if kind == "paged":
        assert cache.allocator.num_used_blocks == 0
    # the model's own name for the cache argument: ``cache`` where transformers has it (5.24), else
    # ``past_key_values`` again (5.17's generate refuses ``cache=``)
    name = "cache" if "cache" in inspect.signature(tiny.forward).parameters else "past_key_values"
    again = tiny.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                          **{name: cache})
    tiny.set_attn_implementation("sdpa")
    assert torch.equal(first, again)


def test_lengths_are_per_layer(tiny):
    for cache in (_make("linear", tiny), _make("paged", tiny)):
        k = torch.randn(B, 2, 4, 16)
        cache.update(k, k, 0)
        assert [cache.get_seq_length(i) for i in range(3)] == [4, 0, 0]
        assert cache.get_mask_sizes(1, 0) == (5, 0) and cache.get_mask_sizes(1, 1) == (1, 0)
        with pytest.raises(ValueError, match="layer_idx"):
            cache.update(k, k, 0)  # twice in one step
        cache.update(k, k, 1)
        cache.update(k, k, 2)
        assert [cache.get_seq_length(i) for i in range(3)] == [4, 4, 4]
        kk, vv = cache.update(k, k, 0)
        assert kk.shape == (B, 2, 8, 16) and torch.equal(kk[:, :, 4:], k)


def test_in_place_update_without_the_attention_function_is_an_error(tiny):
    """With ``kvcache_paged`` set, ``update`` only records the step and the attention function writes; a next
    layer's update after a layer nobody wrote raises instead of silently losing its keys."""
    cache = _make("paged", tiny)
    tiny.set_attn_implementation("kvcache_paged")
    k = torch.randn(B, 2, 4, 16)
    kk, _ = cache.update(k, k, 0)
    assert kk is k and cache.seq_lens == [0] * B  # handed to the attention function, nothing written yet
    with pytest.raises(ValueError, match="attn_implementation"):
        cache.update(k, k, 1)
    cache.reset()
    tiny.set_attn_implementation("sdpa")
    for i in range(3):
        cache.update(k, k, i)
    assert cache.seq_lens == [4] * B and cache.get_seq_length() == 4


def _windowed_attention(q, k, v, scale, window, softcap):
    """fp64 causal attention of q ``[B, Hq, T, D]`` (the last T positions) over k / v ``[B, H, S, D]`` with a
    sliding window and a logit soft-cap: ``[B, T, Hq, D]``."""
    T, S, rep = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = q.double() @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    qpos, kpos = torch.arange(S - T, S)[:, None], torch.arange(S)[None, :]
    allowed = (kpos <= qpos) & ((qpos - kpos < window) if window is not None else True)
    s = s.masked_fill(~allowed, float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)


def test_layers_with_their_own_window_and_softcap(tiny):
    """kvcache_paged attention whose layers differ in sliding window and soft-cap (the first layer's options are
    the step's plan, the others take plans of their own) equals attention over every key with each layer's
    options, through a prefill and two decode steps."""
    cache = _make("paged", tiny, block_size=4)
    tiny.set_attn_implementation("kvcache_paged")
    g = torch.Generator().manual_seed(3)
    layers = [(None, None, 0.25), (3, None, 0.25), (None, 2.0, 0.5)]  # (window, softcap, scale) per layer
    keys: list = [None] * 3
    values: list = [None] * 3
    for T in (6, 1, 1):
        for i, (window, softcap, scale) in enumerate(layers):
            q, k, v = (torch.randn(B, h, T, 16, generator=g) for h in (4, 2, 2))
            kk, vv = cache.update(k, v, i)
            out, _ = kvcache_paged_attention(torch.nn.Module(), q, kk, vv, None, scaling=scale,
                                             sliding_window=window, softcap=softcap)
            keys[i] = k if keys[i] is None else torch.cat((keys[i], k), dim=2)
            values[i] = v if values[i] is None else torch.cat((values[i], v), dim=2)
            want = _windowed_attention(q, keys[i], values[i], scale, window, softcap)
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert cache.seq_lens == [8] * B and cache.get_seq_length() == 8


def test_errors(tiny):
    cfg = tiny.config
    with pytest.raises(ValueError, match="kv_dtype"):
        PagedCache(cfg, max_batch_size=1, max_cache_len=8, kv_dtype="int2")
    with pytest.raises(ValueError, match="kv_dtype"):
        LinearCache(cfg, max_batch_size=1, max_cache_len=8, kv_dtype="int8")
    with pytest.raises(ValueError, match="max_cache_len"):
        LinearCache(cfg, max_batch_size=1, max_cache_len=0)
    with pytest.raises(TypeError, match="max_batch_size"):
        PagedCache(cfg, max_batch_size=1.5, max_cache_len=8)
    with pytest.raises(ValueError, match="layout"):
        PagedCache(cfg, max_batch_size=1, max_cache_len=8, layout="XYZ")
    with pytest.raises(TypeError, match="config"):
        PagedCache(object(), max_batch_size=1, max_cache_len=8)
    k = torch.randn(2, 2, 3, 16)
    with pytest.raises(ValueError, match="max_batch_size"):
        LinearCache(cfg, max_batch_size=1, max_cache_len=8).update(k, k, 0)
    with pytest.raises(ValueError, match="max_batch_size"):
        PagedCache(cfg, max_batch_size=1, max_cache_len=8).update(k, k, 0)
    small = PagedCache(cfg, max_batch_size=2, max_cache_len=8, block_size=2, num_blocks=2)
    with pytest.raises(ValueError, match="num_blocks"):
        small.update(k, k, 0)  # 2 rows x 2 blocks needed, 2 in the pool
    assert small.allocator.num_used_blocks == 0 and small.get_seq_length() == 0
    lin = LinearCache(cfg, max_batch_size=2, max_cache_len=4)
    lin.update(k, k, 0)
    lin.update(k, k, 1)
    lin.update(k, k, 2)
    before = lin.store.buffer.clone()
    with pytest.raises(ValueError, match="max_seq_len"):
        lin.update(k, k, 0)  # 3 + 3 > 4
    assert torch.equal(lin.store.buffer, before) and lin.get_seq_length(0) == 3
    with pytest.raises(ValueError, match="beam_idx"):
        PagedCache(cfg, max_batch_size=2, max_cache_len=8).reorder_cache(torch.tensor([0, 1, 2]))


def test_attention_function_without_kvcache_equals_sdpa(tiny):
    ids, mask = _inputs()
    tiny.set_attn_implementation("sdpa")
    ref = tiny(input_ids=ids, attention_mask=mask).logits
    tiny.set_attn_implementation("kvcache_paged")
    got = tiny(input_ids=ids, attention_mask=mask).logits  # no cache given: transformers' DynamicCache
    tiny.set_attn_implementation("sdpa")
    valid = mask.bool()
    assert torch.allclose(got[valid], ref[valid], atol=1e-5)
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match="dropout"):
        kvcache_paged_attention(torch.nn.Module(), q, q[:, :2], q[:, :2], None, dropout=0.1)


def test_linear_cache_with_per_layer_shapes_uses_the_manager(tiny):
    cache = LinearCache(tiny.config, max_batch_size=2, max_cache_len=8, layers=[(2, 16), (1, 8), (2, 16)],
                        kv_dtype="bf16")
    ks = [torch.randn(2, h, 3, d) for h, d in ((2, 16), (1, 8), (2, 16))]
    outs = [cache.update(k, -k, i) for i, k in enumerate(ks)]
    assert type(cache.store).__name__ == "KVCacheManager" and cache.store.lengths.tolist() == [3, 3]
    for k, (kk, vv) in zip(ks, outs):
        assert kk.dtype == torch.float32 and kk.shape == k.shape  # converted back to the model's dtype
        assert torch.equal(kk, k.to(torch.bfloat16).float()) and torch.equal(vv, (-k).to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="layers"):
        LinearCache(tiny.config, max_batch_size=2, max_cache_len=8, layers=[(2, 16)])


def test_int4b_beam_fork_at_a_block_boundary_copies_the_kept_next_block(tiny):
    # int4b keeps the block after a full one (the next partial block's keys spill into it): after a fork at a block
    # boundary both rows hold it, and the next step's writes must go to copies, not to the shared block
    cache = PagedCache(tiny.config, max_batch_size=2, max_cache_len=16, kv_dtype="int4b", block_size=4)
    ids = torch.randint(1, 97, (2, 3), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        tiny(input_ids=ids, past_key_values=cache, use_cache=True)
        tiny(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)  # 4 tokens: block 0 full, block 1 kept
        assert [len(t) for t in cache.block_tables] == [2, 2]
        cache.reorder_cache(torch.tensor([0, 0]))
        assert cache.block_tables[0] == cache.block_tables[1]
        tiny(input_ids=ids[:, 1:2], past_key_values=cache, use_cache=True)
    t0, t1 = cache.block_tables
    assert t0[0] == t1[0] and t0[1] != t1[1] and t0[2] != t1[2]  # the full block shared, the written ones not
    assert all(cache.allocator.ref_count(b) == 1 for b in (t0[1], t1[1], t0[2], t1[2]))


def test_int4b_crop_inside_a_full_block_is_refused_and_changes_nothing(tiny):
    cache = PagedCache(tiny.config, max_batch_size=1, max_cache_len=16, kv_dtype="int4b", block_size=4)
    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        tiny(input_ids=ids, past_key_values=cache, use_cache=True)  # block 0 full, block 1 partial (2 rows)
    tables = [list(t) for t in cache.block_tables]
    cache.crop(-1)  # inside the partial block: its int8 rows stay as they are
    assert cache.get_seq_length() == 5
    with pytest.raises(NotImplementedError, match="crop inside a full block of an int4b cache"):
        cache.crop(-3)  # 2 tokens: inside block 0, whose keys are int4 per channel
    assert cache.get_seq_length() == 5 and [list(t) for t in cache.block_tables] == tables
