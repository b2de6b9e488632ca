"""``deepspeed.moe.sharded_moe``: DeepSpeed's top-k gate and its MoE layer, with
zeroplane's experts behind them.

[Note: DeepSpeed's gates]
DeepSpeed's ``TopKGate`` decides, for each of a rank's S tokens, k experts and a
weight for each, and drops a route when its expert is over capacity: the
arithmetic below follows DeepSpeed 0.19's ``top1gating``, ``top2gating`` and
``topkgating`` step for step (same operations, same random draws in the same
order, so a script keeps its numbers):

- k = 1: the softmax's argmax (with ``noisy_gate_policy="RSample"``, of the
  logits plus Gumbel noise; with ``"Jitter"`` the input was multiplied by
  uniform noise in [0.99, 1.01] first); capacity ``ceil(S / E * factor)``, at
  least ``min_capacity``; over capacity, the tokens kept are the top
  ``capacity`` of a uniform draw (random token selection, ``use_rts``) or of
  the mask itself; the weight is the softmax probability, not renormalized.
  ``l_aux = E * sum(mean gate * fraction routed)``.
- k = 2: the second expert is the argmax of the logits plus Gumbel noise
  (``top2_2nd_expert_sampling``) over the others; capacity
  ``ceil(2 S / E * factor)`` by position (first choices first); the two
  weights renormalized over the routes kept.
- k > 2: the softmax's top k; over capacity the routes with the largest
  weights stay; weights renormalized. ``l_aux = E^2 mean(...) / k``.
- ``drop_tokens=False``: no route is dropped (DeepSpeed's capacity then only
  sizes its buffers, which zeroplane does not have).

The gate returns the routes as transformers 5.x's experts take them
(``top_k_index`` S x k, -1 for a dropped route, and ``top_k_weights``), so the
layer's experts are a :class:`worker.moe.Experts`: every expert runs every call
(no stage-3 hang on a data-dependent expert), and ``ParallelConfig(
expert_parallel=k)`` splits them and moves tokens by all-to-all (worker/moe/
dispatch.py [Note: expert parallelism]) where DeepSpeed pads every expert to
its capacity. The output of a token is the weighted sum of its kept routes'
expert outputs, as DeepSpeed's, and a token with none gets zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MOELayer", "Routes", "TopKGate", "top1gating", "top2gating", "topkgating"]

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


@dataclass
class Routes:
    """A gate's decision for S tokens: ``index`` (S x k experts, -1 where the route
    was dropped), ``weight`` (S x k), the load-balancing loss ``l_aux`` and the
    routes per expert before any drop (``exp_counts``, as DeepSpeed counts them)."""

    index: torch.Tensor
    weight: torch.Tensor
    l_aux: torch.Tensor
    exp_counts: torch.Tensor


def _capacity(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    # in float32, as DeepSpeed's capacity factor is a float32 tensor
    capacity = int(torch.ceil(tokens / experts * torch.tensor(factor)).item())
    return max(capacity, int(min_capacity))


def _uniform(low: float, high: float, shape: torch.Size, device: torch.device) -> torch.Tensor:
    # the distribution DeepSpeed samples, so that the draw from the generator is the same
    dist = torch.distributions.uniform.Uniform(
        torch.tensor(low, device=device), torch.tensor(high, device=device)
    )
    return dist.rsample(shape)


def _gumbel(shape: torch.Size, device: torch.device) -> torch.Tensor:
    one, zero = torch.tensor(1.0, device=device), torch.tensor(0.0, device=device)
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def top1gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
) -> Routes:
    """Each token's first expert ([Note: DeepSpeed's gates], k = 1)."""
    tokens, experts = logits.shape
    noisy = None
    if noisy_gate_policy == "RSample":
        noisy = logits + _gumbel(logits.shape, logits.device)
    gates = F.softmax(logits, dim=1)
    capacity = _capacity(tokens, experts, capacity_factor, min_capacity)
    chosen = torch.argmax(gates if noisy is None else noisy, dim=1)
    mask = F.one_hot(chosen, num_classes=experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = torch.sum(mask, dim=0).detach()
    if not drop_tokens:
        capacity = tokens  # nothing dropped: every expert may take every token
    l_aux = torch.sum(torch.mean(gates, dim=0) * torch.mean(mask.float(), dim=0)) * experts
    ranked = mask * _uniform(0.0, 1.0, mask.shape, logits.device) if use_rts else mask
    if tokens < min_capacity:
        raise ValueError(
            f"a top-1 gate got {tokens} tokens, fewer than its min_capacity={min_capacity}: "
            "set min_capacity lower or give it more tokens (as DeepSpeed requires)"
        )
    picked = torch.topk(ranked, k=min(capacity, tokens), dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, picked, 1)
    kept = mask.sum(dim=1) > 0
    index = torch.where(kept, chosen, torch.full_like(chosen, -1))
    weight = (gates * mask).sum(dim=1)
    return Routes(index.unsqueeze(1), weight.unsqueeze(1), l_aux, exp_counts)


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    top2_2nd_expert_sampling: bool = True,
) -> Routes:
    """Each token's two experts ([Note: DeepSpeed's gates], k = 2)."""
    tokens, experts = logits.shape
    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=experts)
    if top2_2nd_expert_sampling:
        logits = logits + _gumbel(logits.shape, logits.device)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=experts)
    place1 = torch.cumsum(mask1, dim=0) - 1
    place2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
    l_aux = torch.mean(torch.mean(gates, dim=0) * torch.mean(mask1.float(), dim=0))
    l_aux = l_aux * experts * experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()
    if drop_tokens:
        capacity = _capacity(tokens, experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(place1, capacity)
        mask2 = mask2 * torch.lt(place2, capacity)
    g1 = (gates * mask1.float()).sum(dim=1)
    g2 = (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
    index = torch.stack(
        [
            torch.where(mask1.any(dim=1), first, torch.full_like(first, -1)),
            torch.where(mask2.any(dim=1), second, torch.full_like(second, -1)),
        ],
        dim=1,
    )
    return Routes(index, torch.stack([g1 / denom, g2 / denom], dim=1), l_aux, exp_counts)


def topkgating(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
) -> Routes:
    """Each token's ``k`` experts ([Note: DeepSpeed's gates], k > 2; routes over
    capacity dropped by weight, DeepSpeed's ``drop_policy="probs"``)."""
    tokens, experts = logits.shape
    gates = F.softmax(logits, dim=1)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = torch.sum(mask, dim=0).detach()
    l_aux = torch.mean(torch.mean(gates, dim=0) * torch.mean(mask.float(), dim=0))
    l_aux = l_aux * experts * experts / k
    if drop_tokens:
        capacity = _capacity(tokens, experts, capacity_factor * k, min_capacity)
        ranked = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
        picked = torch.topk(ranked, k=min(capacity, tokens), dim=0, sorted=False)[1]
        mask &= torch.zeros_like(gates, dtype=torch.bool).scatter_(0, picked, True)
    masked = gates * mask
    total = torch.clamp(masked.sum(dim=-1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    masked = masked / total
    kept = mask.gather(1, top_idx)
    index = torch.where(kept, top_idx, torch.full_like(top_idx, -1))
    return Routes(index, masked.gather(1, top_idx), l_aux, exp_counts)


class TopKGate(nn.Module):
    """DeepSpeed's gate (its constructor): a bias-free ``wg`` linear map to the
    ``num_experts`` logits, computed in fp32, and the routing of [Note: DeepSpeed's
    gates]; its call returns :class:`Routes`."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group: Any = None,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if k < 1 or k > num_experts:
            raise ValueError(f"TopKGate: k={k} must be between 1 and num_experts={num_experts}")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(
                f"noisy_gate_policy={noisy_gate_policy!r}: DeepSpeed's are None, 'Jitter' "
                "and 'RSample'"
            )
        if noisy_gate_policy not in (None, "None") and k != 1:
            raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r} is for k=1 gates, not k={k}")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def forward(self, input: torch.Tensor, used_token: torch.Tensor | None = None) -> Routes:
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = x * _uniform(1.0 - 1e-2, 1.0 + 1e-2, x.shape, x.device)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            noisy = self.noisy_gate_policy if self.training else None
            return top1gating(
                logits, factor, self.min_capacity, used_token, noisy, self.drop_tokens, self.use_rts
            )
        if used_token is not None:
            raise ValueError("used_token is taken by a top-1 gate only (as in DeepSpeed)")
        if self.k == 2:
            return top2gating(
                logits, factor, self.min_capacity, self.drop_tokens, self.top2_2nd_expert_sampling
            )
        return topkgating(logits, self.k, factor, self.min_capacity, self.drop_tokens)


class MOELayer(nn.Module):
    """DeepSpeed's MoE layer: ``gate`` routes the tokens, ``experts`` (a
    :class:`~worker.deepspeed.moe.experts.Experts`) run them; ``l_aux`` and
    ``exp_counts`` are the last call's."""

    def __init__(
        self,
        gate: TopKGate,
        experts: nn.Module,
        ep_group_name: str | None = None,
        ep_size: int = 1,
        num_local_experts: int = 1,
        use_tutel: bool = False,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group_name = ep_group_name
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1])
        routes = self.gate(rows, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        out = self.experts.deepspeed_experts(rows, routes.index, routes.weight)
        return out.reshape(hidden.shape).to(hidden.dtype)
