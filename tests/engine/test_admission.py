"""Admission control of the paged engine (``decode_reserve``, :mod:`kvcache.engine.admission`): by default a request
is admitted only while the pool keeps room for what the running ones are expected to generate, so requests that run
to ``max_tokens`` are never preempted; requests that stop early teach it to admit more; ``decode_reserve=0`` admits
while the prompt fits and preempts (the tokens stay transformers' either way)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import support_models as sm
from kvcache.engine import LLM, SamplingParams
from kvcache.engine.admission import DecodeReserve
from kvcache.engine.scheduler import Scheduler
from kvcache.engine.sequence import Sequence
from kvcache.paged import BlockAllocator

BS = 4
PROMPTS = [[(5 * i + 11 * r + 3) % 126 + 2 for i in range(8)] for r in range(4)]  # 8 tokens: 2 blocks each
NEW = 24  # 32 tokens a request: 8 blocks, 2 requests fill the 16-block pool


def _seq(i: int, prompt: list[int], max_tokens: int) -> Sequence:
    return Sequence(i, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def _run(s: Scheduler, stop_after: int | None = None) -> int:
    """Step a scheduler to the end with a fake model; returns the most requests that ran in one step. Requests finish
    at max_tokens, or with "stop" after ``stop_after`` tokens."""
    most = 0
    while s.has_unfinished():
        batch = s.schedule()
        most = max(most, len(batch.seqs))
        s.postprocess(batch, [7 if f else None for f in batch.sample])
        for seq, f in zip(batch.seqs, batch.sample):
            if f and seq.num_generated >= seq.params.max_tokens:
                s.finish(seq, "length")
            elif f and stop_after is not None and seq.num_generated >= stop_after:
                s.finish(seq, "stop")
        assert sum(s.used_blocks()) <= s.allocator.num_blocks
        s.allocator.check_invariants()
    return most


@pytest.mark.parametrize("reserve, most, preempted", [(None, 2, False), (1.0, 2, False), (0.0, 4, True)])
def test_scheduler_admits_what_can_finish(reserve, most, preempted):
    s = Scheduler(BlockAllocator(16, BS), max_num_seqs=4, max_num_batched_tokens=64, max_blocks_per_seq=16,
                  decode_reserve=reserve)
    seqs = [_seq(i, p, NEW) for i, p in enumerate(PROMPTS)]
    for q in seqs:
        s.add(q)
    assert _run(s) == most
    assert (s.num_preemptions > 0) == preempted
    assert all(q.num_generated == NEW for q in seqs) and s.allocator.num_used_blocks == 0


def test_early_stops_let_more_in_and_a_preemption_raises_the_estimate():
    s = Scheduler(BlockAllocator(16, BS), max_num_seqs=4, max_num_batched_tokens=64, max_blocks_per_seq=16)
    assert s.reserve.ratio == 1.0 and s.reserve.learned
    for i in range(24):  # requests that stop after 1 of their 24 tokens
        s.add(_seq(i, PROMPTS[i % 4], NEW))
    _run(s, stop_after=1)
    low = s.reserve.ratio
    assert low < 0.2 and s.num_preemptions == 0
    seqs = [_seq(100 + i, p, NEW) for i, p in enumerate(PROMPTS)]
    for q in seqs:
        s.add(q)
    assert _run(s) == 4  # all four admitted on the learned estimate: they outgrow the pool, one is preempted
    assert s.num_preemptions > 0 and s.reserve.ratio > low
    assert all(q.num_generated == NEW for q in seqs)


def test_reserve_rules():
    r = DecodeReserve(block_size=4, windows=[None, 8], chunk=8)
    seq = _seq(0, list(range(40)), 24)
    seq.block_tables, seq.num_freed = [[], []], [0, 0]  # one table per group, as the scheduler gives it
    seq.num_computed = 39  # decoding: one token fed a step
    assert r.expected_tokens(seq) == 64
    # two of them: 16 full-attention blocks each at the end; a window of 8 fed 1 token a step spans at most 3 blocks
    assert r.admits([seq], seq, room=[32, 6]) and not r.admits([seq], seq, room=[31, 6])
    assert not r.admits([seq], seq, room=[32, 5])
    fresh = _seq(1, list(range(40)), 24)  # its prompt unfed: fed 6 tokens a step, a window spans up to 5 blocks
    fresh.block_tables, fresh.num_freed = [[], []], [0, 0]
    assert r.admits([seq], fresh, room=[40, 8]) and not r.admits([seq], fresh, room=[40, 7])
    with pytest.raises(ValueError, match="^room: expected one count per group"):
        r.admits([seq], fresh, room=[40])
    seq.token_ids += [5] * 6  # 6 of 24 generated, then stopped: 1/4 of the budget
    r.finished(seq)
    assert r.ratio == pytest.approx(1 - 0.125 * 0.75)
    r.preempted()
    assert r.ratio == pytest.approx(1 - 0.125 * 0.75 / 2)
    fixed = DecodeReserve(block_size=4, windows=[None], chunk=8, ratio=0.5)
    fixed.finished(seq), fixed.preempted()
    assert fixed.ratio == 0.5 and not fixed.learned
    assert fixed.expected_tokens(_seq(1, [1, 2, 3], 7)) == 3 + 4


@pytest.mark.parametrize("kw, name, err", [
    (dict(block_size=0, windows=[None], chunk=8), "block_size", ValueError),
    (dict(block_size=4, windows=[], chunk=8), "windows", ValueError),
    (dict(block_size=4, windows=[0], chunk=8), "windows", ValueError),
    (dict(block_size=4, windows=[None], chunk=0), "chunk", ValueError),
    (dict(block_size=4, windows=[None], chunk=8, ratio=1.5), "ratio", ValueError),
    (dict(block_size=4, windows=[None], chunk=8, ratio=True), "ratio", TypeError),
    (dict(block_size=4, windows=[None], chunk=8, ratio="0.5"), "ratio", TypeError),
])
def test_reserve_refuses_bad_input(kw, name, err):
    with pytest.raises(err, match=f"^{name}: expected"):
        DecodeReserve(**kw)


@pytest.fixture(scope="module")
def llama():
    model = sm.build("llama")
    return model, [sm.greedy(model, prompt=p, n=NEW) for p in PROMPTS]


def _llm(model, **kw) -> LLM:
    return LLM(model, tokenizer=sm.IdsTokenizer(), max_num_seqs=4, block_size=BS, num_blocks=16, max_model_len=64,
               max_num_batched_tokens=16, cuda_graphs=False, **kw)


def test_engine_default_never_preempts_requests_that_run_to_max_tokens(llama):
    model, want = llama
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0)
    llm = _llm(model)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == want
    assert llm.stats.preemptions == 0
    eager = _llm(model, decode_reserve=0.0)  # vLLM's policy: all four start, then preempt each other
    assert [o.token_ids for o in eager.generate(PROMPTS, greedy)] == want
    assert eager.stats.preemptions > 0


def test_engine_learns_from_early_stops(llama):
    model, want = llama
    llm = _llm(model)
    short = SamplingParams(max_tokens=NEW, temperature=0.0, stop_token_ids=list(range(sm.VOCAB)))
    outs = llm.generate([PROMPTS[i % 4] for i in range(24)], short)  # every request stops at its first token
    assert all(len(o.token_ids) == 1 and o.finish_reason == "stop" for o in outs)
    assert llm.stats.preemptions == 0
    # the next requests run to max_tokens: more start than fit, the estimate runs short, preemption recomputes them
    got = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0.0))
    assert [o.token_ids for o in got] == want
    assert llm.stats.preemptions > 0
    assert llm.allocator.num_used_blocks == 0
    llm.allocator.check_invariants()


def test_finishes_are_credited():
    # a request 2 tokens from its end holds 8 blocks; a new one needs 9 blocks by its end, 3 of them (its prompt and
    # a first token) before the first finishes: 11 blocks of room suffice (the sum of their final sizes is 17)
    r = DecodeReserve(block_size=4, windows=[None], chunk=64)
    old = _seq(0, list(range(8)), 24)
    old.token_ids += [5] * 22  # 30 tokens, 2 to go
    old.block_table, old.num_computed = list(range(8)), 29
    new = _seq(1, list(range(8)), 24)
    assert r.admits([old], new, room=[11]) and not r.admits([old], new, room=[10])
    busy = _seq(2, list(range(8)), 24)  # finishes before the new one, at its full size: nothing given back in time
    busy.block_table, busy.num_computed = [8, 9], 7
    assert r.admits([busy], new, room=[16]) and not r.admits([busy], new, room=[15])  # 8 + 8 blocks


def _arrive(s: Scheduler, arrivals: list[tuple[int, Sequence]]) -> None:
    """Step ``s`` with a fake model, adding each request at its step; every request runs to max_tokens."""
    step = 0
    while arrivals or s.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            s.add(arrivals.pop(0)[1])
        batch = s.schedule()
        s.postprocess(batch, [7 if f else None for f in batch.sample])
        for q, f in zip(batch.seqs, batch.sample):
            if f and q.num_generated >= q.params.max_tokens:
                s.finish(q, "length")
        step += 1


@pytest.mark.parametrize("reserve, preempted", [(None, False), (0.0, True)])
def test_a_prompt_fed_over_several_steps(reserve, preempted):
    # a 37-token prompt fed 6 tokens a step (7 steps) while the running request grows: its blocks come back later
    s = Scheduler(BlockAllocator(44, 1, enable_prefix_caching=False), max_num_seqs=4, max_num_batched_tokens=8,
                  max_blocks_per_seq=44, decode_reserve=reserve)
    _arrive(s, [(0, _seq(0, [1] * 4, 40)), (1, _seq(1, [2] * 37, 1))])
    assert (s.num_preemptions > 0) == preempted


@pytest.mark.parametrize("reserve, preempted", [(None, False), (0.0, True)])
def test_shared_prefix_blocks_count_once(reserve, preempted):
    # request 1 takes request 0's 10 cached prompt blocks: they do not come back when request 0 finishes
    shared = list(range(2, 12))
    s = Scheduler(BlockAllocator(30, 1), max_num_seqs=4, max_num_batched_tokens=64, max_blocks_per_seq=30,
                  decode_reserve=reserve)
    _arrive(s, [(0, _seq(0, shared, 2)), (0, _seq(2, [40, 41, 42, 43, 44], 20)), (1, _seq(1, shared + [99], 11))])
    assert (s.num_preemptions > 0) == preempted
    assert s.allocator.num_used_blocks == 0


def test_engine_default_with_window_groups():
    # Gemma 2 (a window-8 layer beside a global one): 26 blocks of the global layer, 5 of the window one; the default
    # admits what both pools hold to the end, so nothing is preempted, and the tokens are transformers'
    model = sm.build("gemma2")
    prompts = [[(5 * i + 3 * r) % 126 + 2 for i in range(40)] for r in range(3)]
    llm = LLM(model, tokenizer=sm.IdsTokenizer(), max_num_seqs=3, max_model_len=64, block_size=BS,
              max_num_batched_tokens=8, num_blocks=16, cuda_graphs=False)
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))]
    assert got == [sm.greedy(model, prompt=p, n=24) for p in prompts]
    assert llm.stats.preemptions == 0
    assert [g.num_blocks for g in llm.stats.groups] == [26, 5]
    assert all(g.blocks_used <= g.num_blocks for g in llm.stats.groups)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10**6), block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(8, 40),
       budget=st.integers(1, 32), prefix=st.booleans())
def test_no_preemption_when_requests_run_to_max_tokens(seed, block_size, num_blocks, budget, prefix):
    # requests arriving over time, prompts fed over several steps, shared prefixes: the default never preempts a
    # request that runs to its max_tokens
    rng = random.Random(seed)
    s = Scheduler(BlockAllocator(num_blocks, block_size, enable_prefix_caching=prefix), max_num_seqs=rng.randint(2, 6),
                  max_num_batched_tokens=budget, max_blocks_per_seq=num_blocks)
    shared, cap = [rng.randint(2, 50) for _ in range(24)], num_blocks * block_size
    arrivals = []
    for i in range(rng.randint(2, 7)):
        n = rng.randint(1, max(1, cap // 2))
        k = min(n, rng.randint(1, 24)) if prefix and rng.random() < 0.6 else 0
        prompt = shared[:k] + [rng.randint(2, 50) for _ in range(n - k)]
        arrivals.append((rng.randint(0, 12), _seq(i, prompt, rng.randint(1, max(1, cap - n)))))
    arrivals.sort(key=lambda a: a[0])
    _arrive(s, arrivals)
    assert s.num_preemptions == 0 and s.allocator.num_used_blocks == 0
