"""Tests of the cache classes (LinearKVCache, KVCacheManager, KVSnapshot) and their configs.

Helpers shared by the test modules of this package live here. They are an independent reference: plain
torch indexing and Python lists, never the library's ops.
"""

from __future__ import annotations

import torch

from kvcache._validate import bits

KV_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16}
_INT_RANGE = {torch.uint8: (0, 256), torch.int16: (-(2**15), 2**15)}




def beq(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of two tensors of the same dtype and shape."""
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return torch.equal(bits(a), bits(b.to(a.device)))


def random_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fresh random bit patterns (every value of the dtype, NaN payloads included) in ``t``'s shape.

    Random bits rather than random floats: a copy that goes through a float conversion (NaN
    canonicalisation, fp8 saturation) would show up as a bit difference.
    """
    it = _INT_OF_WIDTH[t.element_size()]
    lo, hi = _INT_RANGE[it]
    while True:
        r = torch.randint(lo, hi, tuple(t.shape), dtype=it, generator=gen)
        if t.numel() == 0 or bool((r != 0).any()):
            return r.view(t.dtype).to(t.device)


def fill_random(t: torch.Tensor, gen: torch.Generator) -> None:
    """Overwrite ``t`` in place with random bits (never all zeros)."""
    t.copy_(random_like(t, gen))


def cache_layers(cache) -> list[torch.Tensor]:
    return [cache.layer(i) for i in range(cache.num_layers)]


def fill_cache(cache, gen: torch.Generator) -> None:
    for layer in cache_layers(cache):
        fill_random(layer, gen)


def capture(cache) -> dict:
    """Everything observable about a cache, copied (to compare before / after a call)."""
    return {
        "layers": [bits(layer).clone() for layer in cache_layers(cache)],
        "lengths_buffer": cache.lengths_buffer.clone(),
        "lengths": cache.lengths.tolist(),
        "active": cache.active_batch_size,
        "all_empty": cache.all_empty,
    }


def assert_unchanged(cache, before: dict) -> None:
    after = capture(cache)
    assert after["active"] == before["active"]
    assert after["lengths"] == before["lengths"]
    assert after["all_empty"] == before["all_empty"]
    assert torch.equal(after["lengths_buffer"], before["lengths_buffer"])
    for i, (a, b) in enumerate(zip(after["layers"], before["layers"])):
        assert torch.equal(a, b), f"layer {i} changed"


def expected_after_evict(lengths: list[int], finished: list[bool]) -> tuple[list[int], list[int]]:
    """Independent expectation of an eviction: (kept old indices, new lengths)."""
    kept = [i for i, f in enumerate(finished) if not f]
    return kept, [lengths[i] for i in kept]


def assert_evicted(cache, layers_before: list[torch.Tensor], lengths: list[int], finished: list[bool],
                   mapping: torch.Tensor) -> None:
    """Check a finished eviction against clones of the layers taken before it."""
    old = len(finished)
    kept, new_lengths = expected_after_evict(lengths, finished)
    exp_map = [-1] * old
    for j, i in enumerate(kept):
        exp_map[i] = j
    assert isinstance(mapping, torch.Tensor)
    assert mapping.dtype == torch.int32
    assert mapping.device == cache.device
    assert mapping.tolist() == exp_map
    assert cache.active_batch_size == len(kept)
    assert cache.lengths.tolist() == new_lengths
    assert cache.lengths.dtype == torch.int32
    for li, (layer, before) in enumerate(zip(cache_layers(cache), layers_before)):
        for j, i in enumerate(kept):
            n = lengths[i]
            assert beq(layer[j, :, :, :n], before[i, :, :, :n]), f"layer {li}: new slot {j} != old slot {i}"
        # Compaction writes only kept sequences' new slots: every slot from new_active on is untouched.
        assert beq(layer[len(kept):], before[len(kept):]), f"layer {li}: a slot >= new active was written"
