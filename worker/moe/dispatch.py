"""Expert parallelism: each rank of an expert-parallel group holds E/ep whole experts
of every mixture-of-experts layer, and tokens reach them by all-to-all.

[Note: expert parallelism]
The world's ranks form ep groups of ``ep`` consecutive ranks (``[0, ep)``,
``[ep, 2·ep)``, ...: a node's ranks, where the launcher numbers a node's ranks
consecutively, so the token exchange stays on the node when ep fits one) and,
across them, *expert-data-parallel* groups of the ranks at the same place
(``{j, j + ep, ...}``), which hold the same experts. Place j of every ep
group holds experts ``[j·E/ep, (j+1)·E/ep)`` of each layer, under the names the
model gave them (an :class:`~worker.moe.experts.Experts` keeps those children; a
fused module keeps those rows of its parameters), and the engine shards their
ZeRO state over the expert-data-parallel group (worker/moe/shards.py), the
dense parameters' over the whole world (DeepSpeed-MoE's and torchtitan's layout).

A layer's call (worker/moe/routing.py [Note: routed experts]):

1. route: the T·K assignments sorted by expert, counted per expert;
2. the counts go to every rank of the ep group (an all-to-all of E integers),
   so each rank knows how many rows it will receive for each of its experts;
3. dispatch: the sorted rows to the ranks holding their experts (an all-to-all
   of variable sizes: dropless, or capped by ``capacity_factor``);
4. the received rows, grouped by source rank, are regrouped by local expert,
   each local expert runs once on its rows (every expert, every call: the
   same stage-3 gathers on every rank whatever the routing), and the results
   go back to the source order;
5. combine: the all-to-all back, and each row, weighted, to its token.

Autograd runs the same exchanges backwards (:class:`_AllToAll`). The router's
logits are computed by the dense part, every rank for its own tokens, so a
load-balancing or z-loss on them is the model's own, untouched.

[Note: experts on a mesh]
With tensor parallelism (``ParallelConfig(expert_parallel=k, tensor_parallel=t)``,
``zeroplane run --ep k --tp t``) the plan splits the dense layers over tp and
leaves every experts module whole (a plan entry inside one is refused,
worker/tp.py ``apply_tp``; ``moe_plan`` for Hugging Face MoE decoders); with
pipeline parallelism (``pipeline_parallel=p``, ``--pp p``) each stage holds its
layers' experts. The ep groups lie inside data parallelism, one set per tp and
pp position: ``k`` consecutive dp indices at one (pp, tp) index, and the
expert-data-parallel group the dp indices at the same place (worker/factory.py
``_split_dp``, as a cp group on a mesh). The tp ranks of a dp index hold the
same tokens (a row-wise layer's output is made whole), so each runs the same
exchange over its own ep group and computes the same expert gradients, as a
parameter replicated over tp does ([Note: replicated parameters under TP]): the
gradient norm counts an expert's square 1/tp times on each tp rank
(worker/clipping.py ``replica_weight``) and sums over the stages, and a
checkpoint writes the experts from tp rank 0's places only
(worker/moe/checkpoint.py), so it is the whole model's and loads at any layout.
A pipeline's schedule runs each micro-batch's exchanges on every dp rank of the
stage in the same order; its shape inference on meta tensors (torch before 2.13)
passes an experts layer through without an exchange.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from worker.collectives import Collectives
from worker.compat import eager
from worker.leaves import LEAF_ATTR
from worker.moe.experts import expert_count, is_experts, keep_experts, run_rows
from worker.moe.routing import combine, route

__all__ = ["ExpertGroups", "ExpertLoad", "apply_expert_parallel", "expert_modules"]


@dataclass
class ExpertGroups:
    """This rank's ep group (the ranks that exchange tokens) and expert-data-parallel
    group (the ranks that hold the same experts), over a world of ``world`` ranks."""

    ep: Collectives
    edp: Collectives
    world: int

    @classmethod
    def form(cls, world: Collectives, ep: int) -> ExpertGroups:
        """Form the groups over ``world`` (every rank calls this, at the same point)."""
        if ep < 1 or world.world_size % ep:
            raise ValueError(
                f"expert_parallel={ep} must divide the world's {world.world_size} ranks"
            )
        if ep == world.world_size:
            return cls(ep=world, edp=Collectives.ahead(0, 1, world.backend), world=ep)
        return cls(ep=world.split(ep), edp=world.across(ep), world=world.world_size)

    @property
    def size(self) -> int:
        return self.ep.world_size

    @property
    def place(self) -> int:
        return self.ep.rank


@dataclass
class ExpertLoad:
    """What one layer's exchanges carried on this rank since the engine started:
    rows received per local expert (the load balance), bytes sent and received by
    the all-to-alls (both directions, forward and backward), assignments dropped
    over capacity. Counters: the metrics take their rates."""

    tokens: torch.Tensor
    a2a_bytes: int = 0
    dropped: int = 0


@dataclass
class _Placed:
    """An experts module's place under expert parallelism (set on the module)."""

    base: type[nn.Module]
    groups: ExpertGroups
    num_experts: int  # the layer's, over all ranks
    first: int  # the first expert this rank holds
    capacity_factor: float | None
    # every parameter of the layer's experts as the model had it, by its name in the
    # module, and its full shape (checkpoints are of the whole model, worker/moe/checkpoint.py)
    full_shapes: dict[str, tuple[int, ...]]
    load: ExpertLoad = field(init=False)
    # the layer's call, which torch.compile runs as it is (a graph break on each side):
    # its exchanges' sizes depend on the routing, and its collectives go through the
    # engine's counted Collectives (worker/compat.py ``eager``)
    call: Callable[..., torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        self.load = ExpertLoad(torch.zeros(self.num_experts // self.groups.size, dtype=torch.long))
        self.call = eager(_exchange_and_run)


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks of ``comm`` (``send[i]`` rows to rank i, ``recv[i]`` from it);
    the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Collectives, send: list[int], recv: list[int],
                load: ExpertLoad) -> torch.Tensor:  # fmt: skip
        ctx.comm, ctx.send, ctx.recv, ctx.load = comm, send, recv, load
        return _exchange(x, comm, send, recv, load)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = _exchange(grad.contiguous(), ctx.comm, ctx.recv, ctx.send, ctx.load)
        return back, None, None, None, None


def _exchange(
    x: torch.Tensor, comm: Collectives, send: list[int], recv: list[int], load: ExpertLoad
) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    comm.all_to_all(out, x, output_split_sizes=recv, input_split_sizes=send)
    load.a2a_bytes += (x.numel() + out.numel()) * x.element_size()
    return out


class ExpertParallel(nn.Module):
    """The class an experts module takes under expert parallelism (a subclass of its
    own, made per class, as FSDP2 does): its call exchanges tokens with the ep group
    ([Note: expert parallelism]); the module holds only this rank's experts. It is a
    stage-3 leaf: gathered whole, by the ranks holding the same experts."""

    _zp_expert: _Placed

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return self._zp_expert.call(self, hidden, top_k_index, top_k_weights)


def _exchange_and_run(
    module: ExpertParallel,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """An experts module's call under expert parallelism ([Note: expert parallelism])."""
    if hidden.is_meta:
        # a pipeline stage's shape inference on meta tensors (torch before 2.13's
        # PipelineStage): the layer's output has its input's shape, no exchange
        return torch.empty_like(hidden)
    placed = module._zp_expert
    ep, local = placed.groups.ep, placed.num_experts // placed.groups.size
    routed = route(top_k_index, placed.num_experts, placed.capacity_factor)
    # 2. how many rows each rank sends each of its experts, per expert (ep x local)
    counts = routed.counts.view(ep.world_size, local).contiguous()
    incoming = torch.empty_like(counts)
    exchanged = ep.all_to_all(incoming, counts, as_op="control", async_op=True)
    outgoing = hidden[routed.rows]  # while the counts travel
    exchanged.wait()
    send, recv = counts.sum(1).tolist(), incoming.sum(1).tolist()
    # 3. dispatch
    rows = _AllToAll.apply(outgoing, ep, send, recv, placed.load)
    # 4. grouped by local expert, run, back to source order
    by_expert = incoming.sum(0)
    if local == 1:  # one expert here: the rows are its, in source order already
        out = run_rows(module, placed.base, rows, by_expert)
    else:
        expert_of_row = torch.arange(local, device=rows.device).repeat(ep.world_size)
        of_row = torch.repeat_interleave(expert_of_row, incoming.flatten())
        order = torch.sort(of_row, stable=True).indices
        grouped = run_rows(module, placed.base, rows[order], by_expert)
        out = grouped.new_empty(grouped.shape).index_copy(0, order, grouped)
    # 5. combine
    back = _AllToAll.apply(out, ep, recv, send, placed.load)
    placed.load.tokens += by_expert.to(placed.load.tokens.device)
    placed.load.dropped += routed.dropped
    return combine(back, routed, top_k_weights, hidden.shape[0])


_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _parallel_class(base: type[nn.Module]) -> type[nn.Module]:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"ExpertParallel{base.__name__}", (ExpertParallel, base), {})
    return _CLASSES[base]


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of ``model`` (worker/moe/experts.py's kinds), by name."""
    return [(name, m) for name, m in model.named_modules() if is_experts(m)]


def apply_expert_parallel(
    model: nn.Module, groups: ExpertGroups, *, capacity_factor: float | None = None
) -> list[nn.Module]:
    """Keep this rank's experts of every experts module of ``model`` and make each
    exchange its tokens over ``groups.ep`` ([Note: expert parallelism]). Returns the
    modules, whose parameters the engine shards over ``groups.edp``."""
    found = expert_modules(model)
    if not found:
        raise ValueError(
            "expert_parallel > 1, but the model has no experts module: wrap a layer's expert "
            "modules in worker.moe.Experts, or use a transformers 5.x MoE model "
            "(docs/guides/moe.md)"
        )
    k = groups.size
    for name, module in found:
        count = expert_count(module)
        if count % k:
            raise ValueError(f"{name} has {count} experts, which expert_parallel={k} cannot split")
        base = type(module)
        cap = capacity_factor
        if cap is None:
            cap = getattr(module, "capacity_factor", None)
        first = groups.place * (count // k)
        full_shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
        keep_experts(module, first, first + count // k)
        module.__class__ = _parallel_class(base)
        module._zp_expert = _Placed(base, groups, count, first, cap, full_shapes)
        setattr(module, LEAF_ATTR, True)
    return [m for _, m in found]
