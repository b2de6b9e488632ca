"""Differences between the torch versions zeroplane supports (2.5 and newer), in one place."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_flat", "reduce_scatter_flat"]

# torch 2.13 renamed the flat-tensor collectives (`*_single`) and deprecated the
# old names; older releases only have the old ones.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
