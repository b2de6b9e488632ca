"""A pool of gloo worker processes, reused across tests.

Spawning a process and importing torch costs seconds, so each world size gets
one pool of ranks for the whole session; a test sends a function (importable,
so it pickles by reference) to every rank and gets each rank's return value
back. A task that raises on any rank, or that does not finish within its
timeout, fails the test and tears the pool down (its process group may be
wedged mid-collective); the next test gets a fresh one.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["RankError", "WorkerPool"]


class RankError(AssertionError):
    """A task failed on some rank; the message carries that rank's traceback."""


def _serve(rank: int, world_size: int, store_path: str, tasks: mp.Queue, results: mp.Queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    from torch.distributed.distributed_c10d import _world

    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        before = set(_world.pg_map)
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # report everything, including assertion failures
            results.put((rank, False, traceback.format_exc()))
        # the groups the task made (subgroups, meshes) go with it: each gloo group
        # keeps a polling thread, and the suite's tasks made ~60 of them a rank
        made = set(_world.pg_map) - before
        for group in made:
            dist.destroy_process_group(group)
        if made:  # DTensor's caches would hand back meshes of the destroyed groups
            from worker.compat import forget_meshes

            forget_meshes()
            # a group's threads stop when its last reference goes, and a task's engines
            # hold theirs in reference cycles (hooks, weak back-references)
            gc.collect()
    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="zeroplane-pool-")
        store = os.path.join(self._dir.name, "store")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results: mp.Queue = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(rank, world_size, store, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120, **kwargs: Any) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if self.broken:
            raise RuntimeError("worker pool is broken")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            if (remaining <= 0 or dead) and errors:
                break
            if remaining <= 0 or dead:
                self.close(kill=True)
                why = f"ranks {dead} died" if dead else f"timed out after {timeout:.0f}s"
                raise RankError(f"{fn.__name__} on world size {self.world_size}: {why}")
            try:
                rank, ok, value = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            (out if ok else errors)[rank] = value
            if errors and len(out) + len(errors) < self.world_size:
                # the other ranks may be stuck in a collective with the failed one
                deadline = min(deadline, time.monotonic() + 10)
        if errors:
            self.close(kill=True)
            rank = min(errors)
            raise RankError(f"rank {rank} of {self.world_size} failed:\n{errors[rank]}")
        return [out[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        self.broken = True
        if not kill:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._dir.cleanup()
