"""``LLM.stats``: the last ``generate`` call's counters, and ``stats.total`` summed over the completed calls (a toy
Llama with random weights, both cache modes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcache.engine import LLM, EngineStats, SamplingParams
from kvcache.engine.stats import GenerateStats, TotalStats, accumulate
from support_models import IdsTokenizer

SUMMED = ("requests", "prompt_tokens", "generated_tokens", "elapsed_s", "cached_prompt_tokens", "preemptions",
          "steps", "graph_steps", "overlapped_steps")


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama()


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(2, 256, (16,), generator=g).tolist()  # one full block of 16 shared by every prompt
    return [shared + torch.randint(2, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("cache", ["paged", "linear"])
def test_total_sums_the_calls_and_last_covers_one(model, cache):
    llm = LLM(model, tokenizer=IdsTokenizer(), cache=cache, max_num_seqs=4, max_model_len=64, kv_cache_memory=2**20)
    assert isinstance(llm.stats, GenerateStats) and llm.stats.total == TotalStats(
        num_blocks=llm.stats.num_blocks, cache_bytes=llm.stats.cache_bytes, kv_dtype="auto", cache=cache,
        attention=llm.stats.attention)  # nothing run yet: zero counters, the engine's settings
    calls = [(_prompts((3, 9, 1), 1), 5), (_prompts((6,), 2), 3), (_prompts((2, 4), 3), 7)]
    seen: list[GenerateStats] = []
    for prompts, n in calls:
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        st = llm.stats
        # the last call only
        assert (st.requests, st.generated_tokens) == (len(prompts), len(prompts) * n)
        assert st.prompt_tokens == sum(map(len, prompts)) and sum(len(o.token_ids) for o in outs) == st.generated_tokens
        seen.append(st)
    total = llm.stats.total
    assert total.calls == 3
    for name in SUMMED:
        assert getattr(total, name) == pytest.approx(sum(getattr(s, name) for s in seen), rel=1e-12), name
    assert (total.requests, total.generated_tokens) == (6, 3 * 5 + 3 + 2 * 7)
    assert total.blocks_used == max(s.blocks_used for s in seen) > 0
    assert total.tokens_per_s == pytest.approx(total.generated_tokens / total.elapsed_s)
    assert total.prefix_cache_hit_rate == pytest.approx(total.cached_prompt_tokens / total.prompt_tokens)
    assert total.cached_prompt_tokens > 0  # later prompts hit the shared block (a ratio of sums, not of rates)
    # an object kept from an earlier call keeps that call's figures and the totals as they were then
    assert seen[0].requests == 3 and seen[0].total.calls == 1 and seen[1].total.calls == 2
    assert seen[0].total.generated_tokens == seen[0].generated_tokens
    # asdict: the last call's EngineStats fields, as before the totals existed
    assert set(dataclasses.asdict(llm.stats)) == {f.name for f in dataclasses.fields(EngineStats)}


def test_a_refused_call_leaves_stats_and_totals(model):
    llm = LLM(model, tokenizer=IdsTokenizer(), max_num_seqs=2, max_model_len=32, kv_cache_memory=2**20)
    llm.generate(_prompts((4,), 5), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    before = llm.stats
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(_prompts((4,), 6), SamplingParams(max_tokens=30, temperature=0.0))
    assert llm.stats is before and llm.stats.total.calls == 1 and llm.stats.total.generated_tokens == 4


def test_accumulate_validates_and_recomputes_rates():
    t = accumulate(TotalStats(), EngineStats(requests=2, prompt_tokens=10, cached_prompt_tokens=5,
                                             generated_tokens=8, elapsed_s=2.0, blocks_used=3))
    t = accumulate(t, EngineStats(requests=1, prompt_tokens=30, cached_prompt_tokens=0, generated_tokens=2,
                                  elapsed_s=3.0, blocks_used=2, kv_dtype="int8"))
    assert (t.calls, t.requests, t.blocks_used, t.kv_dtype) == (2, 3, 3, "int8")
    assert t.prefix_cache_hit_rate == 5 / 40 and t.tokens_per_s == 10 / 5.0  # not the mean of 0.5 and 0
    with pytest.raises(TypeError, match="total: expected a TotalStats, got EngineStats"):
        accumulate(EngineStats(), EngineStats())
    with pytest.raises(TypeError, match="last: expected an EngineStats, got dict"):
        accumulate(TotalStats(), {})
    with pytest.raises(TypeError, match="total: expected a TotalStats or None, got int"):
        GenerateStats(total=3)
