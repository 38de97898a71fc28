"""The multi-process harness itself: a rank that hangs fails the test within its deadline and every rank
process is gone afterwards (no hung CI, no stray processes)."""

from __future__ import annotations

import time

import pytest

from .world import RankContext, World

pytestmark = pytest.mark.timeout(120)


def _hang_on_rank_1(ctx: RankContext) -> int:
    if ctx.rank == 1:
        time.sleep(600)
    return ctx.rank


def test_a_hanging_rank_fails_clearly_and_is_killed() -> None:
    world = World("gloo", 2)
    try:
        procs = list(world._procs)
        t0 = time.monotonic()
        with pytest.raises(AssertionError, match=r"rank\(s\) \[1\] did not answer within 3 s; reports: rank 0: ok 0"):
            world.run(_hang_on_rank_1, timeout=3)
        assert time.monotonic() - t0 < 20
        assert not world.alive and not any(p.is_alive() for p in procs)
    finally:
        world.kill()
