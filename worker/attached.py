"""A worker in a coordinator's job whose script formed the process group itself
(:class:`AttachedSession`): a member that reports, but whose group zeroplane cannot
re-form. worker/entry.py (``initialize``) picks it when the script brings its own group."""

from __future__ import annotations

import logging
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from coordinator.core.messages import FINISHED
from worker.ballot import BoundaryVote
from worker.birth import Init
from worker.collectives import CollectiveError, Handle
from worker.config import ZeroConfig
from worker.control import ControlPlane
from worker.engine import (
    OptimizerArg,
    ZeroEngine,
    build_inventory_for,
    resolve_optimizer,
)
from worker.metrics import SnapshotBoard, start_metrics
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
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        user_optimizer = resolve_optimizer(model, optimizer)
        scheduler = resolve_scheduler(scheduler, user_optimizer)
        inventory = build_inventory_for(model, user_optimizer, config)
        metrics = start_metrics(config, SnapshotBoard())
        control = ControlPlane.join(
            address,
            inventory,
            device=device,
            metrics_port=None if metrics is None else metrics.port,
            stage=config.stage,
            fixed=(rank, world),
        )
        gen = control.generation
        if gen.world_size != world or control.rank != rank:
            control.close(leave=True)
            raise RuntimeError(
                f"the coordinator placed this worker at rank {control.rank} of "
                f"{gen.world_size}, but the script's process group has it at rank "
                f"{rank} of {world}: is another job registered with this coordinator?"
            )
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
