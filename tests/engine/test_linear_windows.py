"""The linear engine's window layers (a second cache of 2 x window tokens a slot) with shared-prefix snapshots:
a snapshot holds the window before the prefix's end, whichever slot reaches that end first, so requests restoring
it generate transformers' greedy tokens (Gemma 3 tiny model, window 8, fp32, CPU)."""

from __future__ import annotations

import random

import support_models as sm
from kvcache.engine import LLM, SamplingParams

R = random.Random(1)
BASE = [R.randrange(2, sm.VOCAB) for _ in range(40)]  # no EOS / pad (ids 0 and 1)


def test_prefix_snapshots_after_a_longer_restored_prefix_equal_transformers():
    """Call 1 saves BASE's snapshot, its window part from offset 29 (> 40 - 8). In each later call the first
    request restores it, so the slot that first holds the call's shared prefix N starts past N - 8: a snapshot
    from it would need negative tokens (N 10), hold 4 of the 7 keys before N (N 33), or miss key N - 8 that a
    prompt equal to the prefix needs when it prefills from N - 1 (N 36). The snapshot comes from the slot that
    prefills the prefix instead."""
    model = sm.build("gemma3")
    llm = LLM(model, tokenizer=sm.IdsTokenizer(), cache="linear", max_model_len=64, max_num_seqs=2)
    assert llm.core.window_cache.config.max_seq_len == 2 * sm.WINDOW  # window layers in their own cache
    params = SamplingParams(max_tokens=8, temperature=0)
    calls = [[BASE + [3], BASE + [4]], [BASE + [6, 7], BASE[:10] + [11, 12]],
             [BASE + [6, 7], BASE[:33] + [11, 12]], [BASE + [6, 7], BASE[:36]]]
    for i, prompts in enumerate(calls):
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [sm.greedy(model, p, 8) for p in prompts]
        assert i == 0 or outs[0].num_cached_tokens == len(BASE)  # restored call 1's snapshot
