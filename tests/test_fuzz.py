"""Differential fuzzing (issue 13): random valid inputs for every op, the torch reference against the kernel.

Each example draws an op's inputs (shapes, dtypes, formats, layouts, batch kinds, lengths at 0 and at
capacity), runs the pure-torch reference on CPU copies and the Triton kernel on other copies (compiled on a
GPU when there is one, else through Triton's interpreter), and compares every tensor the op may write, byte
for byte. The exceptions are the interpreter's conversions, bit-exact on the GPU: float32 -> float8_e4m3fn may
differ by one fp8 step (DESIGN.md, "Execution backends"), and float32 -> bfloat16 truncates in Triton's
interpreter (triton 3.9: 1.6953125 - 0.003 becomes 1.6875, torch and the GPU round to 1.6953125), so a
dequantized bf16 output may be one bf16 step lower there. On the GPU, int8 / int4 dequantization ``q * scale +
zero`` may be one fused multiply-add: outputs within one step of the model dtype plus ``2^-22`` of the row's
largest magnitude (the bound of tests/paged/paged_reference.py).

Bounded for CI (a few examples per op, a total well under a minute on 2 cores). ``KVCACHE_FUZZ_EXAMPLES=N``
(read here) sets the examples per test for a longer run, e.g. on the GPU:
``KVCACHE_FUZZ_EXAMPLES=300 python -m pytest tests/test_fuzz.py -q``. CI runs are derandomized and skip
shrinking (a failure prints its drawn values; shrinking through the interpreter takes minutes); the long
profile draws fresh examples and shrinks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvcache import PagedConfig, PagedKVCache, ops
from kvcache._validate import bits as _bits

HAS_CUDA = torch.cuda.is_available()
_N = int(os.environ.get("KVCACHE_FUZZ_EXAMPLES", "0"))


def fuzz(default: int):  # type: ignore[no-untyped-def]
    """Hypothesis settings: ``default`` examples in CI, KVCACHE_FUZZ_EXAMPLES when set."""
    phases = list(Phase) if _N else [Phase.explicit, Phase.reuse, Phase.generate]
    return settings(max_examples=_N or default, deadline=None, derandomize=not _N, database=None, phases=phases,
                    suppress_health_check=list(HealthCheck))


# ---------------------------------------------------------------------------------------------------------
# running one op on both backends


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in ("KVCACHE_TRITON_INTERPRET", "TRITON_INTERPRET")}
    os.environ["KVCACHE_TRITON_INTERPRET"] = "1" if name == "interpreter" else "0"
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_both(fn: Callable[..., object], tensors: Sequence[torch.Tensor]) -> tuple[list, list, object, object]:
    """``fn(*copies)`` on the reference and on the kernel; returns (reference tensors, kernel tensors, reference
    result, kernel result), all on the CPU. ``tensors`` are CPU tensors; ``fn`` writes some of them in place."""
    ref = [t.clone() for t in tensors]
    with backend("torch"):
        ref_out = fn(*ref)
    if HAS_CUDA:
        ker = [t.cuda() for t in tensors]
        ker_out = fn(*ker)
        torch.cuda.synchronize()
        ker = [t.cpu() for t in ker]
        ker_out = _to_cpu(ker_out)
    else:
        ker = [t.clone() for t in tensors]
        with backend("interpreter"):
            ker_out = fn(*ker)
    return ref, ker, ref_out, ker_out


def _to_cpu(x):  # type: ignore[no-untyped-def]
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, tuple):
        return tuple(_to_cpu(y) for y in x)
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    return _bits(t.contiguous())


# (mantissa bits, smallest normal exponent) of the formats whose interpreter conversions may be one step off
_STEP = {torch.float8_e4m3fn: (3, -6), torch.bfloat16: (7, -126)}


def step(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` values at the magnitude of ``x`` (float32): 2^(e - mantissa bits)."""
    mant, emin = _STEP[dtype]
    a = x.abs().clamp(min=2.0**emin)
    return torch.exp2(torch.floor(torch.log2(a)) - mant)


def assert_same(ref: torch.Tensor, ker: torch.Tensor, what: str, *, converted: bool = False,
                fma: bool = False) -> None:
    """Byte-equal; with ``converted`` (the op converted float32 into ``ref.dtype``) and the interpreter, values
    of fp8 / bf16 may be one step apart; with ``fma`` on the GPU, the dequantization bound (module doc)."""
    assert ref.shape == ker.shape and ref.dtype == ker.dtype, what
    if torch.equal(bits(ref), bits(ker)):
        return
    if fma and HAS_CUDA:
        a, b = ref.double(), ker.double()
        mag = torch.maximum(a.abs(), b.abs())
        fi = torch.finfo(ref.dtype)
        ulp = fi.eps * torch.exp2(torch.floor(torch.log2(mag.clamp(min=fi.tiny))))
        tol = ulp + mag.amax(dim=-1, keepdim=True) * 2.0**-22
        if bool((((a - b).abs() <= tol) | (a == b)).all()):
            return
    if converted and ref.dtype in _STEP and not HAS_CUDA:
        a, b = ref.float(), ker.float()
        same_nan = a.isnan() == b.isnan()
        close = ((a - b).abs() <= step(torch.maximum(a.abs(), b.abs()), ref.dtype)) | (a == b) | (a.isnan() & b.isnan())
        if bool(same_nan.all()) and bool(close.all()):
            return
    diff = (bits(ref) != bits(ker)).nonzero()
    first = tuple(int(i) for i in diff[0])
    raise AssertionError(f"{what}: {diff.shape[0]} of {ref.numel()} elements differ; first at {first}: "
                         f"reference {ref[first]}, kernel {ker[first]}")


def random_bits(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(tuple(shape))


def i32(xs) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.tensor(list(xs), dtype=torch.int32)


KV_DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float32]
seeds = st.integers(0, 2**31 - 1)


# ---------------------------------------------------------------------------------------------------------
# linear ops


@fuzz(30)
@given(data=st.data())
def test_fuzz_lengths(data):  # type: ignore[no-untyped-def]
    n = data.draw(st.integers(1, 40), "n")
    max_len = data.draw(st.one_of(st.none(), st.integers(0, 64)), "max_len")
    lengths = i32(data.draw(st.lists(st.integers(0, 64), min_size=n, max_size=n), "lengths"))
    as_tensor = data.draw(st.booleans(), "as_tensor")
    if as_tensor:
        inc = i32(data.draw(st.lists(st.integers(-8, 8), min_size=n, max_size=n), "inc"))
    else:
        inc = torch.tensor([data.draw(st.integers(-8, 8), "inc")], dtype=torch.int32)
    flag = torch.zeros(1, dtype=torch.int32)

    def op(lengths, inc, flag):  # type: ignore[no-untyped-def]
        increment = inc if as_tensor else int(inc[0])
        kw = {} if max_len is None else {"max_len": max_len, "overflow": flag}
        ops.increment_lengths(lengths, increment, **kw)

    ref, ker, _, _ = run_both(op, [lengths, inc, flag])
    assert_same(ref[0], ker[0], "lengths")
    assert_same(ref[2], ker[2], "overflow")

    # compaction of the lengths, order-preserving or not (check=False rule)
    old = data.draw(st.integers(0, n), "old")
    new = data.draw(st.integers(0, old), "new")
    mapping = i32(data.draw(st.lists(st.integers(-2, n + 1), min_size=n, max_size=n), "mapping"))
    ref, ker, _, _ = run_both(lambda L, M: ops.compact_lengths(L, M, old, new), [lengths, mapping])
    assert_same(ref[0], ker[0], "compacted lengths")


@fuzz(20)
@given(data=st.data(), seed=seeds)
def test_fuzz_save_restore(data, seed):  # type: ignore[no-untyped-def]
    dtype = data.draw(st.sampled_from(KV_DTYPES), "dtype")
    B = data.draw(st.integers(1, 3), "B")
    nl = data.draw(st.integers(1, 3), "layers")
    specs = [(data.draw(st.integers(1, 3)), data.draw(st.sampled_from([1, 2, 8, 12]))) for _ in range(nl)]
    S = [data.draw(st.integers(1, 6)) for _ in range(nl)]
    seq_len = data.draw(st.integers(0, min(S)), "seq_len")
    b = data.draw(st.integers(0, B - 1), "batch_idx")
    layers = [random_bits((B, 2, h, s, d), dtype, seed + i) for i, ((h, d), s) in enumerate(zip(specs, S))]
    snaps = [random_bits((2, h, seq_len, d), dtype, seed + 100 + i) for i, (h, d) in enumerate(specs)]
    one = data.draw(st.booleans(), "single-layer op")
    save = data.draw(st.booleans(), "save")

    def op(*ts):  # type: ignore[no-untyped-def]
        cache, snap = list(ts[:nl]), list(ts[nl:])
        if one and save:
            ops.save_kv_layer(cache[0], snap[0], b)
        elif one:
            ops.restore_kv_layer(snap[0], cache[0], b)
        elif save:
            ops.save_kv_layers(cache, snap, b, seq_len)
        else:
            ops.restore_kv_layers(snap, cache, b, seq_len)

    ref, ker, _, _ = run_both(op, layers + snaps)
    for i, (r, k) in enumerate(zip(ref, ker)):
        assert_same(r, k, f"tensor {i}")


def _mapping(data, old: int) -> tuple[list[int], int]:  # type: ignore[no-untyped-def]
    if data.draw(st.booleans(), "order-preserving"):
        finished = data.draw(st.lists(st.booleans(), min_size=old, max_size=old), "finished")
        mapping, j = [], 0
        for f in finished:
            mapping.append(-1 if f else j)
            j += not f
        return mapping, j
    new = data.draw(st.integers(0, old), "new")
    return data.draw(st.lists(st.integers(-2, old + 1), min_size=old, max_size=old), "mapping"), new


@fuzz(20)
@given(data=st.data(), seed=seeds)
def test_fuzz_compaction(data, seed):  # type: ignore[no-untyped-def]
    dtype = data.draw(st.sampled_from(KV_DTYPES), "dtype")
    B = data.draw(st.integers(1, 5), "B")
    old = data.draw(st.integers(0, B), "old")
    mapping, new = _mapping(data, old)
    hetero = data.draw(st.booleans(), "heterogeneous")
    nl = data.draw(st.integers(1, 3), "layers") if hetero else 1
    shapes = [(B, 2, data.draw(st.integers(1, 3)), data.draw(st.integers(1, 5)),
               data.draw(st.sampled_from([1, 4, 6, 16]))) for _ in range(nl)]
    s_min = min(s[3] for s in shapes)
    lens = data.draw(st.lists(st.sampled_from([0, s_min, 1, s_min - 1, s_min + 3]), min_size=B, max_size=B), "lens")
    layers = [random_bits(s, dtype, seed + i) for i, s in enumerate(shapes)]
    tensors = layers + [i32(lens), i32(mapping + [-1] * (B - old))]

    def op(*ts):  # type: ignore[no-untyped-def]
        *ls, lengths, m = ts
        if hetero:
            ops.compact_kv_layers(list(ls), m, lengths, old, new, dst_lengths=lengths)
        else:
            ops.compact_kv_layer(ls[0], m, lengths, old, new, dst_lengths=lengths)

    ref, ker, _, _ = run_both(op, tensors)
    for i, (r, k) in enumerate(zip(ref, ker)):
        assert_same(r, k, f"tensor {i}")

    # any tensor along dim 0, in place or into another tensor
    row = data.draw(st.sampled_from([(3,), (2, 5), ()]), "row shape")
    bdtype = data.draw(st.sampled_from([torch.int8, torch.float16, torch.float32, torch.int64, torch.bool]), "dtype")
    src = random_bits((B, *row), torch.uint8 if bdtype == torch.bool else bdtype, seed + 7)
    if bdtype == torch.bool:
        src = src % 2 == 1
    dst = torch.zeros((new, *row), dtype=bdtype)
    in_place = data.draw(st.booleans(), "in place")
    m = i32(mapping + [-1] * (B - old))

    def op2(s, d, m):  # type: ignore[no-untyped-def]
        ops.compact_batch(s, m, s if in_place else d, old, new)

    ref, ker, _, _ = run_both(op2, [src, dst, m])
    for i, (r, k) in enumerate(zip(ref, ker)):
        assert_same(r, k, f"compact_batch tensor {i}")

    finished = torch.tensor(data.draw(st.lists(st.booleans(), min_size=B, max_size=B), "finished"))
    ref, ker, r_out, k_out = run_both(lambda f: ops.build_batch_mapping(f), [finished])
    assert_same(r_out[0], k_out[0], "mapping")
    assert r_out[1] == k_out[1]


# ---------------------------------------------------------------------------------------------------------
# paged ops


FORMATS = ["auto", "fp8", "int8", "int4"]


def _paged_tensors(kv_dtype: str, layout: str, H: int, D: int, bs: int, nb: int, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    """(pool, params or None) of one layer, filled with random bytes (params: finite positive scales)."""
    cache = PagedKVCache(PagedConfig(1, H, D, bs, nb, dtype=dtype, kv_dtype=kv_dtype, layout=layout, device="cpu"))
    pool = random_bits(cache.pool(0).shape, cache.pool(0).dtype, seed)
    p = cache.params(0)
    params = None if p is None else torch.rand(p.shape, generator=torch.Generator().manual_seed(seed + 1)) + 0.5
    return pool, params


def _tables(data, nb_seq: int, bs: int):  # type: ignore[no-untyped-def]
    """Per sequence: total tokens after the append (0 .. capacity, capacity often), and disjoint block tables."""
    blocks = [data.draw(st.integers(1, 3)) for _ in range(nb_seq)]
    totals = [data.draw(st.one_of(st.just(m * bs), st.integers(0, m * bs))) for m in blocks]
    nb = sum(blocks) + 1
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(data.draw(seeds))).tolist()
    width = max(blocks)
    tables, k = [], 0
    for m in blocks:
        row = perm[k : k + m]
        k += m
        tables.append(row + [row[-1]] * (width - m))  # padding columns: never read (past capacity)
    return totals, tables, nb


@fuzz(25)
@given(data=st.data(), seed=seeds)
def test_fuzz_append_paged(data, seed):  # type: ignore[no-untyped-def]
    kv_dtype = data.draw(st.sampled_from(FORMATS), "kv_dtype")
    layout = data.draw(st.sampled_from(["NHD", "HND"]), "layout")
    dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]), "dtype")
    H = data.draw(st.integers(1, 3), "H")
    D = data.draw(st.sampled_from([2, 8, 12, 32] if kv_dtype == "int4" else [1, 3, 8, 12, 32]), "D")
    bs = data.draw(st.sampled_from([1, 2, 4]), "block_size")
    B = data.draw(st.integers(1, 3), "B")
    totals, tables, nb = _tables(data, B, bs)
    q_lens = [data.draw(st.integers(0, min(t, 5))) for t in totals]
    kv_lens = [t - q for t, q in zip(totals, q_lens)]
    n = sum(q_lens)
    scale = data.draw(st.sampled_from([1.0, 0.05, 30.0]), "value scale")
    gen = torch.Generator().manual_seed(seed)
    k = torch.empty((n, H, D), dtype=dtype)  # copied into fresh tensors: contiguous strides even when empty
    v = torch.empty((n, H, D), dtype=dtype)
    k.copy_(torch.randn((n, H, D), generator=gen) * scale + torch.randn((n, H, 1), generator=gen))
    v.copy_(torch.randn((n, H, D), generator=gen) * scale)
    pool, params = _paged_tensors(kv_dtype, layout, H, D, bs, nb, dtype, seed)
    scales = torch.tensor([data.draw(st.sampled_from([1.0, 0.5, 0.01])), data.draw(st.sampled_from([1.0, 2.0]))],
                          dtype=torch.float32)
    slots = data.draw(st.booleans(), "slot mapping")
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    if slots:
        mapping = []
        for b in range(B):
            for t in range(kv_lens[b], totals[b]):
                mapping.append(tables[b][t // bs] * bs + t % bs)
        skip = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), "skip rows")
        index = [torch.tensor([-1 if s else m for m, s in zip(mapping, skip)], dtype=torch.int64)]
    else:
        index = [i32(sum(tables, [])).view(B, -1), i32(cu), i32(kv_lens)]

    def op(k, v, pool, params, scales, *idx):  # type: ignore[no-untyped-def]
        kw = {"slot_mapping": idx[0]} if slots else {"block_tables": idx[0], "cu_q_lens": idx[1], "kv_lens": idx[2]}
        ops.append_paged_kv(k, v, pool, params if params.numel() else None, kv_dtype=kv_dtype, layout=layout,
                            fp8_scales=scales if kv_dtype == "fp8" else None, **kw)

    p = params if params is not None else torch.empty(0)
    ref, ker, _, _ = run_both(op, [k, v, pool, p, scales, *index])
    assert_same(ref[2], ker[2], f"pool {kv_dtype} {layout}", converted=kv_dtype == "fp8")
    assert_same(ref[3], ker[3], "params")
    assert_same(ref[0], ker[0], "k (input)")


@fuzz(20)
@given(data=st.data(), seed=seeds)
def test_fuzz_gather_paged(data, seed):  # type: ignore[no-untyped-def]
    kv_dtype = data.draw(st.sampled_from(FORMATS), "kv_dtype")
    layout = data.draw(st.sampled_from(["NHD", "HND"]), "layout")
    dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]), "dtype")
    H = data.draw(st.integers(1, 3), "H")
    D = data.draw(st.sampled_from([2, 8, 12]), "D")
    bs = data.draw(st.sampled_from([1, 2, 4]), "block_size")
    B = data.draw(st.integers(1, 3), "B")
    totals, tables, nb = _tables(data, B, bs)
    n = sum(totals)
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn((n, H, D), generator=gen) * 3).to(dtype)
    v = torch.randn((n, H, D), generator=gen).to(dtype)
    pool, params = _paged_tensors(kv_dtype, layout, H, D, bs, nb, dtype, seed)
    scales = torch.tensor([0.5, 2.0], dtype=torch.float32)
    bt = i32(sum(tables, [])).view(B, -1)
    cu = [0]
    for t in totals:
        cu.append(cu[-1] + t)
    fp8 = scales if kv_dtype == "fp8" else None
    with backend("torch"):  # fill the pool once (the reference); both backends then read the same bytes
        ops.append_paged_kv(k, v, pool, params, kv_dtype=kv_dtype, layout=layout, block_tables=bt,
                            cu_q_lens=i32(cu), kv_lens=i32([0] * B), fp8_scales=fp8)
    S_out = max(totals) + data.draw(st.integers(0, 2), "extra output tokens")
    k_out = random_bits((B, H, S_out, D), dtype, seed + 5)
    v_out = random_bits((B, H, S_out, D), dtype, seed + 6)

    def op(pool, params, scales, bt, lens, k_out, v_out):  # type: ignore[no-untyped-def]
        ops.gather_paged_kv(pool, params if params.numel() else None, kv_dtype=kv_dtype, layout=layout,
                            block_tables=bt, kv_lens=lens, k_out=k_out, v_out=v_out,
                            fp8_scales=scales if kv_dtype == "fp8" else None)

    p = params if params is not None else torch.empty(0)
    ref, ker, _, _ = run_both(op, [pool, p, scales, bt, i32(totals), k_out, v_out])
    quant = kv_dtype in ("int8", "int4")
    assert_same(ref[5], ker[5], f"k_out {kv_dtype} {layout}", converted=kv_dtype != "auto", fma=quant)
    assert_same(ref[6], ker[6], f"v_out {kv_dtype} {layout}", converted=kv_dtype != "auto", fma=quant)


@fuzz(15)
@given(data=st.data(), seed=seeds)
def test_fuzz_copy_blocks(data, seed):  # type: ignore[no-untyped-def]
    kv_dtype = data.draw(st.sampled_from(FORMATS), "kv_dtype")
    layout = data.draw(st.sampled_from(["NHD", "HND"]), "layout")
    L = data.draw(st.integers(1, 3), "layers")
    nb = data.draw(st.integers(2, 8), "num_blocks")
    cache = PagedKVCache(PagedConfig(L, 2, 8, 2, nb, dtype=torch.float16, kv_dtype=kv_dtype, layout=layout,
                                     device="cpu"))
    buffers = [random_bits(cache.buffer.shape, cache.buffer.dtype, seed)]
    if cache.params_buffer is not None:
        buffers.append(random_bits(cache.params_buffer.shape, torch.float32, seed + 1))
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(seed)).tolist()
    npairs = data.draw(st.integers(0, nb // 2), "pairs")
    pairs = torch.tensor([[perm[2 * i], perm[2 * i + 1]] for i in range(npairs)], dtype=torch.int64).view(-1, 2)
    check = data.draw(st.booleans(), "check")

    def op(pairs, *bufs):  # type: ignore[no-untyped-def]
        ops.copy_blocks(list(bufs), pairs, check=check)

    ref, ker, _, _ = run_both(op, [pairs, *buffers])
    for i, (r, k) in enumerate(zip(ref[1:], ker[1:])):
        assert_same(r, k, f"buffer {i}")
