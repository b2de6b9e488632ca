"""Differences between the torch versions zeroplane supports (2.5 and newer), in one place."""

from __future__ import annotations

import contextlib

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
    """
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return
    _broken_groups.append(distributed_c10d._get_default_group())
    abort = getattr(distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        # NCCL: ends its kernels; already gone is fine, the destroy below covers it
        with contextlib.suppress(RuntimeError):
            abort()
    if dist.is_initialized():
        dist.destroy_process_group()
