"""KV transfer by torch.distributed point-to-point: blocks of every kv_dtype and snapshots arrive bit-exact
(one chunk or many, chunk sizes that do not divide the payload, torch and the Triton kernels under the
interpreter), formats are checked on arrival (nothing written on a mismatch), damage on the wire (a changed
byte, swapped chunks, a changed header) is named and leaves the documented state, the receiver's blocks come
from its own allocator, and a disaggregated prefill -> decode run gives the single-process tokens."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import kvcache
from kvcache import BlockAllocator, KVSnapshot
from kvcache.distributed import recv_blocks, recv_snapshot, send_blocks, send_snapshot, wire

from .conftest import world_params
from .helpers import block_table, cu, ints, make_cache, randn
from .world import RankContext

pytestmark = pytest.mark.timeout(180)

PROMPTS = [9, 6]  # tokens per sequence of the sender's prefill
INTERPRET = {"KVCACHE_TRITON_INTERPRET": "1"}  # the ranks run the Triton kernels through the interpreter


def _prefilled(device: torch.device, seed: int, **kw):  # type: ignore[no-untyped-def]
    """A cache with two prefilled sequences whose blocks are scattered (some ids taken first); returns the
    cache, its block table and the lengths."""
    cache = make_cache(device, **kw)
    bs, nb = cache.config.block_size, cache.config.num_blocks
    alloc = BlockAllocator(nb, bs)
    alloc.allocate(3)
    table = block_table(alloc, [-(-n // bs) for n in PROMPTS], device, reverse=True)
    gen = torch.Generator().manual_seed(seed)
    H, D = cache.config.num_kv_heads, cache.config.head_dim
    for layer in range(cache.num_layers):
        k = randn(gen, (sum(PROMPTS), H, D), cache.config.dtype, device)
        v = randn(gen, (sum(PROMPTS), H, D), cache.config.dtype, device)
        cache.append(layer, k, v, cache.plan(table, cu(PROMPTS, device), ints([0] * len(PROMPTS), device),
                                             check=True))
    return cache, table


def _sent_ids(table: torch.Tensor) -> list[int]:
    """Block ids of every sequence, in order, sequence after sequence."""
    bs = 4
    return [int(x) for b, n in enumerate(PROMPTS) for x in table[b, :-(-n // bs)].tolist()]


def _sentinel(cache, seed: int = 5) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    cache.buffer.view(torch.uint8).copy_(torch.randint(0, 256, cache.buffer.view(torch.uint8).shape, generator=g,
                                                       dtype=torch.uint8))
    if cache.params_buffer is not None:
        cache.params_buffer.copy_(torch.rand(cache.params_buffer.shape, generator=g))


def _receiver(ctx: RankContext, kw: dict):  # type: ignore[no-untyped-def]
    cache = make_cache(ctx.device, **kw)
    _sentinel(cache)
    alloc = BlockAllocator(cache.config.num_blocks, cache.config.block_size)
    alloc.allocate(5)  # the receiver's own blocks in use: new ones come after them
    return cache, alloc


def _check_arrived(cache, before, ids, src_cache, src_ids) -> None:  # type: ignore[no-untyped-def]
    """Blocks ``ids`` of ``cache`` hold ``src_cache``'s ``src_ids`` bit for bit; every other byte is as before."""
    idx = torch.tensor(ids, dtype=torch.long, device=cache.device)
    sidx = torch.tensor(src_ids, dtype=torch.long, device=cache.device)
    got, want = cache.buffer.view(torch.uint8), src_cache.buffer.view(torch.uint8)
    assert torch.equal(got.index_select(1, idx), want.index_select(1, sidx))
    others = torch.ones(cache.config.num_blocks, dtype=torch.bool, device=cache.device)
    others[idx] = False
    assert torch.equal(got[:, others], before[0][:, others])
    if cache.params_buffer is not None:
        gp, wp = cache.params_buffer.view(torch.int32), src_cache.params_buffer.view(torch.int32)
        assert torch.equal(gp.index_select(1, idx), wp.index_select(1, sidx))
        assert torch.equal(gp[:, others], before[1][:, others])


def _snapshot_state(cache):  # type: ignore[no-untyped-def]
    return (cache.buffer.view(torch.uint8).clone(),
            None if cache.params_buffer is None else cache.params_buffer.view(torch.int32).clone())


def _row_bytes(cache) -> int:  # type: ignore[no-untyped-def]
    """Payload bytes of one block of one layer (data and params): the wire's row."""
    return cache.config.block_bytes // cache.num_layers


def _blocks_roundtrip(ctx: RankContext, kw: dict, checksum: bool, rows_per_chunk: float | None = None
                      ) -> list[int] | None:
    """Every rank but the last sends its blocks (its own data) to the last rank, which receives them in rank
    order and compares with the senders' caches rebuilt locally. ``rows_per_chunk``: the sender's chunk_bytes
    in rows (None: the default, one chunk here)."""
    last = ctx.size - 1
    if ctx.rank != last:
        cache, table = _prefilled(ctx.device, 100 + ctx.rank, **kw)
        chunk = None if rows_per_chunk is None else int(rows_per_chunk * _row_bytes(cache))
        assert send_blocks(cache, _sent_ids(table), dst=last, checksum=checksum, chunk_bytes=chunk) is True
        return None
    cache, alloc = _receiver(ctx, kw)
    free0 = alloc.num_free_blocks
    all_ids = []
    for src in range(last):
        before = _snapshot_state(cache)
        ids = recv_blocks(cache, alloc, src=src)
        src_cache, src_table = _prefilled(ctx.device, 100 + src, **kw)
        sent = _sent_ids(src_table)
        assert ids is not None and len(ids) == len(sent)
        assert not set(ids) & set(range(5)) and not set(ids) & set(all_ids)  # fresh blocks of its allocator
        _check_arrived(cache, before, ids, src_cache, sent)
        # the sequences read back through the new block table: the sender's K / V exactly
        bs, off = 4, 0
        table = torch.zeros(len(PROMPTS), 3, dtype=torch.int32)
        for b, n in enumerate(PROMPTS):
            nblk = -(-n // bs)
            table[b, :nblk] = torch.tensor(ids[off:off + nblk])
            off += nblk
        for layer in range(cache.num_layers):
            k, v = cache.gather(layer, cache.plan(table.to(ctx.device), seq_lens=ints(PROMPTS, ctx.device)))
            ks, vs = src_cache.gather(layer, src_cache.plan(src_table, seq_lens=ints(PROMPTS, ctx.device)))
            assert torch.equal(k, ks) and torch.equal(v, vs)
        all_ids += ids
    assert alloc.num_free_blocks == free0 - len(all_ids)
    return all_ids


@pytest.mark.parametrize("world", world_params(2, 3), indirect=True)
@pytest.mark.parametrize("kw", [
    dict(kv_dtype="auto", layout="NHD", dtype=torch.float16),
    dict(kv_dtype="auto", layout="HND", dtype=torch.bfloat16),
    dict(kv_dtype="fp8", layout="NHD", dtype=torch.float16),
    dict(kv_dtype="int8", layout="HND", dtype=torch.float16),
    dict(kv_dtype="int4", layout="NHD", dtype=torch.bfloat16, head_dim=10, num_kv_heads=3),
    dict(kv_dtype="k8v4", layout="HND", dtype=torch.float16, head_dim=10, num_kv_heads=3),
    dict(kv_dtype="fp8k", layout="HND", dtype=torch.float16, head_dim=10, num_kv_heads=3),
], ids=["fp16-NHD", "bf16-HND", "fp8", "int8-HND", "int4-D10-H3", "k8v4-HND", "fp8k-HND-D10-H3"])
def test_blocks_arrive_bit_exact(world, kw: dict) -> None:
    res = world.run(_blocks_roundtrip, kw, True)
    assert len(res[-1]) == (world.size - 1) * sum(-(-n // 4) for n in PROMPTS)


@pytest.mark.parametrize("world", world_params(2), indirect=True)
def test_blocks_without_checksum(world) -> None:
    world.run(_blocks_roundtrip, dict(kv_dtype="int4", layout="HND"), False)
    world.run(_blocks_roundtrip, dict(kv_dtype="auto"), False, 3)


KW_ALL = {
    "fp16": dict(kv_dtype="auto", layout="NHD", dtype=torch.float16),
    "fp8": dict(kv_dtype="fp8", layout="HND", dtype=torch.float16),
    "int8": dict(kv_dtype="int8", layout="NHD", dtype=torch.bfloat16),
    "int4": dict(kv_dtype="int4", layout="HND", dtype=torch.float16, head_dim=10, num_kv_heads=3),
}


@pytest.mark.parametrize("world", world_params(2, 3), indirect=True)
@pytest.mark.parametrize("name", sorted(KW_ALL))
def test_blocks_arrive_bit_exact_in_chunks(world, name: str) -> None:
    """10 rows (2 layers x 5 blocks) in chunks of one row, of 3 rows (the last chunk 1 row), and of 4.5 rows'
    bytes (rounded down to 4: the last chunk 2 rows); with 3 ranks, two senders' chunks in flight to one."""
    for rows in (1, 3, 4.5):
        world.run(_blocks_roundtrip, KW_ALL[name], True, rows)


@pytest.mark.parametrize("world", world_params(2), indirect=True)
@pytest.mark.parametrize("name", ["fp16", "int4"])
def test_blocks_in_chunks_through_the_triton_kernels(world, name: str) -> None:
    """The checksum and the checked scatter as Triton kernels (the interpreter on the CPU, compiled on GPUs)."""
    world.run(_blocks_roundtrip, KW_ALL[name], True, 3, env=INTERPRET)


def _counts(ctx: RankContext, kw: dict) -> None:
    """One block, then every free block of the receiver (18, in random order, from a pool of random bytes), in
    chunks of 5 rows (36 rows: the last chunk 1)."""
    g = torch.Generator().manual_seed(9)
    if ctx.rank == 0:
        cache = make_cache(ctx.device, **kw)
        _sentinel(cache, seed=77)
        assert send_blocks(cache, [13], dst=1, chunk_bytes=5 * _row_bytes(cache))
        assert send_blocks(cache, torch.randperm(24, generator=g)[:18], dst=1, chunk_bytes=5 * _row_bytes(cache))
        return
    src_cache = make_cache(ctx.device, **kw)
    _sentinel(src_cache, seed=77)
    cache, alloc = _receiver(ctx, kw)
    before = _snapshot_state(cache)
    one = recv_blocks(cache, alloc, src=0)
    assert one == [5]
    _check_arrived(cache, before, one, src_cache, [13])
    before = _snapshot_state(cache)
    many = recv_blocks(cache, alloc, src=0)
    assert many == list(range(6, 24))  # a new allocator hands out free blocks in order
    _check_arrived(cache, before, many, src_cache, torch.randperm(24, generator=g)[:18].tolist())
    assert alloc.num_free_blocks == 0


@pytest.mark.parametrize("world", world_params(2), indirect=True)
@pytest.mark.parametrize("name", ["fp16", "int8"])
def test_one_block_and_every_free_block(world, name: str) -> None:
    world.run(_counts, KW_ALL[name])


def _large(ctx: RankContext) -> None:
    """64 MiB (8 layers x 128 blocks of 64 KiB, fp16 8 heads x 128 x 16 tokens) in the default chunks (4 of
    16 MiB): arrives bit-exact, twice (the staging of one transfer is not the next one's)."""
    kw = dict(num_layers=8, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=160)
    ids = torch.randperm(160, generator=torch.Generator().manual_seed(3))[:128].tolist()
    cache = make_cache(ctx.device, **kw)
    _sentinel(cache, seed=30 + ctx.rank)
    if ctx.rank == 0:
        assert send_blocks(cache, ids, dst=1) and send_blocks(cache, ids[::-1], dst=1)
        return
    src_cache = make_cache(ctx.device, **kw)
    _sentinel(src_cache, seed=30)
    alloc = BlockAllocator(160, 16)
    for sent in (ids, ids[::-1]):
        before = _snapshot_state(cache)
        got = recv_blocks(cache, alloc, src=0)
        _check_arrived(cache, before, got, src_cache, sent)
        alloc.free(got)


@pytest.mark.slow
@pytest.mark.parametrize("world", world_params(2), indirect=True)
def test_large_transfer_in_default_chunks(world) -> None:
    world.run(_large, timeout=120)


MISMATCH = {
    "layout": ({}, dict(layout="HND"), "layout 'NHD', expected 'HND'"),
    "kv_dtype": ({}, dict(kv_dtype="int8"), "kv_dtype 'auto', expected 'int8'"),
    "dtype": ({}, dict(dtype=torch.bfloat16), "dtype torch.float16, expected torch.bfloat16"),
    "head_dim": ({}, dict(head_dim=8), "head_dim 16, expected 8"),
    "num_kv_heads": ({}, dict(num_kv_heads=1), "num_kv_heads 2, expected 1"),
    "block_size": ({}, dict(block_size=8), "block_size 4, expected 8"),
    "num_layers": ({}, dict(num_layers=1), "num_layers 2, expected 1"),
}


def _mismatch(ctx: RankContext, name: str) -> None:
    """A rejected transfer raises on both ranks and writes nothing; the next transfer still works."""
    send_kw, recv_kw, msg = MISMATCH[name]
    if ctx.rank == 0:
        cache, table = _prefilled(ctx.device, 1, **send_kw)
        with pytest.raises(ValueError, match="dst: rank 1 rejected the blocks") as e:
            send_blocks(cache, _sent_ids(table), dst=1)
        assert name in str(e.value)
        good, gtable = _prefilled(ctx.device, 2, **recv_kw)
        assert send_blocks(good, _sent_ids(gtable)[:2], dst=1)
        return
    if ctx.rank != 1:
        return
    cache, alloc = _receiver(ctx, recv_kw)
    before, free0 = _snapshot_state(cache), alloc.num_free_blocks
    with pytest.raises(ValueError, match=f"src: rank 0 sent blocks with {msg}"):
        recv_blocks(cache, alloc, src=0)
    assert alloc.num_free_blocks == free0
    assert torch.equal(cache.buffer.view(torch.uint8), before[0])
    ids = recv_blocks(cache, alloc, src=0)
    assert ids is not None and len(ids) == 2


@pytest.mark.parametrize("world", world_params(2), indirect=True)
@pytest.mark.parametrize("name", sorted(MISMATCH))
def test_format_mismatch_rejected_on_both_ranks(world, name: str) -> None:
    world.run(_mismatch, name)


def _no_room(ctx: RankContext) -> None:
    if ctx.rank == 0:
        cache, table = _prefilled(ctx.device, 3)
        ids = _sent_ids(table)
        assert send_blocks(cache, ids, dst=1) is False  # no room: nothing sent
        assert send_blocks(cache, ids, dst=1) is True
        assert send_blocks(cache, [], dst=1) is True
        return
    cache, alloc = _receiver(ctx, {})
    held = alloc.allocate(alloc.num_free_blocks - 2)
    before = _snapshot_state(cache)
    assert recv_blocks(cache, alloc, src=0) is None
    assert alloc.num_free_blocks == 2 and torch.equal(cache.buffer.view(torch.uint8), before[0])
    alloc.free(held)
    assert len(recv_blocks(cache, alloc, src=0)) == 5
    assert recv_blocks(cache, alloc, src=0) == []


@pytest.mark.parametrize("world", world_params(2), indirect=True)
def test_allocator_full_is_a_value_on_both_ranks(world) -> None:
    world.run(_no_room)


def _fp8_scales(ctx: RankContext, kv_dtype: str = "fp8") -> None:
    kw = dict(kv_dtype=kv_dtype)
    sends = 3 if kv_dtype == "fp8k" else 2
    if ctx.rank == 0:
        cache, table = _prefilled(ctx.device, 4, **kw)
        for _ in range(sends):  # the first is sent, and the receiver refuses the scales
            assert send_blocks(cache, _sent_ids(table), dst=1)
        return
    cache, alloc = _receiver(ctx, kw)
    cache.kv_scales.mul_(2)
    before, free0 = _snapshot_state(cache), alloc.num_free_blocks
    with pytest.raises(ValueError, match="K / V scales"):
        recv_blocks(cache, alloc, src=0)
    assert alloc.num_free_blocks == free0 and torch.equal(cache.buffer.view(torch.uint8), before[0])
    ids = recv_blocks(cache, alloc, src=0, adopt_scales=True)
    src_cache, src_table = _prefilled(ctx.device, 4, **kw)
    used = [1] if kv_dtype == "fp8k" else [0, 1]  # the scales the blocks decode with: fp8k's keys carry their own
    assert torch.equal(cache.kv_scales[:, used], src_cache.kv_scales[:, used])
    _check_arrived(cache, before, ids, src_cache, _sent_ids(src_table))
    if kv_dtype == "fp8k":  # a k_scale of its own is no reason to refuse fp8k blocks, nor is it replaced
        cache.kv_scales[:, 0] = 7.0
        again = recv_blocks(cache, alloc, src=0)
        assert again is not None and len(again) == len(ids)
        assert bool((cache.kv_scales[:, 0] == 7.0).all())
        assert torch.equal(cache.kv_scales[:, 1], src_cache.kv_scales[:, 1])


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8k"])
@pytest.mark.parametrize("world", world_params(2), indirect=True)
def test_fp8_scales_checked_or_adopted(world, kv_dtype: str) -> None:
    """The layer's (k_scale, v_scale) travel with fp8 blocks (fp8k: v_scale is read, and its key scales come in
    the params pool): a receiver whose scales differ refuses the blocks, or adopts the sender's."""
    world.run(_fp8_scales, kv_dtype)


class _Sent:
    """The works of messages sent in place of one."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> bool:
        return all(w.wait() for w in self.works)


@contextlib.contextmanager
def _tampered(tamper):  # type: ignore[no-untyped-def]
    """This rank's point-to-point sends pass through ``tamper(i, tensor) -> tensors to send instead`` (``i``:
    the message's index: 0 the header, then the chunks): damage on the wire, below the transfer's code."""
    real = dist.isend
    count = [0]

    def isend(tensor, dst=None, group=None, tag=0, **kw):  # type: ignore[no-untyped-def]
        i = count[0]
        count[0] += 1
        return _Sent([real(t, dst, group=group, tag=tag, **kw) for t in tamper(i, tensor)])

    dist.isend = isend
    try:
        yield
    finally:
        dist.isend = real


def _flip(at: int, byte: int):  # type: ignore[no-untyped-def]
    def tamper(i: int, t: torch.Tensor) -> list[torch.Tensor]:
        if i != at:
            return [t]
        t = t.clone()
        t.view(torch.uint8)[byte] ^= 0x20
        return [t]
    return tamper


def _swap(a: int):  # type: ignore[no-untyped-def]
    """Messages ``a`` and ``a + 1`` sent in each other's place."""
    held: list[torch.Tensor] = []

    def tamper(i: int, t: torch.Tensor) -> list[torch.Tensor]:
        if i == a:
            held.append(t.clone())
            return []
        return [t, held.pop()] if i == a + 1 else [t]
    return tamper


DAMAGE = {  # what happens on the wire (message c + 1 is chunk c), the damaged chunks; 10 rows in 5 chunks of 2
    "byte-in-chunk-1": (_flip(2, 77), {1}),
    "trailer-of-chunk-4": (_flip(5, -12), {4}),  # lane B of the checksum the sender wrote
    "chunks-1-and-2-swapped": (_swap(2), {1, 2}),
}


def _damaged(ctx: RankContext, name: str, kw: dict) -> None:
    """A chunk damaged on the wire: the receiver names the first once every chunk is in, gives its new blocks
    back and leaves exactly this state: the damaged chunks' rows not written, the other chunks' rows written,
    every other block unchanged. The next transfer works."""
    tamper, bad = DAMAGE[name]
    if ctx.rank == 0:
        cache, table = _prefilled(ctx.device, 6, **kw)
        with _tampered(tamper):
            assert send_blocks(cache, _sent_ids(table), dst=1, chunk_bytes=2 * _row_bytes(cache))
        assert send_blocks(cache, _sent_ids(table), dst=1, chunk_bytes=2 * _row_bytes(cache))
        return
    cache, alloc = _receiver(ctx, kw)
    before, free0 = _snapshot_state(cache), alloc.num_free_blocks
    with pytest.raises(ValueError, match=rf"src: chunk {min(bad)} of 5 of the blocks from rank 0 arrived damaged.*"
                                         r"it was not written; the 5 new blocks were given back"):
        recv_blocks(cache, alloc, src=0)
    assert alloc.num_free_blocks == free0
    src_cache, src_table = _prefilled(ctx.device, 6, **kw)
    sent, new = _sent_ids(src_table), list(range(5, 10))  # the blocks a new allocator hands out next
    for pool, mine, old, theirs in _pools_of(cache, before, src_cache):
        for layer in range(cache.num_layers):
            for j, b in enumerate(new):
                want = old[layer, b] if (layer * len(new) + j) // 2 in bad else theirs[layer, sent[j]]
                assert torch.equal(mine[layer, b], want), (pool, layer, j)
        keep = [b for b in range(cache.config.num_blocks) if b not in new]
        assert torch.equal(mine[:, keep], old[:, keep])
    after = _snapshot_state(cache)
    ids = recv_blocks(cache, alloc, src=0)
    assert ids is not None and len(ids) == 5
    _check_arrived(cache, after, ids, src_cache, sent)


def _pools_of(cache, before, src_cache):  # type: ignore[no-untyped-def]
    """(name, this cache's, as before, the sender's) bytes of each pool, ``[L, num_blocks, ...]``."""
    out = [("data", cache.buffer.view(torch.uint8), before[0], src_cache.buffer.view(torch.uint8))]
    if cache.params_buffer is not None:
        out.append(("params", cache.params_buffer.view(torch.int32), before[1],
                    src_cache.params_buffer.view(torch.int32)))
    return out


@pytest.mark.parametrize("world", world_params(2), indirect=True)
@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_damaged_chunk_named_and_not_written(world, name: str) -> None:
    world.run(_damaged, name, KW_ALL["int8"])


@pytest.mark.parametrize("world", world_params(2), indirect=True)
def test_damaged_chunk_not_written_by_the_triton_kernels(world) -> None:
    world.run(_damaged, "byte-in-chunk-1", KW_ALL["fp16"], env=INTERPRET)


def _damaged_header(ctx: RankContext) -> None:
    """A header changed on the wire: refused on both ranks before anything moves; the next transfer works."""
    if ctx.rank == 0:
        cache, table = _prefilled(ctx.device, 7)
        with _tampered(_flip(0, 8 * wire.F_COUNT)), pytest.raises(ValueError, match="dst: rank 1 rejected the "
                                                                                  "blocks: the header arrived damaged"):
            send_blocks(cache, _sent_ids(table), dst=1)
        assert send_blocks(cache, _sent_ids(table), dst=1)
        return
    cache, alloc = _receiver(ctx, {})
    before, free0 = _snapshot_state(cache), alloc.num_free_blocks
    with pytest.raises(ValueError, match="src: the header of the blocks from rank 0 arrived damaged"):
        recv_blocks(cache, alloc, src=0)
    assert alloc.num_free_blocks == free0 and torch.equal(cache.buffer.view(torch.uint8), before[0])
    assert recv_blocks(cache, alloc, src=0) == list(range(5, 10))  # a new allocator hands out blocks in order


@pytest.mark.parametrize("world", world_params(2), indirect=True)
def test_damaged_header_rejected_on_both_ranks(world) -> None:
    world.run(_damaged_header)


# ------------------------------------------------------------------------------------------ snapshots


def _make_snapshots(device: torch.device) -> list[KVSnapshot]:
    g = torch.Generator().manual_seed(11)
    packed = KVSnapshot.empty([(2, 16), (2, 16), (2, 16)], 7, dtype=torch.float16, device=device)
    for t in packed.layers:
        t.copy_(torch.randn(t.shape, generator=g).half())
    mixed = KVSnapshot([torch.randn(2, h, 5, d, generator=g).to(torch.bfloat16).to(device)
                        for h, d in [(1, 8), (4, 6), (2, 80)]])
    fp8 = KVSnapshot([torch.randn(2, 3, 4, 16, generator=g).to(torch.float8_e4m3fn).to(device)])
    empty = KVSnapshot.empty([(2, 8)], 0, dtype=torch.float16, device=device)
    return [packed, mixed, fp8, empty]


def _linear(device: torch.device) -> kvcache.LinearKVCache:
    """A linear cache of two 12-token sequences of seeded values."""
    cache = kvcache.LinearKVCache(kvcache.CacheConfig(num_layers=2, max_batch_size=2, max_seq_len=16, num_kv_heads=2,
                                                      head_dim=8, dtype=torch.float16, device=device))
    g = torch.Generator().manual_seed(21)
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=g).half())
    cache.reset_for_new_sequences([12, 12])
    return cache


def _snapshots(ctx: RankContext) -> None:
    snaps = _make_snapshots(ctx.device)
    if ctx.rank == 0:
        for s in snaps:
            send_snapshot(s, dst=ctx.size - 1)
        with pytest.raises(ValueError, match="rejected the snapshot: it expects dtype torch.bfloat16"):
            send_snapshot(snaps[0], dst=ctx.size - 1)
        send_snapshot(snaps[1], dst=ctx.size - 1)  # received, then refused for its layer specs
        send_snapshot(_linear(ctx.device).save(1, 10), dst=ctx.size - 1)  # a system prompt, saved and shipped
        return
    if ctx.rank != ctx.size - 1:
        return
    for s in snaps:
        got = recv_snapshot(src=0, device=ctx.device)
        assert got.flat is not None and got.equal(s) and got.layer_specs == s.layer_specs
        assert got.device.type == ctx.device.type
    with pytest.raises(ValueError, match="src: rank 0 sent a snapshot with dtype torch.float16, expected "
                                         "torch.bfloat16"):
        recv_snapshot(src=0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"layer_specs: expected \[\(1, 8\), \(4, 6\), \(2, 64\)\]"):
        recv_snapshot(src=0, layer_specs=[(1, 8), (4, 6), (2, 64)])
    # restored into slot 0 of this rank's linear cache: the sender's slot 1, first 10 tokens
    snap = recv_snapshot(src=0, device=ctx.device, dtype=torch.float16, layer_specs=[(2, 8), (2, 8)], seq_len=10)
    mine, theirs = kvcache.LinearKVCache(kvcache.CacheConfig(num_layers=2, max_batch_size=2, max_seq_len=16,
                                                             num_kv_heads=2, head_dim=8, dtype=torch.float16,
                                                             device=ctx.device)), _linear(ctx.device)
    mine.restore(snap, 0)
    for i in range(2):
        assert torch.equal(mine.layer(i)[0, :, :, :10], theirs.layer(i)[1, :, :, :10])
        assert not mine.layer(i)[0, :, :, 10:].any() and not mine.layer(i)[1].any()


@pytest.mark.parametrize("world", world_params(2, 3), indirect=True)
def test_snapshots_arrive_bit_exact(world) -> None:
    world.run(_snapshots)


def _snapshots_in_chunks(ctx: RankContext) -> None:
    """Snapshots in chunks of 48 bytes (their data does not divide: the last chunk is padded), then one with a
    byte changed on the wire in chunk 2: named, no snapshot returned; the next transfer works."""
    snaps = _make_snapshots(ctx.device)
    if ctx.rank == 0:
        for s in snaps:
            send_snapshot(s, dst=1, chunk_bytes=48)
        with _tampered(_flip(3, 5)):
            send_snapshot(snaps[1], dst=1, chunk_bytes=64)
        send_snapshot(snaps[1], dst=1, chunk_bytes=64)
        return
    for s in snaps:
        got = recv_snapshot(src=0, device=ctx.device)
        assert got.flat is not None and got.equal(s) and got.layer_specs == s.layer_specs
    chunks = -(-snaps[1].nbytes // 64)  # 16 bytes of layer specs per layer travel in front of chunk 0
    with pytest.raises(ValueError, match=f"src: chunk 2 of {chunks} of the snapshot from rank 0 arrived damaged"):
        recv_snapshot(src=0, device=ctx.device)
    assert recv_snapshot(src=0, device=ctx.device).equal(snaps[1])


@pytest.mark.parametrize("world", world_params(2), indirect=True)
def test_snapshots_in_chunks_and_a_damaged_chunk(world) -> None:
    world.run(_snapshots_in_chunks)


# ------------------------------------------------------------------------------------------ disaggregated


def _tiny_model(device: torch.device, H: int, D: int, hq: int, vocab: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(2024)
    return {name: (torch.randn(shape, generator=g) / shape[0] ** 0.5).to(device) for name, shape in [
        ("emb", (vocab, 32)), ("wq", (32, hq * D)), ("wk", (32, H * D)), ("wv", (32, H * D)),
        ("wo", (hq * D, vocab))]}


def _step(cache, model, tokens, table, lens_before, q_lens, kv_dtype):  # type: ignore[no-untyped-def]
    """One forward of a 1-layer attention model over the new tokens; greedy next token of each sequence."""
    dev = cache.device
    H, D = cache.config.num_kv_heads, cache.config.head_dim
    x = model["emb"][tokens]
    q = (x @ model["wq"]).view(len(tokens), -1, D)
    k, v = (x @ model["wk"]).view(-1, H, D), (x @ model["wv"]).view(-1, H, D)
    c = cu(q_lens, dev)
    plan = cache.plan(table, c, ints(lens_before, dev))
    cache.append(0, k, v, plan)
    out = cache.attention(0, q, plan)
    last = c[1:].long() - 1
    logits = out.reshape(len(tokens), -1)[last] @ model["wo"]
    return logits.argmax(-1), out


def _disaggregated(ctx: RankContext, kv_dtype: str, decode_steps: int) -> list[list[int]]:
    """Prefill on rank 0, blocks sent, greedy decode on rank 1; rank 1 also runs everything alone and compares
    the tokens and every attention output."""
    kw = dict(kv_dtype=kv_dtype, num_layers=1, dtype=torch.float32, rope=True, num_blocks=16)
    H, D, hq, vocab, bs = 2, 16, 4, 50, 4
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in PROMPTS]
    model = _tiny_model(ctx.device, H, D, hq, vocab)
    cap = [-(-(n + decode_steps) // bs) for n in PROMPTS]  # blocks for prompt + decode
    tokens = torch.cat(prompts).to(ctx.device)
    if ctx.rank == 0:
        cache = make_cache(ctx.device, **kw)
        table = block_table(BlockAllocator(16, bs), cap, ctx.device)
        first, _ = _step(cache, model, tokens, table, [0, 0], PROMPTS, kv_dtype)
        send = [int(x) for b, n in enumerate(PROMPTS) for x in table[b, :-(-n // bs)].tolist()]
        assert send_blocks(cache, send, dst=1)
        torch.distributed.send(first.to(torch.int64), dst=1)  # the first generated tokens travel with the KV
        return []
    if ctx.rank != 1:
        return []
    # alone: prefill and decode in one cache
    alone = make_cache(ctx.device, **kw)
    t_alone = block_table(BlockAllocator(16, bs), cap, ctx.device, reverse=True)
    nxt, _ = _step(alone, model, tokens, t_alone, [0, 0], PROMPTS, kv_dtype)
    want, outs_alone, lens = [nxt.tolist()], [], list(PROMPTS)
    for _ in range(decode_steps):
        nxt, o = _step(alone, model, nxt, t_alone, lens, [1, 1], kv_dtype)
        want.append(nxt.tolist())
        outs_alone.append(o)
        lens = [n + 1 for n in lens]
    # disaggregated: the prompt's blocks from rank 0, decode blocks from this rank's allocator
    cache = make_cache(ctx.device, **kw)
    alloc = BlockAllocator(16, bs)
    ids = recv_blocks(cache, alloc, src=0)
    first = torch.empty(2, dtype=torch.int64, device=ctx.device)
    torch.distributed.recv(first, src=0)
    table = torch.zeros(2, max(cap), dtype=torch.int32)
    off = 0
    for b, n in enumerate(PROMPTS):
        nblk = -(-n // bs)
        table[b, :nblk] = torch.tensor(ids[off:off + nblk])
        more = alloc.allocate(cap[b] - nblk)
        table[b, nblk:cap[b]] = torch.tensor(more, dtype=torch.int32)
        off += nblk
    table = table.to(ctx.device)
    nxt, got, lens = first.to(ctx.device), [first.tolist()], list(PROMPTS)
    for i in range(decode_steps):
        nxt, o = _step(cache, model, nxt, table, lens, [1, 1], kv_dtype)
        got.append(nxt.tolist())
        assert torch.equal(o, outs_alone[i]), f"attention output of decode step {i} differs"
        lens = [n + 1 for n in lens]
    assert got == want
    return got


@pytest.mark.parametrize("world", world_params(2), indirect=True)
@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
def test_disaggregated_prefill_decode_gives_single_process_tokens(world, kv_dtype: str) -> None:
    res = world.run(_disaggregated, kv_dtype, 4)
    assert len(res[1]) == 5 and all(len(t) == 2 for t in res[1])


# ------------------------------------------------------------------------------------------ single process


def test_arguments_checked_before_any_message() -> None:
    cache = make_cache(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"block_ids: expected ids in \[0, 24\), got \[24\]"):
        send_blocks(cache, [1, 24], dst=1)
    with pytest.raises(TypeError, match="block_ids"):
        send_blocks(cache, "12", dst=1)
    with pytest.raises(TypeError, match="cache: expected a kvcache.PagedKVCache"):
        send_blocks(object(), [1], dst=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="checksum"):
        send_blocks(cache, [1], dst=1, checksum=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_bytes: expected an int >= 1, got 0"):
        send_blocks(cache, [1], dst=1, chunk_bytes=0)
    with pytest.raises(ValueError, match="chunk_bytes: expected an int <= 1073741824"):
        send_blocks(cache, [1], dst=1, chunk_bytes=(1 << 30) + 1)
    with pytest.raises(TypeError, match="chunk_bytes: expected an int"):
        send_snapshot(KVSnapshot.empty([(2, 8)], 1, dtype=torch.float16, device="cpu"), dst=1,
                      chunk_bytes=4.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allocator: expected 24 blocks of 4 tokens"):
        recv_blocks(cache, BlockAllocator(24, 8), src=0)
    with pytest.raises(TypeError, match="allocator"):
        recv_blocks(cache, None, src=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="snapshot"):
        send_snapshot(cache, dst=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype"):
        recv_snapshot(0, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="not initialized"):  # a clear error, not a hang
        send_blocks(cache, [1], dst=1)
