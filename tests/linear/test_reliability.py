"""Issue 13 on the linear caches: the host copy of the lengths cannot be trusted wrongly, messages, memory.

The caches keep a host mirror of ``lengths`` so that bound checks need no device sync. It is tied to the
tensor's version counter: any write through torch or kvcache's ops drops it, and the next call that needs the
values reads the device. Each test writes the lengths behind the cache's back and checks that every host
decision (``host_lengths``, ``save``'s bound, ``commit``'s bound, ``all_empty``) follows the device values.
"""

from __future__ import annotations

import pytest
import torch

from kvcache import CacheConfig, KVCacheManager, KVLayerConfig, LinearKVCache, ManagerConfig, ops

from . import assert_unchanged, capture


def linear(device, B=2, S=8) -> LinearKVCache:
    return LinearKVCache(CacheConfig(2, B, S, 1, 8, dtype=torch.float16, device=device))


def manager(device, B=2, S=8) -> KVCacheManager:
    return KVCacheManager(ManagerConfig(B, S, [KVLayerConfig(1, 8), KVLayerConfig(2, 4)], dtype=torch.float16,
                                        device=device))


CACHES = {"linear": linear, "manager": manager}


def write_increment(c):
    ops.increment_lengths(c.lengths, -5)


def write_setitem(c):
    c.lengths[1] = 1


def write_add(c):
    c.lengths.add_(-5)


def write_buffer(c):
    c.lengths_buffer[:2].sub_(5)


def write_setitem_past_capacity(c):
    c.lengths[1] = 12


def write_add_one(c):
    c.lengths.add_(1)


WRITES = {"ops.increment_lengths": write_increment, "setitem": write_setitem, "add_": write_add,
          "lengths_buffer": write_buffer, "setitem-12": write_setitem_past_capacity, "add_+1": write_add_one}


@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("write", list(WRITES))
def test_outside_write_is_seen(device, kind, write):
    c = CACHES[kind](device)
    c.reset_for_new_sequences([6, 6])
    WRITES[write](c)
    dev = c.lengths.tolist()
    assert dev != [6, 6]
    assert c.host_lengths() == dev


@pytest.mark.parametrize("kind", list(CACHES))
def test_issue_stale_mirror_repro(device, kind):
    # reset [6, 6]; ops.increment_lengths(c.lengths, -5): host_lengths said [6, 6], save(0, 6) copied 5 stale
    # tokens, commit(7) was refused "about 13 tokens" where the real value would be 8.
    c = CACHES[kind](device)
    c.reset_for_new_sequences([6, 6])
    ops.increment_lengths(c.lengths, -5)
    assert c.host_lengths() == [1, 1]
    with pytest.raises(ValueError, match=r"^seq_len: expected an int <= 1 \(the tokens sequence 0 holds\), got 6"):
        c.save(0, 6)
    assert c.save(0, 1).seq_len == 1
    c.commit(7)
    assert c.lengths.tolist() == [8, 8] and c.host_lengths() == [8, 8]


@pytest.mark.parametrize("write", list(WRITES))
def test_commit_after_outside_write_checks_device_values(device, write):
    c = linear(device)
    c.reset_for_new_sequences([6, 6])
    WRITES[write](c)
    dev = c.lengths.tolist()
    if max(dev) > 6:
        # the stale mirror [6, 6] would accept + 2; the device values refuse it: raises, nothing changes
        with pytest.raises(ValueError, match=r"^new_lengths: sequence \d would hold"):
            c.commit(2)
        assert c.lengths.tolist() == dev and c.host_lengths() == dev
    inc = 8 - max(dev)  # fills the fullest sequence; after a decrease, more than the stale mirror allowed (2)
    c.commit(inc)
    assert c.lengths.tolist() == [v + inc for v in dev]
    assert c.host_lengths() == c.lengths.tolist()


def test_commit_tensor_after_outside_write(device):
    c = linear(device)
    c.reset_for_new_sequences([6, 6])
    c.lengths.add_(-5)
    with pytest.raises(ValueError, match=r"^new_lengths: sequence 1 would hold 9 tokens"):
        c.commit(torch.tensor([0, 8], dtype=torch.int32))
    assert c.lengths.tolist() == [1, 1]
    c.commit(torch.tensor([7, 2], dtype=torch.int32))
    assert c.lengths.tolist() == [8, 3] and c.host_lengths() == [8, 3]


def test_all_empty_follows_outside_writes(device):
    c = linear(device)
    c.reset_for_new_sequences([0, 0])
    assert c.all_empty
    c.lengths[0] = 3
    assert not c.all_empty
    c.lengths.zero_()
    assert c.all_empty


def test_evict_after_outside_write_keeps_device_values(device):
    c = linear(device, B=3)
    c.reset_for_new_sequences([6, 6, 6])
    c.lengths.copy_(torch.tensor([1, 2, 3], dtype=torch.int32))
    c.evict([True, False, False])
    assert c.lengths.tolist() == [2, 3] and c.host_lengths() == [2, 3]


def test_evict_check_reads_device_lengths(device):
    c = linear(device, S=3)
    c.reset_for_new_sequences([1, 2])
    c.lengths[1] = 12
    before = capture(c)
    with pytest.raises(ValueError, match=r"^lengths: expected values in \[0, 3\], got \[1, 12\]"):
        c.evict([True, False], check=True)
    assert_unchanged(c, before)


def test_planted_length_never_passes_save_bound(device):
    c = linear(device, S=3)
    c.reset_for_new_sequences([1, 2])
    c.lengths[1] = 12
    with pytest.raises(ValueError, match=r"^seq_len: expected an int <= 3"):
        c.save(1, 12)
    assert c.save(1, 3).seq_len == 3


def test_invalidate_host_lengths(device):
    c = linear(device)
    c.reset_for_new_sequences([2, 3])
    # a write torch cannot see: through a second tensor over the same memory, made without the view machinery
    alias = torch.empty(0, dtype=torch.int32, device=device).set_(c.lengths_buffer.untyped_storage(), 0, (2,), (1,))
    with torch.no_grad():
        alias.data.copy_(torch.tensor([5, 5], dtype=torch.int32))
    assert c.host_lengths() == [2, 3]  # unseen: the reason for invalidate_host_lengths
    c.invalidate_host_lengths()
    assert c.host_lengths() == [5, 5]
    with pytest.raises(ValueError, match=r"would hold 9 tokens"):
        c.commit(4)


def test_mirror_works_under_inference_mode(device):
    with torch.inference_mode():
        c = linear(device)
        c.reset_for_new_sequences([6, 6])
        c.lengths[0] = 2
        assert c.host_lengths() == [2, 6]
        c.commit(1)
        assert c.lengths.tolist() == [3, 7]


# ---------------------------------------------------------------------------------------------------------
# messages and sizes


@pytest.mark.parametrize("kind", list(CACHES))
def test_save_from_empty_batch_message(device, kind):
    c = CACHES[kind](device)
    with pytest.raises(ValueError, match=r"^batch_idx: no active sequence to save from \(active_batch_size is 0\)"):
        c.save(0, 0)


def test_wrong_device_messages_name_one_device(device):
    c = linear(device)
    c.reset_for_new_sequences([1, 1])
    want = "cpu" if device.type == "cpu" else rf"{device.type}(:\d+)? or cpu"  # a CUDA cache takes host counts
    bad = torch.device("meta")
    with pytest.raises(ValueError, match=rf"^new_lengths: expected device {want}, got meta"):
        c.commit(torch.ones(2, dtype=torch.int32, device=bad))
    with pytest.raises(ValueError, match=rf"^finished: expected device {want}, got meta"):
        c.evict(torch.zeros(2, dtype=torch.bool, device=bad))


@pytest.mark.parametrize("kind", ["linear", "manager"])
def test_config_larger_than_memory_fails_before_allocating(kind):
    if kind == "linear":
        cfg = CacheConfig(64, 4096, 1 << 20, 8, 128, dtype=torch.float16, device="cpu")  # 1 PiB
        make = LinearKVCache
    else:
        cfg = ManagerConfig(4096, 1 << 20, [KVLayerConfig(8, 128)] * 64, dtype=torch.float16, device="cpu")
        make = KVCacheManager
    with pytest.raises(ValueError, match=r"^config: the cache needs 1048576\.0 GiB, more than the .* GiB available"):
        make(cfg)


def test_check_memory_function():
    from kvcache._device import available_memory, check_memory

    avail, total = available_memory(torch.device("cpu"))
    assert 0 < avail <= total * 2  # MemAvailable may count swap-backed caches; both are positive
    check_memory(1 << 20, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^pool: the cache needs"):
        check_memory(total * 4 + avail * 4, torch.device("cpu"), "pool")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graph_replay_then_invalidate_host_lengths():
    # A replay runs no Python: torch's version counter cannot see it, invalidate_host_lengths() is the contract.
    dev = torch.device("cuda")
    c = linear(dev, S=64)
    c.reset_for_new_sequences([1, 2])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        c.commit(1)  # warm-up: compiles the kernel
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        c.commit(1)  # host mirror: +1 once, at capture
    assert c.host_lengths() == [3, 4]
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert c.lengths.tolist() == [5, 6]
    c.invalidate_host_lengths()
    assert c.host_lengths() == [5, 6]
    with pytest.raises(ValueError, match=r"would hold 65 tokens"):
        c.commit(59)
