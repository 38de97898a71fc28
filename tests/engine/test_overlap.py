"""The paged engine's overlapped loop against its step-by-step loop.

With ``cuda_graphs=True`` (on the CPU: the graph path's static buffers, uncaptured) every step is launched before the
host reads the previous step's greedy tokens: eager prefill and mixed steps too, whose tokens are placeholders in the
host's state until read. ``cuda_graphs=False`` runs, reads and processes each step before scheduling the next. Both
must give the same tokens, finish reasons and cache state, in every situation where the host decides something
before it knows a token: requests finishing by length, stop token and stop string at different steps, requests
joining as others leave, chunked prefill mixed with decode, prefix-cache hits, preemption, non-greedy rows.
"""

from __future__ import annotations

import pytest
import torch

from kvcache.engine import LLM, SamplingParams
from support_models import IdsTokenizer


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=0,
                      eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return _tiny_llama()


def _prompts(shared: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(2, 256, (shared,), generator=g).tolist()
    return [prefix + torch.randint(2, 256, (n,), generator=g).tolist() for n in (3, 9, 14, 6, 11, 5, 8)]


def _engine(model, *, graphs: bool, **kw) -> LLM:
    args = dict(tokenizer=IdsTokenizer(), max_num_seqs=3, block_size=4, max_num_batched_tokens=8, max_model_len=64)
    args.update(kw)
    return LLM(model, cuda_graphs=graphs, **args)


def _params(ref, greedy_only: bool = True) -> list[SamplingParams]:
    """Requests ending by length (1 to 20 tokens), by a stop token and by a stop string, each at its own step:
    the stops are tokens that the unconstrained run produces mid-way (one of them at the request's last token)."""
    out = []
    for i, o in enumerate(ref):
        t = o.token_ids
        kind = i % 3
        if kind == 0:
            out.append(SamplingParams(max_tokens=(1, 20, 7, 13)[i % 4], temperature=0.0, ignore_eos=True))
        elif kind == 1:
            out.append(SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[t[2 + i]]))
        else:
            out.append(SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[f"{t[3 + i]} {t[4 + i]}"]))
    # a stop token that is the request's last allowed token: the first request's, sampled by its prefill step
    # (finished by length when that eager step is advanced, "stop" once read), and the last one's, mid-decode
    out[0] = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, stop_token_ids=[ref[0].token_ids[0]])
    last = ref[-1].token_ids
    k = next(k for k in range(2, len(last)) if last[k] not in last[:k])
    out[-1] = SamplingParams(max_tokens=k + 1, temperature=0.0, ignore_eos=True, stop_token_ids=[last[k]])
    if not greedy_only:
        out[3] = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    return out


@pytest.mark.parametrize("case", ["chunked", "prefix", "preempt", "sampled"])
def test_overlapped_steps_equal_step_by_step(model, case):
    kw: dict = {"enable_prefix_caching": case == "prefix"}
    if case == "preempt":
        # room for one request of 34 tokens, admission by the free blocks alone: three running ones preempt each other
        kw.update(num_blocks=10, decode_reserve=0.0)
    prompts = _prompts(shared=10 if case == "prefix" else 0)
    plain = _engine(model, graphs=False, **kw)
    ref = plain.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    params = _params(ref, greedy_only=case != "sampled")
    want = plain.generate(prompts, params)
    fast = _engine(model, graphs=True, **kw)
    got = fast.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert sorted({o.finish_reason for o in got}) == ["length", "stop"]
    assert got[0].finish_reason == got[-1].finish_reason == "stop"
    # eager steps were launched ahead too: more overlapped launches than graph steps could account for (a
    # non-greedy request's steps are read before the next is scheduled)
    assert fast.stats.overlapped_steps > (0 if case == "sampled" else fast.stats.graph_steps)
    assert plain.stats.overlapped_steps == 0
    assert fast.stats.generated_tokens == sum(len(o.token_ids) for o in got)
    if case == "prefix":
        assert fast.stats.cached_prompt_tokens > 0
    if case == "preempt":
        assert plain.stats.preemptions > 0 and fast.stats.preemptions > 0
    for llm in (plain, fast):
        assert llm.allocator.num_used_blocks == 0
        llm.allocator.check_invariants()
        assert not llm.scheduler.has_unfinished()


def test_overlapped_steps_equal_transformers(model):
    # the overlapped loop against transformers itself, each request alone (EOS ignored, lengths differ)
    prompts = _prompts()
    fast = _engine(model, graphs=True)
    outs = fast.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                                   for m in (4, 12, 1, 9, 16, 6, 10)])
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(o.token_ids),
                             do_sample=False, pad_token_id=1, eos_token_id=None)
        assert o.token_ids == ref[0, len(p):].tolist()


def test_progress_counts_every_token_once(model):
    seen = []
    fast = _engine(model, graphs=True)
    outs = fast.generate(_prompts(), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                         progress=lambda done, total, gen: seen.append((done, total, gen)))
    assert seen[-1] == (len(outs), len(outs), sum(len(o.token_ids) for o in outs))
    assert all(a[0] <= b[0] and a[2] <= b[2] for a, b in zip(seen, seen[1:]))


@pytest.mark.parametrize("graphs", [False, True], ids=["step-by-step", "overlapped"])
def test_one_token_prompt_chunk_is_not_a_decode_step(model, graphs):
    # a budget of 2 tokens: the second prompt's chunks of one token share steps with the first request's decode
    # rows, so a step can have one token per request and still hold a prompt chunk that samples nothing. Such a
    # step is a prefill step (no graph, no token for that row); with a non-greedy request it must not fail
    prompts = [[5, 6], [7, 8, 9, 10, 11]]
    kw = dict(max_num_seqs=2, max_num_batched_tokens=2, max_model_len=32)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = _engine(model, graphs=graphs, **kw).generate(prompts, greedy)
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             pad_token_id=1, eos_token_id=None)
        assert o.token_ids == ref[0, len(p):].tolist()
    mixed = [SamplingParams(max_tokens=4, temperature=0.7, seed=1, ignore_eos=True), greedy]
    want = _engine(model, graphs=False, **kw).generate(prompts, mixed)
    got = _engine(model, graphs=graphs, **kw).generate(prompts, mixed)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
