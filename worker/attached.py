"""A worker in a coordinator's job whose script formed the process group itself
(:class:`AttachedSession`): a member that reports, but whose group zeroplane cannot
re-form. worker/entry.py (``initialize``) picks it when the script brings its own group,
and for every tensor/pipeline-parallel worker in a coordinator's job.

[Note: mesh jobs in the coordinator's job]
A mesh worker (``zeroplane run --tp/--pp/--mesh auto``) is a member like a
data-parallel one: it registers, heartbeats, reports its steps, loss and memory,
and serves /metrics with its mesh coordinates as labels. Its ranks are its
launcher's (a fixed group: the coordinator keeps them and forms the generation
once all have registered). What it registers is the whole model's inventory,
before tensor parallelism slices it or a pipeline splits it, so every rank of
the job registers the same one and the coordinator plans memory for the model
as it is; the engine's buckets are its own, over its dp group and its shards,
and are not compared with the generation's layout. Each worker asks for the
same mesh (the coordinator refuses one that asks for another, FAILED_PRECONDITION):
its tp and pp degrees, or 0 for a degree the coordinator chooses
(``$ZEROPLANE_MESH=auto``) with coordinator/core/meshplan.py ``choose_mesh``
from the inventory and the smallest device memory; the generation carries the
mesh shape and each member's coordinates (proto ``Generation.mesh``,
``Member.mesh``), and the worker builds exactly that mesh. This module's fixed
group serves ``--mesh auto`` workers, and a lost rank ends their job; a worker
given its tp and pp is elastic by whole groups instead
(worker/elastic/mesh_session.py [Note: elastic by whole groups])."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from coordinator.core.meshplan import MeshShape
from coordinator.core.messages import FINISHED
from worker.ballot import BoundaryVote
from worker.birth import Init
from worker.collectives import CollectiveError, Handle
from worker.config import ZeroConfig
from worker.engine import (
    OptimizerArg,
    ZeroEngine,
    build_inventory_for,
    resolve_optimizer,
)
from worker.inventory import Inventory
from worker.metrics import MetricsServer, SnapshotBoard, start_metrics
from worker.rendezvous import ControlPlane
from worker.reporting import FinalReport, planned_config, report
from worker.schedule import SchedulerArg, resolve_scheduler

__all__ = ["AttachedSession"]

logger = logging.getLogger(__name__)


class AttachedSession(FinalReport):
    """A worker whose script formed the process group itself, in a coordinator's job.

    It registers (keeping the script's ranks), heartbeats, reports and serves
    metrics like any member, and takes the coordinator's stage and layout. The
    group is the script's, so zeroplane cannot re-form it: no worker joins or
    leaves while it runs, and a lost peer ends the job (as under torchrun).
    """

    def __init__(self, control: ControlPlane) -> None:
        super().__init__()
        self.control = control

    @classmethod
    def attach(
        cls,
        model: nn.Module,
        optimizer: OptimizerArg,
        *,
        config: ZeroConfig,
        address: str,
        group: dist.ProcessGroup | None,
        scheduler: SchedulerArg | None = None,
        device: torch.device,
        init: Init | None = None,
    ) -> ZeroEngine:
        rank = dist.get_rank(group)
        user_optimizer, inventory, metrics, control = _join_fixed(
            model, optimizer, config, address, device, group=group
        )
        scheduler = resolve_scheduler(scheduler, user_optimizer)
        gen = control.generation
        if rank == 0:
            logger.warning(
                "this script formed its own process group, which zeroplane cannot "
                "re-form: workers joining or leaving (elastic scaling, crash recovery "
                "from replicas) are off for this job. Let worker.initialize form the "
                "group (no dist.init_process_group in the script) to have them."
            )
        engine = ZeroEngine(
            model,
            user_optimizer,
            config=planned_config(config, gen, rank),
            group=group,
            inventory=inventory,
            align=gen.align,
            metrics=metrics,
            lr_scheduler=scheduler,
            device=device,
            init=init,
        )
        if engine.layout != gen.layout:
            control.close(leave=True)
            raise RuntimeError(
                "the coordinator's bucket layout differs from this worker's: "
                "are all workers running the same model and zeroplane version?"
            )
        return cls._start(control, engine)

    @classmethod
    def attach_mesh(
        cls,
        model: nn.Module,
        optimizer: OptimizerArg,
        *,
        config: ZeroConfig,
        address: str,
        ask: tuple[int, int],
        device: torch.device,
        build: MeshBuild,
    ) -> ZeroEngine:
        """A worker of a mesh job in a coordinator's job ([Note: mesh jobs in the
        coordinator's job]): it registers the whole model's inventory with the mesh
        it asks for (``ask``: tp and pp, 0 for a degree the coordinator chooses),
        takes the generation's mesh, stage and bucket size, and ``build`` makes the
        engine on that mesh (a MeshEngine, a PipelineEngine, or a ZeroEngine where
        the mesh is one rank deep) with the metrics endpoint registered."""
        user_optimizer, _, metrics, control = _join_fixed(
            model, optimizer, config, address, device, mesh=ask
        )
        gen = control.generation
        rank, shape = control.rank, gen.mesh or MeshShape(dp=gen.world_size)
        try:
            engine = build(user_optimizer, planned_config(config, gen, rank), shape, metrics)
        except BaseException:
            control.close(leave=True)
            raise
        logger.info(
            "mesh pp=%d x dp=%d x tp=%d from generation %d (%s)",
            shape.pp, shape.dp, shape.tp, gen.id, gen.mesh_reason or "no mesh",
        )  # fmt: skip
        return cls._start(control, engine)

    @classmethod
    def _start(cls, control: ControlPlane, engine: ZeroEngine) -> ZeroEngine:
        session = cls(control)
        engine.membership = session
        session.report_at_exit(engine)
        report(control, engine)
        return engine

    # ------------------------------------------------------------ the engine's seams

    def vote(self, engine: ZeroEngine) -> BoundaryVote:
        return BoundaryVote(generation=self.control.generation.id)

    def generation_id(self) -> int:
        return self.control.generation.id

    def replica_bytes(self) -> int:
        return 0

    def log_gradients(
        self, engine: ZeroEngine, grads: list[torch.Tensor], used: list[int]
    ) -> Handle | None:
        return None  # no replicas: a lost peer ends the job

    def after_load(self, engine: ZeroEngine) -> None:
        pass

    def after_step(self, engine: ZeroEngine, agreed: BoundaryVote, stepped: bool) -> None:
        if stepped and self.control.report_due():
            report(self.control, engine)

    def recover(self, engine: ZeroEngine, exc: CollectiveError) -> NoReturn:
        raise exc

    def close(self) -> None:
        self._forget_exit(send=True)
        self.control.close(leave=True, reason=FINISHED)


# what builds a mesh job's engine: (the optimizer, the planned config, the mesh, metrics)
MeshBuild = Callable[
    [torch.optim.Optimizer, ZeroConfig, MeshShape, MetricsServer | None], ZeroEngine
]


def _join_fixed(
    model: nn.Module,
    optimizer: OptimizerArg,
    config: ZeroConfig,
    address: str,
    device: torch.device,
    *,
    group: dist.ProcessGroup | None = None,
    mesh: tuple[int, int] | None = None,
) -> tuple[torch.optim.Optimizer, Inventory, MetricsServer | None, ControlPlane]:
    """Register a worker of a group its launcher or script formed (its ranks fixed) and
    wait for the generation that keeps them: the optimizer, the inventory it
    registered, its metrics endpoint and its control plane."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    user_optimizer = resolve_optimizer(model, optimizer)
    inventory = build_inventory_for(model, user_optimizer, config)
    metrics = start_metrics(config, SnapshotBoard())
    control = ControlPlane.join(
        address,
        inventory,
        device=device,
        metrics_port=None if metrics is None else metrics.port,
        stage=config.stage,
        fixed=(rank, world),
        mesh=mesh,
    )
    _check_placed(control, rank, world)
    return user_optimizer, inventory, metrics, control


def _check_placed(control: ControlPlane, rank: int, world: int) -> None:
    """The coordinator kept the script's ranks; else leave and say so."""
    gen = control.generation
    if gen.world_size != world or control.rank != rank:
        control.close(leave=True)
        raise RuntimeError(
            f"the coordinator placed this worker at rank {control.rank} of "
            f"{gen.world_size}, but the script's process group has it at rank "
            f"{rank} of {world}: is another job registered with this coordinator?"
        )
