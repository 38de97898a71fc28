"""PagedKVCache block operations (copy_blocks, swap_out / swap_in) and the error contract of every public paged
entry point: TypeError for wrong types, ValueError whose message starts with the argument's name for wrong
shapes / dtypes / devices / modes / ranges, and not one byte of the pool written by a rejected call.
"""

from __future__ import annotations

import pytest
import torch

from kvcache.ops import append_paged_kv, copy_blocks, gather_paged_kv
from kvcache.paged import PagedKVCache, SwappedBlocks
from kvcache.rope import RopeConfig, RopeKernelParams

from . import paged_reference as pr

HAS_CUDA = torch.cuda.is_available()


def _random_bytes(t: torch.Tensor, gen: torch.Generator) -> None:
    """Every byte of the contiguous ``t`` random (NaN payloads included for float pools)."""
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)
    pr.bits(t).view(torch.uint8).copy_(raw.view(pr.bits(t).view(torch.uint8).shape))


def _snapshot(cache: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
    return pr.bits(cache.buffer).cpu().clone(), (
        None if cache.params_buffer is None else pr.bits(cache.params_buffer).cpu().clone()
    )


def _assert_unchanged(cache: PagedKVCache, snap, what: str) -> None:  # type: ignore[no-untyped-def]
    pr.assert_bits_equal(cache.buffer, snap[0], what)
    if snap[1] is not None:
        pr.assert_bits_equal(cache.params_buffer, snap[1], what + " (params)")


# ---------------------------------------------------------------------------------------------------------
# copy_blocks


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8", "int4", "k8v4", "fp8k"])
def test_copy_blocks_every_layer_data_and_params(device, kv_dtype, layout):
    gen = pr.generator(400)
    cache = pr.sentinel_cache(device, num_layers=3, num_kv_heads=3, head_dim=80, block_size=4, num_blocks=9,
                              kv_dtype=kv_dtype, layout=layout)
    _random_bytes(cache.buffer, gen)
    if cache.params_buffer is not None:
        _random_bytes(cache.params_buffer, gen)
    before = _snapshot(cache)
    src, dst = [1, 4, 4], [6, 0, 8]
    cache.copy_blocks(src, dst)
    want = before[0].clone()
    want_p = None if before[1] is None else before[1].clone()
    for s, d in zip(src, dst):
        want[:, d] = before[0][:, s]
        if want_p is not None:
            want_p[:, d] = before[1][:, s]  # type: ignore[index]
    pr.assert_bits_equal(cache.buffer, want, "pool after copy_blocks")
    if want_p is not None:
        pr.assert_bits_equal(cache.params_buffer, want_p, "params after copy_blocks")


def test_copy_blocks_accepts_tensors_and_empty(device):
    gen = pr.generator(401)
    cache = pr.sentinel_cache(device, num_layers=2, num_blocks=6, kv_dtype="int8")
    _random_bytes(cache.buffer, gen)
    _random_bytes(cache.params_buffer, gen)
    before = _snapshot(cache)
    cache.copy_blocks([], [])
    cache.copy_blocks(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))
    _assert_unchanged(cache, before, "after empty copy_blocks")
    cache.copy_blocks(torch.tensor([5], dtype=torch.int32), torch.tensor([2], dtype=torch.int64))
    want = before[0].clone()
    want[:, 2] = before[0][:, 5]
    pr.assert_bits_equal(cache.buffer, want, "pool")


@pytest.mark.parametrize(
    "src, dst, exc, name",
    [
        ([1, 2], [3, 2], ValueError, "dst"),  # dst overlaps a source
        ([1, 2], [3, 3], ValueError, "dst"),  # duplicate destinations
        ([1], [1], ValueError, "dst"),  # copy onto itself
        ([1, 2], [3], ValueError, "dst"),  # lengths differ
        ([6], [0], ValueError, "src"),  # out of range
        ([-1], [0], ValueError, "src"),
        ([0], [6], ValueError, "dst"),
        ([1.0], [2], TypeError, "src"),
        ("12", [2, 3], TypeError, "src"),
        (3, [2], TypeError, "src"),
        ([1], None, TypeError, "dst"),
        (torch.tensor([1.0]), [2], ValueError, "src"),
        (torch.tensor([[1]]), [2], ValueError, "src"),
        ([1], torch.tensor([7]), ValueError, "dst"),
    ],
)
def test_copy_blocks_rejects(device, src, dst, exc, name):
    gen = pr.generator(402)
    cache = pr.sentinel_cache(device, num_layers=2, num_blocks=6, kv_dtype="int4")
    _random_bytes(cache.buffer, gen)
    before = _snapshot(cache)
    with pytest.raises(exc, match=pr.names(name)):
        cache.copy_blocks(src, dst)
    _assert_unchanged(cache, before, "pool after a rejected copy_blocks")


def test_copy_blocks_op_rejects(device, other_device):
    buf = pr.fill_sentinel(torch.empty((2, 4, 16), dtype=torch.float16, device=device))
    good = torch.tensor([[0, 1]], dtype=torch.int64, device=device)
    before = buf.clone()
    cases = [
        (dict(pairs=[[0, 1]]), TypeError, "pairs"),
        (dict(pairs=good.int()), ValueError, "pairs"),
        (dict(pairs=torch.tensor([[0, 1, 2]], device=device)), ValueError, "pairs"),
        (dict(pairs=torch.tensor([0, 1], device=device)), ValueError, "pairs"),
        (dict(pairs=torch.tensor([[0, 1]], device=other_device)), ValueError, "pairs"),
        (dict(buffers=[buf.transpose(1, 2)]), ValueError, "buffers[0]"),
        (dict(buffers=[buf, buf[0]]), ValueError, "buffers[1]"),
    ]
    for kw, exc, name in cases:
        args = dict(buffers=[buf], pairs=good)
        args.update(kw)
        with pytest.raises(exc, match=pr.names(name)):
            copy_blocks(**args)
        pr.assert_bits_equal(buf, before, f"buffer after rejected {list(kw)}")
    copy_blocks(buffers=[buf], pairs=good)
    pr.assert_bits_equal(buf[:, 1], before[:, 0], "copied block")


def test_copy_blocks_op_rejects_ids_out_of_range(device):
    """The op reads the pairs before copying: an id outside [0, num_blocks), a repeated destination or a
    destination that is also a source raises ValueError and nothing is written, not even the valid pairs;
    the buffer is the middle of a larger tensor, whose neighbours stay untouched too."""
    big = pr.fill_sentinel(torch.empty((3, 2, 4, 16), dtype=torch.float16, device=device))
    gen = pr.generator(409)
    big[1] = pr.randn((2, 4, 16), torch.float16, gen, device)
    buf = big[1:2]  # [L=1, num_blocks=2, ...], contiguous
    assert buf.is_contiguous() and buf.data_ptr() == big[1].data_ptr()
    before = big.clone()
    bad = [[[0, 2]], [[0, -1]], [[2, 0]], [[0, 1], [1, 2]], [[0, 1], [0, 1]], [[0, 1], [1, 0]]]
    for pairs in bad:
        with pytest.raises(ValueError, match=pr.names("pairs")):
            copy_blocks([buf], torch.tensor(pairs, dtype=torch.int64, device=device))
        pr.assert_bits_equal(big, before, f"tensor after rejected pairs {pairs}")
    with pytest.raises(TypeError, match=pr.names("check")):
        copy_blocks([buf], torch.tensor([[0, 1]], device=device), check="no")
    with pytest.raises(TypeError, match=pr.names("buffers")):
        copy_blocks(buf, torch.tensor([[0, 1]], device=device))


def test_copy_blocks_op_unchecked_skips_ids_out_of_range(device):
    """With check=False (the caller vouches for the ids) a pair with an id out of range is skipped by the
    kernel and the reference alike: the other pairs are copied, nothing outside the buffer is written."""
    big = pr.fill_sentinel(torch.empty((3, 3, 4, 16), dtype=torch.float16, device=device))
    gen = pr.generator(410)
    big[1] = pr.randn((3, 4, 16), torch.float16, gen, device)
    buf = big[1:2]
    before = big.clone()
    pairs = torch.tensor([[0, 3], [1, 2], [-1, 0], [2, -5], [7, 1]], dtype=torch.int64, device=device)
    copy_blocks([buf], pairs, check=False)
    want = before.clone()
    want[1, 2] = before[1, 1]
    pr.assert_bits_equal(big, want, "tensor after unchecked pairs")


# ---------------------------------------------------------------------------------------------------------
# swap


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int4", "fp8", "fp8k"])
def test_swap_out_swap_in_round_trip(device, kv_dtype, layout):
    """swap_out copies blocks of every layer to (pinned, on a GPU) host memory; swap_in writes them into other
    block ids, of this cache or another of the same shape: bytes identical, nothing else touched."""
    gen = pr.generator(403)
    cache = pr.sentinel_cache(device, num_layers=3, num_kv_heads=2, head_dim=96, block_size=4, num_blocks=10,
                              kv_dtype=kv_dtype, layout=layout)
    _random_bytes(cache.buffer, gen)
    if cache.params_buffer is not None:
        _random_bytes(cache.params_buffer, gen)
    orig = _snapshot(cache)
    stream = torch.cuda.Stream() if cache.device.type == "cuda" else None
    swapped = cache.swap_out([1, 4, 5], stream=stream)
    assert isinstance(swapped, SwappedBlocks) and swapped.num_blocks == 3
    assert swapped.data.device.type == "cpu"
    assert swapped.data.shape == (3, 3, *cache.buffer.shape[2:])
    if cache.device.type == "cuda":
        assert swapped.data.is_pinned() and swapped.event is not None
    else:
        assert swapped.event is None
    assert (swapped.params is None) == (cache.params_buffer is None)
    if swapped.params is not None:
        assert swapped.params.shape == (3, 3, *cache.params_buffer.shape[2:])
        for i, blk in enumerate([1, 4, 5]):
            pr.assert_bits_equal(swapped.params[i], orig[1][:, blk], f"swapped params of block {blk}")
    swapped.synchronize()
    _assert_unchanged(cache, orig, "swap_out must not write the cache")
    for i, blk in enumerate([1, 4, 5]):
        pr.assert_bits_equal(swapped.data[i], orig[0][:, blk], f"swapped block {blk}")
    # the blocks are reused (overwritten), then the data comes back into other ids
    pr.fill_sentinel(cache.buffer)
    if cache.params_buffer is not None:
        pr.fill_sentinel(cache.params_buffer)
    cache.swap_in(swapped, [7, 2, 9], stream=stream)
    if cache.device.type == "cuda":
        torch.cuda.synchronize()
    want = pr.bits(pr.fill_sentinel(torch.empty_like(cache.buffer))).cpu()
    want_p = None if orig[1] is None else pr.bits(pr.fill_sentinel(torch.empty_like(cache.params_buffer))).cpu()
    for src, dst in zip([1, 4, 5], [7, 2, 9]):
        want[:, dst] = orig[0][:, src]
        if want_p is not None:
            want_p[:, dst] = orig[1][:, src]  # type: ignore[index]
    pr.assert_bits_equal(cache.buffer, want, "pool after swap_in")
    if want_p is not None:
        pr.assert_bits_equal(cache.params_buffer, want_p, "params after swap_in")
    # into a second cache of the same config, with a tensor of ids
    other = pr.sentinel_cache(device, num_layers=3, num_kv_heads=2, head_dim=96, block_size=4, num_blocks=10,
                              kv_dtype=kv_dtype, layout=layout)
    other.swap_in(swapped, torch.tensor([0, 1, 2]))
    for i, blk in enumerate([1, 4, 5]):
        pr.assert_bits_equal(other.buffer[:, i], orig[0][:, blk], f"second cache block {i}")
        if orig[1] is not None:
            pr.assert_bits_equal(other.params_buffer[:, i], orig[1][:, blk], f"second cache params of block {i}")


def test_swap_rejects(device):
    gen = pr.generator(404)
    cache = pr.sentinel_cache(device, num_layers=2, num_blocks=6, kv_dtype="int8")
    _random_bytes(cache.buffer, gen)
    before = _snapshot(cache)
    with pytest.raises(ValueError, match=pr.names("block_ids")):
        cache.swap_out([0, 6])
    with pytest.raises(TypeError, match=pr.names("block_ids")):
        cache.swap_out("01")
    swapped = cache.swap_out([0, 3])
    swapped.synchronize()
    cases = [
        (lambda: cache.swap_in("swapped", [1, 2]), TypeError, "swapped"),
        (lambda: cache.swap_in(swapped, [1]), ValueError, "block_ids"),
        (lambda: cache.swap_in(swapped, [1, 6]), ValueError, "block_ids"),
        (lambda: cache.swap_in(swapped, [1, -1]), ValueError, "block_ids"),
        (lambda: cache.swap_in(swapped, [1, 2.0]), TypeError, "block_ids"),
    ]
    other = pr.sentinel_cache(device, num_layers=2, num_blocks=6, head_dim=16, kv_dtype="int8")
    cases.append((lambda: other.swap_in(swapped, [1, 2]), ValueError, "swapped"))
    cases.append((lambda: cache.swap_in(swapped, [1, 1]), ValueError, "block_ids"))
    # blocks of the right shape but not this cache's: scale / zero missing, or data of another dtype
    no_params = SwappedBlocks(swapped.data, None, None)
    cases.append((lambda: cache.swap_in(no_params, [1, 2]), ValueError, "swapped"))
    bad_params = SwappedBlocks(swapped.data, swapped.params[:, :1], None)  # type: ignore[index]
    cases.append((lambda: cache.swap_in(bad_params, [1, 2]), ValueError, "swapped"))
    as_int8 = SwappedBlocks(swapped.data.view(torch.int8), swapped.params, None)
    cases.append((lambda: cache.swap_in(as_int8, [1, 2]), ValueError, "swapped"))
    for fn, exc, name in cases:
        with pytest.raises(exc, match=pr.names(name)):
            fn()
        _assert_unchanged(cache, before, f"pool after a rejected swap ({name})")
    assert pr.is_all_sentinel(other.buffer)


def test_swap_in_rejects_blocks_of_another_format(device):
    """int8 blocks of head_dim 8 and int4 blocks of head_dim 16 have the same storage shape and dtype (8 bytes
    per row); fp16 blocks of an NHD and an HND cache with block_size == heads too; fp8 and fp8k blocks share the
    data pool's shape and dtype. swap_in takes blocks only into a cache of the format they came from: ValueError,
    nothing written."""
    gen = pr.generator(411)
    pairs = [
        (dict(num_kv_heads=2, head_dim=8, kv_dtype="int8"), dict(num_kv_heads=2, head_dim=16, kv_dtype="int4")),
        (dict(num_kv_heads=4, head_dim=8, layout="NHD"), dict(num_kv_heads=4, head_dim=8, layout="HND")),
        (dict(num_kv_heads=2, head_dim=8, kv_dtype="fp8"), dict(num_kv_heads=2, head_dim=8, kv_dtype="fp8k")),
        (dict(num_kv_heads=2, head_dim=8, kv_dtype="fp8k"), dict(num_kv_heads=2, head_dim=8, kv_dtype="fp8")),
    ]
    for src_kw, dst_kw in pairs:
        src = pr.sentinel_cache(device, num_layers=2, block_size=4, num_blocks=6, **src_kw)
        dst = pr.sentinel_cache(device, num_layers=2, block_size=4, num_blocks=6, **dst_kw)
        _random_bytes(src.buffer, gen)
        swapped = src.swap_out([0, 3])
        swapped.synchronize()
        assert swapped.data.shape[1:] == (dst.buffer.shape[0], *dst.buffer.shape[2:])
        before = _snapshot(dst)
        with pytest.raises(ValueError, match=pr.names("swapped")):
            dst.swap_in(swapped, [1, 2])
        _assert_unchanged(dst, before, f"{dst_kw} cache after blocks of {src_kw}")


# ---------------------------------------------------------------------------------------------------------
# append_paged_kv: errors

H, D, BS, NB = 2, 8, 4, 4


def _append_args(device, kv_dtype="auto"):  # type: ignore[no-untyped-def]
    """A valid call: (k, v, pool, params) and keyword arguments, pools sentinel-filled."""
    gen = pr.generator(405)
    dp = D // 2 if kv_dtype == "int4" else D
    sdt = {"auto": torch.float16, "fp8": torch.float8_e4m3fn, "int8": torch.uint8, "int4": torch.uint8,
           "fp8k": torch.float8_e4m3fn}[kv_dtype]
    pool = pr.fill_sentinel(torch.empty((NB, 2, BS, H, dp), dtype=sdt, device=device))
    params = None
    if kv_dtype in ("int8", "int4"):
        params = pr.fill_sentinel(torch.empty((NB, 2, BS, H, 2), dtype=torch.float32, device=device))
    elif kv_dtype == "fp8k":  # one float32 scale per (token, head) of the keys
        params = pr.fill_sentinel(torch.empty((NB, 1, BS, H, 1), dtype=torch.float32, device=device))
    k = pr.randn((5, H, D), torch.float16, gen, device)
    v = pr.randn((5, H, D), torch.float16, gen, device)
    kw = dict(kv_dtype=kv_dtype, layout="NHD", block_tables=pr.i32([[0, 1], [2, 3]], device),
              cu_q_lens=pr.i32([0, 3, 5], device), kv_lens=pr.i32([0, 2], device))
    if kv_dtype in ("fp8", "fp8k"):
        kw["fp8_scales"] = torch.ones(2, dtype=torch.float32, device=device)
    return [k, v, pool, params], kw


def _rope_params(device, rot=D, dtype=torch.float32, n=None):  # type: ignore[no-untyped-def]
    """RopeKernelParams, possibly malformed: rotary_dim ``rot``, inv_freq of ``n`` entries (default rot // 2)."""
    inv = torch.rand(rot // 2 if n is None else n, generator=pr.generator(0)).to(dtype=dtype, device=device)
    return RopeKernelParams(inv, 1.0, rot, False)


def _slot_mode(kw, device):  # type: ignore[no-untyped-def]
    for key in ("block_tables", "cu_q_lens", "kv_lens"):
        kw.pop(key)
    kw["slot_mapping"] = torch.tensor([0, 1, -1, 5, 6], device=device)


# case: (mutate(args, kw, device, other_device) editing a valid call in place, exception, argument name)
APPEND_ERRORS = {
    # k / v
    "k-list": ((lambda a, kw, d, o: a.__setitem__(0, a[0].tolist())), TypeError, "k"),
    "v-none": ((lambda a, kw, d, o: a.__setitem__(1, None)), TypeError, "v"),
    "k-int-dtype": ((lambda a, kw, d, o: a.__setitem__(0, a[0].to(torch.int16))), ValueError, "k"),
    "k-2d": ((lambda a, kw, d, o: a.__setitem__(0, a[0].reshape(5, H * D))), ValueError, "k"),
    "k-other-device": ((lambda a, kw, d, o: a.__setitem__(0, a[0].to(o))), ValueError, "k"),
    "v-rows": ((lambda a, kw, d, o: a.__setitem__(1, a[1][:4])), ValueError, "v"),
    "v-dtype": ((lambda a, kw, d, o: a.__setitem__(1, a[1].bfloat16())), ValueError, "v"),
    "k-heads": ((lambda a, kw, d, o: (a.__setitem__(0, a[0][:, :1]), a.__setitem__(1, a[1][:, :1]))),
                ValueError, "k"),
    "k-head-dim": ((lambda a, kw, d, o: (a.__setitem__(0, a[0][..., :4]), a.__setitem__(1, a[1][..., :4]))),
                   ValueError, "k"),
    "k-model-dtype": ((lambda a, kw, d, o: (a.__setitem__(0, a[0].bfloat16()), a.__setitem__(1, a[1].bfloat16()))),
                      ValueError, "k"),
    "k-head-dim-strided": ((lambda a, kw, d, o: a.__setitem__(0, torch.cat([a[0], a[0]], -1)[..., ::2])),
                           ValueError, "k"),
    "v-head-dim-strided": ((lambda a, kw, d, o: a.__setitem__(1, torch.cat([a[1], a[1]], -1)[..., ::2])),
                           ValueError, "v"),
    # pool / params / format
    "pool-none": ((lambda a, kw, d, o: a.__setitem__(2, None)), TypeError, "pool"),
    "pool-4d": ((lambda a, kw, d, o: a.__setitem__(2, a[2][0])), ValueError, "pool"),
    "pool-strided": ((lambda a, kw, d, o: a.__setitem__(2, torch.cat([a[2], a[2]])[::2])), ValueError, "pool"),
    "pool-int-dtype": ((lambda a, kw, d, o: a.__setitem__(2, a[2].view(torch.int16))), ValueError, "pool"),
    "pool-kv-dim": ((lambda a, kw, d, o: a.__setitem__(2, torch.cat([a[2], a[2][:, :1]], 1))), ValueError, "pool"),
    "params-for-auto": ((lambda a, kw, d, o: a.__setitem__(3, torch.zeros(NB, 2, BS, H, 2, device=d))),
                        ValueError, "params"),
    "kv_dtype-unknown": ((lambda a, kw, d, o: kw.update(kv_dtype="int2")), ValueError, "kv_dtype"),
    "kv_dtype-type": ((lambda a, kw, d, o: kw.update(kv_dtype=8)), TypeError, "kv_dtype"),
    "layout-unknown": ((lambda a, kw, d, o: kw.update(layout="NDH")), ValueError, "layout"),
    "layout-type": ((lambda a, kw, d, o: kw.update(layout=0)), TypeError, "layout"),
    # ragged description
    "block_tables-int64": ((lambda a, kw, d, o: kw.update(block_tables=kw["block_tables"].long())),
                           ValueError, "block_tables"),
    "block_tables-list": ((lambda a, kw, d, o: kw.update(block_tables=[[0, 1], [2, 3]])), TypeError,
                          "block_tables"),
    "block_tables-rows": ((lambda a, kw, d, o: kw.update(block_tables=kw["block_tables"][:1])), ValueError,
                          "block_tables"),
    "block_tables-1d": ((lambda a, kw, d, o: kw.update(block_tables=kw["block_tables"][0])), ValueError,
                        "block_tables"),
    "block_tables-strided": ((lambda a, kw, d, o: kw.update(block_tables=pr.i32([[0, 9, 1], [2, 9, 3]], d)[:, ::2])),
                             ValueError, "block_tables"),
    "block_tables-device": ((lambda a, kw, d, o: kw.update(block_tables=kw["block_tables"].to(o))), ValueError,
                            "block_tables"),
    "cu_q_lens-int64": ((lambda a, kw, d, o: kw.update(cu_q_lens=kw["cu_q_lens"].long())), ValueError,
                        "cu_q_lens"),
    "cu_q_lens-tuple": ((lambda a, kw, d, o: kw.update(cu_q_lens=(0, 3, 5))), TypeError, "cu_q_lens"),
    "cu_q_lens-2d": ((lambda a, kw, d, o: kw.update(cu_q_lens=kw["cu_q_lens"][None])), ValueError, "cu_q_lens"),
    "cu_q_lens-empty": ((lambda a, kw, d, o: kw.update(cu_q_lens=pr.i32([], d))), ValueError, "cu_q_lens"),
    "kv_lens-length": ((lambda a, kw, d, o: kw.update(kv_lens=pr.i32([0, 2, 1], d))), ValueError, "kv_lens"),
    "kv_lens-float": ((lambda a, kw, d, o: kw.update(kv_lens=kw["kv_lens"].float())), ValueError, "kv_lens"),
    "cu_k_lens-length": ((lambda a, kw, d, o: (kw.pop("kv_lens"), kw.update(cu_k_lens=pr.i32([0, 3], d)))),
                         ValueError, "cu_k_lens"),
    "kv_lens-and-cu_k_lens": ((lambda a, kw, d, o: kw.update(cu_k_lens=pr.i32([0, 3, 7], d))), ValueError,
                              "(kv_lens|cu_k_lens|cu_q_lens)"),
    "no-lengths": ((lambda a, kw, d, o: kw.pop("kv_lens")), ValueError, "(kv_lens|cu_k_lens|cu_q_lens)"),
    "no-block_tables": ((lambda a, kw, d, o: kw.pop("block_tables")), ValueError, "(block_tables|cu_q_lens)"),
    "no-cu_q_lens": ((lambda a, kw, d, o: kw.pop("cu_q_lens")), ValueError, "cu_q_lens"),
    "positions-in-ragged-mode": ((lambda a, kw, d, o: kw.update(positions=torch.arange(5, device=d))),
                                 ValueError, "positions"),
    # slot mapping
    "slot_mapping-with-table": ((lambda a, kw, d, o: kw.update(slot_mapping=torch.arange(5, device=d))),
                                ValueError, "slot_mapping"),
    "slot_mapping-length": ((lambda a, kw, d, o: (_slot_mode(kw, d), kw.update(slot_mapping=kw["slot_mapping"][:4]))),
                            ValueError, "slot_mapping"),
    "slot_mapping-float": ((lambda a, kw, d, o: (_slot_mode(kw, d),
                                                   kw.update(slot_mapping=kw["slot_mapping"].float()))),
                           ValueError, "slot_mapping"),
    "slot_mapping-cp": ((lambda a, kw, d, o: (_slot_mode(kw, d), kw.update(cp_size=2))), ValueError, "cp_size"),
    "slot-rope-no-positions": ((lambda a, kw, d, o: (_slot_mode(kw, d), kw.update(rope=_rope_params(d)))),
                               ValueError, "positions"),
    "slot-positions-length": ((lambda a, kw, d, o: (_slot_mode(kw, d), kw.update(
        rope=_rope_params(d), positions=torch.arange(4, device=d)))), ValueError, "positions"),
    "slot-positions-float": ((lambda a, kw, d, o: (_slot_mode(kw, d), kw.update(
        rope=_rope_params(d), positions=torch.arange(5, device=d).float()))), ValueError, "positions"),
    # context parallel
    "cp_size-0": ((lambda a, kw, d, o: kw.update(cp_size=0)), ValueError, "cp_size"),
    "cp_rank-range": ((lambda a, kw, d, o: kw.update(cp_size=2, cp_rank=2)), ValueError, "cp_rank"),
    "cp_rank-negative": ((lambda a, kw, d, o: kw.update(cp_size=2, cp_rank=-1)), ValueError, "cp_rank"),
    "cp_size-str": ((lambda a, kw, d, o: kw.update(cp_size="2")), TypeError, "cp_size"),
    "cp_size-bool": ((lambda a, kw, d, o: kw.update(cp_size=True)), TypeError, "cp_size"),
    "cp_rank-float": ((lambda a, kw, d, o: kw.update(cp_rank=0.0)), TypeError, "cp_rank"),
    # rope
    "rope-str": ((lambda a, kw, d, o: kw.update(rope="default")), TypeError, "rope"),
    "rope-config-not-params": ((lambda a, kw, d, o: kw.update(rope=RopeConfig(head_dim=D))), TypeError, "rope"),
    "rope-rotary-dim": ((lambda a, kw, d, o: kw.update(rope=_rope_params(d, rot=D + 2, n=(D + 2) // 2))),
                        ValueError, "rope"),
    "rope-odd-rotary-dim": ((lambda a, kw, d, o: kw.update(rope=_rope_params(d, rot=5, n=2))), ValueError, "rope"),
    "rope-inv_freq-float64": ((lambda a, kw, d, o: kw.update(rope=_rope_params(d, dtype=torch.float64))),
                              ValueError, "rope"),
    "rope-inv_freq-length": ((lambda a, kw, d, o: kw.update(rope=_rope_params(d, n=3))), ValueError, "rope"),
    "rope-inv_freq-device": ((lambda a, kw, d, o: kw.update(rope=_rope_params(o))), ValueError, "rope"),
}


@pytest.mark.parametrize("case", list(APPEND_ERRORS))
def test_append_op_rejects(device, other_device, case):
    mutate, exc, name = APPEND_ERRORS[case]
    args, kw = _append_args(device)
    mutate(args, kw, device, other_device)
    pool = _append_args(device)[0][2] if not isinstance(args[2], torch.Tensor) else args[2]
    before = pr.bits(pool).cpu().clone() if pool.device.type != "meta" else None
    with pytest.raises(exc, match="^" + name + r"(?!\w)"):
        append_paged_kv(*args, **kw)
    if before is not None:
        pr.assert_bits_equal(pool, before, "pool after a rejected append")


QUANT_APPEND_ERRORS = {
    "int8-no-params": ("int8", lambda a, kw, d: a.__setitem__(3, None), TypeError, "params"),
    "int8-params-shape": ("int8", lambda a, kw, d: a.__setitem__(3, a[3][:, :, :2]), ValueError, "params"),
    "int8-params-dtype": ("int8", lambda a, kw, d: a.__setitem__(3, a[3].half()), ValueError, "params"),
    "int8-pool-fp16": ("int8", lambda a, kw, d: a.__setitem__(2, torch.zeros(NB, 2, BS, H, D, dtype=torch.float16,
                                                                           device=d)), ValueError, "pool"),
    "int4-pool-full-width": ("int4", lambda a, kw, d: a.__setitem__(2, torch.zeros(NB, 2, BS, H, D, dtype=torch.uint8,
                                                                                  device=d)), ValueError, "k"),
    "int4-odd-head-dim": ("int4", lambda a, kw, d: (a.__setitem__(0, torch.randn(5, H, D + 1, device=d).half()),
                                                    a.__setitem__(1, torch.randn(5, H, D + 1, device=d).half())),
                          ValueError, "k"),
    "fp8-no-scales": ("fp8", lambda a, kw, d: kw.pop("fp8_scales"), ValueError, "fp8_scales"),
    "fp8-scales-shape": ("fp8", lambda a, kw, d: kw.update(fp8_scales=torch.ones(3, device=d)), ValueError,
                         "fp8_scales"),
    "fp8-scales-dtype": ("fp8", lambda a, kw, d: kw.update(fp8_scales=torch.ones(2, device=d).half()), ValueError,
                         "fp8_scales"),
    "fp8-pool-uint8": ("fp8", lambda a, kw, d: a.__setitem__(2, a[2].view(torch.uint8)), ValueError, "pool"),
    "fp8k-no-params": ("fp8k", lambda a, kw, d: a.__setitem__(3, None), TypeError, "params"),
    "fp8k-params-of-int8": ("fp8k", lambda a, kw, d: a.__setitem__(3, torch.zeros(NB, 2, BS, H, 2, device=d)),
                            ValueError, "params"),
    "fp8k-params-width-2": ("fp8k", lambda a, kw, d: a.__setitem__(3, torch.zeros(NB, 1, BS, H, 2, device=d)),
                            ValueError, "params"),
    "fp8k-params-dtype": ("fp8k", lambda a, kw, d: a.__setitem__(3, a[3].half()), ValueError, "params"),
    "fp8k-no-scales": ("fp8k", lambda a, kw, d: kw.pop("fp8_scales"), ValueError, "fp8_scales"),
    "fp8k-pool-uint8": ("fp8k", lambda a, kw, d: a.__setitem__(2, a[2].view(torch.uint8)), ValueError, "pool"),
}


@pytest.mark.parametrize("case", list(QUANT_APPEND_ERRORS))
def test_append_op_rejects_quantized(device, case):
    kv_dtype, mutate, exc, name = QUANT_APPEND_ERRORS[case]
    args, kw = _append_args(device, kv_dtype)
    mutate(args, kw, device)
    pool, params = args[2], args[3]
    before = pr.bits(pool).cpu().clone()
    before_p = None if not isinstance(params, torch.Tensor) else pr.bits(params).cpu().clone()
    with pytest.raises(exc, match=pr.names(name)):
        append_paged_kv(*args, **kw)
    pr.assert_bits_equal(pool, before, "pool after a rejected append")
    if before_p is not None:
        pr.assert_bits_equal(params, before_p, "params after a rejected append")


def test_append_op_accepts_the_valid_calls(device):
    """The base calls of the error tests are valid (so each rejection is due to its one change)."""
    for kv_dtype in ("auto", "fp8", "int8", "int4", "fp8k"):
        args, kw = _append_args(device, kv_dtype)
        append_paged_kv(*args, **kw)
        assert not pr.is_all_sentinel(args[2])
    args, kw = _append_args(device)
    _slot_mode(kw, device)
    append_paged_kv(*args, **kw, rope=_rope_params(device), positions=torch.arange(5, device=device))


# ---------------------------------------------------------------------------------------------------------
# check=True


def _cache_for_checks(device):  # type: ignore[no-untyped-def]
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=NB)
    gen = pr.generator(406)
    k = pr.randn((5, H, D), torch.float16, gen, device)
    return cache, k


CHECK_ERRORS = {
    # valid call: sequence 0 holds 3 tokens, sequence 1 holds 2 + 2 (one block of 4 each)
    "table-too-short": (dict(kv_lens=[2, 3]), dict(), "block_tables"),  # seq 0: 5 tokens need 2 blocks
    "block-id-past-pool": (dict(tables=[[0], [NB]]), dict(), "block_tables"),
    "block-id-negative": (dict(tables=[[-1], [1]]), dict(), "block_tables"),
    "cu_q_lens-not-from-0": (dict(cu=[1, 3, 5]), dict(), "cu_q_lens"),
    "cu_q_lens-decreasing": (dict(cu=[0, 4, 3]), dict(), "cu_q_lens"),
    "cu_q_lens-past-rows": (dict(cu=[0, 3, 6]), dict(), "cu_q_lens"),
    "kv_lens-negative": (dict(kv_lens=[0, -1]), dict(), "kv_lens"),
    "cu_k_lens-short": (dict(cu_k=[0, 3, 4]), dict(), "cu_k_lens"),  # seq 1: total 1 < its 2 new tokens
    "cu_k_lens-not-from-0": (dict(cu_k=[1, 4, 6]), dict(), "cu_k_lens"),
    "slot-past-pool": (dict(slots=[0, 1, 2, 3, NB * BS]), dict(), "slot_mapping"),
    "slot-below-minus-1": (dict(slots=[0, 1, -2, 3, 4]), dict(), "slot_mapping"),
}


def _check_call(cache, k, device, *, tables=([0], [1]), cu=(0, 3, 5), kv_lens=(0, 2), cu_k=None, slots=None,  # type: ignore[no-untyped-def]
                **extra):
    if slots is not None:
        return cache.append(0, k, k, cache.plan(slot_mapping=torch.tensor(slots, device=device), check=True, **extra))
    lens = dict(kv_lens=pr.i32(list(kv_lens), device)) if cu_k is None else dict(cu_k_lens=pr.i32(list(cu_k), device))
    width = max(len(t) for t in tables)
    padded = [list(t) + [0] * (width - len(t)) for t in tables]
    return cache.append(0, k, k, cache.plan(block_tables=pr.i32(padded, device), cu_q_lens=pr.i32(list(cu), device),
                                            check=True, **lens, **extra))


@pytest.mark.parametrize("case", list(CHECK_ERRORS))
def test_check_true_rejects(device, case):
    call, extra, name = CHECK_ERRORS[case]
    cache, k = _cache_for_checks(device)
    with pytest.raises(ValueError, match=pr.names(name)):
        _check_call(cache, k, device, **call, **extra)
    assert pr.is_all_sentinel(cache.buffer), "pool written by a rejected append"


def test_check_true_accepts_valid_batches(device):
    cache, k = _cache_for_checks(device)
    _check_call(cache, k, device)
    _check_call(cache, k, device, cu_k=[0, 3, 7])
    _check_call(cache, k, device, slots=[0, -1, 5, NB * BS - 1, 9])
    _check_call(cache, k, device, cu=[0, 3, 3], kv_lens=[1, 4])  # padding rows past cu_q_lens[-1]
    assert not pr.is_all_sentinel(cache.buffer)


def test_check_true_cp_rank_exact_table(device):
    """Context parallel: a rank's table needs room for ceil((total - rank) / cp_size) local tokens only.
    Total 5 over 2 ranks, block_size 1: rank 0 holds positions 0, 2, 4 (3 blocks), rank 1 holds 1, 3 (2)."""
    cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=D, block_size=1, num_blocks=NB)
    k = pr.randn((5, H, D), torch.float16, pr.generator(407), device)
    common = dict(cu_q_lens=pr.i32([0, 5], device), kv_lens=pr.i32([0], device), cp_size=2, check=True)
    cache.append(0, k, k, cache.plan(block_tables=pr.i32([[0, 1, 2]], device), cp_rank=0, **common))
    with pytest.raises(ValueError, match=pr.names("block_tables")):
        cache.append(0, k, k, cache.plan(block_tables=pr.i32([[0, 1]], device), cp_rank=0, **common))
    cache.append(0, k, k, cache.plan(block_tables=pr.i32([[3, 2]], device), cp_rank=1, **common))
    for t, blk in ((1, 3), (3, 2)):
        pr.assert_bits_equal(cache.pool(0)[blk, 0, 0], k[t], f"rank 1 position {t}")


# ---------------------------------------------------------------------------------------------------------
# gather_paged_kv: errors


def _gather_args(device, kv_dtype="auto"):  # type: ignore[no-untyped-def]
    args, _ = _append_args(device, kv_dtype)
    pool, params = args[2], args[3]
    out = pr.fill_sentinel(torch.empty((2, 2, H, 6, D), dtype=torch.float16, device=device))
    kw = dict(kv_dtype=kv_dtype, layout="NHD", block_tables=pr.i32([[0, 1], [2, 3]], device),
              kv_lens=pr.i32([5, 3], device), k_out=out[0], v_out=out[1])
    if kv_dtype in ("fp8", "fp8k"):
        kw["fp8_scales"] = torch.ones(2, dtype=torch.float32, device=device)
    return [pool, params], kw, out


GATHER_ERRORS = {
    "pool-list": (lambda a, kw, d, o: a.__setitem__(0, [1, 2]), TypeError, "pool"),
    "pool-shape": (lambda a, kw, d, o: a.__setitem__(0, a[0][:, 0]), ValueError, "pool"),
    "kv_dtype-unknown": (lambda a, kw, d, o: kw.update(kv_dtype="fp4"), ValueError, "kv_dtype"),
    "layout-unknown": (lambda a, kw, d, o: kw.update(layout="HDN"), ValueError, "layout"),
    "params-for-auto": (lambda a, kw, d, o: a.__setitem__(1, torch.zeros(NB, 2, BS, H, 2, device=d)), ValueError,
                        "params"),
    "block_tables-int64": (lambda a, kw, d, o: kw.update(block_tables=kw["block_tables"].long()), ValueError,
                           "block_tables"),
    "block_tables-none": (lambda a, kw, d, o: kw.update(block_tables=None), TypeError, "block_tables"),
    "block_tables-device": (lambda a, kw, d, o: kw.update(block_tables=kw["block_tables"].to(o)), ValueError,
                            "block_tables"),
    "kv_lens-length": (lambda a, kw, d, o: kw.update(kv_lens=pr.i32([5], d)), ValueError, "kv_lens"),
    "kv_lens-int64": (lambda a, kw, d, o: kw.update(kv_lens=kw["kv_lens"].long()), ValueError, "kv_lens"),
    "cu_k_lens-length": (lambda a, kw, d, o: (kw.pop("kv_lens"), kw.update(cu_k_lens=pr.i32([0, 5], d))), ValueError,
                         "cu_k_lens"),
    "both-lengths": (lambda a, kw, d, o: kw.update(cu_k_lens=pr.i32([0, 5, 8], d)), ValueError,
                     "(kv_lens|cu_k_lens)"),
    "no-lengths": (lambda a, kw, d, o: kw.pop("kv_lens"), ValueError, "(kv_lens|cu_k_lens)"),
    "k_out-only": (lambda a, kw, d, o: kw.pop("v_out"), ValueError, "(k_out|v_out)"),
    "k_out-list": (lambda a, kw, d, o: kw.update(k_out=[0]), TypeError, "k_out"),
    "k_out-heads": (lambda a, kw, d, o: (kw.update(k_out=kw["k_out"][:, :1]), kw.update(v_out=kw["v_out"][:, :1])),
                    ValueError, "k_out"),
    "k_out-batch": (lambda a, kw, d, o: (kw.update(k_out=kw["k_out"][:1]), kw.update(v_out=kw["v_out"][:1])),
                    ValueError, "k_out"),
    "k_out-head-dim": (lambda a, kw, d, o: kw.update(k_out=kw["k_out"][..., :4], v_out=kw["v_out"][..., :4]),
                       ValueError, "k_out"),
    "k_out-head-dim-strided": (lambda a, kw, d, o: kw.update(
        k_out=torch.zeros(2, H, 6, 2 * D, dtype=torch.float16, device=d)[..., ::2]), ValueError, "k_out"),
    "k_out-3d": (lambda a, kw, d, o: kw.update(k_out=kw["k_out"][0]), ValueError, "k_out"),
    "k_out-int": (lambda a, kw, d, o: kw.update(k_out=torch.zeros(2, H, 6, D, dtype=torch.int16, device=d)),
                  ValueError, "k_out"),
    "k_out-device": (lambda a, kw, d, o: kw.update(k_out=torch.zeros(2, H, 6, D, dtype=torch.float16, device=o)),
                     ValueError, "k_out"),
    "k_out-dtype-vs-auto-pool": (lambda a, kw, d, o: (kw.update(k_out=kw["k_out"].float(),
                                                                v_out=kw["v_out"].float())), ValueError, "k_out"),
    "v_out-shape": (lambda a, kw, d, o: kw.update(v_out=kw["v_out"][:, :, :5]), ValueError, "v_out"),
    "v_out-dtype": (lambda a, kw, d, o: kw.update(v_out=kw["v_out"].bfloat16()), ValueError, "v_out"),
    "max_len-negative": (lambda a, kw, d, o: (kw.pop("k_out"), kw.pop("v_out"), kw.update(max_len=-1)), ValueError,
                         "max_len"),
    "max_len-float": (lambda a, kw, d, o: (kw.pop("k_out"), kw.pop("v_out"), kw.update(max_len=2.5)), TypeError,
                      "max_len"),
    "max_len-bool": (lambda a, kw, d, o: (kw.pop("k_out"), kw.pop("v_out"), kw.update(max_len=True)), TypeError,
                     "max_len"),
    "dtype-int": (lambda a, kw, d, o: (kw.pop("k_out"), kw.pop("v_out"), kw.update(dtype=torch.int32)), ValueError,
                  "dtype"),
    "dtype-str": (lambda a, kw, d, o: (kw.pop("k_out"), kw.pop("v_out"), kw.update(dtype="float16")), TypeError,
                  "dtype"),
    "cp_rank-range": (lambda a, kw, d, o: kw.update(cp_rank=3, cp_size=3), ValueError, "cp_rank"),
    "cp_size-0": (lambda a, kw, d, o: kw.update(cp_size=0), ValueError, "cp_size"),
    "cp_size-float": (lambda a, kw, d, o: kw.update(cp_size=2.0), TypeError, "cp_size"),
    "rope-str": (lambda a, kw, d, o: kw.update(rope="yes"), TypeError, "rope"),
    "rope-rotary-dim": (lambda a, kw, d, o: kw.update(rope=_rope_params(d, rot=D + 2, n=(D + 2) // 2)), ValueError,
                        "rope"),
    "rope-inv_freq-device": (lambda a, kw, d, o: kw.update(rope=_rope_params(o)), ValueError, "rope"),
}


@pytest.mark.parametrize("case", list(GATHER_ERRORS))
def test_gather_op_rejects(device, other_device, case):
    mutate, exc, name = GATHER_ERRORS[case]
    args, kw, out = _gather_args(device)
    pool = args[0]
    mutate(args, kw, device, other_device)
    before = pr.bits(pool).cpu().clone()
    with pytest.raises(exc, match="^" + name + r"(?!\w)"):
        gather_paged_kv(*args, **kw)
    pr.assert_bits_equal(pool, before, "pool after a rejected gather")
    assert pr.is_all_sentinel(out), "outputs written by a rejected gather"


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8", "int4", "fp8k"])
def test_gather_op_rejects_quantized(device, kv_dtype):
    args, kw, out = _gather_args(device, kv_dtype)
    cases = []
    kw_no_out = {k: v for k, v in kw.items() if k not in ("k_out", "v_out")}
    cases.append((args, kw_no_out, ValueError, "dtype"))  # a quantized pool: the model dtype must be given
    if kv_dtype in ("fp8", "fp8k"):
        cases.append((args, {k: v for k, v in kw.items() if k != "fp8_scales"}, ValueError, "fp8_scales"))
    if kv_dtype != "fp8":
        cases.append(([args[0], None], kw, TypeError, "params"))
        cases.append(([args[0], args[1][:1]], kw, ValueError, "params"))
    if kv_dtype == "fp8k":  # the (scale, zero) pool of the integer formats is not fp8k's
        cases.append(([args[0], torch.zeros(NB, 2, BS, H, 2, device=device)], kw, ValueError, "params"))
    for a, k, exc, name in cases:
        with pytest.raises(exc, match=pr.names(name)):
            gather_paged_kv(*a, **k)
        assert pr.is_all_sentinel(out)
    # and the valid calls, on appended data
    a_args, a_kw = _append_args(device, kv_dtype)
    a_kw["kv_lens"] = pr.i32([0, 0], device)  # sequences of 3 and 2 tokens
    append_paged_kv(a_args[0], a_args[1], args[0], args[1], **a_kw)
    kw["kv_lens"] = kw_no_out["kv_lens"] = pr.i32([3, 2], device)
    gather_paged_kv(*args, **kw)
    exp = pr.gather_expected(args[0], args[1], [[0, 1], [2, 3]], [3, 2], kv_dtype=kv_dtype, layout="NHD", s_out=6,
                             dtype=torch.float16)
    pr.assert_gather_matches(out[0], out[1], exp, kv_dtype=kv_dtype)
    k2, _ = gather_paged_kv(*args, **kw_no_out, dtype=torch.bfloat16)
    assert k2.dtype == torch.bfloat16 and k2.shape == (2, H, 3, D)


# ---------------------------------------------------------------------------------------------------------
# PagedKVCache entry points


def test_cache_append_and_gather_reject(device, other_device):
    rope_cache = pr.sentinel_cache(device, num_kv_heads=H, head_dim=64, block_size=BS, num_blocks=NB,
                                   rope=RopeConfig(head_dim=64, rope_type="dynamic", factor=2.0,
                                                   max_position_embeddings=8))
    cache = pr.sentinel_cache(device, num_layers=2, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=NB,
                              kv_dtype="int8")
    gen = pr.generator(408)
    k = pr.randn((3, H, D), torch.float16, gen, device)
    k64 = pr.randn((3, H, 64), torch.float16, gen, device)
    sm = torch.tensor([0, 1, 2], device=device)
    bt = pr.i32([[0]], device)
    out4 = torch.zeros(1, H, 4, D, device=device)
    cases = [
        (lambda: cache.append(2, k, k, cache.plan(slot_mapping=sm)), ValueError, "layer"),
        (lambda: cache.append(-1, k, k, cache.plan(slot_mapping=sm)), ValueError, "layer"),
        (lambda: cache.append("0", k, k, cache.plan(slot_mapping=sm)), TypeError, "layer"),
        (lambda: cache.append(0, k, k, cache.plan(slot_mapping=sm, rope=True)), ValueError, "rope"),
        (lambda: cache.append(0, k[:, :1], k[:, :1], cache.plan(slot_mapping=sm)), ValueError, "k"),
        (lambda: cache.append(0, k, k, cache.plan(slot_mapping=sm.float())), ValueError, "slot_mapping"),
        (lambda: cache.append(0, k, k, cache.plan(slot_mapping=sm, check=True, cp_size=2)), ValueError, "cp_size"),
        (lambda: cache.gather(2, cache.plan(bt, seq_lens=pr.i32([1], device))), ValueError, "layer"),
        (lambda: cache.gather(1.0, cache.plan(bt, seq_lens=pr.i32([1], device))), TypeError, "layer"),
        (lambda: cache.gather(0, cache.plan(bt, seq_lens=pr.i32([1], device)), rope=True), ValueError, "rope"),
        (lambda: cache.gather(0, cache.plan(bt.long(), seq_lens=pr.i32([1], device))), ValueError, "block_tables"),
        (lambda: cache.gather(0, cache.plan(bt)), ValueError, "seq_lens"),
        (lambda: cache.gather(0, bt), TypeError, "plan"),
        (lambda: cache.append(0, k, k, rope_cache.plan(slot_mapping=sm, rope=False)), ValueError, "plan"),
        (lambda: rope_cache.append(0, k64, k64, rope_cache.plan(slot_mapping=sm, positions=sm, rope_seq_len=0)),
         ValueError,
         "(rope_seq_len|seq_len)"),
        (lambda: rope_cache.append(0, k64, k64, rope_cache.plan(slot_mapping=sm, positions=sm, rope_seq_len="9")),
         TypeError,
         "(rope_seq_len|seq_len)"),
        (lambda: rope_cache.append(0, k64, k64, rope_cache.plan(slot_mapping=sm, positions=None, rope_seq_len=4)),
         ValueError,
         "positions"),
        # dynamic scaling needs the current length (transformers derives it from the positions)
        (lambda: rope_cache.append(0, k64, k64, rope_cache.plan(slot_mapping=sm, positions=sm)), ValueError,
         "rope_seq_len"),
        (lambda: rope_cache.gather(0, rope_cache.plan(bt, seq_lens=pr.i32([1], device)), rope=True), ValueError,
         "rope_seq_len"),
        (lambda: cache.append(0, k, k, cache.plan(slot_mapping=sm, rope=RopeConfig(
            head_dim=D, rope_type="dynamic", factor=2.0, max_position_embeddings=8))), ValueError, "rope_seq_len"),
        # the cache's model dtype (float16) for every format, and a bool check
        (lambda: cache.append(0, k.float(), k.float(), cache.plan(slot_mapping=sm)), ValueError, "k"),
        (lambda: cache.append(0, k, k.bfloat16(), cache.plan(slot_mapping=sm)), ValueError, "v"),
        (lambda: cache.append(0, k, k, cache.plan(slot_mapping=sm, check="no")), TypeError, "check"),
        (lambda: cache.gather(1, cache.plan(bt, seq_lens=pr.i32([1], device)), k_out=out4, v_out=out4, max_len=5),
         ValueError, "max_len"),
        (lambda: cache.gather(1, cache.plan(bt, seq_lens=pr.i32([1], device)), k_out=out4, v_out=out4,
                              max_len=4.0), TypeError, "max_len"),
        (lambda: rope_cache.append(0, k64, k64, rope_cache.plan(slot_mapping=sm, positions=sm, rope="x")), TypeError,
         "rope"),
    ]
    snaps = (_snapshot(cache), _snapshot(rope_cache))
    for i, (fn, exc, name) in enumerate(cases):
        with pytest.raises(exc, match="^" + name + r"(?!\w)"):
            fn()
        _assert_unchanged(cache, snaps[0], f"cache after rejected call {i}")
        _assert_unchanged(rope_cache, snaps[1], f"rope cache after rejected call {i}")
    # the valid forms of the same calls
    rope_cache.append(0, k64, k64, rope_cache.plan(slot_mapping=sm, positions=sm, rope_seq_len=40))
    cache.append(1, k, k, cache.plan(slot_mapping=sm))
    cache.gather(1, cache.plan(bt, seq_lens=pr.i32([3], device)))
    cache.gather(1, cache.plan(bt, seq_lens=pr.i32([3], device)), k_out=torch.zeros(1, H, 4, D, device=device),
                 v_out=torch.zeros(1, H, 4, D, device=device), max_len=4)
