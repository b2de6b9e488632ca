"""``deepspeed.comm``: ``torch.distributed`` under DeepSpeed's names (most are the same
ones), and the few DeepSpeed adds (``get_local_rank``, ``init_distributed``)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["get_local_rank", "get_rank", "get_world_size", "init_distributed"]


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """The process's rank on its host (``$LOCAL_RANK``, which every launcher sets)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Form the default process group from the launcher's environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); one process alone without
    one. Nothing where a group exists."""
    if dist.is_initialized() or dist_init_required is False:
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    os.environ.setdefault("RANK", "0" if rank < 0 else str(rank))
    os.environ.setdefault("WORLD_SIZE", "1" if world_size < 0 else str(world_size))
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(
        backend, init_method=init_method or "env://", timeout=timeout or timedelta(minutes=30)
    )


def __getattr__(name: str) -> Any:
    # every other name: torch.distributed's (barrier, all_reduce, ReduceOp, ...)
    return getattr(dist, name)
