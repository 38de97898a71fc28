"""BlockAllocator: allocation, free, fork, copy-on-write, prefix caching, LRU eviction, errors.

Pure Python, CPU only. Expectations are built independently: hand-worked scenarios, an independent
re-implementation of the documented hash encoding, and a hypothesis state machine with a plain-Python model
(ref counts, free set, LRU list, what each block holds) checked after every step.
"""

from __future__ import annotations

import dataclasses
import doctest
import hashlib
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvcache.paged.allocator as allocator_module
import kvcache.paged.prefix_cache as prefix_cache_module
from kvcache.paged.allocator import BlockAllocator, PrefixCacheStats, hash_block_tokens, hash_blocks

ALLOCATOR_PY = Path(allocator_module.__file__)


def snapshot(a: BlockAllocator) -> dict:
    """Everything about an allocator, internal order included, copied (to compare before / after a call)."""
    return {
        "ref": [a.ref_count(b) for b in range(a.num_blocks)],
        "hash": [a.block_hash(b) for b in range(a.num_blocks)],
        "free_list": list(a._free),
        "lru": list(a._evictable),
        "hash_to_block": dict(a._hash_to_block),
        "stats": a.stats,
        "counts": (a.num_free_blocks, a.num_used_blocks, a.num_cached_blocks, a.num_evictable_blocks, a.usage),
    }


def cached_chain(a: BlockAllocator, tokens: list[int], extra_keys: tuple = ()) -> list[int]:
    """Allocate blocks for ``tokens``, register their full blocks, free them: a cached, unreferenced chain."""
    hashes = a.hash_blocks(tokens, extra_keys=extra_keys)
    blocks = a.allocate(-(-len(tokens) // a.block_size))
    a.cache_blocks(blocks[: len(hashes)], hashes)
    a.free(blocks)
    return blocks


# --------------------------------------------------------------------------------------------- construction


def test_construction_and_properties():
    a = BlockAllocator(num_blocks=6, block_size=16)
    assert a.num_blocks == 6 and a.block_size == 16 and a.enable_prefix_caching
    assert a.num_free_blocks == 6 and a.num_used_blocks == 0 and a.num_cached_blocks == 0
    assert a.num_evictable_blocks == 0 and a.usage == 0.0
    assert a.stats == PrefixCacheStats() and a.stats.hit_rate == 0.0
    assert all(a.ref_count(b) == 0 and a.block_hash(b) is None for b in range(6))
    assert "num_blocks=6" in repr(a)
    a.check_invariants()
    assert not BlockAllocator(3, 4, enable_prefix_caching=False).enable_prefix_caching
    assert BlockAllocator(np.int64(3), np.int32(2)).num_blocks == 3  # numpy ints are ints


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"num_blocks": 0, "block_size": 4}, ValueError, "num_blocks"),
        ({"num_blocks": -3, "block_size": 4}, ValueError, "num_blocks"),
        ({"num_blocks": 2.0, "block_size": 4}, TypeError, "num_blocks"),
        ({"num_blocks": "8", "block_size": 4}, TypeError, "num_blocks"),
        ({"num_blocks": True, "block_size": 4}, TypeError, "num_blocks"),
        ({"num_blocks": 8, "block_size": 0}, ValueError, "block_size"),
        ({"num_blocks": 8, "block_size": None}, TypeError, "block_size"),
        ({"num_blocks": 8, "block_size": 4, "enable_prefix_caching": 1}, TypeError, "enable_prefix_caching"),
    ],
)
def test_construction_errors(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        BlockAllocator(**kwargs)


# ---------------------------------------------------------------------------------------------- allocate


def test_allocate_fifo_and_ref_counts():
    a = BlockAllocator(5, 2)
    assert a.allocate(2) == [0, 1]
    assert a.allocate(0) == []
    assert a.allocate(3) == [2, 3, 4]
    assert all(a.ref_count(b) == 1 for b in range(5))
    assert a.num_free_blocks == 0 and a.num_used_blocks == 5 and a.usage == 1.0
    a.free([3, 1])
    assert a.usage == pytest.approx(3 / 5)
    assert a.allocate(2) == [1, 3]  # freed in reverse order, handed out first-freed first
    a.check_invariants()


def test_allocate_out_of_blocks_changes_nothing():
    a = BlockAllocator(4, 2)
    cached_chain(a, [1, 2, 3, 4])  # 2 cached evictable blocks
    a.allocate(1)
    before = snapshot(a)
    assert a.num_free_blocks == 3
    assert a.can_allocate(3) and not a.can_allocate(4)
    assert a.allocate(4) is None
    assert a.allocate(100) is None
    assert snapshot(a) == before
    a.check_invariants()


@pytest.mark.parametrize(("n", "exc"), [(-1, ValueError), (1.0, TypeError), (True, TypeError), ("2", TypeError)])
def test_allocate_errors(n, exc):
    a = BlockAllocator(4, 2)
    before = snapshot(a)
    with pytest.raises(exc, match="^n:"):
        a.allocate(n)
    with pytest.raises(exc, match="^n:"):
        a.can_allocate(n)
    assert snapshot(a) == before


def test_allocate_takes_free_blocks_before_evicting_lru():
    a = BlockAllocator(6, 2)
    first = cached_chain(a, [1, 1, 2, 2])  # blocks 0, 1
    second = cached_chain(a, [3, 3, 4, 4])  # blocks 2, 3
    assert (first, second) == ([0, 1], [2, 3])
    # LRU (oldest first): free() releases in reverse, so each chain's last block is older than its first.
    assert list(a._evictable) == [1, 0, 3, 2]
    assert a.num_free_blocks == 6 and a.num_evictable_blocks == 4 and a.num_cached_blocks == 4
    got = a.allocate(3)
    assert got == [4, 5, 1]  # the two never-cached blocks, then the least recently used cached one
    assert a.block_hash(1) is None and a.num_cached_blocks == 3 and a.stats.evictions == 1
    assert a.match_prefix(a.hash_blocks([1, 1, 2, 2])) == [0]  # chain of `first` lost its tail only
    a.check_invariants()


# ------------------------------------------------------------------------------------------------- free


def test_free_uncached_goes_to_free_list_cached_to_lru():
    a = BlockAllocator(4, 2)
    blocks = a.allocate(3)
    hashes = a.hash_blocks([5, 6, 7, 8])
    a.cache_blocks(blocks[:2], hashes)
    a.free(blocks)
    assert a.num_evictable_blocks == 2 and a.num_cached_blocks == 2
    assert list(a._free) == [3, 2] and list(a._evictable) == [1, 0]
    assert [a.ref_count(b) for b in blocks] == [0, 0, 0]
    assert a.block_hash(0) == hashes[0] and a.block_hash(2) is None
    a.check_invariants()


def test_free_shared_block_needs_every_reference():
    a = BlockAllocator(3, 2)
    blocks = a.allocate(2)
    a.fork(blocks)
    a.fork([blocks[0]])
    a.free(iter([blocks[0], blocks[0]]))  # any iterable; an id may repeat up to its ref count
    assert (a.ref_count(0), a.ref_count(1)) == (1, 2)
    a.free(blocks)
    a.free([1])
    assert a.num_used_blocks == 0 and a.num_free_blocks == 3
    a.check_invariants()


@pytest.mark.parametrize(
    ("bad", "exc", "match"),
    [
        ([0, 7], ValueError, r"block_ids: expected block ids in \[0, 4\), got 7"),
        ([-1], ValueError, "block_ids: expected block ids"),
        ([0, 2], ValueError, "block_ids: block 2 is not allocated .*double free"),
        ([0, 1, 1], ValueError, "block_ids: block 1 is freed 2 times but its ref count is 1"),
        ([0, 1.0], TypeError, "block_ids: expected an int, got float"),
        ([0, None], TypeError, "block_ids: expected an int"),
        (1, TypeError, "block_ids: expected an iterable"),
        ("01", TypeError, "block_ids: expected an iterable"),
    ],
)
def test_free_errors_change_nothing(bad, exc, match):
    a = BlockAllocator(4, 2)
    a.allocate(2)  # blocks 0, 1 held once; 2, 3 free
    before = snapshot(a)
    with pytest.raises(exc, match=match):
        a.free(bad)
    assert snapshot(a) == before
    a.check_invariants()


def test_double_free():
    a = BlockAllocator(2, 2)
    blocks = a.allocate(2)
    a.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        a.free([blocks[1]])


def test_free_order_evicts_tail_of_a_chain_first():
    a = BlockAllocator(3, 1)
    tokens = [7, 8, 9]
    cached_chain(a, tokens)
    for kept in (2, 1, 0):
        a.allocate(1)  # each eviction takes the chain's current last block
        assert a.match_prefix(a.hash_blocks(tokens)) == list(range(kept))
        a.free(list(range(kept)))
    assert a.stats.evictions == 3


# ------------------------------------------------------------------------------------------------- fork


def test_fork_shares_blocks():
    a = BlockAllocator(4, 2)
    blocks = a.allocate(2)
    assert a.fork(blocks) == blocks
    assert a.fork(np.array(blocks)) == blocks  # numpy ids are accepted, returned as ints
    assert all(type(b) is int for b in a.fork(np.array(blocks)))
    assert [a.ref_count(b) for b in blocks] == [4, 4]
    assert a.num_used_blocks == 2 and a.num_free_blocks == 2
    assert a.fork([]) == []
    a.check_invariants()


@pytest.mark.parametrize(
    ("bad", "exc", "match"),
    [
        ([0, 3], ValueError, "block_ids: block 3 is not allocated"),
        ([4], ValueError, "block_ids"),
        (["0"], TypeError, "block_ids"),
        (None, TypeError, "block_ids"),
    ],
)
def test_fork_errors_change_nothing(bad, exc, match):
    a = BlockAllocator(4, 2)
    a.allocate(2)
    before = snapshot(a)
    with pytest.raises(exc, match=match):
        a.fork(bad)
    assert snapshot(a) == before


# ---------------------------------------------------------------------------------------- copy_on_write


def test_cow_exclusive_uncached_writes_in_place():
    a = BlockAllocator(2, 2)
    (b,) = a.allocate(1)
    before = snapshot(a)
    assert a.copy_on_write(b) == b
    assert snapshot(a) == before


def test_cow_shared_block_copies():
    a = BlockAllocator(3, 2)
    (b,) = a.allocate(1)
    a.fork([b])
    new = a.copy_on_write(b)
    assert new not in (None, b)
    assert (a.ref_count(b), a.ref_count(new)) == (1, 1)
    assert a.copy_on_write(b) == b  # the other holder is now exclusive
    a.check_invariants()


def test_cow_shared_block_without_spare_returns_none():
    a = BlockAllocator(2, 2)
    blocks = a.allocate(2)
    a.fork([blocks[0]])
    before = snapshot(a)
    assert a.copy_on_write(blocks[0]) is None
    assert snapshot(a) == before


def test_cow_cached_block_copies_and_keeps_cache_entry():
    a = BlockAllocator(3, 2)
    (b,) = a.allocate(1)
    (h,) = a.hash_blocks([1, 2])
    a.cache_blocks([b], [h])
    new = a.copy_on_write(b)
    assert new not in (None, b) and a.ref_count(new) == 1 and a.block_hash(new) is None
    assert a.ref_count(b) == 0 and a.block_hash(b) == h and a.num_evictable_blocks == 1  # still matchable
    assert a.match_prefix([h]) == [b]
    a.check_invariants()


def test_cow_never_evicts_the_block_it_copies():
    a = BlockAllocator(2, 1)
    x, y = a.allocate(2)
    hx, hy = a.hash_blocks([1, 2])
    a.cache_blocks([x, y], [hx, hy])
    a.free([y])  # y cached, evictable; x held and cached; no free block
    new = a.copy_on_write(x)
    assert new == y and a.block_hash(y) is None and a.stats.evictions == 1
    assert a.ref_count(x) == 0 and a.block_hash(x) == hx  # x now the evictable cached block
    a.check_invariants()


def test_cow_exclusive_cached_block_without_spare_drops_hash_in_place():
    a = BlockAllocator(1, 2)
    (b,) = a.allocate(1)
    (h,) = a.hash_blocks([1, 2])
    a.cache_blocks([b], [h])
    assert a.copy_on_write(b) == b
    assert a.block_hash(b) is None and a.num_cached_blocks == 0 and a.ref_count(b) == 1
    assert a.stats.evictions == 0  # not an eviction: the holder keeps the block
    a.free([b])
    assert a.match_prefix([h]) == []
    a.check_invariants()


def test_cow_shared_cached_block_without_spare_returns_none():
    a = BlockAllocator(1, 2)
    (b,) = a.allocate(1)
    a.cache_blocks([b], a.hash_blocks([1, 2]))
    a.fork([b])
    before = snapshot(a)
    assert a.copy_on_write(b) is None
    assert snapshot(a) == before


@pytest.mark.parametrize(
    ("bad", "exc", "match"),
    [
        (1, ValueError, "block_id: block 1 is not allocated"),
        (2, ValueError, "block_id: expected block ids"),
        (-1, ValueError, "block_id"),
        (0.0, TypeError, "block_id"),
        ([0], TypeError, "block_id"),
    ],
)
def test_cow_errors_change_nothing(bad, exc, match):
    a = BlockAllocator(2, 2)
    a.allocate(1)
    before = snapshot(a)
    with pytest.raises(exc, match=match):
        a.copy_on_write(bad)
    assert snapshot(a) == before


# ------------------------------------------------------------------------------------------------ hashing


def reference_block_hash(parent: int | None, tokens: list[int]) -> int:
    """The documented encoding, re-implemented for a block without extra keys."""
    parent_bytes = b"n" if parent is None else b"p" + struct.pack("<Q", parent)
    data = (
        b"kvcache.paged.block-hash.v1\x00"
        + parent_bytes
        + b"k"
        + struct.pack("<I", len(tokens))
        + struct.pack(f"<{len(tokens)}q", *tokens)
        + b"t"
        + struct.pack("<I", 0)
    )
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def test_hash_blocks_matches_reference_encoding():
    tokens = [101, 7, 2**40, 0, 5, 9, 3]
    hashes = hash_blocks(tokens, 3)
    assert len(hashes) == 2  # the partial block (token 3) has no hash
    parent = None
    for i, h in enumerate(hashes):
        parent = reference_block_hash(parent, tokens[3 * i : 3 * i + 3])
        assert h == parent
        assert 0 <= h < 2**64


def test_hash_golden_value():
    # Hashes are a cross-process, cross-version contract (a scheduler and its workers, persisted caches).
    # Changing the encoding must change the version tag in allocator.py and this value together.
    assert hash_blocks([1, 2, 3, 4], 4) == [reference_block_hash(None, [1, 2, 3, 4])]
    assert hash_blocks([1, 2, 3, 4], 4) == [0xFA326E89723875A4]


def test_hash_chain_properties():
    t = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    full = hash_blocks(t, 2)
    assert len(full) == 4 and len(set(full)) == 4
    assert hash_blocks(t, 2) == full  # deterministic
    assert hash_blocks(t[:4], 2) == full[:2]  # a prefix's chain is a prefix of the chain
    assert hash_blocks(t[4:], 2, parent_hash=full[1]) == full[2:]  # chains continue
    assert [hash_block_tokens(p, t[2 * i : 2 * i + 2]) for i, p in enumerate([None, *full[:3]])] == full
    assert hash_blocks(t[:1], 2) == [] and hash_blocks([], 2) == []
    # the same block after a different prefix hashes differently
    assert hash_blocks([0, 0, 4, 1], 2)[1] != full[1]
    assert hash_blocks(tuple(t), 2) == full and hash_blocks(np.array(t), 2) == full
    assert hash_blocks([np.int64(x) for x in t], 2) == full


def test_hash_extra_keys():
    t = [1, 2, 3, 4]
    base = hash_blocks(t, 2)
    variants = [
        ("lora", 1),
        ("lora", 2),
        ("salt", "x"),
        (1,),
        ("1",),
        (1.0,),
        (True,),
        (None,),
        (b"1",),
        ((1, 2),),
        (1, 2),
        ("mm", bytes(32)),
    ]
    hashes = [tuple(hash_blocks(t, 2, extra_keys=k)) for k in variants]
    assert len(set(hashes + [tuple(base)])) == len(variants) + 1  # all distinct, none equal to no keys
    assert hash_blocks(t, 2, extra_keys=("lora", 1)) == hash_blocks(t, 2, extra_keys=["lora", np.int32(1)])
    assert hash_blocks(t, 2, extra_keys=()) == base


def test_hash_is_stable_across_processes_and_needs_no_torch():
    """The allocator module loads without torch, and hashes do not depend on PYTHONHASHSEED."""
    code = (
        "import importlib.util, sys, types\n"
        "sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        # the allocator and its block_hash module as a bare package: kvcache/paged/__init__.py imports torch
        f"pkg = sys.modules['alloc'] = types.ModuleType('alloc'); pkg.__path__ = [{str(ALLOCATOR_PY.parent)!r}]\n"
        f"spec = importlib.util.spec_from_file_location('alloc.allocator', {str(ALLOCATOR_PY)!r})\n"
        "m = sys.modules['alloc.allocator'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "a = m.BlockAllocator(4, 2)\n"
        "print(a.hash_blocks([5, 6, 7, 8, 9], extra_keys=('lora', 3, 'salt')))\n"
    )
    want = str(hash_blocks([5, 6, 7, 8, 9], 2, extra_keys=("lora", 3, "salt")))
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == want


def test_allocator_module_imports_no_torch():
    for path in (ALLOCATOR_PY, ALLOCATOR_PY.parent / "block_hash.py", ALLOCATOR_PY.parent / "prefix_cache.py"):
        source = path.read_text()
        assert "import torch" not in source and "from torch" not in source


@pytest.mark.parametrize(
    ("call", "exc", "name"),
    [
        (lambda: hash_blocks([1, 2], 0), ValueError, "block_size"),
        (lambda: hash_blocks([1, 2], 2.0), TypeError, "block_size"),
        (lambda: hash_blocks([1, 2.5], 2), TypeError, "token_ids"),
        (lambda: hash_blocks([1, 2**63], 2), ValueError, "token_ids"),
        (lambda: hash_blocks("ab", 1), TypeError, "token_ids"),
        (lambda: hash_blocks(5, 1), TypeError, "token_ids"),
        (lambda: hash_blocks([1, 2], 2, extra_keys="lora"), TypeError, "extra_keys"),
        (lambda: hash_blocks([1, 2], 2, extra_keys=(object(),)), TypeError, "extra_keys"),
        (lambda: hash_blocks([1, 2], 2, extra_keys=({"a": 1},)), TypeError, "extra_keys"),
        (lambda: hash_blocks([1, 2], 2, parent_hash=-1), ValueError, "parent_hash"),
        (lambda: hash_blocks([1, 2], 2, parent_hash=2**64), ValueError, "parent_hash"),
        (lambda: hash_blocks([1, 2], 2, parent_hash="0"), TypeError, "parent_hash"),
        (lambda: hash_block_tokens(None, [1, None]), TypeError, "token_ids"),
    ],
)
def test_hash_errors(call, exc, name):
    with pytest.raises(exc, match=name):
        call()


def test_method_hash_blocks_uses_block_size():
    a = BlockAllocator(2, 3, enable_prefix_caching=False)
    t = [1, 2, 3, 4, 5, 6, 7]
    assert a.hash_blocks(t, extra_keys=(1,)) == hash_blocks(t, 3, extra_keys=(1,))


# ------------------------------------------------------------------------------------------- prefix cache


def test_match_prefix_counts_and_revives():
    a = BlockAllocator(6, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = a.hash_blocks(tokens)
    assert a.match_prefix(hashes) == []
    assert a.stats == PrefixCacheStats(queries=1, hits=0, misses=3)
    blocks = cached_chain(a, tokens)
    assert a.num_evictable_blocks == 3
    got = a.match_prefix(hashes)
    assert got == blocks and [a.ref_count(b) for b in got] == [1, 1, 1]
    assert a.num_evictable_blocks == 0 and a.num_used_blocks == 3
    assert a.match_prefix(hashes[:2]) == blocks[:2]  # referenced blocks match too: shared
    assert [a.ref_count(b) for b in got] == [2, 2, 1]
    assert a.stats == PrefixCacheStats(queries=3, hits=5, misses=3)
    assert a.stats.hit_rate == pytest.approx(5 / 8)
    a.reset_stats()
    assert a.stats == PrefixCacheStats()
    a.check_invariants()


def test_match_prefix_stops_at_first_miss():
    a = BlockAllocator(6, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = a.hash_blocks(tokens)
    blocks = a.allocate(3)
    a.cache_blocks([blocks[0], blocks[2]], [hashes[0], hashes[2]])  # block 1 never cached
    a.free(blocks)
    assert a.match_prefix(hashes) == [blocks[0]]
    assert a.stats == PrefixCacheStats(queries=1, hits=1, misses=2)
    assert a.match_prefix(hashes[1:]) == []  # hash 1 missing: nothing after it counts
    assert a.match_prefix([]) == []
    assert a.stats == PrefixCacheStats(queries=3, hits=1, misses=4)


def test_match_prefix_respects_extra_keys():
    a = BlockAllocator(4, 2)
    cached_chain(a, [1, 2, 3, 4], extra_keys=("lora", 1))
    assert a.match_prefix(a.hash_blocks([1, 2, 3, 4])) == []
    assert a.match_prefix(a.hash_blocks([1, 2, 3, 4], extra_keys=("lora", 2))) == []
    assert a.match_prefix(a.hash_blocks([1, 2, 3, 4], extra_keys=("lora", 1))) == [0, 1]


@pytest.mark.parametrize(
    ("bad", "exc"), [([1.5], TypeError), (["a"], TypeError), ([-1], ValueError), ([2**64], ValueError), (3, TypeError)]
)
def test_match_prefix_errors_change_nothing(bad, exc):
    a = BlockAllocator(4, 2)
    cached_chain(a, [1, 2, 3, 4])
    query = a.hash_blocks([1, 2]) + bad if isinstance(bad, list) else bad  # a valid hit, then a bad hash
    before = snapshot(a)
    with pytest.raises(exc, match="block_hashes"):
        a.match_prefix(query)
    assert snapshot(a) == before


def test_cache_blocks_keeps_existing_entry_for_duplicate_hash():
    a = BlockAllocator(4, 2)
    hashes = a.hash_blocks([1, 2, 3, 4])
    x = a.allocate(2)
    y = a.allocate(2)  # another request computed the same prefix concurrently
    a.cache_blocks(x, hashes)
    a.cache_blocks(y, hashes)
    assert [a.block_hash(b) for b in x] == hashes and [a.block_hash(b) for b in y] == [None, None]
    a.cache_blocks(x, hashes)  # re-registering is a no-op
    a.free(y)
    assert a.num_evictable_blocks == 0 and a.num_cached_blocks == 2  # y went back to the free list
    a.free(x)
    assert a.match_prefix(hashes) == x
    a.check_invariants()


CACHE_BLOCKS_ERRORS = [
    ([0, 1], [11], ValueError, "block_hashes: expected one hash per block"),
    ([0, 2], [11, 12], ValueError, "block_ids: block 2 is not allocated"),
    ([0, 9], [11, 12], ValueError, "block_ids: expected block ids"),
    ([0, 0], [11, 12], ValueError, "block_hashes: block 0 is given two hashes"),
    ([0], [-5], ValueError, "block_hashes"),
    ([0], [1.0], TypeError, "block_hashes"),
    ([0.0], [11], TypeError, "block_ids"),
    ([0], 11, TypeError, "block_hashes"),
]


@pytest.mark.parametrize(
    ("ids", "hashes", "exc", "match", "caching"),
    [(*case, caching) for case in CACHE_BLOCKS_ERRORS for caching in (True, False)]
    + [([1], [12], ValueError, "block_hashes: block 1 is already cached under hash 99", True)],
)
def test_cache_blocks_errors_change_nothing(ids, hashes, exc, match, caching):
    """Validated the same with prefix caching on or off (block 1 is cached under hash 99 when on)."""
    a = BlockAllocator(4, 2, enable_prefix_caching=caching)
    a.allocate(2)
    a.cache_blocks([1], [99])
    before = snapshot(a)
    with pytest.raises(exc, match=match):
        a.cache_blocks(ids, hashes)
    assert snapshot(a) == before


def test_prefix_caching_disabled():
    a = BlockAllocator(4, 2, enable_prefix_caching=False)
    hashes = a.hash_blocks([1, 2, 3, 4])
    blocks = a.allocate(2)
    a.cache_blocks(blocks, hashes)
    assert [a.block_hash(b) for b in blocks] == [None, None] and a.num_cached_blocks == 0
    a.free(blocks)
    assert a.num_evictable_blocks == 0 and list(a._free) == [2, 3, 1, 0]
    assert a.match_prefix(hashes) == []
    assert a.stats == PrefixCacheStats()  # nothing counted
    assert a.copy_on_write(a.allocate(1)[0]) is not None
    assert a.reset_prefix_cache() is False
    a.check_invariants()


def test_reset_prefix_cache():
    a = BlockAllocator(6, 2)
    assert a.reset_prefix_cache() is False
    cached_chain(a, [1, 2, 3, 4])  # blocks 0, 1: cached, unreferenced
    held = a.allocate(1)
    (h,) = a.hash_blocks([9, 9])
    a.cache_blocks(held, [h])  # cached and referenced
    stats = a.stats
    assert a.reset_prefix_cache() is True
    assert a.num_cached_blocks == 0 and a.num_evictable_blocks == 0 and a.num_free_blocks == 5
    assert all(a.block_hash(b) is None for b in range(6)) and a.ref_count(held[0]) == 1
    assert a.stats == stats
    a.free(held)
    assert a.num_evictable_blocks == 0  # no hash any more: back to the free list
    assert a.match_prefix(a.hash_blocks([1, 2, 3, 4])) == [] and a.match_prefix([h]) == []
    assert a.reset_prefix_cache() is False
    a.check_invariants()


# -------------------------------------------------------------------------------------------- invariants


def _corrupt_ref(a):
    a._ref[3] = 1  # a free-listed block with a reference


def _corrupt_negative(a):
    a._ref[3] = -1


def _corrupt_leak(a):
    a._free.remove(3)  # not in any state


def _corrupt_hash_map(a):
    a._hash_to_block[12345] = 0  # held, uncached block 0 named by a hash


def _corrupt_block_hash(a):
    a._hash[0] = 777  # held block 0 claims a hash the map does not hold


def _corrupt_free_hash(a):
    a._hash[3] = 5
    a._hash_to_block[5] = 3


def _corrupt_lru_no_hash(a):
    a._free.remove(3)
    a._evictable[3] = None


def _corrupt_counter(a):
    a._num_used += 1


def _corrupt_twice(a):
    a._free.append(3)


def _corrupt_both(a):
    a._evictable[3] = None


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_ref,
        _corrupt_negative,
        _corrupt_leak,
        _corrupt_hash_map,
        _corrupt_block_hash,
        _corrupt_free_hash,
        _corrupt_lru_no_hash,
        _corrupt_counter,
        _corrupt_twice,
        _corrupt_both,
    ],
)
def test_check_invariants_detects_corruption(corrupt):
    a = BlockAllocator(4, 2)
    a.allocate(1)  # block 0 held; 1, 2, 3 free
    a.check_invariants()
    corrupt(a)
    with pytest.raises(RuntimeError, match="corrupted"):
        a.check_invariants()


def test_module_doctest():
    result = doctest.testmod(allocator_module)
    assert result.attempted > 0 and result.failed == 0
    # the prefix cache's methods (listener, lookup) live in its mixin module; their examples use the allocator
    result = doctest.testmod(prefix_cache_module, extraglobs={"BlockAllocator": BlockAllocator})
    assert result.attempted > 0 and result.failed == 0


def test_large_pool_is_linear_time():
    """Every operation is O(1) per block: a 100k-block workload with revivals from the middle of the LRU
    finishes in about a second (an O(n) list/deque removal would take minutes)."""
    n = 100_000
    a = BlockAllocator(n, 1)
    blocks = a.allocate(n)
    hashes = list(range(n))
    a.cache_blocks(blocks, hashes)
    t0 = time.perf_counter()
    a.free(blocks)
    for i in range(0, n, 2):  # revive every other block: removals from the middle of the LRU
        assert a.match_prefix([hashes[i]]) == [i]
    assert a.allocate(n // 2) is not None  # evicts the other half
    a.free(range(0, n, 2))
    elapsed = time.perf_counter() - t0
    a.check_invariants()
    assert elapsed < 20, f"{elapsed:.1f} s for {n} blocks"


# ------------------------------------------------------------------------------------ state machine


@dataclasses.dataclass
class Seq:
    tokens: list[int]
    blocks: list[int]
    extra: tuple


EXTRA_KEYS = [(), ("lora", 1)]
# Requests start with one of a few "system prompts" and go on with random tokens of a 2-letter alphabet, so
# prefixes collide often (hits, shared blocks) and sometimes diverge inside a block.
SYSTEM_PROMPTS = [(), (1, 0, 1, 1, 0, 0), (0, 0, 0, 1)]
PROMPTS = st.builds(
    lambda head, tail: [*head, *tail],
    st.sampled_from(SYSTEM_PROMPTS),
    st.lists(st.integers(0, 1), max_size=4),
).filter(bool)


class AllocatorMachine(RuleBasedStateMachine):
    """Random sequences of requests against a plain-Python model of the allocator.

    The model tracks ref counts, the free set, the LRU list of cached unreferenced blocks, the registered
    hashes, and what each block holds on the "device" (the token prefix through the block and the extra keys
    it was computed with). Writes only ever go into blocks that copy_on_write made exclusive.
    """

    @initialize(
        num_blocks=st.integers(2, 16), block_size=st.integers(1, 3), caching=st.sampled_from([True, True, False])
    )
    def setup(self, num_blocks, block_size, caching):
        self.a = BlockAllocator(num_blocks, block_size, enable_prefix_caching=caching)
        self.n, self.bs, self.caching = num_blocks, block_size, caching
        self.ref = [0] * num_blocks
        self.free_set = set(range(num_blocks))
        self.lru: list[int] = []  # cached, unreferenced; oldest first
        self.hash: dict[int, int] = {}  # block -> hash
        self.map: dict[int, int] = {}  # hash -> block
        self.prefix: dict[int, tuple] = {}  # block -> tokens of its chain through the block's end
        self.extra: dict[int, tuple] = {}  # block -> extra keys its content was computed with
        self.seqs: list[Seq] = []
        self.stats = PrefixCacheStats()

    # model operations ---------------------------------------------------------------------------

    def m_available(self) -> int:
        return len(self.free_set) + len(self.lru)

    def m_allocated(self, got: list[int], n: int) -> None:
        """Check what allocate(n) returned against the model and apply it."""
        assert len(got) == n and len(set(got)) == n
        k = min(n, len(self.free_set))
        assert set(got[:k]) <= self.free_set, "free blocks must be taken first"
        assert got[k:] == self.lru[: n - k], "then the least recently used cached blocks"
        self.free_set -= set(got[:k])
        del self.lru[: n - k]
        for b in got[k:]:
            del self.map[self.hash.pop(b)]
            self.stats.evictions += 1
        for b in got:
            self.ref[b] = 1
            self.prefix[b] = None  # fresh block: content undefined
            self.extra[b] = None

    def m_release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self.hash:
                self.lru.append(b)
            else:
                self.free_set.add(b)

    def m_write(self, seq: Seq, i: int) -> None:
        """The device writes block i of seq: it must be exclusive and uncached."""
        b = seq.blocks[i]
        assert self.a.ref_count(b) == 1, f"write into shared block {b}"
        assert self.a.block_hash(b) is None, f"write into cached block {b}"
        self.prefix[b] = tuple(seq.tokens[: min((i + 1) * self.bs, len(seq.tokens))])
        self.extra[b] = seq.extra

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.bs)

    def pick(self, idx: int) -> Seq:
        return self.seqs[idx % len(self.seqs)]

    def cow(self, seq: Seq, i: int) -> bool:
        """copy_on_write of block i of seq, checked against the model; False when out of blocks."""
        b = seq.blocks[i]
        before = snapshot(self.a)
        exclusive = self.ref[b] == 1 and b not in self.hash
        available = self.m_available()
        got = self.a.copy_on_write(b)
        if exclusive:
            assert got == b and snapshot(self.a) == before
        elif available:
            assert got is not None and got != b
            self.m_allocated([got], 1)
            self.prefix[got], self.extra[got] = self.prefix[b], self.extra[b]  # the caller's device copy
            self.m_release(b)
            seq.blocks[i] = got
        elif self.ref[b] == 1:  # exclusive, cached, nothing spare: the hash is dropped, written in place
            assert got == b
            del self.map[self.hash.pop(b)]
        else:
            assert got is None and snapshot(self.a) == before
            return False
        return True

    # rules -----------------------------------------------------------------------------------

    @rule(
        tokens=PROMPTS,
        extra=st.sampled_from(EXTRA_KEYS),
        cache=st.booleans(),
    )
    def new_sequence(self, tokens, extra, cache):
        """A request: match its prefix, allocate the rest, write it (prefill), maybe publish its full blocks."""
        hashes = self.a.hash_blocks(tokens, extra_keys=extra)
        got = self.a.match_prefix(hashes)
        expect = []
        if self.caching:
            for h in hashes:
                if h not in self.map:
                    break
                expect.append(self.map[h])
            self.stats.queries += 1
            self.stats.hits += len(expect)
            self.stats.misses += len(hashes) - len(expect)
        assert got == expect
        for i, b in enumerate(got):  # a hit holds exactly this prefix, computed with these extra keys
            assert self.prefix[b] == tuple(tokens[: (i + 1) * self.bs]) and self.extra[b] == extra
            if self.ref[b] == 0:
                self.lru.remove(b)
            self.ref[b] += 1
        need = self.num_blocks_for(len(tokens)) - len(got)
        new = self.a.allocate(need)
        if new is None:
            assert need > self.m_available()
            self.a.free(got)
            for b in reversed(got):
                self.m_release(b)
            return
        self.m_allocated(new, need)
        seq = Seq(list(tokens), got + new, extra)
        self.seqs.append(seq)
        for i in range(len(got), len(seq.blocks)):
            self.m_write(seq, i)
        if cache:
            self.m_cache(seq)

    @precondition(lambda self: self.seqs)
    @rule(idx=st.integers(0, 100), tokens=st.lists(st.integers(0, 1), min_size=1, max_size=4), cache=st.booleans())
    def append_tokens(self, idx, tokens, cache):
        """Decode / chunked prefill: copy-on-write the partial last block, allocate what else is needed."""
        seq = self.pick(idx)
        length = len(seq.tokens)
        if length % self.bs and not self.cow(seq, len(seq.blocks) - 1):
            return  # the partial last block is shared and no block is free
        need = self.num_blocks_for(length + len(tokens)) - len(seq.blocks)
        new = self.a.allocate(need)
        if new is None:
            assert need > self.m_available()
            tokens = tokens[: len(seq.blocks) * self.bs - length]  # what fits in the blocks held
        else:
            self.m_allocated(new, need)
            seq.blocks += new
        seq.tokens += tokens
        for i in range(length // self.bs, self.num_blocks_for(len(seq.tokens))):
            self.m_write(seq, i)
        if cache:
            self.m_cache(seq)

    @precondition(lambda self: self.seqs)
    @rule(idx=st.integers(0, 100), token=st.integers(0, 1))
    def rewrite_last_token(self, idx, token):
        """Overwrite the last token (resampling, rejected speculation): needs copy-on-write."""
        seq = self.pick(idx)
        i = len(seq.blocks) - 1
        if self.cow(seq, i):
            seq.tokens[-1] = token
            self.m_write(seq, i)

    @precondition(lambda self: self.seqs)
    @rule(idx=st.integers(0, 100))
    def fork(self, idx):
        seq = self.pick(idx)
        assert self.a.fork(seq.blocks) == seq.blocks
        for b in seq.blocks:
            self.ref[b] += 1
        self.seqs.append(Seq(list(seq.tokens), list(seq.blocks), seq.extra))

    def m_free_sequence(self, i: int) -> None:
        seq = self.seqs.pop(i)
        self.a.free(seq.blocks)
        for b in reversed(seq.blocks):
            self.m_release(b)

    @precondition(lambda self: self.seqs)
    @rule(idx=st.integers(0, 100))
    def free_sequence(self, idx):
        self.m_free_sequence(idx % len(self.seqs))

    @precondition(lambda self: self.seqs and self.m_available() < 3)
    @rule()
    def finish_oldest_when_short(self):
        """A scheduler finishes (or preempts) its oldest request when blocks run short."""
        self.m_free_sequence(0)

    @precondition(lambda self: self.seqs)
    @rule(idx=st.integers(0, 100))
    def cache_full_blocks(self, idx):
        self.m_cache(self.pick(idx))

    def m_cache(self, seq: Seq) -> None:
        """Publish seq's full blocks (cache_blocks) and apply it to the model."""
        hashes = self.a.hash_blocks(seq.tokens, extra_keys=seq.extra)
        blocks = seq.blocks[: len(hashes)]
        self.a.cache_blocks(blocks, hashes)
        if not self.caching:
            return
        for b, h in zip(blocks, hashes):
            if b in self.hash:
                assert self.hash[b] == h
            elif h not in self.map:
                self.hash[b], self.map[h] = h, b

    @rule(roll=st.integers(0, 9))
    def reset_prefix_cache(self, roll):
        if roll != 7:  # rare (7, not 0: hypothesis favours boundary values): a reset wipes the cache
            return
        assert self.a.reset_prefix_cache() == bool(self.map)
        self.hash.clear()
        self.map.clear()
        self.free_set.update(self.lru)
        self.lru.clear()

    @rule(block=st.integers(0, 9), op=st.sampled_from(["free", "free_twice", "fork", "cow", "cache"]))
    def misuse(self, block, op):
        """Double frees and operations on blocks nobody holds raise ValueError and change nothing."""
        b = block % self.n
        if op == "free_twice":
            if self.ref[b] != 1:
                return
        elif self.ref[b] != 0:
            return
        before = snapshot(self.a)
        with pytest.raises(ValueError, match="block_id"):
            if op == "free":
                self.a.free([b])
            elif op == "free_twice":
                self.a.free([b, b])
            elif op == "fork":
                self.a.fork([b])
            elif op == "cow":
                self.a.copy_on_write(b)
            else:
                self.a.cache_blocks([b], [1])
        assert snapshot(self.a) == before

    # invariants --------------------------------------------------------------------------------

    @invariant()
    def allocator_matches_model(self):
        a = self.a
        a.check_invariants()
        used = sum(r > 0 for r in self.ref)
        assert len(self.free_set) + len(self.lru) + used == self.n, "leak in the model"
        assert a.num_free_blocks == len(self.free_set) + len(self.lru)
        assert a.num_used_blocks == used and a.num_evictable_blocks == len(self.lru)
        assert a.num_cached_blocks == len(self.map)
        holders = [0] * self.n
        for seq in self.seqs:
            for b in seq.blocks:
                holders[b] += 1
        assert holders == self.ref, "every reference belongs to a live sequence"
        for b in range(self.n):
            assert a.ref_count(b) == self.ref[b]
            assert a.block_hash(b) == self.hash.get(b)
        assert a.stats == self.stats

    @invariant()
    def contents_match_sequences_and_hash_chains(self):
        for seq in self.seqs:
            assert len(seq.blocks) == self.num_blocks_for(len(seq.tokens))
            for i, b in enumerate(seq.blocks):
                assert self.prefix[b] == tuple(seq.tokens[: min((i + 1) * self.bs, len(seq.tokens))])
                assert self.extra[b] == seq.extra
        for b, h in self.hash.items():  # cached content always matches its hash chain
            p = self.prefix[b]
            assert p and len(p) % self.bs == 0, f"cached block {b} is not full"
            assert hash_blocks(p, self.bs, extra_keys=self.extra[b])[-1] == h


AllocatorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestAllocatorStateMachine = AllocatorMachine.TestCase
