"""kvcache.bench.ceiling: the copy kernel of both ceilings (bit-exact, through Triton's interpreter on the CPU),
the ceiling as the faster of the two copies, and the bytes both copies count (read + written)."""

from __future__ import annotations

import pytest
import torch

import kvcache.bench.ceiling as ceiling_mod
from kvcache.bench.ceiling import Ceiling, copy_rows, measure_ceiling


@pytest.mark.parametrize("dtype, row", [(torch.float16, 64), (torch.float16, 37), (torch.uint8, 5),
                                        (torch.float32, 3), (torch.int64, 9), (torch.uint8, 24)])
def test_copy_rows_bit_exact(dtype, row):
    gen = torch.Generator().manual_seed(row)
    src = torch.randint(-120, 120, (11, row), generator=gen).to(dtype)
    ids = torch.randperm(11, generator=gen)[:7]
    out = torch.full((7, row), 99, dtype=dtype)
    assert copy_rows(src, ids, out) is out
    assert torch.equal(out, src[ids])
    first = torch.arange(7, dtype=torch.int32)
    assert torch.equal(copy_rows(src, first, torch.empty_like(out)), src[:7])


def test_copy_rows_several_rows_per_program():
    # rows far smaller than a program's 64 KiB piece: one program copies many rows, the last ones masked
    src = torch.arange(300 * 8, dtype=torch.int32).view(300, 8)
    ids = torch.randperm(300, generator=torch.Generator().manual_seed(0))[:257]
    out = torch.zeros((257, 8), dtype=torch.int32)
    copy_rows(src, ids, out)
    assert torch.equal(out, src[ids])


def test_copy_rows_validation():
    src = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="src"):
        copy_rows(src[:, ::2], torch.tensor([0]), torch.empty(1, 4))
    with pytest.raises(ValueError, match="ids"):
        copy_rows(src, torch.tensor([0.0]), torch.empty(1, 8))
    with pytest.raises(ValueError, match=r"out: expected a contiguous tensor of shape \[2, 8\], got \[2, 4\]"):
        copy_rows(src, torch.tensor([0, 1]), torch.empty(2, 4))
    with pytest.raises(ValueError, match="out"):
        copy_rows(src, torch.tensor([0, 1]), torch.empty(2, 8, dtype=torch.float16))


def test_ceiling_is_the_faster_copy():
    # 4 GB moved: 1000 us -> 4000 GB/s, 1250 us -> 3200 GB/s
    fast_contiguous = Ceiling(contiguous_us=1000.0, same_pattern_us=1250.0, bytes=4_000_000_000)
    assert fast_contiguous.contiguous_gbs == pytest.approx(4000.0)
    assert fast_contiguous.same_pattern_gbs == pytest.approx(3200.0)
    assert fast_contiguous.gbs == pytest.approx(4000.0)
    fast_pattern = Ceiling(contiguous_us=1430.0, same_pattern_us=1000.0, bytes=4_000_000_000)
    assert fast_pattern.gbs == pytest.approx(4000.0) == fast_pattern.same_pattern_gbs


def test_measure_ceiling_copies_the_same_bytes_both_ways(monkeypatch):
    """Both copies run (contiguous first, then the op's rows) and count the same bytes: read + written of every
    source's rows. The timer is replaced: the test checks the rule, not a speed."""
    data = torch.randint(0, 256, (64, 48), dtype=torch.uint8)
    params = torch.randn(64, 4)
    ids = torch.tensor([9, 3, 40, 41, 7])
    seen: list[int] = []

    def fake_timer(fn, **kwargs):
        fn()  # the copies run (through the interpreter on the CPU)
        seen.append(len(seen))
        return (100.0 if len(seen) == 1 else 80.0), True

    monkeypatch.setattr(ceiling_mod, "graph_replay_us", fake_timer)
    c = measure_ceiling([data, params], ids)
    assert c.bytes == 2 * (5 * 48 + 5 * 4 * 4)
    assert seen == [0, 1] and (c.contiguous_us, c.same_pattern_us) == (100.0, 80.0)
    assert c.gbs == c.same_pattern_gbs == pytest.approx(c.bytes / 80e3)
    with pytest.raises(ValueError, match="srcs"):
        measure_ceiling([data[:3]], ids)
