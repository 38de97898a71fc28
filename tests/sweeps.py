"""Parameter sweeps that run whole on a GPU and as a cover of their values on the CPU.

A kernel test over several axes (batch shapes x launch shapes x formats x RoPE ...) runs every combination where
the kernels are compiled, and in the default CPU suite only a cover: a subset in which every pair of values of any
two axes occurs at least once (:func:`pairwise`: 144 combinations of 3 x 2 x 6 x 2 x 2 values become 15), or every
value of every axis (:func:`each_value`: 6, for sweeps whose cases take seconds each under the interpreter). The
rest are marked ``slow`` (run on a GPU, or on the CPU with ``--run-slow`` / ``KVCACHE_TEST_SLOW=1``), which keeps
the CPU suite within its time budget while every value (and with ``pairwise`` every interaction of two) is still
exercised there.

Example::

    @pytest.mark.parametrize(("kv_dtype", "use_rope"), pairwise(FORMATS, named([False, True], ["no-rope", "rope"])))
    def test_append(device, kv_dtype, use_rope): ...
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from _pytest.mark.structures import ParameterSet

__all__ = ["each_value", "named", "pairwise"]


def named(values: Sequence[Any], ids: Sequence[str]) -> list[ParameterSet]:
    """``values`` as pytest params with test ids ``ids`` (one each)."""
    if len(values) != len(ids):
        raise ValueError(f"named: {len(values)} values but {len(ids)} ids")
    return [pytest.param(v, id=i) for v, i in zip(values, ids)]


def _id(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (str, int, float, bool)) or value is None:
        return str(value)
    raise TypeError(f"pairwise: give {value!r} an id (pytest.param(value, id=...) or named(...))")


def _entries(axis: Sequence[Any]) -> list[tuple[tuple[Any, ...], str, tuple[Any, ...]]]:
    """An axis as (values, id, marks); a ParameterSet may carry several values (one axis of several names)."""
    out = []
    for entry in axis:
        if isinstance(entry, ParameterSet):
            ident = entry.id if entry.id is not None else "-".join(_id(v) for v in entry.values)
            out.append((tuple(entry.values), ident, tuple(entry.marks)))
        else:
            out.append(((entry,), _id(entry), ()))
    return out


def _is_slow(marks: tuple[Any, ...]) -> bool:
    return any(m.name == "slow" for m in marks)  # pytest's Mark and MarkDecorator both carry the name


def pairwise(*axes: Sequence[Any]) -> list[ParameterSet]:
    """Every combination of the axes' values (their product, in order), all but a pairwise cover marked ``slow``.

    Each axis is a list of values or ``pytest.param`` entries (their ids and marks are kept). The cover is chosen
    greedily and deterministically (every collecting process picks the same one): repeatedly the combination
    that covers the most pairs of values not yet covered. A value already marked ``slow`` is left out of it.

    Returns the parameter sets for ``pytest.mark.parametrize`` over the axes' names in order.
    """
    return _covered(axes, 2)


def each_value(*axes: Sequence[Any]) -> list[ParameterSet]:
    """As :func:`pairwise`, with a cover in which every value of every axis occurs at least once (for two-axis
    sweeps, whose pairwise cover is their whole product)."""
    return _covered(axes, 1)


def _covered(axes: Sequence[Sequence[Any]], strength: int) -> list[ParameterSet]:
    if len(axes) < 2:
        raise ValueError(f"a sweep needs at least two axes, got {len(axes)}")
    entries = [_entries(a) for a in axes]
    if any(not e for e in entries):
        raise ValueError("a sweep needs at least one value on every axis")
    fast = [[i for i, (_, _, marks) in enumerate(e) if not _is_slow(marks)] for e in entries]
    combos = list(itertools.product(*(range(len(e)) for e in entries)))

    def covers(combo: tuple[int, ...]) -> set[tuple[tuple[int, int], ...]]:
        return {tuple((a, combo[a]) for a in group) for group in itertools.combinations(range(len(combo)), strength)}

    candidates = [c for c in combos if all(c[a] in fast[a] for a in range(len(c)))]
    todo = set().union(*(covers(c) for c in candidates))
    chosen: set[tuple[int, ...]] = set()
    while todo:
        best = max(candidates, key=lambda c: len(covers(c) & todo))
        chosen.add(best)
        todo -= covers(best)
    params = []
    for combo in combos:
        picked = [entries[a][i] for a, i in enumerate(combo)]
        values = tuple(v for vals, _, _ in picked for v in vals)
        marks = [m for _, _, ms in picked for m in ms]
        if combo not in chosen and not _is_slow(tuple(marks)):
            marks.append(pytest.mark.slow)
        params.append(pytest.param(*values, id="-".join(ident for _, ident, _ in picked), marks=marks))
    return params
