"""BlockAllocator's thread rule (issue 13): one scheduler owns it; ``check_thread=True`` catches a second one."""

from __future__ import annotations

import threading

import pytest

from kvcache import BlockAllocator


def run_in_thread(fn):
    """Run ``fn`` in a new thread; return (result, exception)."""
    out: dict = {}

    def target():
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    t = threading.Thread(target=target, name="second-scheduler")
    t.start()
    t.join()
    return out.get("result"), out.get("error")


@pytest.mark.parametrize(
    "op",
    ["allocate", "can_allocate", "free", "fork", "copy_on_write", "match_prefix", "cache_blocks",
     "reset_prefix_cache", "reset_stats"],
)
def test_second_thread_is_refused_before_any_change(op):
    alloc = BlockAllocator(num_blocks=8, block_size=2, check_thread=True)
    table = alloc.allocate(3)
    hashes = alloc.hash_blocks([1, 2, 3, 4])
    calls = {
        "allocate": lambda: alloc.allocate(1),
        "can_allocate": lambda: alloc.can_allocate(1),
        "free": lambda: alloc.free(table[:1]),
        "fork": lambda: alloc.fork(table),
        "copy_on_write": lambda: alloc.copy_on_write(table[0]),
        "match_prefix": lambda: alloc.match_prefix(hashes),
        "cache_blocks": lambda: alloc.cache_blocks(table[:2], hashes),
        "reset_prefix_cache": lambda: alloc.reset_prefix_cache(),
        "reset_stats": lambda: alloc.reset_stats(),
    }
    before = (alloc.num_free_blocks, alloc.num_used_blocks, [alloc.ref_count(b) for b in range(8)])
    _, err = run_in_thread(calls[op])
    assert isinstance(err, RuntimeError), err
    assert f"BlockAllocator.{op}: called from thread 'second-scheduler'" in str(err)
    assert (alloc.num_free_blocks, alloc.num_used_blocks, [alloc.ref_count(b) for b in range(8)]) == before
    calls[op]()  # the owner still can
    alloc.check_invariants()


def test_owner_is_the_first_operating_thread():
    alloc = BlockAllocator(num_blocks=4, block_size=2, check_thread=True)  # built here, used by a worker
    got, err = run_in_thread(lambda: alloc.allocate(2))
    assert err is None and got == [0, 1]
    with pytest.raises(RuntimeError, match=r"^BlockAllocator\.free: called from thread 'MainThread'"):
        alloc.free(got)
    assert alloc.num_used_blocks == 2
    assert alloc.num_free_blocks == 2  # properties read anywhere


def test_off_by_default_and_validated():
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    blocks = alloc.allocate(1)
    _, err = run_in_thread(lambda: alloc.free(blocks))
    assert err is None and alloc.num_used_blocks == 0
    assert "allocate" not in vars(alloc)  # no wrapper, no cost
    with pytest.raises(TypeError, match=r"^check_thread: expected a bool, got int"):
        BlockAllocator(num_blocks=4, block_size=2, check_thread=1)  # type: ignore[arg-type]
