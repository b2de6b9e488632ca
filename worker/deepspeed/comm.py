"""``deepspeed.comm``: ``torch.distributed`` under DeepSpeed's names (most are the same
ones), and the few DeepSpeed adds (``get_local_rank``, ``init_distributed``)."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

__all__ = ["get_local_rank", "get_rank", "get_world_size", "init_distributed"]


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """The process's rank on its host (``$LOCAL_RANK``, which every launcher sets)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_distributed(*args: Any, **kwargs: Any) -> None:
    from worker.deepspeed import init_distributed as init

    init(*args, **kwargs)


def __getattr__(name: str) -> Any:
    # every other name: torch.distributed's (barrier, all_reduce, ReduceOp, ...)
    return getattr(dist, name)
