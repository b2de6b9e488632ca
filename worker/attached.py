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
(worker/elastic/rings.py [Note: elastic by whole groups])."""

from __future__ import annotations

import logging
from typing import NoReturn

import torch
import torch.distributed as dist

from coordinator.core.meshplan import MeshShape
from coordinator.core.messages import FINISHED
from worker.ballot import BoundaryVote
from worker.collectives import CollectiveError, Handle
from worker.engine import ZeroEngine
from worker.factory import build_engine
from worker.metrics import MetricsServer, SnapshotBoard, start_metrics
from worker.rendezvous import ControlPlane
from worker.reporting import FinalReport, report
from worker.spec import EngineSpec

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
    def attach(cls, spec: EngineSpec) -> ZeroEngine:
        """A data-parallel worker over the script's own group (``spec.group``, or the
        default one), registered with the script's ranks."""
        rank = dist.get_rank(spec.group)
        metrics, control = _join_fixed(spec)
        gen = control.generation
        if rank == 0:
            logger.warning(
                "this script formed its own process group, which zeroplane cannot "
                "re-form: workers joining or leaving (elastic scaling, crash recovery "
                "from replicas) are off for this job. Let worker.initialize form the "
                "group (no dist.init_process_group in the script) to have them."
            )
        engine = build_engine(spec, generation=gen, rank=rank, metrics=metrics)
        if engine.layout != gen.layout:
            control.close(leave=True)
            raise RuntimeError(
                "the coordinator's bucket layout differs from this worker's: "
                "are all workers running the same model and zeroplane version?"
            )
        return cls._start(control, engine)

    @classmethod
    def attach_mesh(cls, spec: EngineSpec) -> ZeroEngine:
        """A worker of a mesh job in a coordinator's job ([Note: mesh jobs in the
        coordinator's job]): it registers the whole model's inventory with the mesh
        it asks for (tp and pp, 0 for a degree the coordinator chooses), takes the
        generation's mesh, stage and bucket size, and builds its engine on that
        mesh (a MeshEngine, a PipelineEngine, or a ZeroEngine where the mesh is one
        rank deep) with the metrics endpoint registered."""
        metrics, control = _join_fixed(spec, mesh=spec.asked_degrees())
        gen = control.generation
        rank, shape = control.rank, gen.mesh or MeshShape(dp=gen.world_size)
        try:
            engine = build_engine(
                spec,
                generation=gen,
                rank=rank,
                shape=shape if shape.group_size > 1 else None,
                metrics=metrics,
            )
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


def _join_fixed(
    spec: EngineSpec, *, mesh: tuple[int, int] | None = None
) -> tuple[MetricsServer | None, ControlPlane]:
    """Register a worker of a group its launcher or script formed (its ranks fixed) and
    wait for the generation that keeps them: its metrics endpoint and its control
    plane. ``spec`` is resolved: its optimizer and the inventory it registered."""
    rank, world = dist.get_rank(spec.group), dist.get_world_size(spec.group)
    inventory = spec.resolve()
    metrics = start_metrics(spec.config, SnapshotBoard())
    assert spec.device is not None
    control = ControlPlane.join(
        spec.coordinator or "",
        inventory,
        device=spec.device,
        metrics_port=None if metrics is None else metrics.port,
        stage=spec.config.stage,
        fixed=(rank, world),
        mesh=mesh,
    )
    _check_placed(control, rank, world)
    return metrics, control


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
