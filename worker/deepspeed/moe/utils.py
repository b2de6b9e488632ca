"""``deepspeed.moe.utils``: the param-group helpers DeepSpeed's MoE scripts call.

DeepSpeed marks an expert's parameters ``allreduce = False`` with a ``group_name``
and wants them in param groups of their own (``"moe": True``), which
``split_params_into_different_moe_groups_for_optimizer`` makes. zeroplane needs no
such groups (its experts are placed by ``ParallelConfig(expert_parallel=k)``), but
a script that calls it gets the same groups DeepSpeed would give it: a model
without such parameters keeps its groups as they are.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param: torch.Tensor) -> bool:
    return getattr(param, "allreduce", True) is False


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | Iterable[dict[str, Any]], max_group_size: int | None = None
) -> list[dict[str, Any]]:
    """Each group's expert parameters moved to a group of their own per
    ``group_name``, with the group's hyperparameters and ``"moe": True``."""
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    out: list[dict[str, Any]] = []
    experts: dict[tuple[int, str], dict[str, Any]] = {}
    for i, group in enumerate(groups):
        params = list(group["params"])
        dense = [p for p in params if not is_moe_param(p)]
        out.append({**group, "params": dense})
        for p in params:
            if is_moe_param(p):
                name = str(getattr(p, "group_name", "moe"))
                key = (i, name)
                if key not in experts:
                    label = f"{group.get('name', i)}_{name}"
                    experts[key] = {**group, "params": [], "name": label, "moe": True}
                experts[key]["params"].append(p)
    return [*(g for g in out if g["params"] or not experts), *experts.values()]
