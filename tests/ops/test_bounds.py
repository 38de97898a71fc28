"""No kernel writes outside its target for any value read from device memory (issue 13, items 1, 4, 7).

Each op gets device tensors holding out-of-range counts and ids (lengths past the row's capacity, negative,
at the int32 limits; mapping entries past the batch, negative, repeated, out of order) with its targets carved
out of one sentinel-filled arena, and must (a) leave every byte between and around them untouched and (b)
produce exactly what the documented rule says, on the torch path and through the Triton interpreter alike.

The rule for compaction (kvcache.ops.compact, kvcache.ops.lengths): entry ``i`` with ``j = mapping[i]`` is
applied when ``0 <= j < new_active`` and, in place, ``j <= i`` and ``j`` is above every earlier applied entry;
a length is clamped to ``[0, S]``. The expected values below follow that rule with plain Python lists.
"""

from __future__ import annotations

import pytest
import torch

import reference as ref
from kvcache import CacheConfig, KVCacheManager, KVLayerConfig, LinearKVCache, ManagerConfig
from kvcache.ops import (
    build_batch_mapping,
    compact_batch,
    compact_kv_layer,
    compact_kv_layers,
    compact_lengths,
    increment_lengths,
    restore_kv_layers,
    save_kv_layers,
)

I32_MAX = 2**31 - 1
I32_MIN = -(2**31)
MARGIN = 256  # sentinel bytes before, between and after the targets


def i32(values, device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def applied_moves(mapping, old_active: int, new_active: int, in_place: bool = True) -> list[tuple[int, int]]:
    moves, best = [], -1
    for i in range(old_active):
        j = mapping[i]
        if not 0 <= j < new_active:
            continue
        if in_place and (j > i or j <= best):
            continue
        moves.append((i, j))
        best = j
    return moves


def expected_layer(before: torch.Tensor, mapping, lengths, old_active, new_active) -> torch.Tensor:
    """Bits after an in-place compaction (reading ``before`` is exact: the rule never reads a written slot)."""
    old = ref.bits(before)
    out = old.clone()
    s = before.shape[3]
    for i, j in applied_moves(mapping, old_active, new_active):
        n = min(max(lengths[i], 0), s)
        out[j, :, :, :n] = old[i, :, :, :n]
    return out


def expected_lengths(lengths, mapping, old_active, new_active, dst) -> list[int]:
    out = list(dst)
    for i, j in applied_moves(mapping, old_active, new_active):
        out[j] = lengths[i]
    return out


class Targets:
    """Tensors carved out of one sentinel-filled arena, MARGIN bytes apart and around."""

    def __init__(self, specs, device) -> None:
        sizes = [-(-ref.nbytes(shape, dtype) // 16) * 16 for shape, dtype in specs]  # 16-byte aligned starts
        self.arena = ref.Arena(MARGIN + sum(n + MARGIN for n in sizes), device)
        self.tensors = []
        off = MARGIN
        for (shape, dtype), n in zip(specs, sizes):
            self.tensors.append(self.arena.tensor(shape, dtype, off))
            off += n + MARGIN

    def assert_margins(self) -> None:
        assert self.arena.gaps_untouched(), "a byte outside the target tensors was written"


# Planted lengths and mappings: (lengths, mapping, old_active, new_active) over B = 5 slots, S = 3 tokens.
PLANTED = {
    "length-past-capacity": ([1, 12, 2, 3, 0], [-1, 0, 1, -1, 2], 5, 3),
    "length-int32-max": ([I32_MAX, 2, I32_MAX, 1, 3], [0, -1, 1, 2, -1], 5, 3),
    "length-negative": ([2, -1, I32_MIN, -2, 3], [-1, 0, 1, 2, -1], 5, 3),
    "mapping-past-batch": ([3, 2, 1, 3, 2], [7, 0, I32_MAX, 1, 5], 5, 2),
    "mapping-negative": ([3, 2, 1, 3, 2], [-2, I32_MIN, 0, -5, 1], 5, 2),
    "mapping-upward": ([2, 3, 3, 1, 2], [1, 0, -1, 3, 2], 5, 4),
    "mapping-repeated": ([1, 2, 3, 3, 1], [-1, 0, 0, 1, 1], 5, 2),
    "mapping-descending": ([1, 2, 3, 3, 1], [-1, -1, 1, 0, 2], 5, 3),
}


@pytest.mark.parametrize("case", list(PLANTED))
def test_compact_kv_layer_planted(device, case):
    lengths_l, mapping_l, old, new = PLANTED[case]
    shape = (5, 2, 2, 3, 4)
    t = Targets([(shape, torch.float16), ((5,), torch.int32), ((5,), torch.int32)], device)
    layer, lengths, mapping = t.tensors
    layer.copy_(ref.random_tensor(shape, torch.float16, ref.generator(1), device))
    lengths.copy_(i32(lengths_l, device))
    mapping.copy_(i32(mapping_l, device))
    before = layer.clone()
    compact_kv_layer(layer, mapping, lengths, old, new, dst_lengths=lengths)
    t.assert_margins()
    ref.assert_bits_equal(layer, expected_layer(before, mapping_l, lengths_l, old, new), case)
    assert lengths.tolist() == expected_lengths(lengths_l, mapping_l, old, new, lengths_l)
    assert mapping.tolist() == mapping_l


@pytest.mark.parametrize("case", ["length-past-capacity", "length-int32-max", "length-negative", "mapping-upward",
                                  "mapping-repeated"])
def test_compact_kv_layers_heterogeneous_planted(device, case):
    lengths_l, mapping_l, old, new = PLANTED[case]
    shapes = [(5, 2, 1, 3, 4), (5, 2, 3, 2, 8), (5, 2, 2, 4, 2)]  # S = 3, 2, 4: the clamp is per layer
    t = Targets([(s, torch.bfloat16) for s in shapes] + [((5,), torch.int32), ((5,), torch.int32)], device)
    *layers, lengths, mapping = t.tensors
    for k, layer in enumerate(layers):
        layer.copy_(ref.random_tensor(layer.shape, torch.bfloat16, ref.generator(10 + k), device))
    lengths.copy_(i32(lengths_l, device))
    mapping.copy_(i32(mapping_l, device))
    before = [x.clone() for x in layers]
    compact_kv_layers(layers, mapping, lengths, old, new, dst_lengths=lengths)
    t.assert_margins()
    for k, (layer, b) in enumerate(zip(layers, before)):
        ref.assert_bits_equal(layer, expected_layer(b, mapping_l, lengths_l, old, new), f"{case} layer {k}")
    assert lengths.tolist() == expected_lengths(lengths_l, mapping_l, old, new, lengths_l)


@pytest.mark.parametrize("case", ["mapping-past-batch", "mapping-negative", "mapping-upward", "mapping-repeated"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "into-dst"])
def test_compact_batch_planted(device, case, in_place):
    _, mapping_l, old, new = PLANTED[case]
    t = Targets([((5, 3), torch.int16), ((new, 3), torch.int16), ((5,), torch.int32)], device)
    src, dst, mapping = t.tensors
    src.copy_(ref.random_tensor((5, 3), torch.int16, ref.generator(3), device))
    dst.copy_(ref.random_tensor((new, 3), torch.int16, ref.generator(4), device))
    mapping.copy_(i32(mapping_l, device))
    target = src if in_place else dst
    s_before = src.clone()
    expected = target.clone()
    for i, j in applied_moves(mapping_l, old, new, in_place):
        expected[j] = s_before[i]
    compact_batch(src, mapping, target, old, new)
    t.assert_margins()
    assert torch.equal(target, expected)
    if not in_place:
        assert torch.equal(src, s_before)


@pytest.mark.parametrize("case", list(PLANTED))
@pytest.mark.parametrize("separate_dst", [False, True], ids=["in-place", "dst"])
def test_compact_lengths_planted(device, case, separate_dst):
    lengths_l, mapping_l, old, new = PLANTED[case]
    t = Targets([((5,), torch.int32), ((5,), torch.int32), ((new,), torch.int32)], device)
    lengths, mapping, dst = t.tensors
    lengths.copy_(i32(lengths_l, device))
    mapping.copy_(i32(mapping_l, device))
    dst_init = [100 + k for k in range(new)]
    dst.copy_(i32(dst_init, device))
    if separate_dst:
        compact_lengths(lengths, mapping, old, new, dst)
        assert dst.tolist() == expected_lengths(lengths_l, mapping_l, old, new, dst_init)
        assert lengths.tolist() == lengths_l
    else:
        compact_lengths(lengths, mapping, old, new)
        assert lengths.tolist() == expected_lengths(lengths_l, mapping_l, old, new, lengths_l)
    t.assert_margins()


@pytest.mark.parametrize("max_len", [None, 7], ids=["saturate", "max_len"])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["int", "tensor"])
def test_increment_lengths_at_int32_limits(device, max_len, as_tensor):
    start = [I32_MAX - 1, 5, I32_MIN + 2, 0, I32_MAX]
    inc_l = [3, 1, -5, I32_MAX, 1] if as_tensor else None
    t = Targets([((5,), torch.int32), ((5,), torch.int32), ((1,), torch.int32)], device)
    lengths, inc, flag = t.tensors
    lengths.copy_(i32(start, device))
    inc.copy_(i32(inc_l or [0] * 5, device))
    flag.zero_()
    increment = inc if as_tensor else 2
    kwargs = {} if max_len is None else {"max_len": max_len, "overflow": flag}
    increment_lengths(lengths, increment, **kwargs)
    incs = inc_l or [2] * 5
    if max_len is None:
        assert lengths.tolist() == [min(max(a + b, I32_MIN), I32_MAX) for a, b in zip(start, incs)]
        assert flag.tolist() == [0]
    else:  # wrapped sums must not slip into [0, max_len]: the update is refused
        assert lengths.tolist() == start
        assert flag.tolist() == [1]
    t.assert_margins()


def test_increment_lengths_wrap_cannot_pass_the_bound(device):
    # -2**31 + -(2**31 - 1) wraps to 1 in int32; the bound check must see the real sum
    lengths = i32([I32_MIN, 0], device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    increment_lengths(lengths, i32([-(2**31 - 1), 0], device), max_len=4, overflow=flag)
    assert lengths.tolist() == [I32_MIN, 0] and flag.tolist() == [1]


def test_build_batch_mapping_into_a_view(device):
    t = Targets([((6,), torch.int32), ((1,), torch.int32)], device)
    out, count = t.tensors
    finished = torch.tensor([True, False, True, False, False, True], device=device)
    mapping, n = build_batch_mapping(finished, out=out, new_active_out=count)
    assert mapping.tolist() == [-1, 0, -1, 1, 2, -1] and count.tolist() == [3]
    t.assert_margins()


def test_save_restore_layers_stay_inside(device):
    shapes = [(2, 2, 1, 4, 4), (2, 2, 2, 4, 2)]
    snaps = [(2, 1, 3, 4), (2, 2, 3, 2)]
    t = Targets([(s, torch.float16) for s in shapes + snaps], device)
    layers, dst = t.tensors[:2], t.tensors[2:]
    for k, layer in enumerate(layers):
        layer.copy_(ref.random_tensor(layer.shape, torch.float16, ref.generator(20 + k), device))
    save_kv_layers(layers, dst, 1, 3)
    t.assert_margins()
    for layer, snap in zip(layers, dst):
        ref.assert_bits_equal(snap, layer[1, :, :, :3])
    before = [x.clone() for x in layers]
    restore_kv_layers(dst, layers, 0, 3)
    t.assert_margins()
    for layer, b, snap in zip(layers, before, dst):
        ref.assert_bits_equal(layer[0, :, :, :3], snap)
        ref.assert_bits_equal(layer[0, :, :, 3:], b[0, :, :, 3:])
        ref.assert_bits_equal(layer[1], b[1])


@pytest.mark.parametrize("op", ["save", "restore"])
def test_layers_ops_refuse_overlap(device, op):
    buf = torch.zeros(2 * 2 * 2 * 4 * 4 + 64, dtype=torch.float16, device=device)
    layer = buf[:128].view(2, 2, 2, 4, 4)
    inside = buf[96:128].view(2, 2, 2, 4)  # the last 32 elements of the layer
    outside = buf[128:160].view(2, 2, 2, 4)
    before = buf.clone()
    with pytest.raises(ValueError, match=r"must not overlap"):  # zeros: torch.equal below is bit-exact
        if op == "save":
            save_kv_layers([layer], [inside], 0, 2)
        else:
            restore_kv_layers([inside], [layer], 0, 2)
    assert torch.equal(buf, before)
    a, b = buf[128:160].view(2, 2, 2, 4), buf[144:176].view(2, 2, 2, 4)
    other = torch.zeros_like(layer)
    with pytest.raises(ValueError, match=r"dst\[0\]: must not overlap dst\[1\]"):
        save_kv_layers([layer, other], [a, b], 0, 2)
    save_kv_layers([layer], [outside], 0, 2)  # adjacent, not overlapping: accepted


# ---------------------------------------------------------------------------------------------------------
# the issue's reproductions


def test_issue_compact_kv_layer_view_inside_larger_tensor(device):
    # ops.compact_kv_layer(layer, [-1, 0], lengths=[0, 12], 2, 1) on a view overwrote 24 elements after it
    t = Targets([((2, 2, 1, 3, 8), torch.float16)], device)
    (layer,) = t.tensors
    layer.copy_(ref.random_tensor(layer.shape, torch.float16, ref.generator(5), device))
    before = layer.clone()
    compact_kv_layer(layer, i32([-1, 0], device), i32([0, 12], device), 2, 1)
    t.assert_margins()
    ref.assert_bits_equal(layer[0], before[1])  # the whole row: 12 clamped to S = 3
    ref.assert_bits_equal(layer[1], before[1])


def test_issue_evict_with_planted_length(device):
    c = LinearKVCache(CacheConfig(1, 2, 3, 1, 8, dtype=torch.float16, device=device))
    c.buffer.copy_(ref.random_tensor(c.buffer.shape, torch.float16, ref.generator(6), device))
    c.reset_for_new_sequences([1, 2])
    c.lengths[1] = 12
    before = c.buffer.clone()
    with pytest.raises(ValueError, match=r"^lengths: expected values in \[0, 3\], got \[1, 12\]"):
        c.evict([True, False], check=True)  # the device values, not the host copy
    ref.assert_bits_equal(c.buffer, before)
    assert c.lengths.tolist() == [1, 12] and c.active_batch_size == 2
    c.evict([True, False])
    ref.assert_bits_equal(c.buffer[0, 0], before[0, 1])
    ref.assert_bits_equal(c.buffer[0, 1], before[0, 1])
    assert c.lengths.tolist() == [12] and c.host_lengths() == [12]


def test_manager_evict_with_planted_lengths(device):
    layers = [KVLayerConfig(1, 4), KVLayerConfig(2, 2), KVLayerConfig(1, 6)]
    m = KVCacheManager(ManagerConfig(4, 3, layers, dtype=torch.float16, device=device))
    gen = ref.generator(7)
    for i in range(3):
        m.layer(i).copy_(ref.random_tensor(m.layer(i).shape, torch.float16, gen, device))
    m.reset_for_new_sequences([1, 2, 3, 0])
    m.lengths.copy_(i32([5, I32_MAX, -4, 2], device))
    before = [m.layer(i).clone() for i in range(3)]
    m.evict([True, False, False, False])
    mapping = [-1, 0, 1, 2]
    for i in range(3):  # layers are neighbours in one allocation: an overrun would show in the next one
        ref.assert_bits_equal(m.layer(i), expected_layer(before[i], mapping, [5, I32_MAX, -4, 2], 4, 3), f"layer {i}")
    assert m.lengths.tolist() == [I32_MAX, -4, 2]


def test_non_order_preserving_mapping_data_and_lengths_agree(device):
    # mapping [1, 0, -1]: 0 -> 1 is an upward move (skipped in place); 1 -> 0 is applied. Before the fix the
    # lengths took both moves and described data that was not there.
    lengths_l = [2, 4, 3]
    layer = ref.random_tensor((3, 2, 1, 4, 2), torch.float16, ref.generator(8), device)
    before = layer.clone()
    lengths = i32(lengths_l, device)
    compact_kv_layer(layer, i32([1, 0, -1], device), lengths, 3, 2, dst_lengths=lengths)
    assert lengths.tolist()[:2] == [4, 4]
    ref.assert_bits_equal(layer[0, :, :, :4], before[1, :, :, :4])  # slot 0 holds old slot 1's 4 tokens
    ref.assert_bits_equal(layer[1], before[1])  # slot 1 kept its own 4 tokens, as its length says
