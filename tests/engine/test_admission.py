"""Admission control of the paged engine (``decode_reserve``, :mod:`kvcache.engine.admission`): by default a request
is admitted only while the pool keeps room for what the running ones are expected to generate, so requests that run
to ``max_tokens`` are never preempted; requests that stop early teach it to admit more; ``decode_reserve=0`` admits
while the prompt fits and preempts (the tokens stay transformers' either way)."""

from __future__ import annotations

import pytest

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
    assert r.expected_tokens(seq) == 64
    assert r.blocks(seq) == [16, 5]  # a window-8 group holds at most ceil((8 - 1 + 8) / 4) + 1 blocks
    # two of them need 32 full-attention blocks and 10 window ones (a window group: the sum of what each still needs)
    assert r.admits([seq], seq, free=[32, 10]) and not r.admits([seq], seq, free=[31, 10])
    assert not r.admits([seq], seq, free=[32, 9])
    seq.block_tables, seq.num_freed = [list(range(10)), [99] * 6 + [0, 1, 2, 3]], [0, 6]
    assert r.blocks(seq) == [6, 1]
    seq.token_ids += [5] * 6  # 6 of 24 generated, then stopped: 1/4 of the budget
    r.finished(seq)
    assert r.ratio == pytest.approx(1 - 0.125 * 0.75)
    r.preempted()
    assert r.ratio == pytest.approx(1 - 0.125 * 0.75 / 2)
    fixed = DecodeReserve(block_size=4, windows=[None], chunk=8, ratio=0.5)
    fixed.finished(seq), fixed.preempted()
    assert fixed.ratio == 0.5 and not fixed.learned
    assert fixed.expected_tokens(_seq(1, [1, 2, 3], 7)) == 3 + 4


@pytest.mark.parametrize("kw, err", [
    (dict(block_size=0, windows=[None], chunk=8), "block_size"),
    (dict(block_size=4, windows=[], chunk=8), "windows"),
    (dict(block_size=4, windows=[0], chunk=8), "windows"),
    (dict(block_size=4, windows=[None], chunk=0), "chunk"),
    (dict(block_size=4, windows=[None], chunk=8, ratio=1.5), "ratio"),
    (dict(block_size=4, windows=[None], chunk=8, ratio=True), "ratio"),
])
def test_reserve_refuses_bad_input(kw, err):
    with pytest.raises(ValueError, match=f"^{err}: expected"):
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
    # a request 2 tokens from its end holds 8 of 10 blocks; a new one needs 8 blocks, 6 of them after the first
    # finishes: it fits with 4 free blocks once the 8 given back are counted (the sum of growths would need 8)
    r = DecodeReserve(block_size=4, windows=[None], chunk=64)
    old = _seq(0, list(range(8)), 24)
    old.token_ids += [5] * 22  # 30 tokens, 2 to go
    old.block_tables = [list(range(8))]
    new = _seq(1, list(range(8)), 24)
    assert r.admits([old], new, free=[4])
    assert not r.admits([old], new, free=[2])  # its prompt and the old one's last blocks do not fit now
    busy = _seq(2, list(range(8)), 24)  # a request that finishes later than the new one: nothing given back in time
    busy.block_tables = [[8, 9]]
    assert not r.admits([busy], new, free=[13]) and r.admits([busy], new, free=[14])  # 6 + 8 blocks
