"""Differences between the torch versions zeroplane supports (2.5 and newer), in one place."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch.distributed as dist

__all__ = ["abort_default_group", "all_gather_flat", "reduce_scatter_flat"]

# torch 2.13 renamed the flat-tensor collectives (`*_single`) and deprecated the
# old names; older releases only have the old ones.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Default groups a dead peer broke, still referenced on purpose (see below).
_broken_groups: list[object] = []


def abort_default_group() -> None:
    """Tear down a default group that a dead peer broke, without waiting.

    Releasing a gloo group runs its destructor, which waits for every operation
    still queued or in flight on it, and after a peer died one of them can wait
    on a survivor that has moved on, until the collective timeout (measured:
    14.5 s of a 15 s timeout, aborting first or not). So the broken group is
    kept referenced here and only unregistered: the new generation's group forms
    at once, and the old one's operations time out in the background. The cost
    is one idle group per crash, and a process that exits within the collective
    timeout of a crash waiting out the rest of it at exit.

    Not quite idle: until those operations time out, the broken group's gloo
    transport thread (``gloo_tcp_loop``, one per group) busy-polls the dead
    peer's connection. Measured (3 ranks on 2 cores): 45-52 % of a core per
    survivor for the whole collective timeout, and every step of the job
    slower meanwhile. So the transport threads alive at the abort (they all
    belong to the broken generation: the next group's is started after) are
    given the lowest CPU priority; the new group's threads keep theirs.
    """
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return
    _broken_groups.append(distributed_c10d._get_default_group())
    _lowest_priority(_TRANSPORT_THREADS)
    abort = getattr(distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        # NCCL: ends its kernels; already gone is fine, the destroy below covers it
        with contextlib.suppress(RuntimeError):
            abort()
    if dist.is_initialized():
        dist.destroy_process_group()


# the threads gloo's TCP transport polls its connections on (one per group)
_TRANSPORT_THREADS = "gloo_tcp_loop"


def _lowest_priority(thread_name: str) -> None:
    """Give this process's threads named ``thread_name`` nice 19 (Linux: a nice
    value is per thread; lowering one's own priority needs no privilege)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return
    for task in tasks.iterdir():
        try:
            if (task / "comm").read_text().strip() == thread_name:
                os.setpriority(os.PRIO_PROCESS, int(task.name), 19)
        except OSError:  # the thread ended meanwhile
            continue
