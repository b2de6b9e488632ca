"""``deepspeed.moe.experts``: a layer's local experts, copies of one module."""

from __future__ import annotations

import copy

from torch import nn

from worker.moe import Experts as _Experts

__all__ = ["Experts"]


class Experts(nn.Module):
    """DeepSpeed's experts container: ``num_local_experts`` deep copies of
    ``expert`` under ``deepspeed_experts`` (DeepSpeed's parameter names), each
    parameter marked as DeepSpeed marks an expert's (``allreduce = False``,
    ``group_name``) so that ``moe.utils.split_params_into_different_moe_groups_for_optimizer``
    finds it. The copies are a :class:`worker.moe.Experts`, which zeroplane's
    expert parallelism splits ([Note: DeepSpeed's gates] in sharded_moe.py)."""

    def __init__(
        self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None
    ) -> None:
        super().__init__()
        self.deepspeed_experts = _Experts(copy.deepcopy(expert) for _ in range(num_local_experts))
        self.num_local_experts = num_local_experts
        for param in self.deepspeed_experts.parameters():
            param.allreduce = False
            param.group_name = expert_group_name
