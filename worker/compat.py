"""Differences between the torch versions zeroplane supports (2.5 and newer), in one place."""

from __future__ import annotations

import contextlib

import torch.distributed as dist

__all__ = ["abort_default_group", "all_gather_flat", "reduce_scatter_flat"]

# torch 2.13 renamed the flat-tensor collectives (`*_single`) and deprecated the
# old names; older releases only have the old ones.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def abort_default_group() -> None:
    """Tear down a default group that a dead peer broke, without waiting.

    ``destroy_process_group`` waits for operations still in flight, and after a
    peer died one of them can hang until the collective timeout. Aborting first
    (where this torch has it) ends them at once.
    """
    from torch.distributed import distributed_c10d

    abort = getattr(distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        # already gone is fine: the destroy below covers what is left
        with contextlib.suppress(RuntimeError):
            abort()
    if dist.is_initialized():
        dist.destroy_process_group()
