"""KVCacheManager: heterogeneous and uniform layers, views, lengths, eviction, save / restore, on both
backends. Expectations come from clones taken before each call; comparisons are bit-exact."""

from __future__ import annotations

import pytest
import torch

from kvcache import CacheConfig, KVCacheManager, KVLayerConfig, KVSnapshot, LinearKVCache, ManagerConfig

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

B, S = 4, 10
HETERO = [(2, 8), (3, 80), (1, 96)]
HETERO_ODD = [(3, 24), (1, 5), (2, 24), (1, 33)]  # a repeated spec, odd head_dims
UNIFORM = [(2, 16)] * 3
SPECS = {"hetero": HETERO, "hetero_odd": HETERO_ODD, "uniform": UNIFORM}


def make_manager(device, specs=HETERO, dtype=torch.float16, *, seed=0, fill=True, max_batch_size=B,
                 max_seq_len=S):
    cfg = ManagerConfig(max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                        layers=[KVLayerConfig(num_kv_heads=h, head_dim=d) for h, d in specs],
                        dtype=dtype, device=device)
    cache = KVCacheManager(cfg)
    gen = torch.Generator().manual_seed(seed)
    if fill:
        fill_cache(cache, gen)
    return cache, gen


def i32(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


# ------------------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_layers_and_views(device, kind, dtype):
    specs = SPECS[kind]
    cache, gen = make_manager(device, specs, dtype, fill=False)
    assert cache.num_layers == len(specs)
    assert cache.is_uniform == (kind == "uniform")
    assert cache.config.num_layers == len(specs)
    assert cache.max_batch_size == B and cache.max_seq_len == S and cache.dtype == dtype
    for i, (h, d) in enumerate(specs):
        lc = cache.layer_config(i)
        assert isinstance(lc, KVLayerConfig) and (lc.num_kv_heads, lc.head_dim) == (h, d)
        layer = cache.layer(i)
        assert tuple(layer.shape) == (B, 2, h, S, d)
        assert layer.dtype == dtype and layer.device.type == torch.device(device).type
        assert layer.is_contiguous()
        assert not bits(layer).any(), "a new cache is zero-initialised"
        k, v = cache.kv(i)
        assert tuple(k.shape) == (B, h, S, d) and tuple(v.shape) == (B, h, S, d)
        new_k, new_v = random_like(k, gen), random_like(v, gen)
        k.copy_(new_k)
        v.copy_(new_v)
        assert beq(layer[:, 0], new_k) and beq(layer[:, 1], new_v)
        whole = random_like(layer, gen)
        layer.copy_(whole)
        k2, v2 = cache.kv(i)
        assert beq(k2, whole[:, 0]) and beq(v2, whole[:, 1])
        assert beq(k, whole[:, 0])
    # layers do not overlap
    for i in range(len(specs)):
        others = [bits(cache.layer(j)).clone() for j in range(len(specs)) if j != i]
        fill_random(cache.layer(i), gen)
        for j, o in zip([j for j in range(len(specs)) if j != i], others):
            assert torch.equal(bits(cache.layer(j)), o), f"writing layer {i} changed layer {j}"


def test_uniform_manager_matches_linear_layout(device):
    cache, _ = make_manager(device, UNIFORM, fill=False)
    assert cache.is_uniform
    h, d = UNIFORM[0]
    step = B * 2 * h * S * d * 2
    base = cache.layer(0).data_ptr()
    for i in range(len(UNIFORM)):
        assert cache.layer(i).data_ptr() == base + i * step


def test_single_layer_is_uniform(device):
    cache, _ = make_manager(device, [(3, 80)], fill=False)
    assert cache.is_uniform and cache.num_layers == 1


def test_layer_index_validation(device):
    cache, _ = make_manager(device, fill=False)
    for bad in (3, 10, -1):
        with pytest.raises(ValueError):
            cache.layer(bad)
        with pytest.raises(ValueError):
            cache.kv(bad)
        with pytest.raises(ValueError):
            cache.layer_config(bad)
    with pytest.raises(TypeError):
        cache.layer(1.0)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- lengths


def test_lengths_reset_commit(device):
    cache, _ = make_manager(device)
    ptr = cache.lengths_buffer.data_ptr()
    assert cache.all_empty and cache.active_batch_size == 0
    cache.reset_for_new_sequences([0, 0, 0])
    assert cache.all_empty
    cache.commit(i32([4, 0, 6]))
    assert not cache.all_empty
    assert cache.lengths.tolist() == [4, 0, 6]
    cache.commit(1)
    assert cache.lengths.tolist() == [5, 1, 7]
    assert cache.lengths.dtype == torch.int32 and cache.lengths.data_ptr() == ptr
    before = capture(cache)
    with pytest.raises(ValueError, match="new_lengths"):
        cache.commit(i32([0, 0, S - 7 + 1]))
    assert_unchanged(cache, before)
    with pytest.raises(ValueError, match="new_lengths"):
        cache.commit(S)
    assert_unchanged(cache, before)
    with pytest.raises(ValueError, match="reuse_lengths"):
        cache.reset_for_new_sequences([0] * (B + 1))
    assert_unchanged(cache, before)
    with pytest.raises(ValueError, match="reuse_lengths"):
        cache.reset_for_new_sequences([S + 1])
    assert_unchanged(cache, before)
    with pytest.raises(ValueError, match="active_batch_size"):
        cache.active_batch_size = B + 1
    assert_unchanged(cache, before)
    cache.active_batch_size = 2
    assert cache.lengths.tolist() == [5, 1]


# ------------------------------------------------------------------------------------------- evict


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("finished", [
    [False, True, False, True],
    [True, False, False, False],
    [True, True, True, False],
    [False, False, False, True],
])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_evict(device, kind, finished, as_tensor):
    cache, gen = make_manager(device, SPECS[kind], seed=sum(finished) * 7 + len(kind))
    lengths = torch.randint(0, S + 1, (B,), generator=gen).tolist()
    lengths[0] = S
    cache.reset_for_new_sequences(lengths)
    before = [layer.clone() for layer in cache_layers(cache)]
    arg = torch.tensor(finished) if as_tensor else list(finished)
    mapping = cache.evict(arg)
    assert_evicted(cache, before, lengths, finished, mapping)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_evict_dtypes(device, dtype):
    cache, _ = make_manager(device, HETERO_ODD, dtype, seed=3)
    lengths = [3, S, 0, 7]
    finished = [True, False, False, False]
    cache.reset_for_new_sequences(lengths)
    before = [layer.clone() for layer in cache_layers(cache)]
    mapping = cache.evict(finished)
    assert_evicted(cache, before, lengths, finished, mapping)


def test_evict_nothing_and_all(device):
    cache, _ = make_manager(device, seed=4)
    cache.reset_for_new_sequences([2, 3, 4])
    before = capture(cache)
    assert cache.evict([False, False, False]).tolist() == [0, 1, 2]
    assert_unchanged(cache, before)
    assert cache.evict(torch.ones(3, dtype=torch.bool)).tolist() == [-1, -1, -1]
    assert cache.active_batch_size == 0 and cache.lengths.tolist() == []
    for a, b in zip(capture(cache)["layers"], before["layers"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("finished,exc", [
    ([False, True], ValueError),
    ([0, 1, 0], TypeError),
    (torch.tensor([0, 1, 0]), ValueError),
    (torch.tensor([True, False]), ValueError),
])
def test_evict_invalid_changes_nothing(device, finished, exc):
    cache, _ = make_manager(device, seed=5)
    cache.reset_for_new_sequences([2, 3, 4])
    before = capture(cache)
    with pytest.raises(exc, match="finished"):
        cache.evict(finished)
    assert_unchanged(cache, before)


# ------------------------------------------------------------------------------------------- save / restore


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_save(device, kind, dtype):
    specs = SPECS[kind]
    cache, _ = make_manager(device, specs, dtype, seed=10)
    cache.reset_for_new_sequences([S, 6, 1])
    before = capture(cache)
    for b, n in [(0, S), (1, 6), (1, 3), (2, 1)]:
        snap = cache.save(b, n)
        assert snap.seq_len == n and snap.dtype == dtype and snap.device == cache.device
        assert snap.layer_specs == tuple(specs)
        assert snap.flat is not None
        assert snap.nbytes == sum(2 * h * n * d for h, d in specs) * snap.layers[0].element_size()
        for i, t in enumerate(snap.layers):
            assert beq(t, cache.layer(i)[b, :, :, :n]), f"layer {i}"
    assert_unchanged(cache, before)


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("layout", ["packed", "separate"])
def test_save_into_out(device, kind, layout):
    specs = SPECS[kind]
    cache, gen = make_manager(device, specs, torch.float8_e4m3fn, seed=11)
    cache.reset_for_new_sequences([3, 8])
    n = 6
    if layout == "packed":
        out = KVSnapshot.empty(specs, n, dtype=cache.dtype, device=device)
    else:
        out = KVSnapshot([torch.empty(2, h, n, d, dtype=cache.dtype, device=device) for h, d in specs])
    for t in out.layers:
        fill_random(t, gen)
    before = capture(cache)
    assert cache.save(1, n, out=out) is out
    for i, t in enumerate(out.layers):
        assert beq(t, cache.layer(i)[1, :, :, :n]), f"layer {i}"
    assert_unchanged(cache, before)
    with pytest.raises(ValueError, match="out"):
        cache.save(0, 3, out=out)  # seq_len mismatch
    assert_unchanged(cache, before)


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("dst", [0, 3])
def test_restore_into_another_slot(device, kind, dtype, dst):
    cache, gen = make_manager(device, SPECS[kind], dtype, seed=20 + dst)
    cache.reset_for_new_sequences([7, 8, 2])
    n = 7
    snap = cache.save(1, n)
    expected = [t.clone() for t in snap.layers]
    fill_cache(cache, gen)
    before = capture(cache)
    cache.restore(snap, dst)
    assert cache.lengths.tolist() == [7, 8, 2] and cache.active_batch_size == 3
    for i, layer in enumerate(cache_layers(cache)):
        old = before["layers"][i]
        assert beq(layer[dst, :, :, :n], expected[i]), f"layer {i}"
        assert torch.equal(bits(layer[dst, :, :, n:]), old[dst, :, :, n:])
        others = [b for b in range(B) if b != dst]
        assert torch.equal(bits(layer[others]), old[others])


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("layout", ["separate", "packed_by_hand"])
def test_restore_hand_made_snapshot(device, kind, dtype, layout):
    specs = SPECS[kind]
    cache, gen = make_manager(device, specs, dtype, seed=30)
    n = 4
    if layout == "separate":
        layers = [random_like(torch.empty(2, h, n, d, dtype=dtype), gen).to(device) for h, d in specs]
    else:
        flat = random_like(torch.empty(sum(2 * h * n * d for h, d in specs), dtype=dtype), gen).to(device)
        layers, off = [], 0
        for h, d in specs:
            layers.append(flat[off : off + 2 * h * n * d].view(2, h, n, d))
            off += 2 * h * n * d
    snap = KVSnapshot(layers)
    assert (snap.flat is None) == (layout == "separate")
    before = capture(cache)
    cache.restore(snap, 2)
    for i, layer in enumerate(cache_layers(cache)):
        old = before["layers"][i]
        assert beq(layer[2, :, :, :n], layers[i]), f"layer {i}"
        assert torch.equal(bits(layer[2, :, :, n:]), old[2, :, :, n:])
        assert torch.equal(bits(layer[[0, 1, 3]]), old[[0, 1, 3]])
    # and it saves back to the same bytes
    cache.reset_for_new_sequences([0, 0, n])
    assert cache.save(2, n).equal(snap)


@pytest.mark.parametrize("lead", [8, 3])
def test_restore_packed_snapshot_inside_larger_buffer(device, lead):
    cache, gen = make_manager(device, HETERO, seed=37)
    n = 5
    sizes = [2 * h * n * d for h, d in HETERO]
    big = random_like(torch.empty(lead + sum(sizes) + 7, dtype=cache.dtype), gen).to(device)
    layers, off = [], lead
    for (h, d), size in zip(HETERO, sizes):
        layers.append(big[off : off + size].view(2, h, n, d))
        off += size
    snap = KVSnapshot(layers)
    assert snap.flat is not None
    before = capture(cache)
    cache.restore(snap, 0)
    for i, layer in enumerate(cache_layers(cache)):
        assert beq(layer[0, :, :, :n], layers[i]), f"layer {i}"
        assert torch.equal(bits(layer[1:]), before["layers"][i][1:])


def test_restore_separate_snapshot_in_reverse_memory_order(device):
    """Layers allocated so that later layers lie at lower addresses: still restored to the right layers."""
    cache, gen = make_manager(device, HETERO, seed=31)
    n = 3
    flat = random_like(torch.empty(sum(2 * h * n * d for h, d in HETERO), dtype=cache.dtype), gen).to(device)
    views, off = [], 0
    for h, d in reversed(HETERO):
        views.append(flat[off : off + 2 * h * n * d].view(2, h, n, d))
        off += 2 * h * n * d
    layers = list(reversed(views))
    snap = KVSnapshot(layers)
    assert snap.flat is None
    cache.restore(snap, 1)
    for i, layer in enumerate(cache_layers(cache)):
        assert beq(layer[1, :, :, :n], layers[i])


def test_save_restore_between_managers(device):
    src, _ = make_manager(device, HETERO_ODD, torch.bfloat16, seed=32)
    dst, _ = make_manager(device, HETERO_ODD, torch.bfloat16, seed=33)
    src.reset_for_new_sequences([5])
    snap = src.save(0, 5)
    before = capture(dst)
    dst.restore(snap, 3)
    for i in range(src.num_layers):
        assert beq(dst.layer(i)[3, :, :, :5], src.layer(i)[0, :, :, :5])
        assert torch.equal(bits(dst.layer(i)[:3]), before["layers"][i][:3])


def test_uniform_manager_and_linear_cache_share_snapshots(device):
    h, d = UNIFORM[0]
    mgr, gen = make_manager(device, UNIFORM, seed=34)
    lin = LinearKVCache(CacheConfig(num_layers=len(UNIFORM), max_batch_size=B, max_seq_len=S, num_kv_heads=h,
                                    head_dim=d, device=device))
    fill_cache(lin, gen)
    mgr.reset_for_new_sequences([6])
    lin.reset_for_new_sequences([2])
    lin.restore(mgr.save(0, 6), 1)
    mgr.restore(lin.save(0, 2), 2)
    for i in range(len(UNIFORM)):
        assert beq(lin.layer(i)[1, :, :, :6], mgr.layer(i)[0, :, :, :6])
        assert beq(mgr.layer(i)[2, :, :, :2], lin.layer(i)[0, :, :, :2])


@pytest.mark.parametrize("batch_idx,seq_len,exc", [
    (3, 1, ValueError), (-1, 1, ValueError), (0, 6, ValueError), (1, 1, ValueError), (0, 1.5, TypeError),
])
def test_save_invalid(device, batch_idx, seq_len, exc):
    cache, _ = make_manager(device, seed=35)
    cache.reset_for_new_sequences([5, 0, S])
    before = capture(cache)
    with pytest.raises(exc):
        cache.save(batch_idx, seq_len)
    assert_unchanged(cache, before)


@pytest.mark.parametrize("case", ["specs_permuted", "heads", "head_dim", "fewer_layers", "dtype", "seq_len",
                                  "batch_idx", "device"])
def test_restore_invalid_changes_nothing(device, other_device, case):
    cache, gen = make_manager(device, HETERO, seed=36)
    cache.reset_for_new_sequences([3, 4])
    specs, n, dtype, dev, batch_idx = list(HETERO), 3, cache.dtype, device, 0
    if case == "specs_permuted":
        specs = [HETERO[1], HETERO[0], HETERO[2]]
    elif case == "heads":
        specs[1] = (4, 80)
    elif case == "head_dim":
        specs[2] = (1, 64)
    elif case == "fewer_layers":
        specs = specs[:2]
    elif case == "dtype":
        dtype = torch.float8_e4m3fn
    elif case == "seq_len":
        n = S + 1
    elif case == "batch_idx":
        batch_idx = B
    else:
        dev = other_device
    layers = [torch.empty(2, h, n, d, dtype=dtype, device=dev) for h, d in specs]
    if dev != other_device:
        for t in layers:
            fill_random(t, gen)
    before = capture(cache)
    with pytest.raises(ValueError):
        cache.restore(KVSnapshot(layers), batch_idx)
    assert_unchanged(cache, before)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_system_prompt_recipe(device, dtype):
    """Restore N saved tokens into two slots, reset with N - 1, prefill from N - 1, commit, evict."""
    cache, gen = make_manager(device, HETERO, dtype, seed=40)
    N = 4
    cache.reset_for_new_sequences([0])
    prompt = []
    for i in range(cache.num_layers):
        p = random_like(cache.layer(i)[0, :, :, :N], gen)
        k, v = cache.kv(i)
        k[0, :, :N], v[0, :, :N] = p[0], p[1]
        prompt.append(p)
    cache.commit(N)
    snap = cache.save(0, N).to("cpu")
    fill_cache(cache, gen)
    snap = snap.to(cache.device)
    cache.restore(snap, 1)
    cache.restore(snap, 3)
    cache.reset_for_new_sequences([0, N - 1, 0, N - 1])
    counts = [2, 3, 5, 1]
    starts = cache.lengths.tolist()
    new = {}
    for b, (start, c) in enumerate(zip(starts, counts)):
        for i in range(cache.num_layers):
            tok = random_like(cache.layer(i)[b, :, :, start:start + c], gen)
            cache.layer(i)[b, :, :, start:start + c] = tok
            new[(b, i)] = tok
    cache.commit(i32(counts))
    assert cache.lengths.tolist() == [2, N - 1 + 3, 5, N]
    before = [layer.clone() for layer in cache_layers(cache)]
    lengths = cache.lengths.tolist()
    mapping = cache.evict([True, False, True, False])
    assert_evicted(cache, before, lengths, [True, False, True, False], mapping)
    for i in range(cache.num_layers):
        for j, b in ((0, 1), (1, 3)):
            assert beq(cache.layer(i)[j, :, :, : N - 1], prompt[i][:, :, : N - 1])
            assert beq(cache.layer(i)[j, :, :, N - 1 : N - 1 + counts[b]], new[(b, i)])
