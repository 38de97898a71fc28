"""The engine against Hugging Face ``generate``: greedy tokens equal per request, in every scheduling mode."""

from __future__ import annotations

import random

import pytest
import torch

from kvcache.engine import LLM, RequestOutput, SamplingParams

NEW_TOKENS = 16  # new tokens per request: small enough for the CPU

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


def _check_equal(outs: list[RequestOutput], prompt_ids: list[list[int]], hf_greedy) -> None:
    assert len(outs) == len(prompt_ids)
    for i, (o, ids) in enumerate(zip(outs, prompt_ids)):
        assert o.request_id == i
        assert o.prompt_token_ids == ids
        ref = hf_greedy(ids, NEW_TOKENS)
        assert o.token_ids == ref, f"request {i}: engine {o.token_ids} != transformers {ref}"
        assert o.finish_reason == ("length" if len(ref) == NEW_TOKENS and ref[-1] != 2 else "stop")


def test_paged_prefix_caching_equals_hf(smollm, conversations, prompt_ids, hf_greedy):
    model, tok = smollm
    llm = LLM(model, tokenizer=tok, max_num_seqs=8)
    outs = llm.generate(conversations, GREEDY)
    _check_equal(outs, prompt_ids, hf_greedy)
    st = llm.stats
    # the system prompt's full blocks are prefilled once: every later request hits them
    shared = len(prompt_ids[0])
    for ids in prompt_ids[1:]:
        shared = min(shared, next((k for k, (a, b) in enumerate(zip(prompt_ids[0], ids)) if a != b), len(ids)))
    full = shared // llm.block_size * llm.block_size
    assert full > 0
    assert [o.num_cached_tokens for o in outs] == [0] + [full] * (len(outs) - 1)
    assert st.cached_prompt_tokens == full * (len(outs) - 1)
    assert st.prefix_cache_hit_rate == pytest.approx(st.cached_prompt_tokens / st.prompt_tokens)
    assert st.requests == len(outs) and st.prompt_tokens == sum(map(len, prompt_ids))
    assert st.generated_tokens == sum(len(o.token_ids) for o in outs)
    assert 0 < st.blocks_used <= st.num_blocks and st.cache_bytes == llm.cache.nbytes
    assert llm.allocator.num_used_blocks == 0  # finished requests left at once
    llm.allocator.check_invariants()
    # a second call hits the cached blocks from the start (the last prompt token is always recomputed)
    again = llm.generate(conversations[:1], GREEDY)
    assert again[0].token_ids == outs[0].token_ids
    assert again[0].num_cached_tokens == (len(prompt_ids[0]) - 1) // llm.block_size * llm.block_size


def test_paged_without_prefix_caching_equals_hf(smollm, conversations, prompt_ids, hf_greedy):
    model, tok = smollm
    llm = LLM(model, tokenizer=tok, max_num_seqs=8, enable_prefix_caching=False, block_size=8)
    outs = llm.generate(conversations, GREEDY)
    _check_equal(outs, prompt_ids, hf_greedy)
    assert llm.stats.cached_prompt_tokens == 0 and all(o.num_cached_tokens == 0 for o in outs)


def test_preemption_in_a_tiny_pool_equals_hf(smollm, conversations, prompt_ids, hf_greedy):
    model, tok = smollm
    bs = 8
    # exactly the blocks of the first two prompts: both are admitted (admission by the free blocks alone), and the
    # first that needs a new block for its generated tokens preempts the other (recomputed later from its prompt
    # and generated tokens)
    first_two = sum(-(-len(p) // bs) for p in prompt_ids[:2])
    assert max(len(p) for p in prompt_ids) + NEW_TOKENS <= first_two * bs
    llm = LLM(model, tokenizer=tok, max_num_seqs=4, block_size=bs, num_blocks=first_two,
              enable_prefix_caching=False, decode_reserve=0.0)
    outs = llm.generate(conversations, GREEDY)
    _check_equal(outs, prompt_ids, hf_greedy)
    assert llm.stats.preemptions > 0
    assert llm.allocator.num_used_blocks == 0
    llm.allocator.check_invariants()


@pytest.mark.parametrize("seed", [1, 2])
def test_random_arrival_orders_and_chunked_prefill(smollm, conversations, prompt_ids, hf_greedy, seed):
    model, tok = smollm
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    # two slots (requests join as others leave), a 24-token budget (prefill chunks mixed with decodes)
    llm = LLM(model, tokenizer=tok, max_num_seqs=2, max_num_batched_tokens=24, block_size=16)
    outs = llm.generate([conversations[i] for i in order], GREEDY)
    _check_equal(outs, [prompt_ids[i] for i in order], hf_greedy)


def test_linear_mode_equals_hf(smollm, conversations, prompt_ids, hf_greedy):
    model, tok = smollm
    llm = LLM(model, tokenizer=tok, cache="linear", max_num_seqs=2, max_model_len=128)
    outs = llm.generate(conversations, GREEDY)
    _check_equal(outs, prompt_ids, hf_greedy)
    core = llm.core
    # the shared prefix is prefilled once, saved once and restored for every later request
    assert core.snapshots_saved == 1 and core.snapshots_restored == len(outs) - 1
    n = len(core.prefix)
    assert [o.num_cached_tokens for o in outs] == [0] + [n] * (len(outs) - 1)
    assert llm.stats.cached_prompt_tokens == n * (len(outs) - 1)
    assert core.cache.active_batch_size == 0  # evicted as they finished


def test_linear_mode_prompt_equal_to_prefix_reuses_n_minus_1(smollm, prompt_ids, hf_greedy):
    model, tok = smollm
    llm = LLM(model, tokenizer=tok, cache="linear", max_num_seqs=2, max_model_len=128)
    shared = prompt_ids[0][:20]
    prompts = [shared + [28], shared + [42], shared]  # the last one is the saved prefix itself
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    assert outs[2].num_cached_tokens == len(shared) - 1
    for o, p in zip(outs, prompts):
        assert o.token_ids == hf_greedy(p, 6)


def test_int8_and_int4_caches_run_close_to_hf(smollm, conversations, prompt_ids, hf_greedy):
    model, tok = smollm
    for kv_dtype in ("int8", "k8v4", "int4", "fp8k", "int4b"):
        llm = LLM(model, tokenizer=tok, kv_dtype=kv_dtype, max_num_seqs=8)
        outs = llm.generate(conversations, GREEDY)
        assert llm.stats.kv_dtype == kv_dtype
        assert llm.cache.config.kv_dtype == kv_dtype
        refs = [hf_greedy(p, NEW_TOKENS) for p in prompt_ids]
        if kv_dtype in ("int8", "fp8k"):  # int8 K / V within scale / 2 of the float32 values, fp8k keys within
            # max(|x| / 16, scale / 1024) with a scale per (token, head) (fp8 values): the first tokens agree
            assert llm.cache.params(0) is not None  # int8: (scale, zero); fp8k: the keys' scales
            assert all(o.token_ids[:4] == r[:4] for o, r in zip(outs, refs)), [o.token_ids for o in outs]
        elif kv_dtype in ("k8v4", "int4b"):  # 8-bit keys, 4-bit values (int4b: keys per channel over each full
            # block): the first 4 tokens of half the answers or more (2 / 4 here: a near tie, "Le Grand Paris is" /
            # "The capital of France", flips on the first token)
            agree = [o.token_ids[:4] == r[:4] for o, r in zip(outs, refs)]
            assert sum(agree) >= len(agree) // 2, agree
        else:  # int4 (16 levels per row) drifts sooner (first tokens: 15/16 agree on the demo's prompts, 2/4 here);
            # a broken int4 path (garbage K / V) agrees on none
            agree = [o.token_ids[:1] == r[:1] for o, r in zip(outs, refs)]
            assert sum(agree) >= len(agree) // 2, agree


def test_seeded_sampling_is_reproducible(smollm, conversations):
    model, tok = smollm
    llm = LLM(model, tokenizer=tok, max_num_seqs=8)
    sp = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, top_k=50, seed=1234)
    a = llm.generate(conversations, sp)
    b = llm.generate(conversations, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    # a request's seed alone fixes its tokens: alone or in another batch, same tokens
    alone = llm.generate(conversations[2:3], sp)
    assert alone[0].token_ids == a[2].token_ids
    other = llm.generate(conversations, SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, top_k=50, seed=99))
    assert [o.token_ids for o in other] != [o.token_ids for o in a]


def test_prompt_forms_stop_strings_and_lengths(smollm, conversations, prompt_ids, hf_greedy):
    model, tok = smollm
    llm = LLM(model, tokenizer=tok, max_num_seqs=4)
    # one conversation, one token-id list, a dict and a plain string
    outs = llm.generate([conversations[0], prompt_ids[1], {"prompt_token_ids": prompt_ids[2]}], GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(p, NEW_TOKENS) for p in prompt_ids[:3]]
    text = tok.decode(prompt_ids[0], skip_special_tokens=False)
    s = llm.generate(text, GREEDY)
    assert len(s) == 1 and s[0].prompt_token_ids == list(tok(text)["input_ids"])
    single = llm.generate(conversations[0], GREEDY)
    assert single[0].token_ids == outs[0].token_ids
    # max_tokens -> "length"; a stop string cuts the text before it
    short = llm.generate(conversations[0], SamplingParams(max_tokens=3, temperature=0.0))
    assert short[0].finish_reason == "length" and short[0].token_ids == hf_greedy(prompt_ids[0], NEW_TOKENS)[:3]
    full = outs[0].text
    word = full.split()[2]
    cut = llm.generate(conversations[0], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop=[word]))
    assert cut[0].finish_reason == "stop" and cut[0].text == full[:full.find(word)]
    # stop_token_ids: the stop token is kept
    stop_tok = outs[0].token_ids[1]
    st = llm.generate(conversations[0], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                        stop_token_ids=[stop_tok]))
    assert st[0].finish_reason == "stop" and st[0].token_ids == outs[0].token_ids[:2]


def test_errors_name_the_argument(smollm, conversations):
    model, tok = smollm
    with pytest.raises(ValueError, match="cache"):
        LLM(model, tokenizer=tok, cache="ring")
    with pytest.raises(ValueError, match="kv_dtype"):
        LLM(model, tokenizer=tok, kv_dtype="int3")
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(model)
    with pytest.raises(ValueError, match="block_size"):
        LLM(model, tokenizer=tok, block_size=0)
    llm = LLM(model, tokenizer=tok, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(conversations[0], SamplingParams(max_tokens=60))
    with pytest.raises(TypeError, match="prompts"):
        llm.generate([3.5])
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        llm.generate([[10**9]])
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(conversations[:2], [SamplingParams()])
    # one request that can never fit: nothing of the call is queued
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([conversations[0], list(range(2, 70))], SamplingParams(max_tokens=2))
    assert not llm.scheduler.has_unfinished()

    # an error in the middle of a run: every request is dropped and its blocks freed
    def boom(done, total, generated):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate(conversations[:2], SamplingParams(max_tokens=4, temperature=0.0), progress=boom)
    assert llm.allocator.num_used_blocks == 0 and not llm.scheduler.has_unfinished()
    llm.allocator.check_invariants()
    assert len(llm.generate(conversations[0], SamplingParams(max_tokens=2, temperature=0.0))[0].token_ids) == 2


def test_graph_batch_layout_equals_eager(smollm, conversations, prompt_ids, hf_greedy):
    # cuda_graphs=True on the CPU: decode steps run through the static buffers, padded to buckets (4 requests
    # -> bucket 4, fewer as they finish -> 2 / 1 / padded rows in the scratch block), uncaptured
    model, tok = smollm
    llm = LLM(model, tokenizer=tok, max_num_seqs=8, cuda_graphs=True)
    outs = llm.generate(conversations[:3], GREEDY)  # 3 requests: bucket 4, one padded row
    _check_equal(outs, prompt_ids[:3], hf_greedy)
    # every step but the two with prefill (the first request, then the two that waited for its system prompt)
    assert llm.stats.graph_steps == llm.stats.steps - 2 > 0
    assert llm.allocator.num_used_blocks == 0


def test_one_step_plan_per_step_through_the_cache_api(smollm, conversations, monkeypatch):
    """Each step builds one StepPlan (PagedKVCache.plan) and every layer appends and attends with that same plan
    through the public cache methods, eagerly and on the graph path (its static buffers, uncaptured here)."""
    from kvcache import PagedKVCache

    plans: list = []
    calls: list = []  # (method, layer, plan)
    plan_fn, append_fn, attention_fn = PagedKVCache.plan, PagedKVCache.append, PagedKVCache.attention

    def plan(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        plans.append(plan_fn(self, *args, **kwargs))
        return plans[-1]

    def append(self, layer, k, v, plan):  # type: ignore[no-untyped-def]
        calls.append(("append", layer, plan))
        return append_fn(self, layer, k, v, plan)

    def attention(self, layer, q, plan, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(("attention", layer, plan))
        return attention_fn(self, layer, q, plan, **kwargs)

    monkeypatch.setattr(PagedKVCache, "plan", plan)
    monkeypatch.setattr(PagedKVCache, "append", append)
    monkeypatch.setattr(PagedKVCache, "attention", attention)
    model, tok = smollm
    n_layers = model.config.num_hidden_layers
    tokens = []
    for graphs in (False, True):
        plans.clear()
        calls.clear()
        llm = LLM(model, tokenizer=tok, max_num_seqs=8, cuda_graphs=graphs)
        outs = llm.generate(conversations[:2], SamplingParams(max_tokens=4, temperature=0.0))
        tokens.append([o.token_ids for o in outs])
        assert len(plans) == llm.stats.steps > 0
        assert (llm.stats.graph_steps > 0) == graphs
        want = [(m, i, p) for p in plans for i in range(n_layers) for m in ("append", "attention")]
        assert len(calls) == len(want)
        assert all(m == wm and i == wi and p is wp for (m, i, p), (wm, wi, wp) in zip(calls, want))
        # the model's scale; the runner's query RoPE tables (fused path) or none, the same tensors every step
        rope = [tuple(map(id, p.q_rope)) if p.q_rope is not None else None for p in plans]
        assert all(p.scale == model.config.head_dim**-0.5 for p in plans) and rope == rope[:1] * len(plans)
    assert tokens[0] == tokens[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_equal_eager_on_gpu(smollm, conversations):
    _, tok = smollm
    from kvcache.engine import load_model

    model, _ = load_model(device="cuda", dtype=torch.float32)
    eager = LLM(model, tokenizer=tok, cuda_graphs=False, max_num_seqs=8, kv_cache_memory=2**28)
    graphs = LLM(model, tokenizer=tok, cuda_graphs=True, max_num_seqs=8, kv_cache_memory=2**28)
    a = eager.generate(conversations, GREEDY)
    b = graphs.generate(conversations, GREEDY)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    if graphs.stats.attention == "paged_attention":
        assert graphs.stats.graph_steps > 0


class _NoText:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
], ids=["default", "llama3"])
def test_random_weight_llama_equals_hf(tiny_llama, rope):
    # the bench's model family (llama3 RoPE, GQA) at toy size: engine greedy == transformers greedy, EOS ignored
    model = tiny_llama(rope)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 256, (n,), generator=g).tolist() for n in (5, 17, 40)]
    llm = LLM(model, tokenizer=_NoText(), max_num_seqs=3, block_size=4, max_num_batched_tokens=32, max_model_len=96)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for o, p in zip(outs, prompts):
        x = torch.tensor([p])
        with torch.inference_mode():
            ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, min_new_tokens=12,
                                 do_sample=False)[0, len(p):].tolist()
        assert o.token_ids == ref
        assert o.finish_reason == "length" and o.text == " ".join(map(str, ref))


def test_overlapped_decode_equals_step_by_step(tiny_llama):
    # graph decode steps launch the next step before their tokens are read (the host's work overlaps the
    # device's); a request finished by a stop token has run one step ahead, whose row is dropped. On the CPU
    # cuda_graphs=True runs the same path uncaptured: tokens, finish reasons and freed blocks must equal the
    # plain step-by-step loop's, with requests finishing by length and by stop token at different steps
    model = tiny_llama()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 256, (n,), generator=g).tolist() for n in (3, 9, 14, 6)]
    plain = LLM(model, tokenizer=_NoText(), max_num_seqs=4, block_size=4, max_num_batched_tokens=64,
                max_model_len=64, cuda_graphs=False)
    ref = plain.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    # stop on a token each request produces somewhere in the middle of its output
    stops = [o.token_ids[4 + 3 * i] for i, o in enumerate(ref)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, stop_token_ids=[t])
              for m, t in zip((20, 7, 20, 11), stops)]
    want = plain.generate(prompts, params)
    fast = LLM(model, tokenizer=_NoText(), max_num_seqs=4, block_size=4, max_num_batched_tokens=64,
               max_model_len=64, cuda_graphs=True)
    got = fast.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert fast.stats.graph_steps > 0 and fast.stats.overlapped_steps > 0
    assert plain.stats.overlapped_steps == 0
    assert fast.allocator.num_used_blocks == 0
    fast.allocator.check_invariants()
