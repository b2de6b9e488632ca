"""``deepspeed.moe.layer``: DeepSpeed's ``MoE`` layer, as its scripts build it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.deepspeed.moe.experts import Experts
from worker.deepspeed.moe.sharded_moe import MOELayer, TopKGate

__all__ = ["MoE"]


class MoE(nn.Module):
    """``deepspeed.moe.layer.MoE``: ``num_experts`` copies of ``expert`` behind a
    top-``k`` gate ([Note: DeepSpeed's gates] in worker/deepspeed/moe/sharded_moe.py),
    its call returning ``(output, l_aux, exp_counts)``; ``use_residual``: DeepSpeed's
    residual MoE (``expert`` itself as a dense MLP beside the experts, mixed by a
    learned softmax coefficient).

    Every rank builds all ``num_experts`` experts; with ``ep_size > 1`` the
    drop-in's ``initialize`` asks for ``ParallelConfig(expert_parallel=ep_size)``,
    which keeps ``num_experts / ep_size`` of them on each rank and moves tokens by
    all-to-all, as DeepSpeed's expert-parallel groups do. The experts start as
    copies of ``expert``, as DeepSpeed's do, so the model is the same on either.
    ``use_tutel`` and ``enable_expert_tensor_parallelism`` are DeepSpeed's kernels
    and layouts, refused when asked for."""

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(
                f"MoE: num_experts={num_experts} must be a multiple of ep_size={ep_size}"
            )
        if use_tutel or enable_expert_tensor_parallelism:
            raise ValueError(
                "MoE(use_tutel=True / enable_expert_tensor_parallelism=True) are DeepSpeed's "
                "kernels and layout; zeroplane splits experts by ParallelConfig(expert_parallel=k) "
                "and keeps each whole on tensor-parallel ranks (docs/guides/moe.md): drop the flag"
            )
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = False
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        # all the layer's experts, in DeepSpeed's order of construction (copies, then
        # the gate's weights drawn), so the random stream is the same
        experts = Experts(expert, num_experts, self.expert_group_name)
        gate = TopKGate(
            hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
            noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling,
        )  # fmt: skip
        self.deepspeed_moe = MOELayer(
            gate, experts, self.expert_group_name, ep_size, self.num_local_experts
        )
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's engine calls this to form the layer's groups; zeroplane's forms
        them from ``ParallelConfig(expert_parallel=...)``: nothing to do."""

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def expert_parallel_of(model: nn.Module) -> int:
    """The ``ep_size`` the model's DeepSpeed MoE layers ask for (1 without any); layers
    asking different sizes are refused, naming them."""
    sizes = {name: m.ep_size for name, m in model.named_modules() if isinstance(m, MoE)}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{n or '(root)'}: {s}" for n, s in sizes.items())
        raise ValueError(
            f"the model's MoE layers ask for different ep_size ({listed}); zeroplane splits "
            "every layer's experts over one expert-parallel size"
        )
    return next(iter(sizes.values()), 1)
