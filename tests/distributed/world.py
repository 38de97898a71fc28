"""Multi-process worlds for the distributed tests: ``size`` ranks spawned once (torch.multiprocessing, spawn),
joined into one process group over 127.0.0.1, and kept for every test of the session that asks for the same
(backend, size): spawning costs seconds of CPU a rank, a task a few milliseconds.

A test sends a function (importable: module level) to every rank; each runs ``fn(ctx, *args)`` and the results
come back in rank order. Bounded in time: a rank that does not answer within the deadline, or that dies,
fails the test with what every rank reported, and the world is killed (children by their own pid) and
started afresh for the next test. A rank that raises fails the test with its traceback; the world is then
restarted too (messages may be left in flight).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

START_TIMEOUT = 60.0  # seconds for every rank to import torch and join the group (2 shared cores)
PG_TIMEOUT = 30.0  # torch.distributed's own timeout of a collective / point-to-point call


@dataclasses.dataclass(frozen=True)
class RankContext:
    """What a rank function gets: its rank, the world size, the backend and the device its tensors use."""

    rank: int
    size: int
    backend: str
    device: torch.device


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, size: int, backend: str, port: int, tasks: Any, results: Any) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (the GPU hosts are shared)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT))
        results.put((rank, "ready", None))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    ctx = RankContext(rank, size, backend, device)
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args, env = item
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            results.put((rank, "ok", fn(ctx, *args)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    dist.destroy_process_group()


class World:
    """``size`` ranks in one process group of ``backend`` (``"gloo"`` or ``"nccl"``)."""

    def __init__(self, backend: str, size: int) -> None:
        self.backend, self.size = backend, size
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(size)]
        port = _free_port()
        self._procs = [ctx.Process(target=_rank_main, args=(r, size, backend, port, self._tasks[r], self._results),
                                   daemon=True) for r in range(size)]
        for p in self._procs:
            p.start()
        self.alive = True
        self._collect("ready", START_TIMEOUT, "start")

    def _collect(self, what: str, timeout: float, task: str) -> list[Any]:
        got: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.size:
            try:
                rank, status, value = self._results.get(timeout=0.2)
                got[rank] = (status, value)
            except queue.Empty:
                if any(s == "error" for s, _ in got.values()):
                    # a rank failed: the others may wait on it in a collective; give them a moment to fail too
                    deadline = min(deadline, time.monotonic() + 3)
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
                if dead or time.monotonic() > deadline:
                    self.kill()
                    why = f"rank(s) {dead} died" if dead else f"rank(s) {sorted(set(range(self.size)) - set(got))} " \
                                                              f"did not answer within {timeout:.0f} s"
                    raise AssertionError(f"{self.backend} world of {self.size}, {task}: {why}; "
                                         f"reports: {self._fmt(got)}") from None
        errors = {r: v for r, (s, v) in got.items() if s == "error"}
        if errors:
            self.kill()
            raise AssertionError(f"{self.backend} world of {self.size}, {task}: rank(s) {sorted(errors)} failed\n"
                                 + "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
        return [got[r][1] for r in range(self.size)]

    @staticmethod
    def _fmt(got: dict[int, tuple[str, Any]]) -> str:
        return "; ".join(f"rank {r}: {s} {str(v)[-2000:]}" for r, (s, v) in sorted(got.items())) or "none"

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0,
            env: dict[str, str] | None = None) -> list[Any]:
        """``fn(ctx, *args)`` on every rank (``env`` set around the call); the results in rank order."""
        if not self.alive:
            raise AssertionError("world is not running")
        for q in self._tasks:
            q.put((fn, args, dict(env or {})))
        return self._collect("ok", timeout, getattr(fn, "__name__", str(fn)))

    def close(self) -> None:
        if not self.alive:
            return
        for q in self._tasks:
            q.put(None)
        deadline = time.monotonic() + 10
        for p in self._procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every rank still running (each by its own process id) and reap it."""
        self.alive = False
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)


class Worlds:
    """One :class:`World` per (backend, size), started on first use, restarted after a failure."""

    def __init__(self) -> None:
        self._worlds: dict[tuple[str, int], World] = {}

    def get(self, backend: str, size: int) -> World:
        w = self._worlds.get((backend, size))
        if w is None or not w.alive:
            w = World(backend, size)
            self._worlds[(backend, size)] = w
        return w

    def close(self) -> None:
        for w in self._worlds.values():
            w.close()
        self._worlds.clear()
