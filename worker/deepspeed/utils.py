"""``deepspeed.utils``: ``set_z3_leaf_modules`` (zeroplane's own, worker/leaves.py: such
a block is gathered whole at stage 3), ``logger`` and ``log_dist``."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch.distributed as dist

from worker.leaves import set_z3_leaf_modules

__all__ = ["log_dist", "logger", "set_z3_leaf_modules"]

logger = logging.getLogger("deepspeed")


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the ranks named (all with ``ranks`` None or holding -1)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    chosen = None if ranks is None else set(ranks)
    if chosen is None or -1 in chosen or rank in chosen:
        logger.log(level, "[Rank %d] %s", rank, message)
