"""The paged engine's scheduler without a model: budgets, chunked prefill, prefix caching, preemption."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import BlockAllocator
from kvcache.engine.sampling import SamplingParams
from kvcache.engine.scheduler import Scheduler
from kvcache.engine.sequence import Sequence, SequenceStatus


def _sched(num_blocks=16, block_size=4, max_num_seqs=4, budget=64, width=16, prefix=True, reserve=0.0) -> Scheduler:
    # decode_reserve 0 (admit while the prompt fits): the preemption tests need requests to outgrow the pool
    alloc = BlockAllocator(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(alloc, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_blocks_per_seq=width,
                     decode_reserve=reserve)


def _seq(i: int, prompt: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(i, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def _step(s: Scheduler, token: int = 7, max_tokens_reached=None):
    """One step with a fake model: every sampling request gets ``token``; requests at max_tokens finish."""
    batch = s.schedule()
    s.postprocess(batch, [token if f else None for f in batch.sample])
    for seq, f in zip(batch.seqs, batch.sample):
        if f and seq.num_generated >= seq.params.max_tokens:
            s.finish(seq, "length")
    return batch


def test_prefill_then_decode_and_release():
    s = _sched()
    s.add(_seq(0, list(range(10)), max_tokens=3))
    b = _step(s)
    assert b.num_tokens == [10] and b.sample == [True] and not b.is_decode
    assert s.running[0].block_table == [0, 1, 2] and s.running[0].num_computed == 10
    b = _step(s)
    assert b.num_tokens == [1] and b.is_decode
    _step(s)
    assert not s.has_unfinished()
    assert s.allocator.num_used_blocks == 0
    s.allocator.check_invariants()


def test_chunked_prefill_mixed_with_decode_within_the_budget():
    s = _sched(budget=8)
    s.add(_seq(0, [1, 2, 3], max_tokens=6))
    _step(s)  # request 0 prefilled, decoding from now on
    s.add(_seq(1, list(range(100, 120))))
    b = _step(s)
    # the decode goes first, then a 7-token chunk of the new prompt; no token sampled for the chunk
    assert b.num_tokens == [1, 7] and b.sample == [True, False] and b.total_tokens == 8
    b = _step(s)
    assert b.num_tokens == [1, 7] and b.sample == [True, False]
    b = _step(s)
    assert b.num_tokens == [1, 6] and b.sample == [True, True]  # the last chunk samples
    assert s.running[1].num_computed == 20 and len(s.running[1].token_ids) == 21


def test_max_num_seqs_and_join_when_one_leaves():
    s = _sched(max_num_seqs=2)
    for i in range(3):
        s.add(_seq(i, [i + 1] * 5, max_tokens=2 + i))
    b = _step(s)
    assert [q.request_id for q in b.seqs] == [0, 1]
    b = _step(s)  # request 0 finishes here (2 tokens)
    assert [q.request_id for q in b.seqs] == [0, 1]
    assert [q.request_id for q in s.running] == [1]
    b = _step(s)
    assert [q.request_id for q in b.seqs] == [1, 2] and b.num_tokens == [1, 5]


def test_prefix_cache_hit_and_in_flight_prefix_prefilled_once():
    s = _sched(block_size=4)
    shared = list(range(50, 62))  # three full blocks
    s.add(_seq(0, shared + [1, 2]))
    s.add(_seq(1, shared + [3, 4]))
    b = _step(s)
    # request 1 shares blocks being prefilled by request 0: it waits one step instead of prefilling them too
    assert [q.request_id for q in b.seqs] == [0]
    b = _step(s)
    assert [q.request_id for q in b.seqs] == [0, 1]
    r1 = s.running[1]
    assert b.num_tokens == [1, 2] and r1.num_cached_tokens == 12
    assert r1.block_table[:3] == s.running[0].block_table[:3]  # shared blocks
    assert s.num_cached_tokens == 12
    assert s.allocator.stats.hits == 3


def test_no_prefix_caching_prefills_everything():
    s = _sched(block_size=4, prefix=False)
    shared = list(range(50, 62))
    s.add(_seq(0, shared + [1, 2]))
    s.add(_seq(1, shared + [3, 4]))
    b = _step(s)
    assert [q.request_id for q in b.seqs] == [0, 1] and b.num_tokens == [14, 14]
    assert s.num_cached_tokens == 0


def test_preemption_recomputes_the_newest_request():
    s = _sched(num_blocks=4, block_size=4, prefix=False)
    s.add(_seq(0, list(range(8)), max_tokens=6))
    s.add(_seq(1, list(range(20, 28)), max_tokens=6))
    b = _step(s)
    assert b.num_tokens == [8, 8] and s.allocator.num_free_blocks == 0
    b = _step(s)  # request 0 needs a third block for its 10th token: request 1 is preempted
    assert [q.request_id for q in b.preempted] == [1] and [q.request_id for q in b.seqs] == [0]
    victim = b.preempted[0]
    assert victim.status is SequenceStatus.WAITING and victim.num_computed == 0 and victim.block_table == []
    assert victim.token_ids == list(range(20, 28)) + [7]  # its generated token is kept and recomputed
    assert s.num_preemptions == 1
    while s.has_unfinished():
        _step(s)
        s.allocator.check_invariants()
    assert victim.num_generated == 6 and victim.num_preemptions >= 1


def test_finish_a_preempted_request_and_drop_finished_rows():
    # the overlapped loop reads a step's tokens after scheduling the next: a request preempted by that schedule can
    # turn out finished (its token was a stop token) while it waits, and a request finished that way may hold a
    # row in a step already launched, whose result is then dropped
    s = _sched(num_blocks=4, block_size=4, prefix=False)
    s.add(_seq(0, list(range(8)), max_tokens=6))
    s.add(_seq(1, list(range(20, 28)), max_tokens=6))
    _step(s)
    b = _step(s)
    victim = b.preempted[0]
    s.finish(victim, "stop")
    assert victim.status is SequenceStatus.FINISHED and victim.finish_reason == "stop"
    assert victim not in s.waiting and victim not in s.running and victim.block_table == []
    b = s.schedule()
    assert [q.request_id for q in b.seqs] == [0]
    s.finish(b.seqs[0], "stop")  # finished before this step's row was processed
    computed = b.seqs[0].num_computed
    assert s.postprocess(b, [7]) == [] and b.seqs[0].num_computed == computed
    assert not s.has_unfinished() and s.allocator.num_used_blocks == 0
    s.allocator.check_invariants()


def test_add_refuses_requests_that_can_never_fit():
    s = _sched(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="prompts"):
        s.add(_seq(0, list(range(15)), max_tokens=2))
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(BlockAllocator(4, 4), max_num_seqs=0, max_num_batched_tokens=8, max_blocks_per_seq=4)
    with pytest.raises(TypeError, match="allocator"):
        Scheduler(object(), max_num_seqs=1, max_num_batched_tokens=8, max_blocks_per_seq=4)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(6, 24), budget=st.integers(4, 40),
       prefix=st.booleans(), max_num_seqs=st.integers(1, 5))
def test_random_workloads_finish_with_consistent_state(seed, num_blocks, budget, prefix, max_num_seqs):
    rng = random.Random(seed)
    s = _sched(num_blocks=num_blocks, block_size=4, max_num_seqs=max_num_seqs, budget=budget, prefix=prefix)
    shared = [rng.randrange(100) for _ in range(rng.randrange(0, 9))]
    seqs = []
    for i in range(rng.randrange(1, 7)):
        prompt = shared + [rng.randrange(100) for _ in range(rng.randrange(1, 9))]
        mt = rng.randrange(1, 8)
        if -(-(len(prompt) + mt) // 4) > num_blocks:
            continue
        seqs.append(_seq(i, prompt, mt))
        s.add(seqs[-1])
    steps = 0
    while s.has_unfinished():
        b = _step(s, token=rng.randrange(100))
        assert b.seqs, "a step with unfinished requests must schedule something"
        assert b.total_tokens <= budget and len(b.seqs) <= max_num_seqs
        for q in s.running:
            assert len(q.block_table) * 4 >= q.num_computed  # blocks cover the KV written
        s.allocator.check_invariants()
        steps += 1
        assert steps < 2000
    assert all(q.num_generated == q.params.max_tokens for q in seqs)
    assert s.allocator.num_used_blocks == 0
