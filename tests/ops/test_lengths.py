"""increment_lengths and compact_lengths against the independent reference, on both backends."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference as ref
from kvcache.ops import compact_lengths, increment_lengths

HYPOTHESIS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def i32(values, device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def random_lengths(n: int, hi: int, seed: int, device) -> torch.Tensor:
    return torch.randint(0, hi + 1, (n,), generator=ref.generator(seed), dtype=torch.int32).to(device)


# ---------------------------------------------------------------------------------------------------------
# increment_lengths


@pytest.mark.parametrize("n", [1, 5, 16, 37])
@pytest.mark.parametrize("increment", [1, 7, 0, -3])
def test_increment_int(device, n, increment):
    lengths = random_lengths(n, 50, seed=n, device=device) + 3  # >= 3: -3 stays >= 0
    before = lengths.tolist()
    increment_lengths(lengths=lengths, increment=increment)
    expected, rejected = ref.increment_lengths(before, increment)
    assert not rejected
    assert lengths.tolist() == expected
    assert lengths.dtype == torch.int32


@pytest.mark.parametrize("n", [1, 6, 37])
def test_increment_tensor(device, n):
    lengths = random_lengths(n, 100, seed=10 + n, device=device)
    inc = random_lengths(n, 20, seed=20 + n, device=device)
    before, inc_before = lengths.tolist(), inc.clone()
    increment_lengths(lengths=lengths, increment=inc)
    assert lengths.tolist() == ref.increment_lengths(before, inc.tolist())[0]
    assert torch.equal(inc, inc_before)


def test_increment_empty(device):
    lengths = torch.empty(0, dtype=torch.int32, device=device)
    overflow = torch.zeros(1, dtype=torch.int32, device=device)
    increment_lengths(lengths=lengths, increment=1, max_len=4, overflow=overflow)
    assert lengths.numel() == 0 and overflow.tolist() == [0]


@pytest.mark.parametrize("as_tensor", [False, True], ids=["int", "tensor"])
def test_increment_max_len_accepts_bound(device, as_tensor):
    # Reaching max_len exactly is allowed.
    lengths = i32([3, 9, 0, 7, 9], device)
    inc = i32([7, 1, 10, 3, 0], device) if as_tensor else 1
    expected = [10, 10, 10, 10, 9] if as_tensor else [4, 10, 1, 8, 10]
    overflow = torch.zeros(1, dtype=torch.int32, device=device)
    increment_lengths(lengths=lengths, increment=inc, max_len=10, overflow=overflow)
    assert lengths.tolist() == expected
    assert overflow.tolist() == [0]


@pytest.mark.parametrize("with_flag", [True, False], ids=["overflow", "no-overflow"])
@pytest.mark.parametrize(
    "increment",
    [1, [0, 0, 1, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5], 100],
    ids=["int", "tensor", "int-all"],
)
def test_increment_max_len_rejects_all_or_nothing(device, increment, with_flag):
    n = 19
    lengths = random_lengths(n, 30, seed=3, device=device)
    lengths[-1] = 31  # only the last sequence passes max_len (31 + 1 > 31, 31 + 5 > 35)
    max_len = 31 if isinstance(increment, int) else 35
    inc = increment if isinstance(increment, int) else i32(increment, device)
    before = lengths.clone()
    overflow = torch.zeros(1, dtype=torch.int32, device=device) if with_flag else None
    _, rejected = ref.increment_lengths(before.tolist(), increment, max_len)
    assert rejected  # the case is built to overflow
    increment_lengths(lengths=lengths, increment=inc, max_len=max_len, overflow=overflow)
    assert torch.equal(lengths, before), "a rejected increment changed lengths"
    if with_flag:
        assert overflow.tolist() == [1]


@pytest.mark.parametrize("as_tensor", [False, True], ids=["int", "tensor"])
def test_increment_negative_result_rejected(device, as_tensor):
    lengths = i32([5, 2, 8, 3], device)
    inc = i32([-1, -3, 0, 2], device) if as_tensor else -3  # 2 - 3 < 0
    before = lengths.clone()
    overflow = torch.zeros(1, dtype=torch.int32, device=device)
    increment_lengths(lengths=lengths, increment=inc, max_len=100, overflow=overflow)
    assert torch.equal(lengths, before)
    assert overflow.tolist() == [1]


def test_increment_overflow_never_cleared(device):
    lengths = i32([1, 2, 3], device)
    overflow = torch.ones(1, dtype=torch.int32, device=device)
    increment_lengths(lengths=lengths, increment=1, max_len=10, overflow=overflow)
    assert lengths.tolist() == [2, 3, 4]
    assert overflow.tolist() == [1]


@HYPOTHESIS
@given(
    pairs=st.lists(st.tuples(st.integers(0, 40), st.integers(-10, 10)), min_size=1, max_size=20),
    max_len=st.integers(0, 45),
    as_tensor=st.booleans(),
)
def test_increment_property(device, pairs, max_len, as_tensor):
    old = [p[0] for p in pairs]
    incs = [p[1] for p in pairs]
    increment = incs if as_tensor else incs[0]
    expected, rejected = ref.increment_lengths(old, increment, max_len)
    lengths = i32(old, device)
    overflow = torch.zeros(1, dtype=torch.int32, device=device)
    inc = i32(incs, device) if as_tensor else incs[0]
    increment_lengths(lengths=lengths, increment=inc, max_len=max_len, overflow=overflow)
    assert lengths.tolist() == expected
    assert overflow.tolist() == [int(rejected)]


def _increment_error_cases(device, other_device):
    lengths = lambda: i32([1, 2, 3], device)
    return [
        ("not-tensor", TypeError, "lengths", dict(lengths=[1, 2, 3], increment=1)),
        ("lengths-2d", ValueError, "lengths", dict(lengths=lengths().view(1, 3), increment=1)),
        ("lengths-int64", ValueError, "lengths", dict(lengths=lengths().long(), increment=1)),
        ("lengths-strided", ValueError, "lengths", dict(lengths=i32(range(6), device)[::2], increment=1)),
        ("inc-float", TypeError, "increment", dict(lengths=lengths(), increment=1.0)),
        ("inc-bool", TypeError, "increment", dict(lengths=lengths(), increment=True)),
        ("inc-int64", ValueError, "increment", dict(lengths=lengths(), increment=lengths().long())),
        ("inc-shape", ValueError, "increment", dict(lengths=lengths(), increment=i32([1, 1], device))),
        ("inc-2d", ValueError, "increment", dict(lengths=lengths(), increment=i32([1, 1, 1], device).view(3, 1))),
        ("inc-device", ValueError, "increment",
         dict(lengths=lengths(), increment=torch.ones(3, dtype=torch.int32, device=other_device))),
        ("max-len-neg", ValueError, "max_len", dict(lengths=lengths(), increment=1, max_len=-1)),
        ("max-len-float", TypeError, "max_len", dict(lengths=lengths(), increment=1, max_len=4.0)),
        ("overflow-no-max", ValueError, "overflow",
         dict(lengths=lengths(), increment=1, overflow=torch.zeros(1, dtype=torch.int32, device=device))),
        ("overflow-dtype", ValueError, "overflow",
         dict(lengths=lengths(), increment=1, max_len=9, overflow=torch.zeros(1, dtype=torch.int64, device=device))),
        ("overflow-shape", ValueError, "overflow",
         dict(lengths=lengths(), increment=1, max_len=9, overflow=torch.zeros(2, dtype=torch.int32, device=device))),
        ("overflow-type", TypeError, "overflow", dict(lengths=lengths(), increment=1, max_len=9, overflow=[0])),
    ]


_INC_ERROR_IDS = [c[0] for c in _increment_error_cases("cpu", "meta")]


@pytest.mark.parametrize("case", _INC_ERROR_IDS)
def test_increment_errors(device, other_device, case):
    _, exc, name, kwargs = next(c for c in _increment_error_cases(device, other_device) if c[0] == case)
    snapshot = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    with pytest.raises(exc, match=ref.names(name)):
        increment_lengths(**kwargs)
    for k, v in snapshot.items():
        assert torch.equal(kwargs[k], v), f"{k} changed by a rejected call"


# ---------------------------------------------------------------------------------------------------------
# compact_lengths

MASKS = [
    [False, True, False, True, False, False],
    [True, False, False, False, False],
    [False, False, False, True],
    [False, False, False],
    [True, True, True, True],
    [True],
    [False],
]


@pytest.mark.parametrize("finished", MASKS, ids=lambda m: "".join("x" if f else "." for f in m))
@pytest.mark.parametrize("dst_mode", ["default", "alias", "separate"])
def test_compact_lengths(device, finished, dst_mode):
    old_active = len(finished)
    mapping_list, new_active = ref.build_batch_mapping(finished)
    # Extra entries past old_active hold garbage that must be ignored.
    mapping = i32([*mapping_list, 0, 1], device)
    lengths = random_lengths(old_active + 2, 60, seed=old_active, device=device) + 1
    before = lengths.tolist()
    if dst_mode == "separate":
        dst = torch.full((old_active + 3,), -7, dtype=torch.int32, device=device)
        compact_lengths(lengths=lengths, batch_mapping=mapping, old_active=old_active, new_active=new_active,
                        dst_lengths=dst)
        expected = ref.compact_lengths(before, mapping_list, old_active, new_active, [-7] * (old_active + 3))
        assert dst.tolist() == expected
        assert dst[new_active:].tolist() == [-7] * (old_active + 3 - new_active)
        assert lengths.tolist() == before
    else:
        kw = {"dst_lengths": lengths} if dst_mode == "alias" else {}
        compact_lengths(lengths=lengths, batch_mapping=mapping, old_active=old_active, new_active=new_active, **kw)
        expected = ref.compact_lengths(before, mapping_list, old_active, new_active, before)
        assert lengths.tolist() == expected
        assert lengths[new_active:].tolist() == before[new_active:]
    assert mapping.tolist() == [*mapping_list, 0, 1]


def test_compact_lengths_zero_active(device):
    lengths = i32([4, 5], device)
    compact_lengths(lengths=lengths, batch_mapping=i32([0, 1], device), old_active=0, new_active=0)
    assert lengths.tolist() == [4, 5]


@HYPOTHESIS
@given(finished=st.lists(st.booleans(), min_size=1, max_size=40), seed=st.integers(0, 2**16), alias=st.booleans())
def test_compact_lengths_property(device, finished, seed, alias):
    old_active = len(finished)
    mapping_list, new_active = ref.build_batch_mapping(finished)
    lengths = random_lengths(old_active, 1000, seed=seed, device=device)
    before = lengths.tolist()
    kw = {"dst_lengths": lengths} if alias else {}
    compact_lengths(lengths, i32(mapping_list, device), old_active, new_active, **kw)
    assert lengths.tolist() == ref.compact_lengths(before, mapping_list, old_active, new_active, before)


def _compact_lengths_error_cases(device, other_device):
    m = lambda: i32([0, -1, 1], device)
    ln = lambda: i32([3, 4, 5], device)
    return [
        ("lengths-type", TypeError, "lengths", dict(lengths=[3, 4, 5], batch_mapping=m(), old_active=3, new_active=2)),
        ("mapping-type", TypeError, "batch_mapping",
         dict(lengths=ln(), batch_mapping=[0, -1, 1], old_active=3, new_active=2)),
        ("dst-type", TypeError, "dst_lengths",
         dict(lengths=ln(), batch_mapping=m(), old_active=3, new_active=2, dst_lengths=[0, 0])),
        ("lengths-int64", ValueError, "lengths",
         dict(lengths=ln().long(), batch_mapping=m(), old_active=3, new_active=2)),
        ("mapping-int64", ValueError, "batch_mapping",
         dict(lengths=ln(), batch_mapping=m().long(), old_active=3, new_active=2)),
        ("dst-int64", ValueError, "dst_lengths",
         dict(lengths=ln(), batch_mapping=m(), old_active=3, new_active=2, dst_lengths=ln().long())),
        ("lengths-short", ValueError, "lengths",
         dict(lengths=i32([3, 4], device), batch_mapping=m(), old_active=3, new_active=2)),
        ("mapping-short", ValueError, "batch_mapping",
         dict(lengths=ln(), batch_mapping=i32([0, -1], device), old_active=3, new_active=2)),
        ("dst-short", ValueError, "dst_lengths",
         dict(lengths=ln(), batch_mapping=m(), old_active=3, new_active=2, dst_lengths=i32([9], device))),
        ("lengths-strided", ValueError, "lengths",
         dict(lengths=i32([3, 0, 4, 0, 5, 0], device)[::2], batch_mapping=m(), old_active=3, new_active=2)),
        ("new-gt-old", ValueError, "new_active", dict(lengths=ln(), batch_mapping=m(), old_active=2, new_active=3)),
        ("new-neg", ValueError, "new_active", dict(lengths=ln(), batch_mapping=m(), old_active=3, new_active=-1)),
        ("old-neg", ValueError, "old_active", dict(lengths=ln(), batch_mapping=m(), old_active=-1, new_active=0)),
        ("old-float", TypeError, "old_active", dict(lengths=ln(), batch_mapping=m(), old_active=3.0, new_active=2)),
        # the destination decides the device: with a separate dst on `device`, lengths elsewhere is the error
        ("lengths-device", ValueError, "lengths",
         dict(lengths=torch.ones(3, dtype=torch.int32, device=other_device), batch_mapping=m(), old_active=3,
              new_active=2, dst_lengths=ln())),
        ("mapping-device", ValueError, "batch_mapping",
         dict(lengths=ln(), batch_mapping=torch.ones(3, dtype=torch.int32, device=other_device), old_active=3,
              new_active=2)),
        ("dst-device", ValueError, "dst_lengths",
         dict(lengths=ln(), batch_mapping=m(), old_active=3, new_active=2,
              dst_lengths=torch.ones(3, dtype=torch.int32, device=other_device))),
    ]


@pytest.mark.parametrize("case", [c[0] for c in _compact_lengths_error_cases("cpu", "meta")])
def test_compact_lengths_errors(device, other_device, case):
    _, exc, name, kwargs = next(c for c in _compact_lengths_error_cases(device, other_device) if c[0] == case)
    snapshot = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    with pytest.raises(exc, match=ref.names(name)):
        compact_lengths(**kwargs)
    for k, v in snapshot.items():
        assert torch.equal(kwargs[k], v), f"{k} changed by a rejected call"
