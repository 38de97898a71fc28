"""build_batch_mapping, compact_kv_layer, compact_kv_layers and compact_batch against the independent
reference: in place, sentinel-filled untouched regions, heterogeneous layers, race-freedom property."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference as ref
from kvcache.ops import build_batch_mapping, compact_batch, compact_kv_layer, compact_kv_layers
from sweeps import named, pairwise

KV_DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn]
DTYPE_IDS = ["fp16", "bf16", "fp8"]

HYPOTHESIS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def i32(values, device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def mask_id(finished) -> str:
    return "".join("x" if f else "." for f in finished)


def make_lengths(finished, capacity: int, s_max: int, seed: int) -> list[int]:
    """Random lengths in [0, s_max] for ``capacity`` slots; among the kept slots of ``finished`` one holds
    ``s_max`` tokens and (with three or more kept) one holds none. Slots past ``len(finished)`` get s_max."""
    gen = ref.generator(seed)
    lengths = torch.randint(0, s_max + 1, (capacity,), generator=gen).tolist()
    kept = [i for i, f in enumerate(finished) if not f]
    if kept:
        lengths[kept[0]] = s_max
    if len(kept) >= 3:
        lengths[kept[1]] = 0
    for i in range(len(finished), capacity):
        lengths[i] = s_max
    return lengths


def fill_layer(layer: torch.Tensor, lengths, old_active: int, gen: torch.Generator) -> None:
    """Random bits in the valid prefix of each active slot and in every inactive slot (stale data);
    the sentinel at tokens >= lengths[i] of active slots."""
    b = ref.bits(layer)
    b.copy_(ref.sentinel_like_bits(layer))
    for i in range(layer.shape[0]):
        n = lengths[i] if i < old_active else layer.shape[3]
        rnd = ref.random_tensor((2, layer.shape[2], n, layer.shape[4]), layer.dtype, gen, layer.device)
        b[i, :, :, :n].copy_(ref.bits(rnd))


def assert_compacted(layer, before, mapping, lengths, old_active, new_active, what="layer"):
    """Full bit-exact match with the reference, plus the untouched regions spelled out."""
    ref.assert_bits_equal(layer, ref.compact_kv_layer(before, mapping, lengths, old_active, new_active), what)
    ref.assert_bits_equal(layer[new_active:], before[new_active:], f"{what}: slots >= new_active")
    for i in range(old_active):
        j = mapping[i]
        if j >= 0:
            n = lengths[i]
            ref.assert_bits_equal(layer[j, :, :, n:], before[j, :, :, n:], f"{what}: slot {j} tokens >= {n}")
            if j < old_active and lengths[j] <= n:
                # Slot j held the sentinel from its own length on: still there past the moved prefix.
                assert ref.is_sentinel(layer[j, :, :, n:]), f"{what}: slot {j} past the moved length was written"


# ---------------------------------------------------------------------------------------------------------
# build_batch_mapping

MASKS = [
    [False, True, False, True, False, False],
    [True, False, False, False, False, False],
    [False, False, False, True],
    [False, False, False],
    [True, True, True, True, True],
    [True],
    [False],
    [],
    [i % 3 == 1 for i in range(37)],
]


@pytest.mark.parametrize("finished", MASKS, ids=mask_id)
def test_build_batch_mapping(device, finished):
    want_map, want_n = ref.build_batch_mapping(finished)
    t = torch.tensor(finished, dtype=torch.bool, device=device)
    t_before = t.clone()
    mapping, new_active = build_batch_mapping(finished=t)
    assert mapping.dtype == torch.int32 and mapping.device.type == device.type
    assert mapping.tolist() == want_map
    assert isinstance(new_active, int) and new_active == want_n
    assert torch.equal(t, t_before)


@pytest.mark.parametrize("finished", MASKS, ids=mask_id)
def test_build_batch_mapping_list_input(device, finished):
    mapping, new_active = build_batch_mapping(list(finished))
    assert (mapping.tolist(), new_active) == ref.build_batch_mapping(finished)


@pytest.mark.parametrize("finished", MASKS, ids=mask_id)
@pytest.mark.parametrize("count_out", [False, True], ids=["int", "new_active_out"])
def test_build_batch_mapping_out(device, finished, count_out):
    want_map, want_n = ref.build_batch_mapping(finished)
    n = len(finished)
    out = torch.full((n + 3,), -77, dtype=torch.int32, device=device)
    count = torch.full((1,), -5, dtype=torch.int32, device=device) if count_out else None
    t = torch.tensor(finished, dtype=torch.bool, device=device)
    mapping, new_active = build_batch_mapping(t, out=out, new_active_out=count)
    assert mapping.shape == (n,) and (n == 0 or mapping.data_ptr() == out.data_ptr()), "mapping is not out[:n]"
    assert out.tolist() == want_map + [-77] * 3, "out past old_active must be untouched"
    if count_out:
        assert new_active is count
        assert count.tolist() == [want_n]
    else:
        assert new_active == want_n


def test_build_batch_mapping_noncontiguous_finished(device):
    # ``finished`` is an input: the docstring asks for shape [old_active], dtype bool, any device.
    full = torch.tensor([False, True, True, False, False, True, False, False], device=device)
    finished = full[::2]  # [F, T, F, F]
    mapping, new_active = build_batch_mapping(finished)
    assert (mapping.tolist(), new_active) == ref.build_batch_mapping(finished.tolist())


@HYPOTHESIS
@given(finished=st.lists(st.booleans(), min_size=0, max_size=70))
def test_build_batch_mapping_property(device, finished):
    mapping, new_active = build_batch_mapping(torch.tensor(finished, dtype=torch.bool, device=device))
    want_map, want_n = ref.build_batch_mapping(finished)
    assert mapping.tolist() == want_map and new_active == want_n
    kept = [j for j in want_map if j >= 0]
    assert kept == list(range(want_n))  # order-preserving: mapping[i] <= i, increasing


def _mapping_error_cases(device, other_device):
    fin = lambda: torch.tensor([False, True, False], device=device)
    return [
        ("int", TypeError, "finished", dict(finished=3)),
        ("str", TypeError, "finished", dict(finished="ftf")),
        ("list-of-int", TypeError, "finished", dict(finished=[0, 1, 0])),
        ("int32", ValueError, "finished", dict(finished=fin().to(torch.int32))),
        ("2d", ValueError, "finished", dict(finished=fin().view(1, 3))),
        ("out-type", TypeError, "out", dict(finished=fin(), out=[0, 0, 0])),
        ("out-int64", ValueError, "out",
         dict(finished=fin(), out=torch.full((3,), 9, dtype=torch.int64, device=device))),
        ("out-short", ValueError, "out",
         dict(finished=fin(), out=torch.full((2,), 9, dtype=torch.int32, device=device))),
        ("out-strided", ValueError, "out",
         dict(finished=fin(), out=torch.full((6,), 9, dtype=torch.int32, device=device)[::2])),
        ("out-device", ValueError, "out",
         dict(finished=fin(), out=torch.full((3,), 9, dtype=torch.int32, device=other_device))),
        ("count-type", TypeError, "new_active_out", dict(finished=fin(), new_active_out=[0])),
        ("count-int64", ValueError, "new_active_out",
         dict(finished=fin(), new_active_out=torch.full((1,), 9, dtype=torch.int64, device=device))),
        ("count-shape", ValueError, "new_active_out",
         dict(finished=fin(), new_active_out=torch.full((2,), 9, dtype=torch.int32, device=device))),
        ("count-device", ValueError, "new_active_out",
         dict(finished=fin(), new_active_out=torch.full((1,), 9, dtype=torch.int32, device=other_device))),
    ]


@pytest.mark.parametrize("case", [c[0] for c in _mapping_error_cases("cpu", "meta")])
def test_build_batch_mapping_errors(device, other_device, case):
    _, exc, name, kwargs = next(c for c in _mapping_error_cases(device, other_device) if c[0] == case)
    snapshot = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    with pytest.raises(exc, match=ref.names(name)):
        build_batch_mapping(**kwargs)
    for k, v in snapshot.items():
        assert torch.equal(kwargs[k], v), f"{k} changed by a rejected call"


# ---------------------------------------------------------------------------------------------------------
# compact_kv_layer

# (B, H, S, D, finished)
LAYER_CASES = [
    pytest.param((6, 2, 16, 80, [False, True, False, True, False, False]), id="d80-mixed"),
    pytest.param((6, 3, 12, 96, [True, False, False, False, False, False]), id="d96-first-evicted"),
    pytest.param((5, 1, 24, 72, [False, False, False, True]), id="d72-last-evicted-partial-batch"),
    pytest.param((4, 5, 6, 1, [True, True, True, True]), id="d1-h5-all-evicted"),
    pytest.param((3, 7, 5, 3, [False, False, False]), id="h7-none-evicted"),
    pytest.param((6, 2, 8, 128, [False, True, True, False, True, False]), id="d128-holes"),
    pytest.param((3, 1, 48, 96, [True, False, False]), id="two-chunks"),
    pytest.param((6, 2, 4, 16, []), id="empty-batch"),
]


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", LAYER_CASES)
@pytest.mark.parametrize("dst_mode", ["none", "alias", "separate"])
def test_compact_kv_layer(device, dtype, case, dst_mode):
    b, h, s, d, finished = case
    old_active = len(finished)
    mapping_list, new_active = ref.build_batch_mapping(finished)
    lengths_list = make_lengths(finished, b, s, seed=b * 10 + h)
    gen = ref.generator(h * 100 + d)
    layer = torch.empty((b, 2, h, s, d), dtype=dtype, device=device)
    fill_layer(layer, lengths_list, old_active, gen)
    before = layer.clone()
    # Entries past old_active: garbage that must not be used (mapping 0 would copy slot old_active to 0).
    mapping = i32(mapping_list + [0] * (b - old_active), device)
    lengths = i32(lengths_list, device)
    dst = torch.full((b,), -9, dtype=torch.int32, device=device) if dst_mode == "separate" else None
    kw = {"dst_lengths": lengths if dst_mode == "alias" else dst} if dst_mode != "none" else {}
    compact_kv_layer(layer=layer, batch_mapping=mapping, lengths=lengths, old_active=old_active,
                     new_active=new_active, **kw)
    assert_compacted(layer, before, mapping_list, lengths_list, old_active, new_active)
    want_lengths = ref.compact_lengths(lengths_list, mapping_list, old_active, new_active, lengths_list)
    if dst_mode == "none":
        assert lengths.tolist() == lengths_list
    elif dst_mode == "alias":
        assert lengths.tolist() == want_lengths
    else:
        assert dst.tolist() == ref.compact_lengths(lengths_list, mapping_list, old_active, new_active, [-9] * b)
        assert lengths.tolist() == lengths_list
    assert mapping.tolist() == mapping_list + [0] * (b - old_active)


# ---------------------------------------------------------------------------------------------------------
# compact_kv_layers

# (H_i, S_i, D_i): heads, max length AND head size differ; min S = 9.
HETERO = [(2, 16, 80), (3, 12, 96), (1, 20, 5), (5, 9, 72), (7, 10, 1)]


def make_layers(specs, b, dtype, device, alloc):
    shapes = [(b, 2, h, s, d) for h, s, d in specs]
    if alloc == "separate":
        return [torch.empty(shape, dtype=dtype, device=device) for shape in shapes], None
    arena = ref.Arena(sum(ref.nbytes(s, dtype) + 96 for s in shapes) + 64, device)
    layers = [None] * len(shapes)
    off = 64
    for i in reversed(range(len(shapes))):  # layer 0 at the highest address
        layers[i] = arena.tensor(shapes[i], dtype, offset=off)
        off += ref.nbytes(shapes[i], dtype) + 96
    return layers, arena


LAYERS_MASKS = [
    [False, True, False, True, False],
    [True, False, False, False, False],
    [False, False, True, True],
    [True, True, True, True, True],
    [False, False],
]


@pytest.mark.parametrize(("dtype", "alloc", "finished", "dst_mode"), pairwise(
    named(KV_DTYPES, DTYPE_IDS), ["separate", "arena"], named(LAYERS_MASKS, [mask_id(m) for m in LAYERS_MASKS]),
    ["none", "alias", "separate"]))
def test_compact_kv_layers(device, dtype, alloc, finished, dst_mode):
    b = 5
    old_active = len(finished)
    mapping_list, new_active = ref.build_batch_mapping(finished)
    min_s = min(s for _, s, _ in HETERO)
    lengths_list = make_lengths(finished, b, min_s, seed=old_active + 3)
    gen = ref.generator(len(mapping_list) * 7 + new_active)
    layers, arena = make_layers(HETERO, b, dtype, device, alloc)
    for layer in layers:
        fill_layer(layer, lengths_list, old_active, gen)
    before = [t.clone() for t in layers]
    mapping = i32(mapping_list + [0] * (b - old_active), device)
    lengths = i32(lengths_list, device)
    dst = torch.full((b,), -9, dtype=torch.int32, device=device) if dst_mode == "separate" else None
    kw = {"dst_lengths": lengths if dst_mode == "alias" else dst} if dst_mode != "none" else {}
    compact_kv_layers(layers=layers, batch_mapping=mapping, lengths=lengths, old_active=old_active,
                      new_active=new_active, **kw)
    for i, (layer, layer0) in enumerate(zip(layers, before)):
        assert_compacted(layer, layer0, mapping_list, lengths_list, old_active, new_active, f"layers[{i}]")
    if arena is not None:
        assert arena.gaps_untouched(), "compact_kv_layers wrote outside the layers"
    want_lengths = ref.compact_lengths(lengths_list, mapping_list, old_active, new_active, lengths_list)
    if dst_mode == "none":
        assert lengths.tolist() == lengths_list
    elif dst_mode == "alias":
        assert lengths.tolist() == want_lengths
    else:
        assert dst.tolist() == ref.compact_lengths(lengths_list, mapping_list, old_active, new_active, [-9] * b)
        assert lengths.tolist() == lengths_list


def test_compact_kv_layers_same_addresses_other_dtype(device):
    # Layers at the same addresses with the same shapes, first fp16 then fp8 (a freed cache and a new fp8 one
    # from a caching allocator): each call must address its own layers.
    specs = [(2, 8, 16), (1, 8, 16), (2, 8, 32)]
    b = 3
    finished = [True, False, False]
    mapping_list, new_active = ref.build_batch_mapping(finished)
    lengths_list = [5, 8, 3]
    arena = ref.Arena(32768, device)
    offsets, off = [], 64
    for h, s, d in specs:
        offsets.append(off)
        off += ref.nbytes((b, 2, h, s, d), torch.float16) + 64
    gen = ref.generator(77)
    for dtype in (torch.float16, torch.float8_e4m3fn):
        ref.bits(arena.buf).copy_(ref.sentinel_like_bits(arena.buf))
        arena.used.clear()
        layers = [arena.tensor((b, 2, h, s, d), dtype, o) for (h, s, d), o in zip(specs, offsets)]
        for layer in layers:
            fill_layer(layer, lengths_list, 3, gen)
        before = [t.clone() for t in layers]
        compact_kv_layers(layers, i32(mapping_list, device), i32(lengths_list, device), 3, new_active)
        for i, (layer, layer0) in enumerate(zip(layers, before)):
            ref.assert_bits_equal(layer, ref.compact_kv_layer(layer0, mapping_list, lengths_list, 3, new_active),
                                  f"{dtype} layers[{i}]")
        assert arena.gaps_untouched(), f"{dtype}: wrote outside the layers"


# ---------------------------------------------------------------------------------------------------------
# compact_batch

BATCH_DTYPES = [torch.float32, torch.int64, torch.int8, torch.bool, torch.float16]
BATCH_MASKS = [
    [False, True, False, True, False, False],
    [True, False, False, False, False],
    [False, False, False, False, False, True],
    [True, True, True],
]


@pytest.mark.parametrize("dtype", BATCH_DTYPES, ids=str)
@pytest.mark.parametrize("trailing", [(), (3, 5)], ids=["B", "B-3-5"])
@pytest.mark.parametrize("finished", BATCH_MASKS, ids=mask_id)
@pytest.mark.parametrize("mode", ["in-place", "out", "out-exact", "strided-src"])
def test_compact_batch(device, dtype, trailing, finished, mode):
    b = 6
    old_active = len(finished)
    mapping_list, new_active = ref.build_batch_mapping(finished)
    mapping = i32(mapping_list + [0] * (b - old_active), device)
    gen = ref.generator(old_active * 31 + len(trailing))
    arena = None
    if mode == "strided-src":
        # src[i] contiguous, dim 0 strided: a slice of a wider tensor.
        big = ref.random_tensor((b, 2, *trailing), dtype, gen, device)
        src = big[:, 1]
    else:
        src = ref.random_tensor((b, *trailing), dtype, gen, device)
    src_before = src.clone()
    if mode == "in-place":
        dst = src
    elif mode == "out-exact":
        shape = (new_active, *trailing)
        arena = ref.Arena(ref.nbytes(shape, dtype) + 128, device)
        dst = arena.tensor(shape, dtype, offset=64)
    else:
        arena = ref.Arena(ref.nbytes((b, *trailing), dtype) + 128, device)
        dst = arena.tensor((b, *trailing), dtype, offset=64)
    expected = ref.compact_batch(src, mapping_list, dst, old_active, new_active)
    compact_batch(src=src, batch_mapping=mapping, dst=dst, old_active=old_active, new_active=new_active)
    ref.assert_bits_equal(dst, expected, "dst")
    ref.assert_bits_equal(dst[new_active:], expected[new_active:], "dst rows >= new_active")
    if mode == "in-place":
        ref.assert_bits_equal(dst[new_active:], src_before[new_active:], "rows >= new_active (stale)")
    else:
        assert ref.is_sentinel(dst[new_active:]), "rows >= new_active of dst were written"
        assert arena.gaps_untouched(), "compact_batch wrote outside dst"
        ref.assert_bits_equal(src, src_before, "src (must not be written out of place)")


def test_compact_batch_out_of_place_permutation(device):
    # Out of place there is no race: any mapping into [0, new_active) is applied as written.
    src = ref.random_tensor((4, 3), torch.int64, ref.generator(1), device)
    dst = torch.full((4, 3), -1, dtype=torch.int64, device=device)
    compact_batch(src, i32([2, -1, 0, 1], device), dst, 4, 3)
    assert torch.equal(dst[:3], src[[2, 3, 0]])
    assert dst[3].tolist() == [-1, -1, -1]


def test_compact_batch_zero_old_active(device):
    src = ref.random_tensor((3, 2), torch.float32, ref.generator(2), device)
    dst = torch.full((3, 2), 5.0, device=device)
    compact_batch(src, i32([0, 0, 0], device), dst, 0, 0)
    assert dst.tolist() == [[5.0, 5.0]] * 3


# ---------------------------------------------------------------------------------------------------------
# race freedom (in place, random finished masks)


@HYPOTHESIS
@given(
    finished=st.lists(st.booleans(), min_size=1, max_size=6),
    extra_slots=st.integers(0, 2),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(KV_DTYPES),
)
def test_compact_kv_layers_race_free(device, finished, extra_slots, seed, dtype):
    specs = [(2, 6, 24), (1, 5, 40), (3, 7, 8)]
    b = len(finished) + extra_slots
    old_active = len(finished)
    mapping, new_active = build_batch_mapping(torch.tensor(finished, dtype=torch.bool, device=device))
    mapping_list, want_n = ref.build_batch_mapping(finished)
    assert mapping.tolist() == mapping_list and new_active == want_n
    gen = ref.generator(seed)
    lengths_list = torch.randint(0, 6, (b,), generator=gen).tolist()  # <= min S_i = 5
    layers = [torch.empty((b, 2, h, s, d), dtype=dtype, device=device) for h, s, d in specs]
    for layer in layers:
        fill_layer(layer, lengths_list, old_active, gen)
    before = [t.clone() for t in layers]
    lengths = i32(lengths_list, device)
    compact_kv_layers(layers, mapping, lengths, old_active, new_active, dst_lengths=lengths)
    for i, (layer, layer0) in enumerate(zip(layers, before)):
        ref.assert_bits_equal(layer, ref.compact_kv_layer(layer0, mapping_list, lengths_list, old_active, new_active),
                              f"layers[{i}]")
    assert lengths.tolist() == ref.compact_lengths(lengths_list, mapping_list, old_active, new_active, lengths_list)


@HYPOTHESIS
@given(
    finished=st.lists(st.booleans(), min_size=1, max_size=8),
    extra_slots=st.integers(0, 2),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(BATCH_DTYPES),
    trailing=st.sampled_from([(), (3, 5), (70,)]),
)
def test_compact_batch_race_free(device, finished, extra_slots, seed, dtype, trailing):
    b = len(finished) + extra_slots
    old_active = len(finished)
    mapping, new_active = build_batch_mapping(finished)
    mapping_list, _ = ref.build_batch_mapping(finished)
    mapping = mapping.to(device)
    src = ref.random_tensor((b, *trailing), dtype, ref.generator(seed), device)
    expected = ref.compact_batch(src, mapping_list, src, old_active, new_active)
    compact_batch(src, mapping, src, old_active, new_active)
    ref.assert_bits_equal(src, expected, "src (in place)")


# ---------------------------------------------------------------------------------------------------------
# check=True and malformed mappings

BAD_MAPPINGS = [
    pytest.param([1, 0], 2, id="swap"),
    pytest.param([0, 0], 1, id="duplicate"),
    pytest.param([-1, 1], 1, id="gap"),
    pytest.param([0, -2, 1], 2, id="below-minus-one"),
    pytest.param([0, -1, 2], 2, id="skips-a-slot"),
]


@pytest.mark.parametrize("bad,new_active", BAD_MAPPINGS)
@pytest.mark.parametrize("op", ["layer", "layers", "batch-in-place", "batch-out"])
def test_check_rejects_unordered_mapping(device, op, bad, new_active):
    old_active = len(bad)
    b = 4
    gen = ref.generator(3)
    lengths = i32([4, 3, 2, 1], device)
    mapping = i32(bad + [0] * (b - old_active), device)
    if op in ("layer", "layers"):
        layer = ref.random_tensor((b, 2, 2, 4, 8), torch.float16, gen, device)
        before = layer.clone()
        lengths_before = lengths.clone()
        with pytest.raises(ValueError, match=ref.names("batch_mapping")):
            if op == "layer":
                compact_kv_layer(layer, mapping, lengths, old_active, new_active, dst_lengths=lengths, check=True)
            else:
                compact_kv_layers([layer], mapping, lengths, old_active, new_active, dst_lengths=lengths, check=True)
        ref.assert_bits_equal(layer, before, "layer after a rejected call")
        assert torch.equal(lengths, lengths_before)
    else:
        src = ref.random_tensor((b, 3), torch.int64, gen, device)
        dst = src if op == "batch-in-place" else torch.full((b, 3), -1, dtype=torch.int64, device=device)
        src_before, dst_before = src.clone(), dst.clone()
        with pytest.raises(ValueError, match=ref.names("batch_mapping")):
            compact_batch(src, mapping, dst, old_active, new_active, check=True)
        assert torch.equal(src, src_before) and torch.equal(dst, dst_before)


@pytest.mark.parametrize("op", ["layer", "layers", "batch"])
def test_check_accepts_valid_mapping(device, op):
    finished = [True, False, True, False, False]
    mapping_list, new_active = ref.build_batch_mapping(finished)
    mapping = i32(mapping_list, device)
    lengths_list = [3, 4, 0, 2, 4]
    gen = ref.generator(4)
    if op == "batch":
        src = ref.random_tensor((5, 2), torch.float32, gen, device)
        expected = ref.compact_batch(src, mapping_list, src, 5, new_active)
        compact_batch(src, mapping, src, 5, new_active, check=True)
        ref.assert_bits_equal(src, expected)
        return
    layer = torch.empty((5, 2, 1, 4, 8), dtype=torch.bfloat16, device=device)
    fill_layer(layer, lengths_list, 5, gen)
    before = layer.clone()
    lengths = i32(lengths_list, device)
    if op == "layer":
        compact_kv_layer(layer, mapping, lengths, 5, new_active, dst_lengths=lengths, check=True)
    else:
        compact_kv_layers([layer], mapping, lengths, 5, new_active, dst_lengths=lengths, check=True)
    ref.assert_bits_equal(layer, ref.compact_kv_layer(before, mapping_list, lengths_list, 5, new_active))
    assert lengths.tolist() == ref.compact_lengths(lengths_list, mapping_list, 5, new_active, lengths_list)


@pytest.mark.parametrize("op", ["layer", "layers"])
@pytest.mark.parametrize("bad_length", [5, -1])
def test_check_rejects_lengths_out_of_range(device, op, bad_length):
    layer = ref.random_tensor((3, 2, 1, 4, 8), torch.float16, ref.generator(6), device)
    before = layer.clone()
    lengths = i32([2, bad_length, 3], device)
    mapping = i32([-1, 0, 1], device)
    with pytest.raises(ValueError, match=ref.names("lengths")):
        if op == "layer":
            compact_kv_layer(layer, mapping, lengths, 3, 2, dst_lengths=lengths, check=True)
        else:
            compact_kv_layers([layer], mapping, lengths, 3, 2, dst_lengths=lengths, check=True)
    ref.assert_bits_equal(layer, before)
    assert lengths.tolist() == [2, bad_length, 3]


@pytest.mark.parametrize("op", ["layer", "layers", "batch"])
def test_malformed_mapping_never_writes_past_new_active(device, op):
    # Without check, a malformed mapping is documented to be skipped where it would race or leave the
    # compacted range: in place, entries with mapping[i] > i or mapping[i] >= new_active are not applied.
    mapping_list = [1, 0, 3, -1, 2]  # 0 -> 1 (forward: skipped), 1 -> 0, 2 -> 3 (>= new_active: skipped)
    old_active, new_active, b = 5, 2, 6
    mapping = i32(mapping_list + [0], device)
    applied = [-1, 0, -1, -1, -1]  # the only move that the guards let through
    gen = ref.generator(8)
    if op == "batch":
        src = ref.random_tensor((b, 4), torch.int8, gen, device)
        expected = ref.compact_batch(src, applied, src, old_active, new_active)
        compact_batch(src, mapping, src, old_active, new_active)
        ref.assert_bits_equal(src, expected)
        return
    lengths_list = [4, 3, 4, 2, 1, 4]
    layer = torch.empty((b, 2, 2, 4, 8), dtype=torch.float16, device=device)
    fill_layer(layer, lengths_list, old_active, gen)
    before = layer.clone()
    lengths = i32(lengths_list, device)
    if op == "layer":
        compact_kv_layer(layer, mapping, lengths, old_active, new_active)
    else:
        compact_kv_layers([layer], mapping, lengths, old_active, new_active)
    ref.assert_bits_equal(layer[new_active:], before[new_active:], "slots >= new_active")
    ref.assert_bits_equal(layer, ref.compact_kv_layer(before, applied, lengths_list, old_active, new_active))


# ---------------------------------------------------------------------------------------------------------
# errors


def _kv_layer_cases(device, other_device, multi: bool):
    """(id, exception, argument named, kwargs) for compact_kv_layer (multi=False) / compact_kv_layers."""
    b = 3
    lname = "layers[0]" if multi else "layer"
    layer = lambda: torch.randn((b, 2, 2, 4, 8), device=device).to(torch.float16)
    m = lambda: i32([0, -1, 1], device)
    ln = lambda: i32([2, 3, 4], device)

    def kw(**over):
        base = dict(layer=layer(), batch_mapping=m(), lengths=ln(), old_active=3, new_active=2,
                    dst_lengths=i32([7, 7, 7], device))
        base.update(over)
        if multi:
            # A single layer is passed as a one-layer list; ``layers=`` overrides pass the value itself.
            lay = base.pop("layer")
            base["layers"] = over["layers"] if "layers" in over else (lay if isinstance(lay, list) else [lay])
        return base

    cases = [
        ("layer-type", TypeError, lname, kw(layer=3 if not multi else [3])),
        ("layer-4d", ValueError, lname, kw(layer=layer()[0])),
        ("layer-fp64", ValueError, lname, kw(layer=layer().double())),
        ("layer-noncontig", ValueError, lname,
         kw(layer=torch.ones((b, 2, 2, 4, 16), dtype=torch.float16, device=device)[..., ::2])),
        ("mapping-type", TypeError, "batch_mapping", kw(batch_mapping=[0, -1, 1])),
        ("lengths-type", TypeError, "lengths", kw(lengths=[2, 3, 4])),
        ("dst-type", TypeError, "dst_lengths", kw(dst_lengths=[0, 0])),
        ("mapping-int64", ValueError, "batch_mapping", kw(batch_mapping=m().long())),
        ("lengths-int64", ValueError, "lengths", kw(lengths=ln().long())),
        ("dst-int64", ValueError, "dst_lengths", kw(dst_lengths=ln().long())),
        ("mapping-short", ValueError, "batch_mapping", kw(batch_mapping=i32([0, -1], device))),
        ("lengths-short", ValueError, "lengths", kw(lengths=i32([2, 3], device))),
        ("dst-short", ValueError, "dst_lengths", kw(dst_lengths=i32([7], device))),
        ("mapping-2d", ValueError, "batch_mapping", kw(batch_mapping=m().view(1, 3))),
        ("lengths-strided", ValueError, "lengths", kw(lengths=i32([2, 0, 3, 0, 4, 0], device)[::2])),
        ("old-gt-batch", ValueError, "old_active",
         kw(batch_mapping=i32([0, 1, 2, 3], device), lengths=i32([1, 1, 1, 1], device), old_active=4, new_active=4)),
        ("old-neg", ValueError, "old_active", kw(old_active=-1, new_active=0)),
        ("old-float", TypeError, "old_active", kw(old_active=3.0)),
        ("new-gt-old", ValueError, "new_active", kw(old_active=2, new_active=3)),
        ("new-neg", ValueError, "new_active", kw(new_active=-1)),
        ("new-tensor", TypeError, "new_active", kw(new_active=torch.tensor(2))),
        ("mapping-device", ValueError, "batch_mapping",
         kw(batch_mapping=torch.ones(3, dtype=torch.int32, device=other_device))),
        ("lengths-device", ValueError, "lengths", kw(lengths=torch.ones(3, dtype=torch.int32, device=other_device))),
        ("dst-device", ValueError, "dst_lengths",
         kw(dst_lengths=torch.ones(3, dtype=torch.int32, device=other_device))),
    ]
    if multi:
        other = lambda shape, **k: torch.ones(shape, dtype=k.get("dtype", torch.float16), device=k.get("dev", device))
        cases += [
            ("layers-tensor", TypeError, "layers", kw(layers=layer())),
            ("layers-empty", ValueError, "layers", kw(layers=[])),
            ("layers-dtype", ValueError, "layers[1]",
             kw(layer=[layer(), other((b, 2, 1, 4, 8), dtype=torch.bfloat16)])),
            ("layers-batch", ValueError, "layers[1]", kw(layer=[layer(), other((b + 1, 2, 1, 4, 8))])),
            ("layers-device", ValueError, "layers[1]", kw(layer=[layer(), other((b, 2, 1, 4, 8), dev=other_device)])),
            ("layers-noncontig", ValueError, "layers[1]",
             kw(layer=[layer(), other((b, 2, 1, 4, 16))[..., ::2]])),
        ]
    return cases


def _run_error_case(fn, exc, name, kwargs):
    written = [(k, v, v.clone()) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"]
    for k, v in kwargs.items():
        if isinstance(v, list):
            written += [(f"{k}[{i}]", t, t.clone()) for i, t in enumerate(v)
                        if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    with pytest.raises(exc, match=ref.names(name)):
        fn(**kwargs)
    for k, t, t0 in written:
        if t.element_size() > 8:  # complex128: compare its bytes
            t, t0 = t.view(torch.uint8), t0.view(torch.uint8)
        ref.assert_bits_equal(t, t0, f"{k} after a rejected call")


@pytest.mark.parametrize("case", [c[0] for c in _kv_layer_cases("cpu", "meta", multi=False)])
def test_compact_kv_layer_errors(device, other_device, case):
    _, exc, name, kwargs = next(c for c in _kv_layer_cases(device, other_device, False) if c[0] == case)
    _run_error_case(compact_kv_layer, exc, name, kwargs)


@pytest.mark.parametrize("case", [c[0] for c in _kv_layer_cases("cpu", "meta", multi=True)])
def test_compact_kv_layers_errors(device, other_device, case):
    _, exc, name, kwargs = next(c for c in _kv_layer_cases(device, other_device, True) if c[0] == case)
    _run_error_case(compact_kv_layers, exc, name, kwargs)


def _batch_cases(device, other_device):
    b = 4
    src = lambda: torch.randn((b, 3, 5), device=device)
    m = lambda: i32([0, -1, 1, 2], device)
    dst = lambda: torch.full((b, 3, 5), 7.0, device=device)

    def kw(**over):
        base = dict(src=src(), batch_mapping=m(), dst=dst(), old_active=4, new_active=3)
        base.update(over)
        return base

    shared = src()
    return [
        ("src-type", TypeError, "src", kw(src=[1.0])),
        ("dst-type", TypeError, "dst", kw(dst=[1.0])),
        ("mapping-type", TypeError, "batch_mapping", kw(batch_mapping=[0, -1, 1, 2])),
        ("src-0d", ValueError, "src", kw(src=torch.tensor(1.0, device=device), dst=torch.tensor(2.0, device=device),
                                          old_active=0, new_active=0)),
        ("src-complex", TypeError, "src",
         kw(src=torch.ones((b, 3), dtype=torch.complex128, device=device),
            dst=torch.ones((b, 3), dtype=torch.complex128, device=device))),
        ("dst-dtype", ValueError, "dst", kw(dst=dst().double())),
        ("dst-device", ValueError, "dst", kw(dst=torch.ones((b, 3, 5), device=other_device))),
        ("dst-trailing", ValueError, "dst", kw(dst=torch.ones((b, 5, 3), device=device))),
        ("dst-ndim", ValueError, "dst", kw(dst=torch.ones((b, 15), device=device))),
        ("dst-short", ValueError, "dst", kw(dst=torch.ones((2, 3, 5), device=device))),
        ("dst-noncontig", ValueError, "dst", kw(dst=torch.ones((b, 3, 10), device=device)[..., ::2])),
        ("dst-overlap", ValueError, "dst", kw(src=shared, dst=shared[1:])),
        ("mapping-int64", ValueError, "batch_mapping", kw(batch_mapping=m().long())),
        ("mapping-short", ValueError, "batch_mapping", kw(batch_mapping=i32([0, -1, 1], device))),
        ("mapping-2d", ValueError, "batch_mapping", kw(batch_mapping=m().view(2, 2))),
        ("mapping-strided", ValueError, "batch_mapping", kw(batch_mapping=i32([0, 9, -1, 9, 1, 9, 2, 9], device)[::2])),
        ("mapping-device", ValueError, "batch_mapping",
         kw(batch_mapping=torch.ones(4, dtype=torch.int32, device=other_device))),
        ("old-gt-batch", ValueError, "old_active",
         kw(batch_mapping=i32([0, 1, 2, 3, 4], device), old_active=5, new_active=3)),
        ("old-float", TypeError, "old_active", kw(old_active=4.0)),
        ("new-gt-old", ValueError, "new_active", kw(old_active=2, new_active=3)),
        ("new-neg", ValueError, "new_active", kw(new_active=-1)),
        ("src-rows-noncontig", ValueError, "src",
         kw(src=torch.randn((b, 5, 3), device=device).transpose(1, 2))),
    ]


@pytest.mark.parametrize("case", [c[0] for c in _batch_cases("cpu", "meta")])
def test_compact_batch_errors(device, other_device, case):
    _, exc, name, kwargs = next(c for c in _batch_cases(device, other_device) if c[0] == case)
    _run_error_case(compact_batch, exc, name, kwargs)


# ---------------------------------------------------------------------------------------------------------
# GPU-sized (slow under the interpreter): many programs walk the batch at once


@pytest.mark.slow
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slow_compact_large_race_free(device, dtype, seed):
    b, old_active = 64, 60
    specs = [(4, 512, 128), (2, 300, 576), (8, 256, 64)]
    gen = ref.generator(seed)
    finished = (torch.rand(old_active, generator=gen) < 0.4).tolist()
    mapping_list, new_active = ref.build_batch_mapping(finished)
    mapping, n = build_batch_mapping(torch.tensor(finished, device=device))
    assert mapping.tolist() == mapping_list and n == new_active
    lengths_list = make_lengths(finished, b, 256, seed=seed)
    layers = [torch.empty((b, 2, h, s, d), dtype=dtype, device=device) for h, s, d in specs]
    for layer in layers:
        fill_layer(layer, lengths_list, old_active, gen)
    before = [t.clone() for t in layers]
    single = before[0].clone()
    lengths = i32(lengths_list, device)
    compact_kv_layer(single, mapping, lengths, old_active, new_active)
    ref.assert_bits_equal(single, ref.compact_kv_layer(before[0], mapping_list, lengths_list, old_active, new_active))
    compact_kv_layers(layers, mapping, lengths, old_active, new_active, dst_lengths=lengths)
    for i, (layer, layer0) in enumerate(zip(layers, before)):
        ref.assert_bits_equal(layer, ref.compact_kv_layer(layer0, mapping_list, lengths_list, old_active, new_active),
                              f"layers[{i}]")
    assert lengths.tolist() == ref.compact_lengths(lengths_list, mapping_list, old_active, new_active, lengths_list)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", BATCH_DTYPES, ids=str)
def test_slow_compact_batch_large(device, dtype):
    b = 256
    gen = ref.generator(3)
    finished = (torch.rand(b, generator=gen) < 0.5).tolist()
    mapping_list, new_active = ref.build_batch_mapping(finished)
    mapping = i32(mapping_list, device)
    src = ref.random_tensor((b, 33, 129), dtype, gen, device)
    expected = ref.compact_batch(src, mapping_list, src, b, new_active)
    compact_batch(src, mapping, src, b, new_active)
    ref.assert_bits_equal(src, expected, "in place")
