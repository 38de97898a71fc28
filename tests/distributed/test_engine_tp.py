"""The engine across ranks: tensor parallel (attention and MLP sharded, all-reduce after the row-parallel
layers) gives the single-process engine's tokens on every rank, on 2 ranks (KV heads split) and 3 ranks (one
KV head replicated); a disaggregated run (prefill on rank 0, blocks sent, decode on rank 1) gives them too."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kvcache import BlockAllocator, PagedConfig, PagedKVCache
from kvcache.engine import LLM, SamplingParams
from kvcache.engine.disagg import prefill_and_send, recv_and_decode

from .conftest import world_params
from .world import RankContext

pytestmark = pytest.mark.timeout(240)

PROMPT_LENS = [21, 7, 13, 3]  # 21 > the step budget of 16: chunked prefill


class _IdsTokenizer:
    """The engine needs only ``decode`` for token-id prompts."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def _tiny_llama(heads: int, kv_heads: int, device: torch.device, seed: int = 0):  # type: ignore[no-untyped-def]
    """A 2-layer random-weight Llama (head_dim 16, vocab 128, fp32), the same on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=16 * heads, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                      max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float().eval().to(device)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=0.8, seed=11, ignore_eos=True)
    return [greedy, greedy, seeded, greedy]


def _tp_run(ctx: RankContext, heads: int, kv_heads: int, kv_dtype: str) -> dict:
    model = _tiny_llama(heads, kv_heads, ctx.device)
    kw = dict(tokenizer=_IdsTokenizer(), block_size=4, max_num_batched_tokens=16, max_num_seqs=3, kv_dtype=kv_dtype)
    tp = LLM(model, kv_cache_memory=2**18, tp_group=dist.group.WORLD, **kw)
    got = [o.token_ids for o in tp.generate(_prompts(), _params())]
    again = [o.token_ids for o in tp.generate(_prompts()[:2], _params()[:2])]  # prefix-cache hits this time
    ref = [o.token_ids for o in LLM(model, num_blocks=64, **kw).generate(_prompts(), _params())]
    return {"tp": got, "again": again, "ref": ref, "cache_heads": tp.cache.config.num_kv_heads,
            "q_heads": tp.model.num_heads, "kv_heads": tp.model.shard.kv_heads, "num_blocks": tp.stats.num_blocks,
            "cached": tp.stats.cached_prompt_tokens}


_TP_CASES = [pytest.param(p.values[0], 4, 2, kv, id=f"{p.id}-4q2kv-{kv}", marks=p.marks) for p in world_params(2)
             for kv in ("auto", "int8")]
_TP_CASES += [pytest.param(p.values[0], 6, 1, "auto", id=f"{p.id}-6q1kv-replicated", marks=p.marks)
              for p in world_params(3)]


@pytest.mark.parametrize("world,heads,kv_heads,kv_dtype", _TP_CASES, indirect=["world"])
def test_tensor_parallel_engine_gives_single_process_tokens(world, heads: int, kv_heads: int, kv_dtype: str) -> None:
    res = world.run(_tp_run, heads, kv_heads, kv_dtype, timeout=120)
    size = world.size
    for r, out in enumerate(res):
        assert out["ref"] and all(len(t) == 6 for t in out["ref"])
        assert out["tp"] == out["ref"], f"rank {r}"
        assert out["again"] == out["ref"][:2], f"rank {r}"
        assert out["cached"] > 0  # the second call hit the prefix cache on every rank alike
        assert out["q_heads"] == heads // size
        assert out["cache_heads"] == max(kv_heads // size, 1)
        assert out["num_blocks"] == res[0]["num_blocks"]
    if kv_heads < size:  # replicated: consecutive ranks hold the same head
        assert [out["kv_heads"] for out in res] == [(r // (size // kv_heads),) for r in range(size)]
    else:
        held = [h for out in res for h in out["kv_heads"]]
        assert held == list(range(kv_heads))


def _bad_tp(ctx: RankContext) -> list[str]:
    errs = []
    for heads, kv, cache in ((4, 2, "paged"), (6, 3, "linear")):
        try:
            LLM(_tiny_llama(heads, kv, ctx.device), tokenizer=_IdsTokenizer(), num_blocks=8, cache=cache,
                tp_group=dist.group.WORLD)
        except ValueError as e:
            errs.append(str(e))
    return errs


@pytest.mark.parametrize("world", world_params(3)[:1], indirect=True)
def test_tensor_parallel_refuses_heads_that_do_not_split(world) -> None:
    for errs in world.run(_bad_tp):
        assert len(errs) == 2
        assert "do not split over 3 ranks" in errs[0]
        assert "tensor parallel" in errs[1] and "paged" in errs[1]


# ------------------------------------------------------------------------------------------ disaggregated


def _disagg(ctx: RankContext, kv_dtype: str) -> dict:
    model = _tiny_llama(4, 2, ctx.device)
    llm = LLM(model, tokenizer=_IdsTokenizer(), block_size=4, num_blocks=32, kv_dtype=kv_dtype)
    prompts, params = _prompts()[:3], _params()[:3]
    ref = [o.token_ids for o in llm.generate(prompts, params)]
    m = llm.model
    cache = PagedKVCache(PagedConfig(num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                                     block_size=4, num_blocks=24, dtype=m.dtype, kv_dtype=kv_dtype,
                                     device=ctx.device), rope=m.rope)
    alloc = BlockAllocator(24, 4)
    got = []
    if ctx.rank == 0:
        for p, sp in zip(prompts, params):
            got.append([prefill_and_send(m, cache, alloc, p, sp, dst=1)])
    else:
        alloc.allocate(5)  # this rank's own blocks in use: the request's come after them
        for sp in params:
            got.append(recv_and_decode(m, cache, alloc, sp, src=0, eos_token_ids=llm.eos_token_ids))
    return {"ref": ref, "got": got, "free": alloc.num_free_blocks}


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("world", world_params(2), indirect=True)
def test_disaggregated_engine_gives_single_process_tokens(world, kv_dtype: str) -> None:
    pre, dec = world.run(_disagg, kv_dtype, timeout=120)
    assert pre["ref"] == dec["ref"]
    assert all(len(t) == 6 for t in dec["ref"])
    assert dec["got"] == dec["ref"]
    assert pre["got"] == [t[:1] for t in pre["ref"]]  # the prefill rank's first token
    assert pre["free"] == 24 and dec["free"] == 24 - 5  # every request's blocks given back on both ranks
