"""save_kv_layer / restore_kv_layer / save_kv_layers / restore_kv_layers: bit-exact against the independent
reference, sentinel-filled destinations, odd shapes, heterogeneous layer lists, both backends."""

from __future__ import annotations

import pytest
import torch

import reference as ref
from kvcache.ops import restore_kv_layer, restore_kv_layers, save_kv_layer, save_kv_layers

KV_DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn]
DTYPE_IDS = ["fp16", "bf16", "fp8"]

# (B, H, S, D, seq_len, batch_idx)
CASES = [
    pytest.param((3, 2, 16, 80, 11, 1), id="d80"),
    pytest.param((2, 3, 12, 96, 12, 1), id="d96-full"),
    pytest.param((4, 1, 9, 72, 1, 3), id="d72-one-token"),
    pytest.param((2, 5, 6, 1, 4, 0), id="d1-h5"),
    pytest.param((3, 7, 5, 3, 0, 2), id="h7-empty"),
    pytest.param((1, 2, 24, 64, 24, 0), id="b1-full"),
    pytest.param((5, 3, 8, 128, 7, 4), id="d128-last-slot"),
    pytest.param((2, 1, 48, 96, 45, 1), id="two-chunks"),  # 45 * 96 elements per row > one 4096 block
]


def _pad(dtype: torch.dtype, misaligned: bool) -> int:
    # A gap of 64 bytes keeps 16-byte alignment; one element of gap makes the tensor start misaligned.
    return torch.empty((), dtype=dtype).element_size() if misaligned else 64


# ---------------------------------------------------------------------------------------------------------
# one layer


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES)
def test_save_kv_layer(device, dtype, case):
    b, h, s_max, d, s, idx = case
    gen = ref.generator(b * 1000 + h * 100 + s)
    src = ref.random_tensor((b, 2, h, s_max, d), dtype, gen, device)
    src_before = src.clone()
    shape = (2, h, s, d)
    arena = ref.Arena(ref.nbytes(shape, dtype) + 128, device)
    dst = arena.tensor(shape, dtype, offset=64)
    save_kv_layer(src=src, dst=dst, batch_idx=idx)
    ref.assert_bits_equal(dst, ref.save_kv_layer(src_before, idx, s), "dst")
    assert arena.gaps_untouched(), "save_kv_layer wrote outside dst"
    ref.assert_bits_equal(src, src_before, "src (must not be written)")


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES)
def test_restore_kv_layer(device, dtype, case):
    b, h, s_max, d, s, idx = case
    gen = ref.generator(b * 1000 + h * 100 + s + 7)
    src = ref.random_tensor((2, h, s, d), dtype, gen, device)
    src_before = src.clone()
    shape = (b, 2, h, s_max, d)
    arena = ref.Arena(ref.nbytes(shape, dtype) + 128, device)
    dst = arena.tensor(shape, dtype, offset=64)  # every byte of the cache holds the sentinel
    expected = ref.restore_kv_layer(dst, src, idx)
    restore_kv_layer(src=src, dst=dst, batch_idx=idx)
    ref.assert_bits_equal(dst, expected, "dst")
    # Explicitly: other slots and tokens >= seq_len are untouched.
    for slot in range(b):
        if slot != idx:
            assert ref.is_sentinel(dst[slot]), f"slot {slot} was written"
    assert ref.is_sentinel(dst[idx, :, :, s:]), "tokens >= seq_len were written"
    assert arena.gaps_untouched(), "restore_kv_layer wrote outside dst"
    ref.assert_bits_equal(src, src_before, "src (must not be written)")


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
def test_save_restore_round_trip(device, dtype, misaligned):
    # Snapshot and cache start one element past a 16-byte boundary when misaligned.
    b, h, s_max, d, s = 3, 3, 20, 40, 17
    gen = ref.generator(11)
    pad = _pad(dtype, misaligned)
    arena = ref.Arena(ref.nbytes((b, 2, h, s_max, d), dtype) * 2 + ref.nbytes((2, h, s, d), dtype) + 512, device)
    cache = arena.tensor((b, 2, h, s_max, d), dtype, offset=pad)
    cache.copy_(ref.random_tensor(cache.shape, dtype, gen, device))
    snap_off = pad + ref.nbytes(cache.shape, dtype) + 64
    snap = arena.tensor((2, h, s, d), dtype, offset=snap_off)
    other_off = snap_off + ref.nbytes(snap.shape, dtype) + 64 + (pad % 16)
    other = arena.tensor((b, 2, h, s_max, d), dtype, offset=other_off)
    save_kv_layer(src=cache, dst=snap, batch_idx=2)
    ref.assert_bits_equal(snap, ref.save_kv_layer(cache, 2, s), "snapshot")
    restore_kv_layer(src=snap, dst=other, batch_idx=0)
    ref.assert_bits_equal(other[0, :, :, :s], cache[2, :, :, :s], "restored prefix")
    assert ref.is_sentinel(other[0, :, :, s:]) and ref.is_sentinel(other[1:])
    assert arena.gaps_untouched()


# ---------------------------------------------------------------------------------------------------------
# lists of layers

# (H_i, S_i, D_i): heads, max length AND head size differ; min S = 9.
HETERO = [(2, 16, 80), (3, 12, 96), (1, 20, 5), (5, 9, 72), (7, 10, 1)]
UNIFORM = [(3, 10, 48)] * 4


def _make_layers(specs, b, dtype, gen, device, alloc):
    """Cache layers ``[B, 2, H_i, S_i, D_i]`` filled with random bits, allocated as ``alloc`` says.

    separate: one allocation each; arena: views of one buffer in reverse order (layer 0 at the highest
    address, so table offsets are negative) with sentinel gaps; stacked: slices ``buf[l]`` of one
    ``[L, B, 2, H, S, D]`` tensor (uniform specs only)."""
    shapes = [(b, 2, h, s, d) for h, s, d in specs]
    if alloc == "separate":
        layers = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
        arena = None
    elif alloc == "stacked":
        assert len(set(shapes)) == 1
        stacked = torch.empty((len(shapes), *shapes[0]), dtype=dtype, device=device)
        layers = [stacked[i] for i in range(len(shapes))]
        arena = None
    else:
        arena = ref.Arena(sum(ref.nbytes(s, dtype) + 96 for s in shapes) + 64, device)
        layers = [None] * len(shapes)
        off = 64
        for i in reversed(range(len(shapes))):
            layers[i] = arena.tensor(shapes[i], dtype, offset=off)
            off += ref.nbytes(shapes[i], dtype) + 96
    for layer in layers:
        layer.copy_(ref.random_tensor(layer.shape, dtype, gen, device))
    return layers, arena


def _make_snapshots(specs, seq_len, dtype, device, packed_arena: bool):
    """Snapshot tensors ``[2, H_i, seq_len, D_i]`` holding the sentinel, inside one arena (with gaps) or
    allocated separately."""
    shapes = [(2, h, seq_len, d) for h, _, d in specs]
    arena = ref.Arena(sum(ref.nbytes(s, dtype) + 64 for s in shapes) + 64, device)
    if packed_arena:
        snaps, off = [], 32
        for shape in shapes:
            snaps.append(arena.tensor(shape, dtype, offset=off))
            off += ref.nbytes(shape, dtype) + 64
        return snaps, arena
    snaps = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        ref.bits(t).copy_(ref.sentinel_like_bits(t))
        snaps.append(t)
    return snaps, None


LAYER_SETS = [
    pytest.param(HETERO, "separate", id="hetero-separate"),
    pytest.param(HETERO, "arena", id="hetero-arena"),
    pytest.param(UNIFORM, "stacked", id="uniform-stacked"),
]


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("specs,alloc", LAYER_SETS)
@pytest.mark.parametrize("seq_len", [0, 1, 6, 9])
def test_save_kv_layers(device, dtype, specs, alloc, seq_len):
    b, idx = 3, 1
    gen = ref.generator(seq_len + 31)
    layers, _ = _make_layers(specs, b, dtype, gen, device, alloc)
    before = [t.clone() for t in layers]
    snaps, snap_arena = _make_snapshots(specs, seq_len, dtype, device, packed_arena=alloc != "separate")
    save_kv_layers(src=layers, dst=snaps, batch_idx=idx, seq_len=seq_len)
    expected = ref.save_kv_layers(before, idx, seq_len)
    for i, (got, want) in enumerate(zip(snaps, expected)):
        ref.assert_bits_equal(got, want, f"dst[{i}]")
    if snap_arena is not None:
        assert snap_arena.gaps_untouched(), "save_kv_layers wrote outside the snapshots"
    for i, (t, t0) in enumerate(zip(layers, before)):
        ref.assert_bits_equal(t, t0, f"src[{i}] (must not be written)")


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("specs,alloc", LAYER_SETS)
@pytest.mark.parametrize("seq_len", [0, 1, 6, 9])
def test_restore_kv_layers(device, dtype, specs, alloc, seq_len):
    b, idx = 3, 2
    gen = ref.generator(seq_len + 77)
    layers, arena = _make_layers(specs, b, dtype, gen, device, alloc)
    for layer in layers:  # the whole cache holds the sentinel
        ref.bits(layer).copy_(ref.sentinel_like_bits(layer))
    snaps = [ref.random_tensor((2, h, seq_len, d), dtype, gen, device) for h, _, d in specs]
    snaps_before = [t.clone() for t in snaps]
    expected = ref.restore_kv_layers(layers, snaps, idx)
    restore_kv_layers(src=snaps, dst=layers, batch_idx=idx, seq_len=seq_len)
    for i, (layer, want) in enumerate(zip(layers, expected)):
        ref.assert_bits_equal(layer, want, f"dst[{i}]")
        assert ref.is_sentinel(layer[:idx]) and ref.is_sentinel(layer[idx + 1 :]), f"dst[{i}]: other slot written"
        assert ref.is_sentinel(layer[idx, :, :, seq_len:]), f"dst[{i}]: tokens >= seq_len written"
    if arena is not None:
        assert arena.gaps_untouched(), "restore_kv_layers wrote outside the layers"
    for i, (t, t0) in enumerate(zip(snaps, snaps_before)):
        ref.assert_bits_equal(t, t0, f"src[{i}] (must not be written)")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=["fp16", "fp8"])
def test_layers_two_chunks_and_round_trip(device, dtype):
    # One layer's rows span two 4096-element blocks; the others are small.
    specs = [(1, 50, 96), (2, 47, 3), (3, 48, 16)]
    b, seq_len = 2, 46
    gen = ref.generator(5)
    layers, _ = _make_layers(specs, b, dtype, gen, device, "separate")
    snaps, _ = _make_snapshots(specs, seq_len, dtype, device, packed_arena=False)
    save_kv_layers(layers, snaps, 1, seq_len)
    for i, (got, want) in enumerate(zip(snaps, ref.save_kv_layers(layers, 1, seq_len))):
        ref.assert_bits_equal(got, want, f"dst[{i}]")
    targets, _ = _make_layers(specs, b, dtype, gen, device, "separate")
    for t in targets:
        ref.bits(t).copy_(ref.sentinel_like_bits(t))
    restore_kv_layers(snaps, targets, 0, seq_len)
    for i, (t, layer) in enumerate(zip(targets, layers)):
        ref.assert_bits_equal(t[0, :, :, :seq_len], layer[1, :, :, :seq_len], f"restored layer {i}")
        assert ref.is_sentinel(t[0, :, :, seq_len:]) and ref.is_sentinel(t[1])


def test_layers_repeated_calls_reuse(device):
    # The per-layer address table is memoised: a second call with the same tensors and new contents (and a
    # different slot) must copy the new contents.
    dtype = torch.bfloat16
    gen = ref.generator(9)
    layers, _ = _make_layers(HETERO, 4, dtype, gen, device, "separate")
    snaps, _ = _make_snapshots(HETERO, 5, dtype, device, packed_arena=True)
    save_kv_layers(layers, snaps, 0, 5)
    for layer in layers:
        layer.copy_(ref.random_tensor(layer.shape, dtype, gen, device))
    save_kv_layers(layers, snaps, 3, 5)
    for i, (got, want) in enumerate(zip(snaps, ref.save_kv_layers(layers, 3, 5))):
        ref.assert_bits_equal(got, want, f"dst[{i}]")


@pytest.mark.parametrize("op", ["save", "restore"])
def test_layers_same_addresses_other_dtype(device, op):
    # Layers and snapshots at the same addresses with the same shapes, first as fp16, then as fp8 (what a
    # caching allocator hands out after a cache is freed and an fp8 one of the same shape is made). Every
    # call must address its own layers: element offsets depend on the element size.
    specs = [(2, 8, 16), (1, 8, 16), (2, 8, 32)]
    b, seq_len, idx = 2, 5, 1
    arena = ref.Arena(16384, device)
    gen = ref.generator(123)
    offsets, off = [], 64
    for h, s, d in specs:
        offsets.append(off)
        off += ref.nbytes((b, 2, h, s, d), torch.float16) + 64
    snap_offsets = []
    for h, _, d in specs:
        snap_offsets.append(off)
        off += ref.nbytes((2, h, seq_len, d), torch.float16) + 64
    for dtype in (torch.float16, torch.float8_e4m3fn):
        ref.bits(arena.buf).copy_(ref.sentinel_like_bits(arena.buf))
        arena.used.clear()
        layers = [arena.tensor((b, 2, h, s, d), dtype, o) for (h, s, d), o in zip(specs, offsets)]
        snaps = [arena.tensor((2, h, seq_len, d), dtype, o) for (h, _, d), o in zip(specs, snap_offsets)]
        if op == "save":
            for t in layers:
                t.copy_(ref.random_tensor(t.shape, dtype, gen, device))
            before = [t.clone() for t in layers]
            save_kv_layers(layers, snaps, idx, seq_len)
            for i, (got, want) in enumerate(zip(snaps, ref.save_kv_layers(before, idx, seq_len))):
                ref.assert_bits_equal(got, want, f"{dtype} dst[{i}]")
        else:
            for t in snaps:
                t.copy_(ref.random_tensor(t.shape, dtype, gen, device))
            expected = ref.restore_kv_layers(layers, snaps, idx)
            restore_kv_layers(snaps, layers, idx, seq_len)
            for i, (got, want) in enumerate(zip(layers, expected)):
                ref.assert_bits_equal(got, want, f"{dtype} dst[{i}]")
        assert arena.gaps_untouched(), f"{dtype}: wrote outside the layers and snapshots"


# ---------------------------------------------------------------------------------------------------------
# errors


def _one_layer_cases(device, other_device):
    """(id, exception, argument named, cache, snapshot, batch_idx) for save_kv_layer (cache = src)."""
    b, h, s_max, d, s = 3, 2, 8, 16, 5
    fp16 = torch.float16
    c = lambda: torch.randn((b, 2, h, s_max, d), device=device).to(fp16)
    sn = lambda: torch.randn((2, h, s, d), device=device).to(fp16)
    cache_name, snap_name = "{cache}", "{snap}"
    big = torch.randn((b, 2, h, s_max, d * 2), device=device).to(fp16)
    cache_for_overlap = c()
    return [
        ("cache-type", TypeError, cache_name, [0], sn(), 0),
        ("snap-type", TypeError, snap_name, c(), [0], 0),
        ("cache-4d", ValueError, cache_name, c()[0], sn(), 0),
        ("cache-dim1", ValueError, cache_name, torch.zeros((b, 3, h, s_max, d), dtype=fp16, device=device) + 1,
         sn(), 0),
        ("cache-fp64", ValueError, cache_name, c().double(), sn().double(), 0),
        ("cache-noncontig", ValueError, cache_name, big[..., ::2], sn(), 0),
        ("snap-3d", ValueError, snap_name, c(), sn()[0], 0),
        ("snap-dtype", ValueError, snap_name, c(), sn().to(torch.bfloat16), 0),
        ("snap-heads", ValueError, snap_name, c(), torch.ones((2, h + 1, s, d), dtype=fp16, device=device), 0),
        ("snap-head-dim", ValueError, snap_name, c(), torch.ones((2, h, s, d + 1), dtype=fp16, device=device), 0),
        ("snap-too-long", ValueError, snap_name, c(), torch.ones((2, h, s_max + 1, d), dtype=fp16, device=device),
         0),
        ("snap-kv", ValueError, snap_name, c(), torch.ones((1, h, s, d), dtype=fp16, device=device), 0),
        ("snap-noncontig", ValueError, snap_name, c(),
         torch.ones((2, h, s, 2 * d), dtype=fp16, device=device)[..., ::2], 0),
        ("snap-device", ValueError, snap_name, c(), torch.ones((2, h, s, d), dtype=fp16, device=other_device), 0),
        ("idx-high", ValueError, "batch_idx", c(), sn(), b),
        ("idx-neg", ValueError, "batch_idx", c(), sn(), -1),
        ("idx-float", TypeError, "batch_idx", c(), sn(), 1.0),
        ("idx-tensor", TypeError, "batch_idx", c(), sn(), torch.tensor(1)),
        ("overlap", ValueError, snap_name, cache_for_overlap,
         cache_for_overlap.view(-1)[: 2 * h * s * d].view(2, h, s, d), 0),
    ]


_ONE_LAYER_IDS = [c[0] for c in _one_layer_cases("cpu", "meta")]


@pytest.mark.parametrize("op", ["save", "restore"])
@pytest.mark.parametrize("case", _ONE_LAYER_IDS)
def test_one_layer_errors(device, other_device, op, case):
    _, exc, name, cache, snap, idx = next(c for c in _one_layer_cases(device, other_device) if c[0] == case)
    # save: src = cache, dst = snapshot; restore: src = snapshot, dst = cache.
    name = name.format(cache="src" if op == "save" else "dst", snap="dst" if op == "save" else "src")
    written = snap if op == "save" else cache
    before = written.clone() if isinstance(written, torch.Tensor) and written.device.type != "meta" else None
    with pytest.raises(exc, match=ref.names(name)):
        if op == "save":
            save_kv_layer(src=cache, dst=snap, batch_idx=idx)
        else:
            restore_kv_layer(src=snap, dst=cache, batch_idx=idx)
    if before is not None:
        ref.assert_bits_equal(written, before, "destination of a rejected call")


def _layers_cases(device, other_device):
    """(id, exception, argument named, cache list, snapshot list, batch_idx, seq_len)."""
    fp16 = torch.float16
    b, s = 2, 4
    specs = [(2, 8, 16), (1, 6, 24)]
    c = lambda: [torch.randn((b, 2, h, sm, d), device=device).to(fp16) for h, sm, d in specs]
    sn = lambda: [torch.randn((2, h, s, d), device=device).to(fp16) for h, _, d in specs]

    def edit(lst, i, value):
        lst = list(lst)
        lst[i] = value
        return lst

    return [
        ("cache-tensor", TypeError, "{cache}", c()[0], sn(), 0, s),
        ("cache-empty", ValueError, "{cache}", [], [], 0, s),
        ("cache-item-type", TypeError, "{cache}[1]", edit(c(), 1, 3), sn(), 0, s),
        ("cache-item-4d", ValueError, "{cache}[1]", edit(c(), 1, c()[1][0]), sn(), 0, s),
        ("cache-item-dtype", ValueError, "{cache}[1]", edit(c(), 1, c()[1].bfloat16()), sn(), 0, s),
        ("cache-item-batch", ValueError, "{cache}[1]",
         edit(c(), 1, torch.ones((b + 1, 2, 1, 6, 24), dtype=fp16, device=device)), sn(), 0, s),
        ("cache-item-noncontig", ValueError, "{cache}[1]",
         edit(c(), 1, torch.ones((b, 2, 1, 6, 48), dtype=fp16, device=device)[..., ::2]), sn(), 0, s),
        ("cache-item-device", ValueError, "{cache}[1]",
         edit(c(), 1, torch.ones((b, 2, 1, 6, 24), dtype=fp16, device=other_device)), sn(), 0, s),
        ("snap-tensor", TypeError, "{snap}", c(), sn()[0], 0, s),
        ("snap-count", ValueError, "{snap}", c(), sn()[:1], 0, s),
        ("snap-item-type", TypeError, "{snap}[1]", c(), edit(sn(), 1, 3), 0, s),
        ("snap-item-shape", ValueError, "{snap}[1]", c(),
         edit(sn(), 1, torch.ones((2, 1, s + 1, 24), dtype=fp16, device=device)), 0, s),
        ("snap-item-heads", ValueError, "{snap}[1]", c(),
         edit(sn(), 1, torch.ones((2, 2, s, 24), dtype=fp16, device=device)), 0, s),
        ("snap-item-dtype", ValueError, "{snap}[1]", c(), edit(sn(), 1, sn()[1].bfloat16()), 0, s),
        ("snap-item-noncontig", ValueError, "{snap}[1]", c(),
         edit(sn(), 1, torch.ones((2, 1, s, 48), dtype=fp16, device=device)[..., ::2]), 0, s),
        ("snap-item-device", ValueError, "{snap}[1]", c(),
         edit(sn(), 1, torch.ones((2, 1, s, 24), dtype=fp16, device=other_device)), 0, s),
        ("idx-high", ValueError, "batch_idx", c(), sn(), b, s),
        ("idx-neg", ValueError, "batch_idx", c(), sn(), -1, s),
        ("idx-float", TypeError, "batch_idx", c(), sn(), 0.0, s),
        ("seq-too-long", ValueError, "seq_len", c(),
         [torch.ones((2, h, 7, d), dtype=fp16, device=device) for h, _, d in specs], 0, 7),  # min S_i = 6
        ("seq-neg", ValueError, "seq_len", c(), sn(), 0, -1),
        ("seq-tensor", TypeError, "seq_len", c(), sn(), 0, torch.tensor(s)),
    ]


_LAYERS_IDS = [c[0] for c in _layers_cases("cpu", "meta")]


@pytest.mark.parametrize("op", ["save", "restore"])
@pytest.mark.parametrize("case", _LAYERS_IDS)
def test_layers_errors(device, other_device, op, case):
    _, exc, name, cache, snaps, idx, seq_len = next(c for c in _layers_cases(device, other_device) if c[0] == case)
    name = name.format(cache="src" if op == "save" else "dst", snap="dst" if op == "save" else "src")
    written = snaps if op == "save" else cache
    before = []
    if isinstance(written, (list, tuple)):
        before = [(t, t.clone()) for t in written if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    with pytest.raises(exc, match=ref.names(name)):
        if op == "save":
            save_kv_layers(src=cache, dst=snaps, batch_idx=idx, seq_len=seq_len)
        else:
            restore_kv_layers(src=snaps, dst=cache, batch_idx=idx, seq_len=seq_len)
    for t, t0 in before:
        ref.assert_bits_equal(t, t0, "destination of a rejected call")


# ---------------------------------------------------------------------------------------------------------
# GPU-sized (slow under the interpreter)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=DTYPE_IDS)
def test_slow_save_restore_large(device, dtype):
    b, h, s_max, d, s, idx = 8, 8, 2048, 128, 2000, 5
    gen = ref.generator(1)
    cache = ref.random_tensor((b, 2, h, s_max, d), dtype, gen, device)
    snap = torch.empty((2, h, s, d), dtype=dtype, device=device)
    ref.bits(snap).copy_(ref.sentinel_like_bits(snap))
    save_kv_layer(src=cache, dst=snap, batch_idx=idx)
    ref.assert_bits_equal(snap, cache[idx, :, :, :s], "dst")
    target = torch.empty_like(cache)
    ref.bits(target).copy_(ref.sentinel_like_bits(target))
    restore_kv_layer(src=snap, dst=target, batch_idx=1)
    ref.assert_bits_equal(target[1, :, :, :s], cache[idx, :, :, :s], "restored")
    assert ref.is_sentinel(target[1, :, :, s:]) and ref.is_sentinel(target[0]) and ref.is_sentinel(target[2:])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=DTYPE_IDS)
def test_slow_layers_large(device, dtype):
    specs = [(8, 1024, 128), (2, 2048, 64), (4, 600, 576), (5, 700, 80)]
    b, seq_len, idx = 6, 555, 4
    gen = ref.generator(2)
    layers, arena = _make_layers(specs, b, dtype, gen, device, "arena")
    snaps, snap_arena = _make_snapshots(specs, seq_len, dtype, device, packed_arena=True)
    save_kv_layers(src=layers, dst=snaps, batch_idx=idx, seq_len=seq_len)
    for i, (snap, layer) in enumerate(zip(snaps, layers)):
        ref.assert_bits_equal(snap, layer[idx, :, :, :seq_len], f"dst[{i}]")
    assert snap_arena.gaps_untouched()
    targets, target_arena = _make_layers(specs, b, dtype, gen, device, "arena")
    for t in targets:
        ref.bits(t).copy_(ref.sentinel_like_bits(t))
    restore_kv_layers(src=snaps, dst=targets, batch_idx=0, seq_len=seq_len)
    for i, (t, layer) in enumerate(zip(targets, layers)):
        ref.assert_bits_equal(t[0, :, :, :seq_len], layer[idx, :, :, :seq_len], f"restored layer {i}")
        assert ref.is_sentinel(t[0, :, :, seq_len:]) and ref.is_sentinel(t[1:])
    assert target_arena.gaps_untouched()
