"""What ``SamplingParams.seed`` fixes against the batch, tested as documented (docs/engine.md, "Seeds and the batch"),
on the CPU with SmolLM2-135M-Instruct (float32):

* a seeded request draws from its own generator: other requests' seeds do not change its draws, and two seeds in one
  batch do not share draws;
* its tokens are the same whatever the other requests are when its logits are: every step of the two batches has
  the same row counts (same prompt lengths and ``max_tokens`` at the same places, prefix caching off), for every
  kv_dtype, the quantized ones included.
"""

from __future__ import annotations

import pytest

from kvcache.engine import LLM, SamplingParams

N = 16  # new tokens per request


def _sp(seed: int) -> SamplingParams:
    # ignore_eos: every request runs all N steps, so the batches' row counts match step by step
    return SamplingParams(max_tokens=N, temperature=1.0, seed=seed, ignore_eos=True)


def _llm(smollm, kv_dtype: str) -> LLM:
    model, tok = smollm
    return LLM(model, tokenizer=tok, kv_dtype=kv_dtype, max_num_seqs=4, enable_prefix_caching=False)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", pytest.param("fp8", marks=pytest.mark.slow),
                                      pytest.param("int4", marks=pytest.mark.slow)])
def test_same_shapes_other_requests_same_tokens(smollm, prompt_ids, kv_dtype):
    llm = _llm(smollm, kv_dtype)
    first = [prompt_ids[0], *prompt_ids[1:4]]
    # other prompts of the same lengths (the same tokens reversed) with other seeds, at the same places
    second = [prompt_ids[0], *[p[::-1] for p in prompt_ids[1:4]]]
    a = llm.generate(first, [_sp(s) for s in (11, 12, 13, 14)])
    b = llm.generate(second, [_sp(s) for s in (11, 22, 23, 24)])
    assert [len(o.token_ids) for o in a + b] == [N] * 8
    assert all(x.token_ids != y.token_ids for x, y in zip(a[1:], b[1:]))  # the other requests did change
    assert a[0].token_ids == b[0].token_ids


def test_seeds_in_one_batch_do_not_share_draws(smollm, prompt_ids):
    llm = _llm(smollm, "auto")
    p = prompt_ids[0]
    x = llm.generate([p] * 4, [_sp(s) for s in (1, 2, 3, 4)])
    y = llm.generate([p] * 4, [_sp(s) for s in (9, 2, 3, 4)])
    # one prompt, four seeds: four different answers, each from its own generator
    assert len({tuple(o.token_ids) for o in x}) == 4
    # request 0's seed changed: its tokens did, the others' did not (no generator shared or consumed in turn)
    assert x[0].token_ids != y[0].token_ids
    assert [o.token_ids for o in x[1:]] == [o.token_ids for o in y[1:]]
