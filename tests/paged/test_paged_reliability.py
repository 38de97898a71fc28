"""Paged appends under bad input: the debug checks (slots written twice, shared blocks, fp8 scales), rows that
cannot be written counted without a sync, the debug mode of the cache, a negative cu_q_lens entry handled alike
by every backend, and a config too large for the device refused before it allocates."""

from __future__ import annotations

import pytest
import torch

from kvcache import PagedConfig, PagedKVCache, ops


def _i32(x: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=device)


def _cache(device: torch.device, kv_dtype: str = "auto", **kw: object) -> PagedKVCache:
    cfg = PagedConfig(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=8, dtype=torch.float16,
                      kv_dtype=kv_dtype, device=device)
    return PagedKVCache(cfg, **kw)  # type: ignore[arg-type]


def _rows(n: int, device: torch.device) -> torch.Tensor:
    return torch.randn(n, 2, 8, generator=torch.Generator().manual_seed(n)).to(torch.float16).to(device)


def test_check_refuses_a_slot_written_twice(device):
    cache = _cache(device)
    k = _rows(3, device)
    with pytest.raises(ValueError, match=r"^slot_mapping: expected each slot at most once.*\[5\]"):
        cache.append(0, k, k, cache.plan(slot_mapping=torch.tensor([5, 2, 5], device=device), check=True))
    assert not cache.buffer.any()
    cache.append(0, k, k, cache.plan(slot_mapping=torch.tensor([5, -1, -1], device=device),
                                     check=True))  # -1 twice is fine


def test_check_refuses_a_block_shared_by_two_writers(device):
    cache = _cache(device)
    k = _rows(4, device)
    tables = _i32([[3], [3]], device)  # both sequences write block 3 at offsets 0..1
    with pytest.raises(ValueError, match="^block_tables: sequences 0 and 1 both write slot 12"):
        cache.append(0, k, k, cache.plan(tables, _i32([0, 2, 4], device), _i32([0, 0], device), check=True))
    assert not cache.buffer.any()
    # a shared prefix block that only one sequence writes into is fine (prefix caching)
    cache.append(0, k[:2], k[:2], cache.plan(_i32([[3, 4], [3, 5]], device), _i32([0, 1, 2], device),
                                             _i32([4, 4], device), check=True))


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_check_refuses_bad_fp8_scales(device, scale):
    cache = _cache(device, "fp8")
    cache.kv_scales[0, 1] = scale
    k = _rows(2, device)
    with pytest.raises(ValueError, match="^fp8_scales: expected finite scales > 0"):
        cache.append(0, k, k, cache.plan(slot_mapping=torch.tensor([0, 1], device=device), check=True))
    assert not cache.buffer.view(torch.uint8).any()


def test_unwritable_rows_are_counted_without_a_sync(device):
    cache = _cache(device)
    # sequence 0: 6 new tokens with a 1-block table (positions 4 and 5 have no block); sequence 1: block id 9
    # is past the 8-block pool; row 7 is padding past cu_q_lens[-1] (not counted)
    plan = cache.plan(_i32([[1], [9]], device), _i32([0, 6, 7], device), _i32([0, 3], device))
    n = cache.unwritable_rows(plan, 8)
    assert n.dtype == torch.int64 and n.device.type == device.type and int(n) == 3
    k = _rows(8, device)
    cache.append(0, k, k, plan)  # no check: the 4 writable rows land, the 3 others are skipped
    assert int(cache.pool(0)[1, 0].ne(0).any(-1).any(-1).sum()) == 4  # block 1 K: 4 token rows
    slots = cache.plan(slot_mapping=torch.tensor([3, -1, 32, -7], device=device))
    assert int(cache.unwritable_rows(slots, 4)) == 2  # slot 32 is past the pool, -7 is not a slot
    cp = cache.plan(_i32([[1]], device), _i32([0, 6], device), _i32([0], device), cp_rank=1, cp_size=2)
    assert int(cache.unwritable_rows(cp, 6)) == 0  # rank 1 holds positions 1, 3, 5: local 0..2, one block


def test_debug_cache_checks_every_append(device):
    cache = _cache(device, debug=True)
    k = _rows(2, device)
    with pytest.raises(ValueError, match="^slot_mapping"):
        cache.append(0, k, k, cache.plan(slot_mapping=torch.tensor([40, 1], device=device)))
    with pytest.raises(ValueError, match="^block_tables"):
        cache.append(0, k, k, cache.plan(block_tables=_i32([[0]], device), cu_q_lens=_i32([0, 2], device),
                                         kv_lens=_i32([3], device)))
    assert not cache.buffer.any()
    with pytest.raises(TypeError, match="^debug"):
        _cache(device, debug=1)


def test_negative_cu_q_lens_entry_is_not_wrapped(device):
    """The reference never indexes with a negative row (Python would wrap it to the last row): with
    cu_q_lens = [-1, 2] and check=False, rows 0 and 1 go to positions 1 and 2, as in the kernel."""
    cache = _cache(device)
    k = _rows(2, device)
    ops.append_paged_kv(k, k, cache.pool(0), kv_dtype="auto", block_tables=_i32([[5]], device),
                        cu_q_lens=_i32([-1, 2], device), kv_lens=_i32([0], device))
    block = cache.pool(0)[5, 0].cpu()  # [block_size, H, D]
    assert not block[0].any()
    assert torch.equal(block[1], k[0].cpu()) and torch.equal(block[2], k[1].cpu())


def test_config_larger_than_the_device_is_refused_before_allocating():
    cfg = PagedConfig(num_layers=200, num_kv_heads=64, head_dim=256, block_size=64, num_blocks=100000,
                      dtype=torch.float16, device="cpu")
    with pytest.raises(ValueError, match="^config: the cache needs .* GiB, more than"):
        PagedKVCache(cfg)
