"""Layer groups of the paged engine: a sliding-window layer holds only the blocks its window still reads, so a pool
smaller than one sequence's whole context runs; greedy tokens stay equal to transformers' (tiny random models,
fp32, CPU) with preemption and prefix caching; the scheduler's freeing rule on its own; what is refused with more
than one group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import support_models as sm
from kvcache.engine import LLM, EngineConfig, SamplingParams
from kvcache.paged.groups import layer_groups
from kvcache.engine.model import LlamaForward
from kvcache.engine.paged_core import PagedEngineCore
from kvcache.engine.scheduler import Scheduler
from kvcache.engine.sequence import Sequence
from kvcache.paged import BlockAllocator, cache_block_bytes

BS = 4  # tokens per block: window 8 spans 2-3 blocks
PROMPT = [(5 * i + 3) % 126 + 2 for i in range(40)]  # 40 tokens: 5 windows of 8
PROMPTS = [PROMPT, PROMPT[:32] + [9, 8, 7, 6, 5, 4, 3, 2], [(3 * i + 1) % 126 + 2 for i in range(40)]]
NEW = 24  # 64 tokens a request: 16 blocks at full context


def _model(name: str):
    return sm.gpt_oss() if name == "gpt_oss" else sm.build(name)


# num_blocks: the memory of that many blocks of every layer, split between the groups by what a 64-token request
# needs in each (16 blocks full, 3 in a window group): Gemma 2 / 3 and gpt-oss (one window layer, one global) get
# 26 blocks for the global layer and 5 for the window one; Mistral (both layers windowed) 8 blocks
@pytest.mark.parametrize("name, num_blocks, graphs", [("gemma2", 16, False), ("gemma3", 16, True),
                                                     ("mistral_window", 8, False), ("gpt_oss", 16, False)])
def test_window_layers_hold_only_their_window(name, num_blocks, graphs):
    model = _model(name)
    llm = LLM(model, tokenizer=sm.IdsTokenizer(), max_num_seqs=3, max_model_len=64, block_size=BS,
              max_num_batched_tokens=8, num_blocks=num_blocks, cuda_graphs=graphs, decode_reserve=0.0)
    got = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0))]
    assert got == [sm.greedy(model, prompt=p, n=NEW) for p in PROMPTS]
    st = llm.stats
    window = [g for g in st.groups if g.window == sm.WINDOW]
    assert len(window) == 1 and window[0].num_layers == (2 if name == "mistral_window" else 1)
    # the window layers' pool cannot hold one request's 16 blocks: it runs because blocks outside the window go back
    assert 0 < window[0].blocks_used <= window[0].num_blocks < 64 // BS
    assert st.preemptions > 0
    assert max(g.blocks_used for g in st.groups) <= st.blocks_used <= sum(g.blocks_used for g in st.groups)
    assert st.num_blocks == sum(g.num_blocks for g in st.groups)
    assert st.cache_bytes == sum(c.nbytes for c in llm.core.caches)
    if name != "mistral_window":
        full = st.groups[0]
        assert (full.window, full.num_blocks, window[0].num_blocks) == (None, 26, 5)


def test_prefix_hits_bring_back_the_window_and_the_graph_path():
    # Gemma 3 in a roomy pool: the second request takes the first's 32-token prefix (8 blocks of the global layer,
    # the window layer's last 2); 4 requests, decode steps through the graph path's padded buffers
    model = sm.build("gemma3")
    llm = LLM(model, tokenizer=sm.IdsTokenizer(), max_num_seqs=4, max_model_len=64, block_size=BS,
              max_num_batched_tokens=48, cuda_graphs=True)
    first = llm.generate([PROMPT], SamplingParams(max_tokens=NEW, temperature=0))[0].token_ids
    assert first == sm.greedy(model, prompt=PROMPT, n=NEW)
    out = llm.generate(PROMPTS[1:] + [PROMPT[:33]], SamplingParams(max_tokens=8, temperature=0))
    assert [o.token_ids for o in out] == [sm.greedy(model, prompt=p, n=8) for p in PROMPTS[1:] + [PROMPT[:33]]]
    assert [o.num_cached_tokens for o in out] == [32, 0, 32]
    assert llm.stats.total.groups[1].blocks_used <= 3 * 5  # 3 requests, at most 5 window blocks each (chunks of 14)


def test_kernels_read_no_block_given_back(monkeypatch):
    # through the Triton interpreter: the window layer's given-back slots hold the scratch block, outside every
    # window; the paged kernels skip or mask it (a prefix hit and chunked prefill included)
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the kernels run compiled on the GPU, the CPU interpreter is not used")
    model = sm.build("gemma3")
    prompts = [PROMPT[:24], PROMPT[:18] + [3, 4, 5]]
    ref = [sm.greedy(model, prompt=p, n=6) for p in prompts]
    monkeypatch.setenv("KVCACHE_TRITON_INTERPRET", "1")
    llm = LLM(model, tokenizer=sm.IdsTokenizer(), max_num_seqs=2, max_model_len=64, block_size=BS,
              max_num_batched_tokens=8)
    out = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    assert [o.token_ids for o in out] == ref
    assert out[1].num_cached_tokens == 16


def test_pool_split_by_what_a_request_needs_in_each_group():
    model = sm.build("gemma3")
    mem = 1 << 20
    llm = LLM(model, tokenizer=sm.IdsTokenizer(), max_model_len=64, block_size=BS, kv_cache_memory=mem)
    block = cache_block_bytes(1, 2, 16, BS, torch.float32)  # one layer's block
    # a 64-token request: 16 blocks of the global layer, min(16, ceil(8 / 4) + 1) = 3 of the window layer
    assert [(g.window, g.num_blocks) for g in llm.stats.groups] == [(None, mem * 16 // (19 * block)),
                                                                     (sm.WINDOW, mem * 3 // (19 * block))]
    assert llm.core.groups == layer_groups([sm.WINDOW, None])
    # one group: the whole budget, as before
    llama = LLM(sm.build("llama"), tokenizer=sm.IdsTokenizer(), max_model_len=64, block_size=BS, kv_cache_memory=mem)
    assert llama.stats.num_blocks == mem // (2 * block) and len(llama.stats.groups) == 1


def _sched(windows, num_blocks=32, budget=64, prefix=True) -> Scheduler:
    allocs = [BlockAllocator(num_blocks, BS, enable_prefix_caching=prefix) for _ in windows]
    return Scheduler(allocs, windows=windows, max_num_seqs=4, max_num_batched_tokens=budget, max_blocks_per_seq=32)


def _step(s: Scheduler) -> None:
    b = s.schedule()
    s.postprocess(b, [5 if f else None for f in b.sample])


@pytest.mark.parametrize("window", [1, 4, 6, 8])
def test_blocks_freed_exactly_when_wholly_outside_the_window(window):
    # prefill chunks of 5 tokens, then decode; before every step, a block of the window group is given back iff
    # every key in it lies at or before the first position the step's first query can no longer see (q - window)
    s = _sched([None, window], budget=5)
    seq = Sequence(0, list(range(2, 19)), SamplingParams(max_tokens=30, temperature=0))
    s.add(seq)
    for _ in range(25):
        b = s.schedule()
        q0 = seq.num_computed  # the step's first query position; it sees keys p > q0 - window
        for k, block in enumerate(seq.block_tables[1]):
            wholly_outside = all(p <= q0 - window for p in range(k * BS, (k + 1) * BS))
            assert (block == s.allocators[1].num_blocks) == wholly_outside, (q0, k)
        assert seq.block_tables[0] == list(range(len(seq.block_tables[0])))  # the full group keeps everything
        live = sum(b != s.allocators[1].num_blocks for b in seq.block_tables[1])
        assert s.used_blocks() == [len(seq.block_tables[0]), live]
        s.postprocess(b, [5 if f else None for f in b.sample])
    s.finish(seq, "length")
    assert s.used_blocks() == [0, 0]
    for a in s.allocators:
        a.check_invariants()


def _cached(s: Scheduler, g: int, n: int) -> list[int]:
    """The blocks group ``g`` caches for the first ``n`` blocks of the chain of tokens 2, 3, ..."""
    hashes = s.allocators[g].hash_blocks(list(range(2, 2 + n * BS)))
    return [s.allocators[g].lookup(h) for h in hashes]


def test_prefix_hit_needs_the_window_blocks_in_every_window_group():
    # request a runs and finishes (its blocks stay cached); b shares its 16-token prefix: the full group serves 4
    # blocks from the start, the window group (window 6) the ones from (16 - 6 + 1) // 4 = 2 on
    s = _sched([None, 6])
    a = Sequence(0, list(range(2, 22)), SamplingParams(max_tokens=2, temperature=0))
    s.add(a)
    while a.num_generated < 2:
        _step(s)
    s.finish(a, "length")
    b = Sequence(1, list(range(2, 18)) + [40, 41, 42], SamplingParams(max_tokens=2, temperature=0))
    s.add(b)
    s.schedule()
    sentinel = s.allocators[1].num_blocks
    assert b.num_cached_tokens == 16 and b.num_freed == [0, 2]
    assert b.block_tables[1][:2] == [sentinel, sentinel] and sentinel not in b.block_tables[1][2:]
    assert b.block_tables[0][:4] == _cached(s, 0, 4) and b.block_tables[1][2:4] == _cached(s, 1, 4)[2:]
    # the window group's blocks of the prefix evicted (every free block allocated): the hit is refused whole
    s.finish(b, "length")
    s.allocators[1].allocate(s.allocators[1].num_free_blocks)
    c = Sequence(2, list(range(2, 18)) + [50], SamplingParams(max_tokens=2, temperature=0))
    s.add(c)
    s.schedule()
    assert c.num_cached_tokens == 0 and c.num_freed == [0, 0]


@pytest.mark.parametrize("field, value", [("host_cache_memory", 1 << 20), ("kv_events", True),
                                          ("disk_cache_dir", "tiers")])
def test_tiers_and_events_refused_with_more_than_one_group(field, value, tmp_path):
    if field == "disk_cache_dir":
        value = str(tmp_path / value)
    with pytest.raises(ValueError, match=f"{field}: not implemented for a model whose layers have different sliding "
                                         r"windows \(2 layer groups, full attention: 1 layer; sliding window 8"):
        LLM(sm.build("gemma2"), tokenizer=sm.IdsTokenizer(), max_model_len=64, **{field: value})
    LLM(sm.build("mistral_window"), tokenizer=sm.IdsTokenizer(), max_model_len=64, **{field: value})  # one group


def test_tensor_parallel_refused_with_more_than_one_group():
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)  # never reached: refused before any collective
    with pytest.raises(ValueError, match="tp_group: not implemented for a model whose layers have different"):
        PagedEngineCore(LlamaForward(sm.build("gemma2")), EngineConfig(tp_group=group, max_model_len=64))


def test_window_pool_too_small_for_one_request_refused_by_name():
    # a 16-token chunk beside a window of 8 spans ceil(23 / 4) + 1 = 7 blocks of the window layer
    llm = LLM(sm.build("gemma2"), tokenizer=sm.IdsTokenizer(), max_model_len=64, block_size=BS,
              max_num_batched_tokens=16, num_blocks=16)
    with pytest.raises(ValueError, match="7 blocks of 4 in the pool of the layers with sliding window 8, expected at "
                                         "most 5"):
        llm.generate([PROMPT], SamplingParams(max_tokens=NEW, temperature=0))


def test_reset_prefix_cache_forgets_every_group():
    # new weights in place: after llm.reset_prefix_cache() the prompt is recomputed and published again, and a
    # request sharing its prefix hits the new blocks of the global and of the window layer (a reset of the first
    # group alone would leave the window layer's old blocks matched under the same hashes)
    model = sm.build("gemma3")
    llm = LLM(model, tokenizer=sm.IdsTokenizer(), max_num_seqs=2, max_model_len=64, block_size=BS,
              max_num_batched_tokens=48)
    sp = SamplingParams(max_tokens=6, temperature=0)
    llm.generate([PROMPT], sp)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "k_proj" in name or "v_proj" in name:
                p.mul_(-1.5)  # every layer's K / V change
    assert llm.reset_prefix_cache() is True
    first = llm.generate([PROMPT], sp)[0]
    again = llm.generate([PROMPT[:33]], sp)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert [first.token_ids, again.token_ids] == [sm.greedy(model, prompt=p, n=6) for p in (PROMPT, PROMPT[:33])]
    with pytest.raises(ValueError, match="reset_prefix_cache: the linear cache keeps no prefix cache"):
        LLM(model, tokenizer=sm.IdsTokenizer(), cache="linear", max_model_len=64).reset_prefix_cache()


def test_window_only_tables_are_bounded_by_max_blocks_per_seq():
    # every layer windowed (Mistral): the window group's table keeps a slot per block of the context, so a request
    # longer than max_blocks_per_seq blocks is refused although its window holds 3
    s = Scheduler([BlockAllocator(32, BS)], windows=[6], max_num_seqs=2, max_num_batched_tokens=8,
                  max_blocks_per_seq=4)
    s.add(Sequence(0, list(range(2, 12)), SamplingParams(max_tokens=6, temperature=0)))  # 16 tokens: 4 blocks
    with pytest.raises(ValueError, match="request 1 needs up to 40 \\+ 8 tokens = 12 blocks of 4 in the pool of the "
                                         "layers with sliding window 6, expected at most 4"):
        s.add(Sequence(1, list(range(2, 42)), SamplingParams(max_tokens=8, temperature=0)))


def test_match_groups_takes_what_every_group_serves_and_refuses_bad_input():
    from kvcache.paged.groups import match_groups

    full, win = BlockAllocator(8, BS), BlockAllocator(8, BS)
    h = full.hash_blocks(list(range(12)))
    full.cache_blocks(full.allocate(3), h)
    win.cache_blocks(win.allocate(3)[2:], h[2:])  # the window group caches only the last block
    assert match_groups([full, win], [None, 4], h) == [[0, 1, 2], [8, 8, 2]]
    used = full.num_used_blocks
    # window 8: a prefix of 3, 2 or 1 blocks needs blocks 1-2, 0-1 or 0 of the window group, not all cached
    assert match_groups([full, win], [None, 8], h) is None and full.num_used_blocks == used
    assert match_groups([full], [None], []) is None
    with pytest.raises(ValueError, match="^allocators: expected at least one"):
        match_groups([], [], h)
    with pytest.raises(ValueError, match="^windows: expected one per allocator"):
        match_groups([full, win], [None], h)


def test_peak_blocks_is_the_most_the_freeing_rule_leaves_held():
    """peak_blocks / blocks_per_seq against a search over every step a sequence can reach: fed at most ``chunk``
    tokens a step (and a decode step scheduled one ahead: blocks for two tokens past the cache), it holds the blocks
    up to its last new token from first_live_block of what was cached before the step; the bound is reached
    (tight), never passed."""
    from kvcache.paged.groups import blocks_per_seq, first_live_block, peak_blocks

    for bs in range(1, 6):
        for window in list(range(1, 14)) + [None]:
            for chunk in range(1, 9):
                for seq_len in (1, 2, 7, 30):
                    held = max(-(-(p + k) // bs) - first_live_block(window, p, bs)
                               for p in range(seq_len) for k in range(1, min(max(chunk, 2), seq_len - p) + 1))
                    assert peak_blocks(window, seq_len, chunk, bs) == held, (bs, window, chunk, seq_len)
                    if chunk == 1:
                        assert blocks_per_seq(window, seq_len, bs) == held
