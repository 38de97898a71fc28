"""argmax (greedy pick over logits rows) against torch.argmax(x, dim=-1), bit for bit, on both backends.

Shapes are chosen so the interpreter reaches every path of the kernels: rows of one chunk (the first kernel writes
the result) and of several (partials + combine), full tiles, a partial last tile. Rows split at multiples of
``TILE`` columns (the kernel's tiles and chunks are multiples of it; rows of a few thousand columns are split in
several chunks), so ties and special values sit on both sides of those columns.
"""

from __future__ import annotations

import pytest
import torch

from kvcache.engine.kernels import argmax

TILE = 2048

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAN, INF = float("nan"), float("inf")


def expect_equal(x: torch.Tensor) -> torch.Tensor:
    got = argmax(x)
    want = torch.argmax(x, dim=-1)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],) and got.device == x.device
    assert torch.equal(got, want), f"got {got.tolist()}, want {want.tolist()}"
    return got


def randn(m: int, v: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, v, generator=g).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,v", [(1, 1), (3, 5), (2, 2 * TILE), (2, 2 * TILE + 77), (1, 5 * TILE + 1234)])
def test_random(device, dtype, m, v):
    expect_equal(randn(m, v, dtype, device, seed=m * 100003 + v))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_first_index(device, dtype):
    m, v = 2, 3 * TILE + 300  # several chunks; the last one ends in a partial tile
    chunk = 2 * TILE
    x = randn(m, v, dtype, device, seed=1).clamp(-4, 4)
    # row 0: the maximum in the second tile of the first chunk, in the next chunk (same lane and a lower one), in
    # its partial last tile and at the row's end; first index = BLOCK + 7
    for col in (chunk + 3, v - 1, 2 * TILE + 7, TILE + 7, TILE + 100, 3 * TILE + 5):
        x[0, col] = 9.0
    # row 1: the maximum only in the second chunk, twice, both in the partial tile; first index = 3 * BLOCK + 1
    x[1, 3 * TILE + 200] = 9.0
    x[1, 3 * TILE + 1] = 9.0
    got = expect_equal(x)
    assert got.tolist() == [TILE + 7, 3 * TILE + 1]


def test_ties_same_lane_later_tile(device):
    # the later tile holds the maximum in the same lane: per-lane updates must keep the earlier index
    x = torch.zeros(1, 2 * TILE, device=device)
    x[0, 10] = x[0, TILE + 10] = 1.0
    assert expect_equal(x).tolist() == [10]
    # a lower lane of the later tile has a larger index than a higher lane of the earlier tile
    y = torch.zeros(1, 2 * TILE, device=device)
    y[0, TILE + 3] = y[0, 50] = 1.0
    assert expect_equal(y).tolist() == [50]


def test_ties_at_chunk_boundaries(device):
    m, v = 1, 5 * TILE + 1234
    cases = [(v - 1,), (0, v - 1)]
    for k in range(1, 6):
        b = k * TILE
        cases += [(b - 1, b), (b, min(b - 1 + TILE, v - 1)), (b,), (b - 1, v - 1)]
    for cols in cases:
        x = torch.full((m, v), -1.0, device=device)
        x[0, list(cols)] = 2.0
        assert expect_equal(x).tolist() == [min(cols)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_value_tied(device, dtype):
    # values from a set of 3: ties everywhere, across chunks; fp16 / bf16 compare as their float32 images
    m, v = 3, 2 * TILE + 501
    g = torch.Generator().manual_seed(7)
    x = (torch.randint(-1, 2, (m, v), generator=g).to(dtype) * 0.5).to(device)
    x[1] = x[1].clamp(max=0)  # the maximum 0 in many places, as +0.0 and -0.0
    x[1, :100] = -0.5
    x[1, 100] = -0.0
    expect_equal(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(device, dtype):
    v = 2 * TILE + 99  # columns from 2 * BLOCK on are in another chunk
    rows = torch.full((10, v), -2.0)
    rows[0, 9] = NAN                                  # NaN beats everything
    rows[1, [3, 50]] = INF
    rows[1, [60, 70]] = NAN                           # a NaN after +inf: the first NaN
    rows[2, :] = -INF                                 # all -inf: index 0
    rows[3, :] = -INF
    rows[3, v - 1] = -1e30 if dtype == torch.float32 else -1e4  # anything above -inf wins
    rows[4, 5] = -0.0
    rows[4, 6] = 0.0
    rows[4, :5] = -1.0                                # -0.0 then +0.0: equal, the first
    rows[4, 7:] = -1.0
    rows[5, 1000] = INF
    rows[5, v - 1] = NAN                              # +inf in the first chunk, NaN in the last one
    rows[6, [4, 2 * TILE + 3]] = INF                # +inf tie across chunks
    rows[7, 2 * TILE + 9] = -NAN                    # a NaN with its sign bit set
    rows[8, :] = NAN                                  # all NaN: index 0
    rows[9, 0] = 5.0                                  # the first column
    x = rows.to(dtype).to(device)
    got = expect_equal(x)
    assert got.tolist() == [9, 60, 0, v - 1, 5, v - 1, 4, 2 * TILE + 9, 0, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_extremes(device, dtype):
    fi = torch.finfo(dtype)
    x = torch.tensor([[fi.tiny / 4, fi.tiny / 2, -fi.tiny / 4, 0.0],            # subnormals
                      [-fi.max, -fi.max, -fi.max * 0.5, -INF],                 # only negatives
                      [fi.max, INF, fi.max, -INF]], dtype=dtype, device=device)
    assert expect_equal(x).tolist() == [1, 2, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_strided_slice(device, dtype):
    wide = randn(4, 3 * TILE, dtype, device, seed=3)
    for x in (wide[:, 5:5 + 2 * TILE + 13], wide[::2, : 2 * TILE + 13], wide[1:3, 1:]):
        assert x.stride(1) == 1 and not x.is_contiguous()
        expect_equal(x)


def test_unused_column_stride(device):
    # V == 1: the column stride is never used
    x = torch.randn(1, 3, device=device).t()
    assert x.shape == (3, 1) and x.stride(1) != 1
    assert argmax(x).tolist() == [0, 0, 0]


def test_empty(device):
    x = torch.empty(0, 100, device=device)
    got = argmax(x)
    assert got.dtype == torch.int64 and got.shape == (0,)
    out = torch.empty(0, dtype=torch.int64, device=device)
    assert argmax(x, out=out) is out


@pytest.mark.parametrize("v", [50, 2 * TILE + 77])
def test_out(device, v):
    x = randn(3, v, torch.bfloat16, device, seed=5)
    out = torch.full((3,), -123, dtype=torch.int64, device=device)
    got = argmax(x, out=out)
    assert got is out
    assert torch.equal(out, torch.argmax(x, dim=-1))
    y = randn(3, v, torch.bfloat16, device, seed=6)
    assert argmax(y, out=out) is out  # a second call into the same buffer
    assert torch.equal(out, torch.argmax(y, dim=-1))


def test_bad_logits_raise_and_write_nothing(device):
    x = torch.randn(2, 8, device=device)
    cases = [
        ([[1.0, 2.0]], TypeError, "logits: expected a torch.Tensor, got list"),
        (x.to(torch.int32), ValueError, "logits: expected a float16 / bfloat16 / float32 tensor, got torch.int32"),
        (x.to(torch.float64), ValueError, "got torch.float64"),
        (x[0], ValueError, r"logits: expected a 2-d tensor \[M, V\], got shape \[8\]"),
        (x[None], ValueError, r"got shape \[1, 2, 8\]"),
        (x[:, :0], ValueError, r"logits: expected at least one column \(V >= 1\), got shape \[2, 0\]"),
        (x.t()[:2], ValueError, r"logits: expected contiguous rows \(stride\(1\) == 1\), got strides \(1, 8\)"),
        (x[:, ::2], ValueError, r"stride\(1\) == 1"),
    ]
    for logits, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            argmax(logits)
        out = torch.full((2,), -7, dtype=torch.int64, device=device)
        with pytest.raises(exc, match=msg):
            argmax(logits, out=out)
        assert out.tolist() == [-7, -7]


def test_bad_out_raises_and_writes_nothing(device, other_device):
    x = torch.randn(2, 8, device=device)
    cases = [
        ([0, 0], TypeError, "out: expected a torch.Tensor, got list"),
        (torch.zeros(2, dtype=torch.int32, device=device), ValueError,
         "out: expected dtype torch.int64, got torch.int32"),
        (torch.zeros(2, dtype=torch.float32, device=device), ValueError, "got torch.float32"),
        (torch.zeros(1, dtype=torch.int64, device=device), ValueError, r"out: expected shape \[2\], got \[1\]"),
        (torch.zeros(1, 2, dtype=torch.int64, device=device), ValueError,
         r"out: expected shape \[2\], got \[1, 2\]"),
        (torch.zeros(2, dtype=torch.int64, device=other_device), ValueError, "out: expected device"),
        (torch.zeros(4, dtype=torch.int64, device=device)[::2], ValueError, "out: expected a contiguous tensor"),
    ]
    for out, exc, msg in cases:
        if isinstance(out, torch.Tensor) and out.device == device:
            out.fill_(-7)
        with pytest.raises(exc, match=msg):
            argmax(x, out=out)
        if isinstance(out, torch.Tensor) and out.device == device:
            assert (out == -7).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("m,v", [(2, 1000), (64, 128256)])
def test_cuda_graph_replay(m, v):
    # captured once into a static out, replayed on new logits: no allocation or host value depends on the data
    x = torch.randn(m, v, device="cuda", dtype=torch.bfloat16)
    out = torch.full((m,), -1, dtype=torch.int64, device="cuda")
    argmax(x, out=out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        argmax(x, out=out)
    for seed in range(3):
        x.copy_(torch.randn(m, v, generator=torch.Generator().manual_seed(seed)).to(x))
        x[0, v // 2] = float("nan") if seed == 2 else x[0, v // 2]
        out.fill_(-1)
        graph.replay()
        assert torch.equal(out, torch.argmax(x, dim=-1))
