"""Memory tiers behind the prefix cache (kvcache.paged.tiers) on the CPU: blocks evicted from the pool are kept in
the host tier (its own LRU) and on disk, found through the hash chain and copied back bit-exact; budgets, eviction
order, no second copy of a block already held, a block brought back and evicted again, damaged or foreign disk
entries refused, persistence across tier objects, and the events."""

from __future__ import annotations

import os

import pytest
import torch

from kvcache.paged import BlockAllocator, PagedConfig, PagedKVCache
from kvcache.paged.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog
from kvcache.paged.tiers import DiskTier, HostTier, TieredCache, cache_fingerprint, tiers_block_bytes, weights_identity
from kvcache.paged.tiers.host import CHUNK_BLOCKS, SlotArena, slot_shapes

BS = 4


def _cache(kv_dtype: str = "auto", num_blocks: int = 8) -> PagedKVCache:
    cache = PagedKVCache(PagedConfig(num_layers=2, num_kv_heads=2, head_dim=16, block_size=BS, num_blocks=num_blocks,
                                     dtype=torch.float16, kv_dtype=kv_dtype, device="cpu"))
    g = torch.Generator().manual_seed(0)
    if cache.buffer.dtype == torch.uint8:
        cache.buffer.copy_(torch.randint(0, 256, cache.buffer.shape, generator=g, dtype=torch.uint8))
    else:
        cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=g).to(cache.buffer.dtype))
    if cache.params_buffer is not None:
        cache.params_buffer.copy_(torch.rand(cache.params_buffer.shape, generator=g))
    return cache


def _blocks(cache: PagedKVCache, ids: list[int]) -> list[torch.Tensor]:
    """The bytes of blocks ``ids`` in every layer (data, params), in order."""
    ts = [cache.buffer] + ([cache.params_buffer] if cache.params_buffer is not None else [])
    return [t[:, ids].clone() for t in ts]


def _publish(alloc: BlockAllocator, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Allocate, cache and free the full blocks of ``tokens``: (block ids, hashes), now cached-unreferenced."""
    hashes = alloc.hash_blocks(tokens)
    ids = alloc.allocate(len(hashes))
    alloc.cache_blocks(ids, hashes)
    alloc.free(ids)
    return ids, hashes


def _bring_back(alloc: BlockAllocator, tiers: TieredCache, hashes: list[int]) -> list[int]:
    """What the scheduler does: allocate, fetch, load, register; returns the device blocks."""
    n = tiers.lookup(hashes)
    ids = alloc.allocate(n)
    f = tiers.fetch(hashes, limit=n)
    alloc.free(ids[f.num_blocks:])
    tiers.load(f, ids[:f.num_blocks])
    alloc.cache_blocks(ids[:f.num_blocks], f.hashes)
    return ids[:f.num_blocks]


def _setup(kv_dtype="auto", host_blocks=8, num_blocks=8, **kw):
    cache = _cache(kv_dtype, num_blocks)
    log = KVEventLog()
    tiers = TieredCache(cache, host_bytes=host_blocks * tiers_block_bytes(cache), events=log, **kw)
    alloc = BlockAllocator(num_blocks, BS)
    alloc.set_listener(tiers)
    return cache, tiers, alloc, log


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8", "int4", "fp8k"])
def test_evicted_blocks_come_back_bit_exact(kv_dtype):
    cache, tiers, alloc, log = _setup(kv_dtype, host_blocks=8, num_blocks=4)
    ids, hashes = _publish(alloc, list(range(4 * BS)))
    want = _blocks(cache, ids)
    taken = alloc.allocate(4)  # evicts all four: copied to the host tier
    assert tiers.lookup(hashes) == 4 and alloc.lookup(hashes[0]) is None
    for t in [cache.buffer] + ([cache.params_buffer] if cache.params_buffer is not None else []):
        t[:, taken] = 0  # their new holder overwrites them
    alloc.free(taken)
    back = _bring_back(alloc, tiers, hashes)
    assert len(back) == 4 and [alloc.lookup(h) for h in hashes] == back
    for a, b in zip(_blocks(cache, back), want):
        assert torch.equal(a, b)
    st = tiers.stats()["host"]
    assert (st.stored, st.hits, st.bytes_in, st.bytes_out) == (4, 4, 4 * tiers_block_bytes(cache),
                                                               4 * tiers_block_bytes(cache))


def test_more_blocks_than_one_copy_batch_come_back_bit_exact():
    n = CHUNK_BLOCKS + 6  # two batches each way
    cache, tiers, alloc, _ = _setup("int8", host_blocks=n, num_blocks=n)
    ids, hashes = _publish(alloc, list(range(n * BS)))
    want = _blocks(cache, ids)
    alloc.free(alloc.allocate(n))
    cache.buffer.zero_()
    cache.params_buffer.zero_()
    back = _bring_back(alloc, tiers, hashes)
    assert len(back) == n
    for a, b in zip(_blocks(cache, back), want):
        assert torch.equal(a, b)


def test_lookup_stops_at_the_first_missing_block_and_walks_host_then_disk(tmp_path):
    cache, tiers, alloc, _ = _setup(host_blocks=2, num_blocks=4, disk_dir=tmp_path, model_id="m")
    _, hashes = _publish(alloc, list(range(4 * BS)))
    alloc.allocate(4)  # four evicted into a host tier of two: the two oldest go on to disk
    assert len(tiers.host) == 2 and len(tiers.disk) == 2
    assert tiers.lookup(hashes) == 4
    assert tiers.lookup(hashes[1:]) == 3  # any run of the chain
    assert tiers.lookup([hashes[0], 12345, hashes[2]]) == 1
    assert tiers.lookup([]) == 0


def test_host_lru_order_and_budget():
    cache, tiers, alloc, log = _setup(host_blocks=3, num_blocks=2)
    chains = []
    for i in range(3):  # three one-block prefixes, published then evicted in turn: a, b, c
        _, h = _publish(alloc, [100 * i + t for t in range(BS)])
        chains.append(h[0])
        alloc.free(alloc.allocate(2))
    a, b, c = chains
    assert tiers.host.hashes() == [a, b, c] and len(tiers.host) == 3
    tiers.fetch([a])  # a hit makes a the most recently used
    assert tiers.host.hashes() == [b, c, a]
    log.drain()
    _, (d,) = _publish(alloc, [999] * BS)
    alloc.free(alloc.allocate(2))  # the tier is full: b, least recently used, leaves
    assert tiers.host.hashes() == [c, a, d] and tiers.lookup([b]) == 0
    assert BlockRemoved((b,), "host") in log.drain()
    assert tiers.stats()["host"].removed == 1


def test_a_block_held_on_the_host_is_not_copied_again():
    cache, tiers, alloc, log = _setup(host_blocks=4, num_blocks=4)
    _, hashes = _publish(alloc, list(range(2 * BS)))
    alloc.free(alloc.allocate(4))
    back = _bring_back(alloc, tiers, hashes)
    alloc.free(back)
    before = tiers.stats()["host"]
    log.drain()
    alloc.free(alloc.allocate(4))  # evicted again: the host still holds both
    after = tiers.stats()["host"]
    assert (after.stored, after.bytes_in) == (before.stored, before.bytes_in)
    ev = log.drain()
    assert [e.medium for e in ev] == ["device"] and sorted(ev[0].block_hashes) == sorted(hashes)


def test_a_block_brought_back_and_evicted_again_after_its_host_copy_left():
    # block A comes back into a device block; before anything reads it, the host tier drops A (other blocks
    # push it out) and the device block is evicted again: it must go down again with A's bytes, not the slot's
    cache, tiers, alloc, _ = _setup(host_blocks=2, num_blocks=3)
    ids, (a,) = _publish(alloc, list(range(BS)))
    want = _blocks(cache, ids)
    alloc.free(alloc.allocate(3))
    (x,) = _bring_back(alloc, tiers, [a])  # in flight: loaded, not yet read by a step
    others = alloc.allocate(2)
    for k, b in enumerate(others):
        cache.buffer[:, b] = float(k + 7)
    alloc.cache_blocks(others, alloc.hash_blocks([50 + t for t in range(2 * BS)]))
    alloc.free(others)
    alloc.free([x])
    alloc.free(alloc.allocate(2))  # evicts the two others: the host tier (2 slots) drops a
    assert tiers.lookup([a]) == 0 and alloc.lookup(a) == x
    cache.buffer[:, others] = -1.0
    alloc.allocate(3)  # evicts x: a goes down again, with its own bytes
    assert tiers.lookup([a]) == 1
    alloc2 = BlockAllocator(3, BS)  # a fresh pool (its blocks overwritten) to bring it back into
    cache.buffer.zero_()
    alloc2.set_listener(tiers)
    back = _bring_back(alloc2, tiers, [a])
    assert torch.equal(_blocks(cache, back)[0], want[0])


def test_too_many_evictions_at_once_keep_the_most_recent():
    cache, tiers, alloc, _ = _setup(host_blocks=2, num_blocks=4)
    _, hashes = _publish(alloc, list(range(4 * BS)))
    alloc.allocate(4)  # free() released the tail first: eviction order is hashes[3], [2], [1], [0]
    assert sorted(tiers.host.hashes()) == sorted(hashes[:2])
    assert tiers.stats()["host"].stored == 2


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8k"])
def test_disk_round_trip_and_persistence_across_tier_objects(tmp_path, kv_dtype):
    cache, tiers, alloc, log = _setup(kv_dtype, host_blocks=0, num_blocks=4, disk_dir=tmp_path, model_id="m")
    ids, hashes = _publish(alloc, list(range(3 * BS)))
    want = _blocks(cache, ids)
    alloc.allocate(4)
    assert tiers.host is None and len(tiers.disk) == 3
    assert sum(isinstance(e, BlockStored) and e.medium == "disk" for e in log.drain()) == 3
    # a new cache and tier object over the same directory: another process, or a restart
    cache2 = _cache(kv_dtype, 4)
    cache2.buffer.zero_()  # what comes back is read from disk, not the same seeded bytes
    cache2.params_buffer.zero_()
    tiers2 = TieredCache(cache2, disk_dir=tmp_path, model_id="m")
    alloc2 = BlockAllocator(4, BS)
    alloc2.set_listener(tiers2)
    assert tiers2.lookup(hashes) == 3
    back = _bring_back(alloc2, tiers2, hashes)
    for a, b in zip(_blocks(cache2, back), want):
        assert torch.equal(a, b)
    assert tiers2.stats()["disk"].hits == 3


def _one_block_on_disk(tmp_path, model_id="m"):
    cache, tiers, alloc, log = _setup(host_blocks=0, num_blocks=2, disk_dir=tmp_path, model_id=model_id)
    _, (h,) = _publish(alloc, list(range(BS)))
    alloc.allocate(2)
    return tiers, h


@pytest.mark.parametrize("where", ["data", "header", "truncated"])
def test_a_damaged_disk_entry_is_refused_deleted_and_reported(tmp_path, where):
    tiers, h = _one_block_on_disk(tmp_path)
    path = tiers.disk.path_for(h)
    raw = bytearray(open(path, "rb").read())
    if where == "data":
        raw[-5] ^= 0x01
    elif where == "header":
        raw[20] ^= 0x20
    else:
        raw = raw[:len(raw) // 2]
    with open(path, "wb") as f:
        f.write(raw)
    tiers.events.drain()
    assert tiers.lookup([h]) == 1  # listed, not read yet
    f = tiers.fetch([h])
    assert f.num_blocks == 0 and not os.path.exists(path)
    assert tiers.stats()["disk"].refused == 1 and tiers.events.drain() == [BlockRemoved((h,), "disk")]


@pytest.mark.parametrize("kv_dtype, reads", [("fp8", (0, 1)), ("fp8k", (1,)), ("int8", ()), ("auto", ())])
def test_the_fingerprint_covers_the_layer_scales_the_format_reads(kv_dtype, reads):
    cache = _cache(kv_dtype)
    base = cache_fingerprint(cache, "m")
    for layer, which in ((0, 0), (1, 1)):
        cache.kv_scales[layer, which] = 0.5
        assert (cache_fingerprint(cache, "m") != base) == (which in reads), (layer, which)
        cache.kv_scales[layer, which] = 1.0
    assert cache_fingerprint(cache, "m") == base


@pytest.mark.parametrize("other", [dict(model_id="another-model"), dict(kv_dtype="int8")])
def test_a_disk_entry_of_another_model_or_format_is_refused(tmp_path, other):
    tiers, h = _one_block_on_disk(tmp_path)
    kw = dict(model_id=other.get("model_id", "m"))
    cache2 = _cache(other.get("kv_dtype", "auto"), 2)
    tiers2 = TieredCache(cache2, disk_dir=tmp_path, **kw)
    assert tiers2.disk.directory != tiers.disk.directory and tiers2.lookup([h]) == 0  # another fingerprint's folder
    os.replace(tiers.disk.path_for(h), tiers2.disk.path_for(h))  # copied in by hand: read, and refused
    assert tiers2.lookup([h]) == 1 and tiers2.fetch([h]).num_blocks == 0
    assert tiers2.stats()["disk"].refused == 1


def test_disk_budget_evicts_least_recently_used_files(tmp_path):
    cache = _cache("auto", 2)
    probe = TieredCache(cache, disk_dir=tmp_path / "probe", model_id="m")
    alloc = BlockAllocator(2, BS)
    alloc.set_listener(probe)
    _publish(alloc, list(range(BS)))
    alloc.allocate(2)
    size = probe.disk.nbytes  # one file
    tiers = TieredCache(cache, disk_dir=tmp_path / "d", disk_bytes=2 * size, model_id="m", events=KVEventLog())
    alloc = BlockAllocator(2, BS)
    alloc.set_listener(tiers)
    hs = []
    for i in range(3):
        _, (h,) = _publish(alloc, [10 * i + 1] * BS)
        hs.append(h)
        alloc.free(alloc.allocate(2))
    assert tiers.disk.hashes() == hs[1:] and tiers.disk.nbytes <= 2 * size
    assert BlockRemoved((hs[0],), "disk") in tiers.events.drain()
    assert not os.path.exists(tiers.disk.path_for(hs[0]))


def test_events_report_each_tier():
    cache, tiers, alloc, log = _setup(host_blocks=4, num_blocks=2)
    ids, hashes = _publish(alloc, list(range(2 * BS)))
    alloc.free(alloc.allocate(2))
    ev = log.drain()
    assert ev[0] == BlockStored(tuple(hashes), "device")
    assert {e.medium for e in ev[1:]} == {"device", "host"}
    assert sorted(h for e in ev[1:] if e.medium == "host" for h in e.block_hashes) == sorted(hashes)
    _publish(alloc, [7] * BS)
    log.drain()
    assert alloc.reset_prefix_cache()  # new weights: the host tier forgets its blocks too
    assert log.drain() == [AllBlocksCleared("device"), AllBlocksCleared("host")] and tiers.lookup(hashes) == 0


def test_a_callable_model_id_is_recomputed_on_reset(tmp_path):
    # the identity of the weights, recomputed when the allocator drops its prefixes: new weights, a new folder;
    # blocks written under the old weights are never found again, and a str model_id is kept as given
    weights = torch.ones(8)
    cache, tiers, alloc, log = _setup(host_blocks=0, num_blocks=2, disk_dir=tmp_path,
                                      model_id=lambda: weights_identity([("w", weights)]))
    _, (h,) = _publish(alloc, list(range(BS)))
    taken = alloc.allocate(2)  # evicts h: written to disk
    old = tiers.disk.directory
    assert tiers.lookup([h]) == 1
    alloc.free(taken)
    _publish(alloc, [5] * BS)
    assert alloc.reset_prefix_cache()  # same weights: same folder, the block is still found
    assert tiers.disk.directory == old and tiers.lookup([h]) == 1
    weights[3] += 1.0  # updated in place, away from the sampled ends
    _publish(alloc, [5] * BS)
    log.drain()
    assert alloc.reset_prefix_cache()
    assert tiers.disk.directory != old and tiers.lookup([h]) == 0 and os.listdir(old)
    assert AllBlocksCleared("disk") in log.drain() and tiers.stats()["disk"].removed == 1
    second = tiers.disk.directory
    weights[5] -= 1.0  # new weights again, with nothing cached on the device: the reset still reaches the tiers
    assert not alloc.reset_prefix_cache()
    assert tiers.disk.directory not in (old, second)
    fixed = TieredCache(cache, disk_dir=tmp_path, model_id="m")
    folder = fixed.disk.directory
    fixed.cleared()
    assert fixed.disk.directory == folder


def test_bad_arguments_are_refused_by_name(tmp_path):
    cache = _cache()
    with pytest.raises(ValueError, match="^host_bytes: expected 0 or at least one block"):
        TieredCache(cache, host_bytes=tiers_block_bytes(cache) - 1)
    with pytest.raises(TypeError, match="^host_bytes: expected an int"):
        TieredCache(cache, host_bytes=1.5)
    with pytest.raises(TypeError, match="^model_id: expected"):
        TieredCache(cache, disk_dir=tmp_path)
    with pytest.raises(TypeError, match="^model_id: expected"):
        TieredCache(cache, disk_dir=tmp_path, model_id=3)
    with pytest.raises(TypeError, match="^model_id: expected .* returned int"):
        TieredCache(cache, disk_dir=tmp_path, model_id=lambda: 3)
    with pytest.raises(ValueError, match="^model_id: expected a non-empty str"):
        TieredCache(cache, disk_dir=tmp_path, model_id="")
    with pytest.raises(ValueError, match="^model_id: a setting of the disk tier, given without disk_dir"):
        TieredCache(cache, model_id="m")
    with pytest.raises(ValueError, match="^disk_bytes: a setting of the disk tier, given without disk_dir"):
        TieredCache(cache, disk_bytes=2**20)
    with pytest.raises(ValueError, match="^disk_bytes: expected"):
        TieredCache(cache, disk_dir=tmp_path, disk_bytes=0, model_id="m")
    with pytest.raises(TypeError, match="^disk_dir: expected a str or os.PathLike"):
        TieredCache(cache, disk_dir=3, model_id="m")
    with pytest.raises(TypeError, match="^directory: expected"):
        DiskTier(3, "f" * 64, 2**20, slot_shapes(cache))
    with pytest.raises(ValueError, match="^capacity_bytes: expected"):
        DiskTier(tmp_path, "f" * 64, 0, slot_shapes(cache))
    with pytest.raises(ValueError, match="^num_slots: expected"):
        SlotArena.allocate(0, slot_shapes(cache), pin=False)
    with pytest.raises(TypeError, match="^num_slots: expected"):
        HostTier(cache, 2.0)
    with pytest.raises(TypeError, match="^model_id: expected"):
        cache_fingerprint(cache, None)
    with pytest.raises(TypeError, match="^shapes: expected"):
        SlotArena.allocate(2, [(2, 4)], pin=False)
    assert not os.listdir(tmp_path)  # nothing was created by a refused call
    with pytest.raises(TypeError, match="^cache: expected a PagedKVCache"):
        TieredCache("cache")
    with pytest.raises(TypeError, match="^listener: expected"):
        BlockAllocator(2, BS).set_listener(object())
    with pytest.raises(ValueError, match="^medium: expected"):
        BlockStored((1,), "gpu")
    tiers = TieredCache(cache, host_bytes=4 * tiers_block_bytes(cache))
    with pytest.raises(ValueError, match="^hashes: expected a block hash"):
        tiers.lookup([-1])
    with pytest.raises(TypeError, match="^hashes: expected an iterable"):
        tiers.fetch(7)
    with pytest.raises(ValueError, match="^limit: expected"):
        tiers.fetch([1], limit=-1)
    for bad in (True, "3", 1.0):
        with pytest.raises(TypeError, match="^limit: expected"):
            tiers.fetch([1], limit=bad)
    f = tiers.fetch([1])
    with pytest.raises(ValueError, match="^block_ids: expected block ids in"):
        tiers.load(f, [99])
    with pytest.raises(ValueError, match="^block_ids: expected 0 ids"):
        tiers.load(f, [1])
    with pytest.raises(TypeError, match="^fetched: expected a Fetched"):
        tiers.load([], [])


def test_an_unusable_disk_dir_is_refused_by_name(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match="^.*disk_dir: cannot create"):
        TieredCache(_cache(), disk_dir=blocker, model_id="m")
    with pytest.raises(OSError, match="^.*directory: cannot create"):
        DiskTier(blocker, "f" * 64, 2**20, slot_shapes(_cache()))


def test_host_slots_in_power_of_two_segments(monkeypatch):
    # pinned allocations are rounded up to a power of two: each segment holds what fits in one, less than a slot lost
    import kvcache.paged.tiers.host as host_mod

    monkeypatch.setattr(host_mod, "SEGMENT_BYTES", 4 * tiers_block_bytes(_cache()))
    cache, tiers, alloc, _ = _setup("int8", host_blocks=11, num_blocks=12)
    arena = tiers.host.arena
    assert arena.num_slots == 11 and len(arena.segments) > 2
    for seg in arena.segments:
        for t in seg:  # each tensor is allocated on its own
            b, per = t.numel() * t.element_size(), t[0].numel() * t.element_size()
            p = 1 << (b - 1).bit_length()  # what the pinned allocator takes for it
            assert p <= host_mod.SEGMENT_BYTES and p - b < per
    # blocks across segment boundaries come back bit-exact
    ids, hashes = _publish(alloc, list(range(11 * BS)))
    want = _blocks(cache, ids)
    alloc.free(alloc.allocate(12))
    cache.buffer.zero_()
    cache.params_buffer.zero_()
    back = _bring_back(alloc, tiers, hashes)
    for a, b in zip(_blocks(cache, back), want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_traffic_never_returns_a_wrong_byte(tmp_path, seed):
    # requests over a few shared prefixes through a small pool, a small host tier and a small disk budget: every
    # block a request ends up with (matched, brought back or written) holds the bytes of its own hash
    g = torch.Generator().manual_seed(seed)
    cache = _cache("int8", 6)
    tiers = TieredCache(cache, host_bytes=3 * tiers_block_bytes(cache), disk_dir=tmp_path, model_id="m",
                        disk_bytes=6 * 1100, events=KVEventLog())
    alloc = BlockAllocator(6, BS)
    alloc.set_listener(tiers)
    tensors = [cache.buffer, cache.params_buffer]

    def content(h: int) -> list[torch.Tensor]:  # what computing the block of hash h writes
        gh = torch.Generator().manual_seed(h % 2**62)
        return [torch.randint(0, 256, cache.buffer[:, 0].shape, generator=gh, dtype=torch.uint8),
                torch.rand(cache.params_buffer[:, 0].shape, generator=gh)]

    stems = [torch.randint(0, 50, (5 * BS,), generator=g).tolist() for _ in range(4)]
    for _ in range(60):
        stem = stems[int(torch.randint(0, 4, (1,), generator=g))]
        hashes = alloc.hash_blocks(stem[:BS * int(torch.randint(1, 6, (1,), generator=g))])
        table = alloc.match_prefix(hashes)
        rest = hashes[len(table):]
        n = tiers.lookup(rest)
        got = alloc.allocate(n) if n else []
        f = tiers.fetch(rest, limit=n)
        alloc.free(got[f.num_blocks:])
        tiers.load(f, got[:f.num_blocks])
        alloc.cache_blocks(got[:f.num_blocks], f.hashes)
        table += got[:f.num_blocks]
        fresh = alloc.allocate(len(hashes) - len(table))
        for b, h in zip(fresh, hashes[len(table):]):
            for t, c in zip(tensors, content(h)):
                t[:, b] = c
        alloc.cache_blocks(fresh, hashes[len(table):])
        table += fresh
        for b, h in zip(table, hashes):
            assert all(torch.equal(t[:, b], c) for t, c in zip(tensors, content(h)))
        alloc.free(table)
        alloc.check_invariants()
        assert len(tiers.host) <= 3 and tiers.disk.nbytes <= 6 * 1100
    st = tiers.stats()
    assert st["host"].hits > 0 and st["disk"].hits > 0 and st["disk"].removed > 0  # every path taken
