"""Tensor parallelism: the head-to-rank mapping, caches sized for a rank's share, and a sharded attention + MLP
block over real ranks equal to the single-rank block."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcache import BlockAllocator, CacheConfig, PagedConfig, PagedKVCache
from kvcache.distributed import KVHeadShard, kv_heads_for_rank, shard_cache_config, shard_kv_heads, shard_paged_config

from .conftest import world_params
from .helpers import block_table, cu, ints
from .world import RankContext

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("num_kv_heads,tp_size,num_q_heads", [
    (8, 1, 32), (8, 2, 32), (8, 4, 32), (8, 8, 32), (2, 4, 8), (1, 4, 4), (1, 3, 12), (3, 3, 9), (2, 6, 12),
    (4, 8, 16), (6, 3, 6), (5, 5, None), (1, 2, None),
])
def test_shard_kv_heads_covers_every_head_and_keeps_gqa_groups(num_kv_heads: int, tp_size: int,
                                                               num_q_heads: int | None) -> None:
    shards = shard_kv_heads(num_kv_heads, tp_size, num_q_heads=num_q_heads)
    assert [s.tp_rank for s in shards] == list(range(tp_size))
    holders = {h: [s.tp_rank for s in shards if h in s.kv_heads] for h in range(num_kv_heads)}
    replicas = max(1, tp_size // num_kv_heads)
    assert all(len(r) == replicas for r in holders.values())  # every head, replicated only when too few
    assert all(s.replicas == replicas and s.num_kv_heads == max(1, num_kv_heads // tp_size) for s in shards)
    for s in shards:
        assert s.kv_heads == tuple(range(s.kv_slice.start, s.kv_slice.stop))
        assert s == kv_heads_for_rank(num_kv_heads, s.tp_rank, tp_size, num_q_heads=num_q_heads)
    if num_q_heads is None:
        assert all(s.q_heads is None and s.q_slice is None for s in shards)
        return
    assert sorted(q for s in shards for q in s.q_heads) == list(range(num_q_heads))  # a partition
    group = num_q_heads // num_kv_heads
    for s in shards:
        # each query head's KV head is held by its rank, and local GQA is a plain split of the local heads
        assert all(q // group in s.kv_heads for q in s.q_heads)
        local_group = len(s.q_heads) // s.num_kv_heads
        assert all(s.kv_heads[j // local_group] == q // group for j, q in enumerate(s.q_heads))


def test_shard_kv_heads_rejects_uneven_splits() -> None:
    with pytest.raises(ValueError, match=r"tp_size: expected a divisor of num_kv_heads \(6\)"):
        shard_kv_heads(6, 4)
    with pytest.raises(ValueError, match=r"tp_size: expected a multiple of num_kv_heads \(4\)"):
        shard_kv_heads(4, 6)
    with pytest.raises(ValueError, match=r"num_q_heads: expected a multiple of tp_size \(4\)"):
        shard_kv_heads(2, 4, num_q_heads=6)
    with pytest.raises(ValueError, match=r"num_q_heads: expected a multiple of num_kv_heads \(4\)"):
        shard_kv_heads(4, 2, num_q_heads=6)
    with pytest.raises(ValueError, match="tp_rank: expected an int <= 1"):
        kv_heads_for_rank(4, 2, 2)
    with pytest.raises(TypeError, match="tp_size"):
        kv_heads_for_rank(4, 0, 2.0)  # type: ignore[arg-type]


def test_configs_sized_for_a_rank_share() -> None:
    cfg = PagedConfig(num_layers=3, num_kv_heads=8, head_dim=64, block_size=16, num_blocks=10, kv_dtype="int4",
                      layout="HND", device="cpu")
    for tp, want in [(1, 8), (2, 4), (8, 1), (16, 1)]:
        local = shard_paged_config(cfg, tp - 1, tp)
        assert local == dataclasses.replace(cfg, num_kv_heads=want)
        assert PagedKVCache(local).pool(0).shape == (10, 2, want, 16, 32)
    lin = CacheConfig(num_layers=2, max_batch_size=3, max_seq_len=32, num_kv_heads=2, head_dim=16, device="cpu")
    assert shard_cache_config(lin, 3, 4) == dataclasses.replace(lin, num_kv_heads=1)
    with pytest.raises(TypeError, match="config: expected a PagedConfig"):
        shard_paged_config(lin, 0, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tp_size"):
        shard_paged_config(cfg, 0, 3)
    assert isinstance(kv_heads_for_rank(8, 0, 2), KVHeadShard)


# ------------------------------------------------------------------------------------------ across ranks

HIDDEN, D, INTER, LAYERS, BS = 24, 8, 24, 2, 4
PROMPTS = [5, 3]


def _weights(hq: int, hkv: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(31)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g) / shape[0] ** 0.5).to(device)

    return [dict(q=w(HIDDEN, hq * D), k=w(HIDDEN, hkv * D), v=w(HIDDEN, hkv * D), o=w(hq * D, HIDDEN),
                 up=w(HIDDEN, INTER), down=w(INTER, HIDDEN)) for _ in range(LAYERS)]


def _shard_weights(ws: list[dict[str, torch.Tensor]], s: KVHeadShard, hq: int,
                   hkv: int) -> list[dict[str, torch.Tensor]]:
    """Column-parallel q / k / v / up (this rank's heads, its slice of the MLP), row-parallel o / down."""
    i0, i1 = s.tp_rank * INTER // s.tp_size, (s.tp_rank + 1) * INTER // s.tp_size
    out = []
    for w in ws:
        out.append(dict(
            q=w["q"].view(HIDDEN, hq, D)[:, s.q_slice].reshape(HIDDEN, -1),
            k=w["k"].view(HIDDEN, hkv, D)[:, s.kv_slice].reshape(HIDDEN, -1),
            v=w["v"].view(HIDDEN, hkv, D)[:, s.kv_slice].reshape(HIDDEN, -1),
            o=w["o"].view(hq, D, HIDDEN)[s.q_slice].reshape(-1, HIDDEN),
            up=w["up"][:, i0:i1], down=w["down"][i0:i1],
        ))
    return out


def _forward(x, ws, cache, table, lens, q_lens, all_reduce):  # type: ignore[no-untyped-def]
    """Attention (paged cache) + MLP blocks with residuals; ``all_reduce`` after each row-parallel product."""
    dev, H = cache.device, cache.config.num_kv_heads
    plan = cache.plan(table, cu(q_lens, dev), ints(lens, dev))  # one plan per step, read by every layer
    for layer, w in enumerate(ws):
        q = (x @ w["q"]).view(x.shape[0], -1, D)
        k, v = (x @ w["k"]).view(-1, H, D), (x @ w["v"]).view(-1, H, D)
        cache.append(layer, k, v, plan)
        a = cache.attention(layer, q, plan)
        x = x + all_reduce(a.reshape(x.shape[0], -1) @ w["o"])
        x = x + all_reduce(torch.nn.functional.silu(x @ w["up"]) @ w["down"])
    return x


def _tp_block(ctx: RankContext, hq: int, hkv: int) -> int:
    import torch.distributed as dist

    def reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    full_cfg = PagedConfig(num_layers=LAYERS, num_kv_heads=hkv, head_dim=D, block_size=BS, num_blocks=16,
                           dtype=torch.float32, device=ctx.device)
    shard = kv_heads_for_rank(hkv, ctx.rank, ctx.size, num_q_heads=hq)
    ws = _weights(hq, hkv, ctx.device)
    caches = [PagedKVCache(full_cfg), PagedKVCache(shard_paged_config(full_cfg, ctx.rank, ctx.size))]
    tables = [block_table(BlockAllocator(16, BS), [3, 3], ctx.device) for _ in caches]
    g = torch.Generator().manual_seed(77)
    lens = [0, 0]
    for q_lens in (PROMPTS, [1, 1], [1, 1]):  # a prefill, two decode steps
        x = torch.randn(sum(q_lens), HIDDEN, generator=g).to(ctx.device)
        want = _forward(x, ws, caches[0], tables[0], lens, q_lens, lambda t: t)
        got = _forward(x, _shard_weights(ws, shard, hq, hkv), caches[1], tables[1], lens, q_lens, reduce)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        lens = [a + b for a, b in zip(lens, q_lens)]
    return caches[1].config.num_kv_heads


@pytest.mark.parametrize("world,hq,hkv", [
    pytest.param(w.values[0], hq, hkv, marks=w.marks, id=f"{w.id}-q{hq}-kv{hkv}")
    for w in world_params(2) for hq, hkv in [(4, 2), (4, 1)]
] + [
    pytest.param(w.values[0], hq, hkv, marks=w.marks, id=f"{w.id}-q{hq}-kv{hkv}")
    for w in world_params(3) for hq, hkv in [(6, 3), (6, 1)]
], indirect=["world"])
def test_tp_sharded_block_equals_single_rank(world, hq: int, hkv: int) -> None:
    res = world.run(_tp_block, hq, hkv)
    assert res == [max(1, hkv // world.size)] * world.size
