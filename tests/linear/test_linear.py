"""LinearKVCache: layout and views, lengths / reset / commit, eviction, save / restore, on both backends.

Expectations are built independently (clones taken before a call, plain indexing, Python lists); every
comparison of cache data is bit-exact on integer views.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache import CacheConfig, KVSnapshot, LinearKVCache

from . import (
    KV_DTYPES,
    assert_evicted,
    assert_unchanged,
    beq,
    bits,
    cache_layers,
    capture,
    fill_cache,
    fill_random,
    random_like,
)

L, B, S, H, D = 3, 5, 12, 2, 24


def make_cache(device, dtype=torch.float16, *, num_layers=L, max_batch_size=B, max_seq_len=S,
               num_kv_heads=H, head_dim=D, seed=0, fill=True):
    cfg = CacheConfig(num_layers=num_layers, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device)
    cache = LinearKVCache(cfg)
    gen = torch.Generator().manual_seed(seed)
    if fill:
        fill_cache(cache, gen)
    return cache, gen


def i32(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


# ------------------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_buffer_layout(device, dtype):
    cache, _ = make_cache(device, dtype, fill=False)
    buf = cache.buffer
    assert tuple(buf.shape) == (L, B, 2, H, S, D)
    assert buf.dtype == dtype
    assert buf.device.type == torch.device(device).type
    assert buf.is_contiguous()
    assert not bits(buf).any(), "a new cache is zero-initialised"
    assert cache.num_layers == L and cache.max_batch_size == B and cache.max_seq_len == S
    assert cache.dtype == dtype
    assert cache.config.shape == tuple(buf.shape)
    assert cache.active_batch_size == 0
    assert cache.lengths.shape == (0,)
    assert cache.all_empty


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_layer_and_kv_views_share_memory(device, dtype):
    cache, gen = make_cache(device, dtype, fill=False)
    for i in range(L):
        layer = cache.layer(i)
        assert tuple(layer.shape) == (B, 2, H, S, D)
        assert layer.data_ptr() == cache.buffer[i].data_ptr()
        k, v = cache.kv(i)
        assert tuple(k.shape) == (B, H, S, D) and tuple(v.shape) == (B, H, S, D)
        assert k.dtype == dtype and v.dtype == dtype

        # write through k and v, read through layer and buffer
        new_k, new_v = random_like(k, gen), random_like(v, gen)
        k.copy_(new_k)
        v.copy_(new_v)
        assert beq(layer[:, 0], new_k) and beq(layer[:, 1], new_v)
        assert beq(cache.buffer[i, :, 0], new_k) and beq(cache.buffer[i, :, 1], new_v)

        # write one token through the layer, read it through a fresh kv(i)
        tok = random_like(layer[2, :, :, 5], gen)
        layer[2, :, :, 5] = tok
        k2, v2 = cache.kv(i)
        assert beq(k2[2, :, 5], tok[0]) and beq(v2[2, :, 5], tok[1])

        # write through the buffer, read through kv
        whole = random_like(cache.buffer[i], gen)
        cache.buffer[i].copy_(whole)
        assert beq(k2, whole[:, 0]) and beq(v2, whole[:, 1])
    # layers do not overlap: writing layer 0 leaves the others alone
    before = [bits(cache.layer(i)).clone() for i in range(1, L)]
    fill_random(cache.layer(0), gen)
    for i in range(1, L):
        assert torch.equal(bits(cache.layer(i)), before[i - 1])


def test_layer_index_validation(device):
    cache, _ = make_cache(device, fill=False)
    for bad in (L, L + 5, -1):
        with pytest.raises(ValueError, match="i"):
            cache.layer(bad)
        with pytest.raises(ValueError):
            cache.kv(bad)
    for bad in (1.0, "1", None, True):
        with pytest.raises(TypeError):
            cache.layer(bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- lengths


def test_lengths_are_a_static_device_view(device):
    cache, _ = make_cache(device, fill=False)
    buf = cache.lengths_buffer
    assert buf.shape == (B,) and buf.dtype == torch.int32
    ptr = buf.data_ptr()

    def check(expected):
        lengths = cache.lengths
        assert lengths.dtype == torch.int32
        assert lengths.device.type == torch.device(device).type
        assert lengths.tolist() == expected
        # a view of the static storage (an empty view's data_ptr() is 0, its storage is still the buffer)
        assert lengths.untyped_storage().data_ptr() == ptr and lengths.storage_offset() == 0
        assert cache.lengths_buffer.data_ptr() == ptr
        assert cache.lengths_buffer[: len(expected)].tolist() == expected

    check([])
    cache.reset_for_new_sequences([3, 0, 5, 1])
    check([3, 0, 5, 1])
    cache.commit(2)
    check([5, 2, 7, 3])
    cache.commit(i32([1, 0, 4, 2]))
    check([6, 2, 11, 5])
    cache.evict([False, True, False, False])
    check([6, 11, 5])
    cache.active_batch_size = 2
    check([6, 11])
    cache.reset_for_new_sequences([1])
    check([1])


def test_active_batch_size_setter(device):
    cache, _ = make_cache(device, fill=False)
    cache.reset_for_new_sequences([4, 3, 2])
    for n in (0, 2, 1):
        cache.active_batch_size = n
        assert cache.active_batch_size == n
        assert cache.lengths.tolist() == [4, 3, 2][:n]
    cache.active_batch_size = B
    assert cache.active_batch_size == B and cache.lengths.shape == (B,)
    assert cache.lengths[:3].tolist() == [4, 3, 2]


@pytest.mark.parametrize("bad,exc", [(B + 1, ValueError), (-1, ValueError), (100, ValueError),
                                     (1.0, TypeError), ("2", TypeError), (True, TypeError),
                                     (torch.tensor(2), TypeError)])
def test_active_batch_size_invalid(device, bad, exc):
    cache, _ = make_cache(device)
    cache.reset_for_new_sequences([4, 3, 2])
    before = capture(cache)
    with pytest.raises(exc, match="active_batch_size"):
        cache.active_batch_size = bad
    assert_unchanged(cache, before)


def test_all_empty(device):
    cache, _ = make_cache(device, fill=False)
    assert cache.all_empty
    cache.reset_for_new_sequences([0, 0, 0])
    assert cache.all_empty
    cache.commit(0)
    assert cache.all_empty
    cache.commit(i32([0, 0, 0]))
    assert cache.all_empty
    cache.commit(i32([0, 2, 0]))
    assert not cache.all_empty
    cache.reset_for_new_sequences([0, 0])
    assert cache.all_empty
    cache.commit(1)
    assert not cache.all_empty
    cache.reset_for_new_sequences([0, 3])
    assert not cache.all_empty
    cache.reset_for_new_sequences([])
    assert cache.all_empty
    cache.reset_for_new_sequences([S])
    assert not cache.all_empty


# ------------------------------------------------------------------------------------------- reset


def test_reset_for_new_sequences(device):
    cache, _ = make_cache(device)
    data = capture(cache)["layers"]
    cache.reset_for_new_sequences([0, S, 3])
    assert cache.active_batch_size == 3
    assert cache.lengths.tolist() == [0, S, 3]
    cache.reset_for_new_sequences([1] * B)
    assert cache.active_batch_size == B and cache.lengths.tolist() == [1] * B
    cache.reset_for_new_sequences(torch.tensor([2, 5]))  # host int tensor
    assert cache.lengths.tolist() == [2, 5]
    cache.reset_for_new_sequences((7,))
    assert cache.lengths.tolist() == [7]
    cache.reset_for_new_sequences([])
    assert cache.active_batch_size == 0 and cache.lengths.shape == (0,)
    # reset never touches the data: a reused prefix is whatever the slot holds
    for a, b in zip(cache_layers(cache), data):
        assert torch.equal(bits(a), b)


@pytest.mark.parametrize("reuse,exc", [
    ([0] * (B + 1), ValueError),      # too many sequences
    ([1, -1, 2], ValueError),         # negative
    ([1, S + 1], ValueError),         # past max_seq_len
    ([1, 2, 1.5], TypeError),         # not an int
    ([True, 1], TypeError),           # bool is not a length
    ("123", TypeError),               # not a sequence of int
    (5, TypeError),
    (None, TypeError),
])
def test_reset_invalid_changes_nothing(device, reuse, exc):
    cache, _ = make_cache(device)
    cache.reset_for_new_sequences([2, 4])
    cache.commit(i32([1, 3]))
    before = capture(cache)
    with pytest.raises(exc, match="reuse_lengths"):
        cache.reset_for_new_sequences(reuse)
    assert_unchanged(cache, before)
    assert cache.lengths.tolist() == [3, 7] and cache.active_batch_size == 2
    cache.commit(1)  # still usable
    assert cache.lengths.tolist() == [4, 8]


# ------------------------------------------------------------------------------------------- commit


def test_commit_int_and_tensor(device):
    cache, _ = make_cache(device, fill=False)
    cache.reset_for_new_sequences([0, 0, 0])
    cache.commit(i32([5, 7, 2]))  # prefill
    assert cache.lengths.tolist() == [5, 7, 2]
    cache.commit(1)  # decode
    assert cache.lengths.tolist() == [6, 8, 3]
    cache.commit(i32([0, 2, 1]))
    assert cache.lengths.tolist() == [6, 10, 4]
    cache.commit(2)
    assert cache.lengths.tolist() == [8, 12, 6]
    # the host-side bound check still knows the lengths after the tensor commits
    before = capture(cache)
    with pytest.raises(ValueError, match="new_lengths"):
        cache.commit(1)  # 12 + 1 > S
    assert_unchanged(cache, before)
    cache.commit(i32([4, 0, 6]))  # exactly max_seq_len is allowed
    assert cache.lengths.tolist() == [S, S, S]
    cache.commit(0)
    assert cache.lengths.tolist() == [S, S, S]


def test_commit_non_contiguous_tensor(device):
    cache, _ = make_cache(device, fill=False)
    cache.reset_for_new_sequences([1, 2, 3])
    cache.commit(i32([4, 100, 5, 100, 6, 100])[::2])
    assert cache.lengths.tolist() == [5, 7, 9]


def test_commit_does_not_modify_argument_or_data(device):
    cache, _ = make_cache(device)
    cache.reset_for_new_sequences([1, 2])
    inc = i32([3, 4])
    data = capture(cache)["layers"]
    cache.commit(inc)
    assert inc.tolist() == [3, 4]
    for a, b in zip(cache_layers(cache), data):
        assert torch.equal(bits(a), b)


def test_commit_negative_allowed_down_to_zero(device):
    cache, _ = make_cache(device, fill=False)
    cache.reset_for_new_sequences([3, 5])
    cache.commit(-3)
    assert cache.lengths.tolist() == [0, 2]
    cache.commit(i32([0, -2]))
    assert cache.lengths.tolist() == [0, 0]


@pytest.mark.parametrize("arg", [
    S - 4 + 1,      # int: takes the full sequence (and the last one) past S
    [1, 0, 0],      # one sequence just past S
    [0, 0, 9],
    -3,             # below zero for the sequence holding 2
    [0, -3, 0],
])
def test_commit_out_of_bounds_changes_nothing(device, arg):
    cache, _ = make_cache(device)
    cache.reset_for_new_sequences([S - 4, 0, 4])
    cache.commit(i32([4, 2, 0]))  # [S, 2, 4]
    if isinstance(arg, list):
        arg = i32(arg)
    before = capture(cache)
    with pytest.raises(ValueError, match="new_lengths"):
        cache.commit(arg)
    assert_unchanged(cache, before)
    with pytest.raises(ValueError, match="new_lengths"):
        cache.commit(arg, check=True)
    assert_unchanged(cache, before)


@pytest.mark.parametrize("arg,exc", [
    (torch.tensor([1, 1], dtype=torch.int64), ValueError),     # dtype
    (torch.tensor([1, 1, 1], dtype=torch.int32), ValueError),  # shape != [active]
    (torch.tensor([1], dtype=torch.int32), ValueError),
    (torch.ones(2, 1, dtype=torch.int32), ValueError),         # 2-d
    (torch.tensor(1, dtype=torch.int32), ValueError),          # 0-d
    (1.0, TypeError),
    (True, TypeError),
    ("1", TypeError),
    (None, TypeError),
])
def test_commit_invalid_argument(device, arg, exc):
    cache, _ = make_cache(device)
    cache.reset_for_new_sequences([1, 2])
    before = capture(cache)
    with pytest.raises(exc, match="new_lengths"):
        cache.commit(arg)
    assert_unchanged(cache, before)


def test_commit_wrong_device_tensor(device):
    # host tensors are accepted (counts known on the host); any device other than host or cache is an error
    cache, _ = make_cache(device)
    cache.reset_for_new_sequences([1, 2])
    before = capture(cache)
    with pytest.raises(ValueError, match="new_lengths"):
        cache.commit(torch.ones(2, dtype=torch.int32, device="meta"))
    assert_unchanged(cache, before)


def test_commit_with_no_active_sequence(device):
    cache, _ = make_cache(device, fill=False)
    cache.reset_for_new_sequences([])
    cache.commit(1)
    cache.commit(torch.zeros(0, dtype=torch.int32))
    assert cache.lengths.tolist() == [] and cache.all_empty


@pytest.mark.parametrize("arg", [1, [0, 0, 1], [2, 0, 0]], ids=["int", "tensor-last", "tensor-first"])
def test_commit_after_growing_active_batch_with_check(device, arg):
    """After ``active_batch_size`` grows, the new slots' lengths are only on the device: an overflowing
    commit is refused there (nothing changed) and ``check=True`` turns the refusal into ValueError."""
    cache, _ = make_cache(device)
    cache.reset_for_new_sequences([S - 1, 0, S])
    cache.active_batch_size = 1
    cache.active_batch_size = 3  # lengths of slots 1, 2 are back but no longer mirrored on the host
    assert cache.lengths.tolist() == [S - 1, 0, S]
    if isinstance(arg, list):
        arg = i32(arg)
    before = capture(cache)
    with pytest.raises(ValueError, match="new_lengths"):
        cache.commit(arg, check=True)
    assert_unchanged(cache, before)
    cache.commit(i32([1, 3, 0]), check=True)
    assert cache.lengths.tolist() == [S, 3, S]


def test_refused_commit_does_not_poison_later_checks(device):
    """A commit refused on the device without ``check`` must not make a later, valid ``check=True`` commit
    raise (its error would say 'nothing was changed' while the lengths were in fact updated)."""
    cache, _ = make_cache(device)
    cache.reset_for_new_sequences([S, 0])
    cache.active_batch_size = 1
    cache.active_batch_size = 2  # host mirror dropped: bounds are checked on the device
    try:
        cache.commit(1)  # S + 1: refused (raising here would be fine too)
    except ValueError:
        pass
    assert cache.lengths.tolist() == [S, 0]
    cache.commit(i32([0, 2]), check=True)  # valid
    assert cache.lengths.tolist() == [S, 2]
    cache.commit(-1, check=True)  # valid
    assert cache.lengths.tolist() == [S - 1, 1]


# ------------------------------------------------------------------------------------------- evict

EVICT_CASES = [
    [False, True, False, True, False],
    [True, False, False, False, False],
    [False, False, False, False, True],
    [True, True, False, True, False],
    [False, True, True, True, True],
    [True, False, True, False, True],
]


@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
@pytest.mark.parametrize("finished", EVICT_CASES)
def test_evict_compacts_layers_and_lengths(device, finished, as_tensor):
    cache, gen = make_cache(device, seed=len(finished) + sum(finished))
    lengths = torch.randint(0, S + 1, (B,), generator=gen).tolist()
    lengths[1] = S  # a full slot
    lengths[3] = 0  # an empty one
    cache.reset_for_new_sequences(lengths)
    before = [layer.clone() for layer in cache_layers(cache)]
    lengths_ptr = cache.lengths.data_ptr()
    arg = torch.tensor(finished, dtype=torch.bool) if as_tensor else list(finished)
    mapping = cache.evict(arg)
    assert_evicted(cache, before, lengths, finished, mapping)
    assert cache.lengths.data_ptr() == lengths_ptr
    # the lengths mirror followed: bounds are still checked, commits land on the right sequences
    kept = [lengths[i] for i, f in enumerate(finished) if not f]
    inc = [S - n for n in kept]
    cache.commit(i32(inc))
    assert cache.lengths.tolist() == [S] * len(kept)
    if kept:
        with pytest.raises(ValueError):
            cache.commit(1)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_evict_dtypes(device, dtype):
    cache, gen = make_cache(device, dtype, seed=7)
    lengths = [5, S, 1, 7, 3]
    finished = [True, False, True, False, False]
    cache.reset_for_new_sequences(lengths)
    before = [layer.clone() for layer in cache_layers(cache)]
    mapping = cache.evict(torch.tensor(finished))
    assert_evicted(cache, before, lengths, finished, mapping)


def test_evict_partial_batch_leaves_inactive_slots(device):
    cache, _ = make_cache(device, seed=3)
    lengths = [4, 9, 6]
    cache.reset_for_new_sequences(lengths)  # slots 3, 4 inactive
    before = [layer.clone() for layer in cache_layers(cache)]
    mapping = cache.evict([True, False, False])
    assert_evicted(cache, before, lengths, [True, False, False], mapping)
    for layer, b in zip(cache_layers(cache), before):
        assert beq(layer[3:], b[3:])


def test_evict_nothing(device):
    cache, _ = make_cache(device, seed=4)
    cache.reset_for_new_sequences([3, 4, 5, 6])
    before = capture(cache)
    mapping = cache.evict([False] * 4)
    assert mapping.tolist() == [0, 1, 2, 3] and mapping.dtype == torch.int32
    assert_unchanged(cache, before)
    mapping = cache.evict(torch.zeros(4, dtype=torch.bool))
    assert mapping.tolist() == [0, 1, 2, 3]
    assert_unchanged(cache, before)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_evict_all(device, as_tensor):
    cache, _ = make_cache(device, seed=5)
    cache.reset_for_new_sequences([3, 4, 5])
    before = capture(cache)
    arg = torch.ones(3, dtype=torch.bool) if as_tensor else [True] * 3
    mapping = cache.evict(arg)
    assert mapping.tolist() == [-1, -1, -1]
    assert cache.active_batch_size == 0
    assert cache.lengths.tolist() == []
    for a, b in zip(capture(cache)["layers"], before["layers"]):
        assert torch.equal(a, b)
    # the cache is reusable afterwards
    cache.reset_for_new_sequences([1, 2])
    cache.commit(1)
    assert cache.lengths.tolist() == [2, 3]


def test_evict_empty_batch(device):
    cache, _ = make_cache(device, seed=6)
    cache.reset_for_new_sequences([])
    before = capture(cache)
    mapping = cache.evict([])
    assert mapping.tolist() == []
    assert_unchanged(cache, before)


def test_evict_mapping_is_a_copy(device):
    cache, _ = make_cache(device, seed=8)
    cache.reset_for_new_sequences([1, 2, 3])
    mapping = cache.evict([False, True, False])
    mapping.fill_(7)
    assert cache.lengths.tolist() == [1, 3]
    cache.reset_for_new_sequences([2, 2])
    assert cache.evict([True, False]).tolist() == [-1, 0]


def test_evict_repeatedly(device):
    cache, _ = make_cache(device, seed=9)
    lengths = [2, 11, 5, 8, 1]
    cache.reset_for_new_sequences(lengths)
    for finished in ([False, False, True, False, False], [True, False, False, False], [False, False, True]):
        before = [layer.clone() for layer in cache_layers(cache)]
        mapping = cache.evict(finished)
        assert_evicted(cache, before, lengths, finished, mapping)
        lengths = [n for n, f in zip(lengths, finished) if not f]


@pytest.mark.parametrize("finished,exc", [
    ([False, True], ValueError),                          # wrong length
    ([False, True, False, True], ValueError),
    ([0, 1, 0], TypeError),                               # not bools
    ([False, None, True], TypeError),
    ("abc", TypeError),
    (3, TypeError),
    (torch.tensor([0, 1, 0], dtype=torch.int32), ValueError),  # dtype
    (torch.tensor([0, 1, 0], dtype=torch.uint8), ValueError),
    (torch.tensor([False, True]), ValueError),            # shape
    (torch.zeros(3, 1, dtype=torch.bool), ValueError),
])
def test_evict_invalid_changes_nothing(device, finished, exc):
    cache, _ = make_cache(device, seed=10)
    cache.reset_for_new_sequences([3, 4, 5])
    before = capture(cache)
    with pytest.raises(exc, match="finished"):
        cache.evict(finished)
    assert_unchanged(cache, before)


def test_evict_wrong_device_tensor(device):
    # a host mask is accepted; any device other than host or cache is an error
    cache, _ = make_cache(device, seed=11)
    cache.reset_for_new_sequences([3, 4, 5])
    before = capture(cache)
    with pytest.raises(ValueError, match="finished"):
        cache.evict(torch.zeros(3, dtype=torch.bool, device="meta"))
    assert_unchanged(cache, before)


def test_evict_with_check(device):
    cache, _ = make_cache(device, seed=12)
    lengths = [3, 4, 5, 1]
    cache.reset_for_new_sequences(lengths)
    before = [layer.clone() for layer in cache_layers(cache)]
    finished = [False, True, False, True]
    mapping = cache.evict(torch.tensor(finished), check=True)
    assert_evicted(cache, before, lengths, finished, mapping)



def test_evict_after_growing_active_batch(device):
    """Lengths of re-activated slots live only on the device: compaction must still use them."""
    cache, _ = make_cache(device, seed=13)
    lengths = [3, 9, 5, S]
    cache.reset_for_new_sequences(lengths)
    cache.active_batch_size = 1
    cache.active_batch_size = 4
    before = [layer.clone() for layer in cache_layers(cache)]
    finished = [True, False, True, False]
    mapping = cache.evict(finished)
    assert_evicted(cache, before, lengths, finished, mapping)
    cache.commit(i32([3, 0]), check=True)
    assert cache.lengths.tolist() == [S, S]

# ------------------------------------------------------------------------------------------- save


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_save(device, dtype):
    cache, _ = make_cache(device, dtype, seed=20)
    cache.reset_for_new_sequences([4, S, 7])
    before = capture(cache)
    for b, n in [(0, 4), (1, S), (2, 3), (1, 1)]:
        snap = cache.save(b, n)
        assert isinstance(snap, KVSnapshot)
        assert snap.seq_len == n and snap.num_layers == L
        assert snap.dtype == dtype and snap.device == cache.device
        assert snap.layer_specs == ((H, D),) * L
        assert snap.flat is not None, "snapshots made by the caches are packed"
        for i, t in enumerate(snap.layers):
            assert tuple(t.shape) == (2, H, n, D)
            assert beq(t, cache.layer(i)[b, :, :, :n])
    assert_unchanged(cache, before)


def test_save_is_a_copy(device):
    cache, gen = make_cache(device, seed=21)
    cache.reset_for_new_sequences([6])
    snap = cache.save(0, 6)
    saved = [t.clone() for t in snap.layers]
    fill_cache(cache, gen)
    for t, s in zip(snap.layers, saved):
        assert beq(t, s)


def test_save_zero_tokens(device):
    cache, _ = make_cache(device, seed=22)
    cache.reset_for_new_sequences([3])
    before = capture(cache)
    snap = cache.save(0, 0)
    assert snap.seq_len == 0
    assert all(tuple(t.shape) == (2, H, 0, D) for t in snap.layers)
    cache.restore(snap, 1)
    assert_unchanged(cache, before)


@pytest.mark.parametrize("batch_idx,seq_len,exc,name", [
    (3, 1, ValueError, "batch_idx"),        # == active
    (4, 1, ValueError, "batch_idx"),        # inactive slot
    (-1, 1, ValueError, "batch_idx"),
    (0, 5, ValueError, "seq_len"),          # more than held (4)
    (1, S + 1, ValueError, "seq_len"),      # more than max
    (2, 1, ValueError, "seq_len"),          # slot 2 holds 0 tokens
    (0, -1, ValueError, "seq_len"),
    (0.0, 1, TypeError, "batch_idx"),
    (0, 1.0, TypeError, "seq_len"),
    (True, 1, TypeError, "batch_idx"),
])
def test_save_invalid(device, batch_idx, seq_len, exc, name):
    cache, _ = make_cache(device, seed=23)
    cache.reset_for_new_sequences([4, S, 0])
    before = capture(cache)
    with pytest.raises(exc, match=name):
        cache.save(batch_idx, seq_len)
    assert_unchanged(cache, before)


def test_save_nothing_active(device):
    cache, _ = make_cache(device, seed=24)
    with pytest.raises(ValueError, match="batch_idx"):
        cache.save(0, 0)



@pytest.mark.parametrize("layout", ["packed", "separate"])
def test_save_into_out(device, layout):
    cache, gen = make_cache(device, torch.bfloat16, seed=25)
    cache.reset_for_new_sequences([4, 9])
    n = 7
    if layout == "packed":
        out = KVSnapshot.empty([(H, D)] * L, n, dtype=cache.dtype, device=device)
    else:
        out = KVSnapshot([torch.empty(2, H, n, D, dtype=cache.dtype, device=device) for _ in range(L)])
    for t in out.layers:
        fill_random(t, gen)
    ptrs = [t.data_ptr() for t in out.layers]
    before = capture(cache)
    got = cache.save(1, n, out=out)
    assert got is out
    assert [t.data_ptr() for t in out.layers] == ptrs, "written in place"
    for i, t in enumerate(out.layers):
        assert beq(t, cache.layer(i)[1, :, :, :n])
    assert_unchanged(cache, before)
    # another slot, into a snapshot of its own length
    out4 = KVSnapshot([t[:, :, :4].contiguous() for t in out.layers])
    cache.save(0, 4, out=out4)
    for i, t in enumerate(out4.layers):
        assert beq(t, cache.layer(i)[0, :, :, :4])


@pytest.mark.parametrize("case", ["seq_len", "heads", "dtype", "layers", "type", "device"])
def test_save_into_invalid_out(device, other_device, case):
    cache, gen = make_cache(device, seed=26)
    cache.reset_for_new_sequences([6])
    specs, n, dtype, dev = [(H, D)] * L, 5, cache.dtype, device
    if case == "seq_len":
        n = 4
    elif case == "heads":
        specs = [(H + 1, D)] * L
    elif case == "dtype":
        dtype = torch.float8_e4m3fn
    elif case == "layers":
        specs = specs[:-1]
    elif case == "device":
        dev = other_device
    out = KVSnapshot([torch.zeros(2, h, n, d, dtype=dtype, device=dev) for h, d in specs])
    out_before = None if dev == other_device else [bits(t).clone() for t in out.layers]
    before = capture(cache)
    exc = TypeError if case == "type" else ValueError
    with pytest.raises(exc, match="out"):
        cache.save(0, 5, out=list(out.layers) if case == "type" else out)  # type: ignore[arg-type]
    assert_unchanged(cache, before)
    if out_before is not None:
        for t, b in zip(out.layers, out_before):
            assert torch.equal(bits(t), b), "a rejected out is not written"

# ------------------------------------------------------------------------------------------- restore


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("dst", [0, 2, 4], ids=["active", "active-last", "inactive"])
def test_restore_into_another_slot(device, dtype, dst):
    cache, gen = make_cache(device, dtype, seed=30 + dst)
    cache.reset_for_new_sequences([9, 5, 3])
    snap = cache.save(1, 5)
    expected = [t.clone() for t in snap.layers]
    fill_cache(cache, gen)  # fresh sentinel everywhere, the snapshot must win only where it lands
    before = capture(cache)
    cache.restore(snap, dst)
    assert cache.lengths.tolist() == [9, 5, 3], "restore does not change lengths"
    assert cache.active_batch_size == 3
    for i, layer in enumerate(cache_layers(cache)):
        old = before["layers"][i]
        assert torch.equal(bits(layer[dst, :, :, :5]), bits(expected[i]))
        assert torch.equal(bits(layer[dst, :, :, 5:]), old[dst, :, :, 5:]), "tokens past the prefix"
        others = [b for b in range(B) if b != dst]
        assert torch.equal(bits(layer[others]), old[others]), "other slots"
    # the snapshot itself is not modified by a restore
    for t, e in zip(snap.layers, expected):
        assert beq(t, e)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_save_restore_between_caches(device, dtype):
    src, gen = make_cache(device, dtype, seed=40)
    dst, _ = make_cache(device, dtype, seed=41)
    src.reset_for_new_sequences([S, 2])
    snap = src.save(0, S)
    before = capture(dst)
    dst.restore(snap, 3)
    for i in range(L):
        assert beq(dst.layer(i)[3], src.layer(i)[0])
        rest = [b for b in range(B) if b != 3]
        assert torch.equal(bits(dst.layer(i)[rest]), before["layers"][i][rest])


def test_restore_snapshot_of_separate_tensors(device):
    cache, gen = make_cache(device, seed=42)
    n = 6
    layers = [random_like(torch.empty(2, H, n, D, dtype=cache.dtype), gen).to(device) for _ in range(L)]
    snap = KVSnapshot(layers)
    assert snap.flat is None
    before = capture(cache)
    cache.restore(snap, 1)
    for i, layer in enumerate(cache_layers(cache)):
        assert beq(layer[1, :, :, :n], layers[i])
        assert torch.equal(bits(layer[1, :, :, n:]), before["layers"][i][1, :, :, n:])
        assert torch.equal(bits(layer[[0, 2, 3, 4]]), before["layers"][i][[0, 2, 3, 4]])


@pytest.mark.parametrize("lead", [0, 8, 3])
def test_restore_packed_snapshot_inside_larger_buffer(device, lead):
    """Layers back to back inside a bigger tensor, starting ``lead`` elements in: a packed snapshot whose
    flat buffer has a storage offset (and, for ``lead=3``, an unaligned start)."""
    cache, gen = make_cache(device, seed=45)
    n = 4
    per_layer = 2 * H * n * D
    big = random_like(torch.empty(lead + L * per_layer + 5, dtype=cache.dtype), gen).to(device)
    layers = [big[lead + i * per_layer : lead + (i + 1) * per_layer].view(2, H, n, D) for i in range(L)]
    snap = KVSnapshot(layers)
    assert snap.flat is not None
    before = capture(cache)
    cache.restore(snap, 3)
    for i, layer in enumerate(cache_layers(cache)):
        assert beq(layer[3, :, :, :n], layers[i]), f"layer {i}"
        assert torch.equal(bits(layer[:3]), before["layers"][i][:3])
        assert torch.equal(bits(layer[3, :, :, n:]), before["layers"][i][3, :, :, n:])


def _snapshot(specs, n, dtype, device, gen):
    return KVSnapshot([random_like(torch.empty(2, h, n, d, dtype=dtype), gen).to(device) for h, d in specs])


@pytest.mark.parametrize("case", [
    "heads", "head_dim", "num_layers_less", "num_layers_more", "dtype", "seq_len", "batch_idx",
    "batch_idx_negative", "device",
])
def test_restore_invalid_changes_nothing(device, other_device, case):
    cache, gen = make_cache(device, seed=43)
    cache.reset_for_new_sequences([3, 4])
    specs = [(H, D)] * L
    batch_idx = 1
    if case == "heads":
        snap = _snapshot([(H + 1, D)] * L, 3, cache.dtype, device, gen)
    elif case == "head_dim":
        snap = _snapshot([(H, D)] * (L - 1) + [(H, D + 8)], 3, cache.dtype, device, gen)
    elif case == "num_layers_less":
        snap = _snapshot(specs[:-1], 3, cache.dtype, device, gen)
    elif case == "num_layers_more":
        snap = _snapshot(specs + [(H, D)], 3, cache.dtype, device, gen)
    elif case == "dtype":
        snap = _snapshot(specs, 3, torch.bfloat16, device, gen)
    elif case == "seq_len":
        snap = _snapshot(specs, S + 1, cache.dtype, device, gen)
    elif case == "batch_idx":
        snap, batch_idx = _snapshot(specs, 3, cache.dtype, device, gen), B
    elif case == "batch_idx_negative":
        snap, batch_idx = _snapshot(specs, 3, cache.dtype, device, gen), -1
    else:
        snap = KVSnapshot([torch.empty(2, H, 3, D, dtype=cache.dtype, device=other_device) for _ in range(L)])
    before = capture(cache)
    with pytest.raises(ValueError):
        cache.restore(snap, batch_idx)
    assert_unchanged(cache, before)


@pytest.mark.parametrize("snap,batch_idx", [("layers", 0), ("tensor", 0), (None, 0), ("ok", 1.0), ("ok", True)])
def test_restore_wrong_types(device, snap, batch_idx):
    cache, gen = make_cache(device, seed=44)
    cache.reset_for_new_sequences([3])
    good = _snapshot([(H, D)] * L, 2, cache.dtype, device, gen)
    arg = {"layers": list(good.layers), "tensor": good.layers[0], None: None, "ok": good}[snap]
    before = capture(cache)
    with pytest.raises(TypeError):
        cache.restore(arg, batch_idx)  # type: ignore[arg-type]
    assert_unchanged(cache, before)



@pytest.mark.parametrize("shape", [(1, 6, 24, 3, 80), (4, 2, 5, 1, 5), (2, 3, 1, 3, 96)],
                         ids=["L1-B6-S24-H3-D80", "L4-B2-S5-H1-D5", "L2-B3-S1-H3-D96"])
@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_odd_shapes_evict_save_restore(device, shape, dtype):
    nl, nb, ns, nh, nd = shape
    cache, gen = make_cache(device, dtype, num_layers=nl, max_batch_size=nb, max_seq_len=ns, num_kv_heads=nh,
                            head_dim=nd, seed=sum(shape))
    lengths = torch.randint(1, ns + 1, (nb,), generator=gen).tolist()
    lengths[-1] = ns
    cache.reset_for_new_sequences(lengths)
    snap = cache.save(nb - 1, ns)
    for i, t in enumerate(snap.layers):
        assert beq(t, cache.layer(i)[nb - 1])
    finished = [i % 2 == 0 for i in range(nb)]
    before = [layer.clone() for layer in cache_layers(cache)]
    mapping = cache.evict(finished)
    assert_evicted(cache, before, lengths, finished, mapping)
    fill_cache(cache, gen)
    before = capture(cache)
    cache.restore(snap, 0)
    for i, layer in enumerate(cache_layers(cache)):
        assert beq(layer[0], snap.layers[i])
        assert torch.equal(bits(layer[1:]), before["layers"][i][1:])

# ------------------------------------------------------------------------------------------- system prompt


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_system_prompt_recipe(device, dtype):
    """DESIGN.md: restore N saved tokens, reset with N - 1, prefill from token N - 1, commit."""
    cache, gen = make_cache(device, dtype, seed=50)
    N = 5

    # 1. Prefill the system prompt alone and save it.
    cache.reset_for_new_sequences([0])
    assert cache.all_empty
    prompt = [random_like(cache.layer(i)[0, :, :, :N], gen) for i in range(L)]
    for i in range(L):
        k, v = cache.kv(i)
        k[0, :, :N] = prompt[i][0]
        v[0, :, :N] = prompt[i][1]
    cache.commit(i32([N]))
    snap = cache.save(0, N).to("cpu")  # kept on the host between requests
    # the snapshot is a host copy: the cache may be overwritten in between
    fill_cache(cache, gen)

    # 2. A new batch of three requests, two of which share the system prompt (slots 0 and 2).
    for b in (0, 2):
        cache.restore(snap.to(cache.device), b)
    cache.reset_for_new_sequences([N - 1, 0, N - 1])
    assert not cache.all_empty
    assert cache.lengths.tolist() == [N - 1, 0, N - 1]

    # 3. Prefill: each request writes its tokens from its reuse length on (the last prompt token again).
    new = [3, 4, 2]
    written = {}
    for b, (start, count) in enumerate(zip([N - 1, 0, N - 1], new)):
        for i in range(L):
            tok = random_like(cache.layer(i)[b, :, :, start:start + count], gen)
            if b != 1:
                tok[:, :, 0] = prompt[i][:, :, N - 1]  # recomputed last prompt token: same K/V
            k, v = cache.kv(i)
            k[b, :, start:start + count] = tok[0]
            v[b, :, start:start + count] = tok[1]
            written[(b, i)] = tok
    cache.commit(i32(new))
    assert cache.lengths.tolist() == [N - 1 + 3, 4, N - 1 + 2]

    # 4. One decode step.
    for b, pos in enumerate(cache.lengths.tolist()):
        for i in range(L):
            tok = random_like(cache.layer(i)[b, :, :, pos], gen)
            cache.layer(i)[b, :, :, pos] = tok
            written[(b, i)] = torch.cat([written[(b, i)], tok.unsqueeze(2)], dim=2)
    cache.commit(1)
    assert cache.lengths.tolist() == [N - 1 + 4, 5, N - 1 + 3]

    for i in range(L):
        layer = cache.layer(i)
        for b in (0, 2):
            n = cache.lengths[b].item()
            assert beq(layer[b, :, :, : N - 1], prompt[i][:, :, : N - 1])
            assert beq(layer[b, :, :, N - 1 : n], written[(b, i)])
            assert beq(layer[b, :, :, :N], prompt[i])  # the last prompt token was rewritten identically
        assert beq(layer[1, :, :, :5], written[(1, i)])

    # 5. A finished request is evicted; the shared-prefix sequence moves down intact.
    before = [layer.clone() for layer in cache_layers(cache)]
    lengths = cache.lengths.tolist()
    mapping = cache.evict([False, True, False])
    assert_evicted(cache, before, lengths, [False, True, False], mapping)
    for i in range(L):
        assert beq(cache.layer(i)[1, :, :, :N], prompt[i])


# ------------------------------------------------------------------------------------------- property test

HL, HB, HS, HH, HD = 2, 4, 8, 2, 8
UNKNOWN = -1  # a token position whose content the model does not pin down (stale data after compaction)


class SlotModel:
    """Plain-Python model of a LinearKVCache: per physical slot, the id of the token at each position.

    Token ``t`` has the payload ``payloads[t]`` (``[L, 2, H, D]`` int16 bits); id 0 is the zero token a new
    cache starts with.
    """

    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen
        self.phys = [[0] * HS for _ in range(HB)]
        self.lengths: list[int] = []
        self.payloads = [torch.zeros(HL, 2, HH, HD, dtype=torch.int16)]

    def write(self, cache: LinearKVCache, b: int, pos: int) -> None:
        """A new, distinct token at position ``pos`` of slot ``b``, written through ``cache.kv(i)``."""
        t = self.new_token()
        self.phys[b][pos] = t
        for i in range(HL):
            k, v = cache.kv(i)
            k[b, :, pos] = self.payloads[t][i, 0].view(torch.float16).to(k.device)
            v[b, :, pos] = self.payloads[t][i, 1].view(torch.float16).to(v.device)

    def new_token(self) -> int:
        while True:
            p = torch.randint(-(2**15), 2**15, (HL, 2, HH, HD), dtype=torch.int16, generator=self.gen)
            if bool(p.any()):
                break
        self.payloads.append(p)
        return len(self.payloads) - 1

    def known_prefix(self, b: int) -> int:
        n = 0
        while n < HS and self.phys[b][n] != UNKNOWN:
            n += 1
        return n

    def check(self, cache: LinearKVCache) -> None:
        assert cache.active_batch_size == len(self.lengths)
        assert cache.lengths.tolist() == self.lengths
        if cache.all_empty:
            assert not any(self.lengths), "all_empty while a sequence holds tokens"
        ids = torch.tensor(self.phys)  # [B, S]
        known = ids != UNKNOWN
        table = torch.stack(self.payloads)  # [T, L, 2, H, D]
        expected = table[ids.clamp(min=0)]  # [B, S, L, 2, H, D]
        for i in range(HL):
            exp = expected[:, :, i].permute(0, 2, 3, 1, 4)  # [B, 2, H, S, D]
            got = bits(cache.layer(i)).cpu()
            mask = known[:, None, None, :, None].expand_as(exp)
            assert torch.equal(got[mask], exp[mask]), f"layer {i} differs from the model"


@st.composite
def _ops(draw):
    return draw(st.lists(st.sampled_from(["reset", "write_commit", "commit_int", "overflow", "evict", "save_restore",
                                          "shrink"]),
                         min_size=2, max_size=10))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_operations_match_model(device, data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    cache = LinearKVCache(CacheConfig(num_layers=HL, max_batch_size=HB, max_seq_len=HS, num_kv_heads=HH,
                                      head_dim=HD, dtype=torch.float16, device=device))
    model = SlotModel(gen)
    model.check(cache)  # zero-initialised
    for b in range(HB):  # distinct tokens everywhere, so that any misplaced copy shows
        for pos in range(HS):
            model.write(cache, b, pos)
    model.check(cache)
    for op in data.draw(_ops(), label="ops"):
        n = len(model.lengths)
        if op == "reset" or n == 0:
            k = data.draw(st.integers(0, HB), label="reset n")
            reuse = [data.draw(st.integers(0, model.known_prefix(b)), label="reuse") for b in range(k)]
            cache.reset_for_new_sequences(reuse)
            model.lengths = list(reuse)
            assert cache.all_empty == (not any(reuse))
        elif op == "write_commit":
            counts = [data.draw(st.integers(0, HS - length), label="count") for length in model.lengths]
            for b, (start, c) in enumerate(zip(model.lengths, counts)):
                for pos in range(start, start + c):
                    model.write(cache, b, pos)
            if len(set(counts)) == 1 and data.draw(st.booleans(), label="as int"):
                cache.commit(counts[0])
            else:
                cache.commit(i32(counts))
            model.lengths = [a + c for a, c in zip(model.lengths, counts)]
            if any(counts):
                assert not cache.all_empty
        elif op == "commit_int":
            inc = data.draw(st.integers(-min(model.lengths), HS - max(model.lengths)), label="inc")
            cache.commit(inc)
            model.lengths = [a + inc for a in model.lengths]
        elif op == "overflow":
            b = data.draw(st.integers(0, n - 1), label="overflow seq")
            counts = [0] * n
            counts[b] = HS - model.lengths[b] + data.draw(st.integers(1, 3), label="excess")
            before = capture(cache)
            with pytest.raises(ValueError):
                cache.commit(i32(counts) if data.draw(st.booleans(), label="as tensor") else max(counts))
            assert_unchanged(cache, before)
        elif op == "evict":
            finished = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="finished")
            arg = torch.tensor(finished, dtype=torch.bool) if data.draw(st.booleans(), label="tensor") else finished
            mapping = cache.evict(arg)
            kept = [i for i, f in enumerate(finished) if not f]
            assert mapping.tolist() == [kept.index(i) if i in kept else -1 for i in range(n)]
            phys = [list(p) for p in model.phys]
            for j, i in enumerate(kept):
                length = model.lengths[i]
                phys[j] = model.phys[i][:length] + [UNKNOWN] * (HS - length)
            model.phys = phys
            model.lengths = [model.lengths[i] for i in kept]
        elif op == "shrink":
            k = data.draw(st.integers(0, n), label="shrink to")
            cache.active_batch_size = k
            model.lengths = model.lengths[:k]
        else:  # save_restore
            b = data.draw(st.integers(0, n - 1), label="save slot")
            s = data.draw(st.integers(0, model.lengths[b]), label="save len")
            t = data.draw(st.integers(0, HB - 1), label="restore slot")
            snap = cache.save(b, s)
            assert snap.seq_len == s
            for pos in range(s):
                tok = model.phys[b][pos]
                if tok == UNKNOWN:
                    continue
                for i in range(HL):
                    assert torch.equal(bits(snap.layers[i][:, :, pos]).cpu(), model.payloads[tok][i])
            cache.restore(snap, t)
            model.phys[t][:s] = model.phys[b][:s]
        model.check(cache)
