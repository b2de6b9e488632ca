"""The experts' ZeRO state under expert parallelism: a second shard state, over the
expert-data-parallel group, beside the engine's own over the world.

[Note: two shard states]
Under expert parallelism (worker/moe/dispatch.py [Note: expert parallelism]) the
ranks of an expert-data-parallel group hold the same experts and the other
ranks hold others, so the experts cannot be partitioned over the world as the
dense parameters are. The engine therefore keeps two
:class:`~worker.state.ShardState`: its own, of every parameter but the experts,
over the world, and :class:`ExpertShards`, of this rank's experts, over the
expert-data-parallel group, at the same stage with the same config. Both are
driven by the engine's one forward, backward and step: their gradient hooks fill
their own buckets in the same backward; each reduces over its group; the
experts' gradients are scaled by 1/world as the dense ones are (an expert's
gradient summed over its group already holds every rank's tokens that reached
it, through the all-to-all's backward), so the step is the mean over the global
batch, as in one process. The gradient norm is one: the experts' squares join
the dense ones before the world's all-reduce (each expert element is owned by
one rank of the world at stages 1-3; at stage 0, where every rank of a group
holds its experts' whole gradients, they are summed over the ep group first).
The experts' parameters count as used at every step where their layer ran: the
layer calls every expert on every rank, as one process calls a fused experts
module (a zero gradient steps, as in torch). At stage 3 the experts of a layer
are one gather unit (the module is a leaf), gathered over their group.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from worker.ballot import Ballot, BoundaryVote
from worker.config import ZeroConfig
from worker.grad_hooks import GradHooks
from worker.inventory import build_inventory
from worker.metrics import ExpertLayerLoad
from worker.moe.dispatch import ExpertGroups, ExpertParallel
from worker.precision import MixedPrecision
from worker.state import ShardState

__all__ = ["ExpertShards", "dense_only", "expert_parallel_modules"]


def expert_parallel_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, ExpertParallel)]


def dense_only(model: nn.Module) -> Callable[[nn.Parameter], bool] | None:
    """Which parameters the engine's own state holds: all but the experts of an
    expert-parallel model ([Note: two shard states]); None when it holds all."""
    experts = {p for m in expert_parallel_modules(model) for p in m.parameters()}
    return None if not experts else (lambda p: p not in experts)


class ExpertShards:
    """This rank's experts' ZeRO state over their expert-data-parallel group, their
    gradient hooks and used-parameter ballot ([Note: two shard states])."""

    def __init__(
        self,
        model: nn.Module,
        user_optimizer: torch.optim.Optimizer,
        config: ZeroConfig,
        *,
        dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        device: torch.device,
        from_module: bool = True,
    ) -> None:
        self.modules = expert_parallel_modules(model)
        # each experts module's name in the model, once (metrics, exports, checkpoints)
        self.names = {m: n for n, m in model.named_modules() if m in set(self.modules)}
        self.groups: ExpertGroups = self.modules[0]._zp_expert.groups
        params = {p for m in self.modules for p in m.parameters()}
        self.inventory = build_inventory(
            model,
            user_optimizer.param_groups,
            compute_dtype=dtype,
            min_unit_numel=config.stage3_min_unit_numel,
            keep=params.__contains__,
        )
        self.state = ShardState(
            model, user_optimizer, self.inventory, config,
            dtype=dtype, reduce_dtype=reduce_dtype, device=device,
        )  # fmt: skip
        self.ballot = Ballot(len(self.state.index), device)
        self.state.alone_by_design = True
        if not from_module:  # (a newcomer whose job turns out not to have started)
            self.state.keep_module_values()
        self.state.build(self.groups.edp, from_module=from_module)
        self.hooks = GradHooks(self.state, self.ballot, self.inventory.params.values())
        # the elements of every expert of every layer, held here or not
        self.full_numel = sum(
            math.prod(shape) for m in self.modules for shape in m._zp_expert.full_shapes.values()
        )

    @classmethod
    def of(
        cls,
        model: nn.Module,
        user_optimizer: torch.optim.Optimizer,
        config: ZeroConfig,
        *,
        precision: MixedPrecision,
        device: torch.device,
        from_module: bool,
    ) -> ExpertShards:
        """The experts' state of ``model``: built from the module's values, or empty
        (``from_module=False``: a newcomer to an elastic job, filled by its peers,
        worker/elastic/blocks.py)."""
        return cls(
            model, user_optimizer, config, dtype=precision.param_dtype,
            reduce_dtype=precision.reduce_dtype, device=device, from_module=from_module,
        )  # fmt: skip

    def regroup(self, groups: ExpertGroups) -> None:
        """Move this rank's experts onto ``groups``, formed over a new world where this
        rank keeps its place (worker/elastic/blocks.py [Note: elastic expert
        parallelism]): the modules exchange tokens over the new ep group; the state
        is rebuilt over the new expert-data-parallel group when it is refilled."""
        if (groups.size, groups.place) != (self.groups.size, self.groups.place):
            raise RuntimeError(
                f"a re-formed world put this rank at place {groups.place} of ep="
                f"{groups.size}, but it holds the experts of place {self.groups.place} of "
                f"ep={self.groups.size}"
            )
        self.groups = groups
        for m in self.modules:
            m._zp_expert.groups = groups

    # ---------------------------------------------------------------- forward, backward

    @staticmethod
    @contextlib.contextmanager
    def forward_context_of(experts: ExpertShards | None) -> Iterator[bool]:
        """``experts``' :meth:`forward_context`, or nothing without experts."""
        if experts is None:
            yield False
            return
        with experts.forward_context() as watching:
            yield watching

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[bool]:
        """The experts' storage's context for a forward; yields whether it watches
        this forward's ops (the first at stage 3)."""
        with self.state.params.forward_context() as mode:
            yield mode is not None

    def before_backward(self, root: object, *, boundary: bool, reduce_now: bool) -> None:
        in_graph = self.hooks.walk(root)
        for i in range(len(self.state.index)):  # every expert runs every call
            self.ballot.mark_used(i)
        if boundary:
            self.ballot.start(self.groups.edp, BoundaryVote())
        self.hooks.arm(in_graph, reduce_now=reduce_now)
        self.state.params.begin_backward()

    def after_backward(self, *, reduce_now: bool) -> None:
        if reduce_now:
            self.hooks.drain()
        self.state.params.end_backward()

    def abort_backward(self) -> None:
        self.state.params.end_backward()

    # ---------------------------------------------------------------- step

    def partition_grads(self, factor: float) -> list[torch.Tensor]:
        """This rank's fp32 partition gradients of the experts, scaled by ``factor``."""
        self.ballot.wait()
        grads = [self.state.reducer.partition_grad(b).float() for b in self.state.buckets]
        for g in grads:
            g.mul_(factor)
        return grads

    def sumsq(self, grads: list[torch.Tensor], *, world_reduces: bool) -> torch.Tensor:
        """The squares of ``grads`` to add to the dense ones of this rank, which the
        world's all-reduce sums when ``world_reduces`` (stages 1-3); otherwise summed
        over the ep group here ([Note: two shard states])."""
        total = torch.zeros((), dtype=torch.float32, device=self.state.device)
        for g in grads:
            total += g.pow(2).sum()
        if not world_reduces:
            self.groups.ep.all_reduce(total, control=True)
        return total

    def step(self, grads: list[torch.Tensor]) -> None:
        st = self.state
        piece_grads = st.optimizer.piece_grads(grads, self.ballot.used())
        st.whole = False
        failed = st.step_and_publish(piece_grads)
        st.global_steps += 1
        st.whole = True
        if failed is not None:
            raise failed

    def finish_step(self) -> None:
        self.state.zero_grads()
        self.ballot.clear()

    # ---------------------------------------------------------------- reports

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The experts' full parameters by name, every layer's whole set of experts
        on every rank (gathered over the group, then over the ep group)."""
        return self._across_ep({n: t.cpu() for n, t in self.state.full_state_dict().items()})

    def _across_ep(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every place's ``mine`` made whole: a fused module's rows concatenated in
        place order, an Experts child's tensors as its place has them (a collective
        over the ep group)."""
        if not self.groups.ep.distributed:
            return mine
        parts: list[dict[str, torch.Tensor]] = [{} for _ in range(self.groups.size)]
        dist.all_gather_object(parts, mine, group=self.groups.ep.group)
        fused = {n for n in mine if all(n in p for p in parts)}
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            out.update({n: t for n, t in part.items() if n not in fused})
        for name in fused:  # a fused module's rows: every rank holds its range
            out[name] = torch.cat([p[name] for p in parts])
        return out

    def export_plan(self, cast: Callable[[torch.Tensor], torch.Tensor], size: int) -> list:
        """The experts' tensors of an export (worker/pretrained.py ``save_weights``),
        whole, under the model's names; each layer's are made together when the
        first is written (a collective over the group and the ep group, every rank
        making them in the same order), so one layer's experts are held at a time."""
        from worker.checkpoint import Planned

        names = self.names
        made: dict[nn.Module, dict[str, torch.Tensor]] = {}

        def make(module: nn.Module, name: str) -> torch.Tensor:
            if module not in made:
                made.clear()
                made[module] = self._layer(names[module] + ".")
            return cast(made[module][name])

        plan = []
        for m in self.modules:
            for rel, shape in m._zp_expert.full_shapes.items():
                name = f"{names[m]}.{rel}"
                plan.append(
                    Planned(name, math.prod(shape) * size, functools.partial(make, m, name))
                )
        return plan

    def _layer(self, prefix: str) -> dict[str, torch.Tensor]:
        """The whole experts of the layer whose names start with ``prefix``."""
        mine: dict[str, torch.Tensor] = {}
        for b in self.state.buckets:
            slots = [s for s in b.spec.slots if s.name.startswith(prefix)]
            if slots:
                full = self.state.gather_master(b)
                for s in slots:
                    mine[s.name] = full[s.offset : s.offset + s.numel].view(s.shape).cpu()
        return self._across_ep(mine)

    def loads(self) -> tuple[ExpertLayerLoad, ...]:
        """Each layer's exchanges so far on this rank, by the layer's name."""
        out = []
        for m in self.modules:
            placed, load = m._zp_expert, m._zp_expert.load
            out.append(
                ExpertLayerLoad(
                    layer=self.names[m],
                    first=placed.first,
                    tokens=tuple(int(t) for t in load.tokens.tolist()),
                    dropped=load.dropped,
                    a2a_bytes=load.a2a_bytes,
                )
            )
        return tuple(out)

    def close(self) -> None:
        self.hooks.remove()
        self.state.release()
