"""The engine of a device mesh ``(pp, dp, tp)``: :class:`MeshEngine`, a ZeRO engine
over the dp group with this rank's tensor-parallel shards (worker/tp.py), and the
gradient-norm scope that makes clipping the whole model's. Built by
worker/factory.py; entered through ``worker.initialize(parallel=...)`` or
:func:`worker.mesh.parallelize`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from coordinator.core.meshplan import MeshCoords, MeshShape
from worker.birth import Init
from worker.collectives import CollectiveError, Collectives, StepAborted
from worker.config import ZeroConfig
from worker.engine import LossFn, OptimizerArg, ZeroEngine
from worker.inventory import Inventory
from worker.metrics import MetricsServer
from worker.schedule import SchedulerArg
from worker.tp import TensorParallel, gather_full
from worker.tp_checkpoint import FullExport, FullView

__all__ = ["MeshEngine", "ModelParallelNorm", "norm_scope"]


@dataclass
class ModelParallelNorm:
    """The engine's :class:`~worker.engine.NormScope` on a mesh: a parameter
    replicated over tp counts 1/tp on each tp rank, and the sum of squares is
    all-reduced over tp and then pp, so the gradient norm (clipping) is the
    whole model's."""

    replicated: set[str]
    tp: int
    comms: list[Collectives]

    def weight(self, name: str) -> float:
        return self.replica_weight if name in self.replicated else 1.0

    @property
    def replica_weight(self) -> float:
        return 1.0 / self.tp

    def reduce(self, sumsq: torch.Tensor) -> None:
        for comm in self.comms:
            comm.all_reduce(sumsq, control=True)


def norm_scope(
    engine: ZeroEngine, mesh: DeviceMesh, shape: MeshShape, tp: TensorParallel | None
) -> ModelParallelNorm | None:
    """The gradient-norm scope of ``engine`` on ``mesh`` (None without tp or pp)."""
    if shape.group_size == 1:
        return None
    sharded = {n for n, s in (tp.slices.items() if tp else ()) if s.dim is not None}
    replicated = set(engine.inventory.trainable) - sharded if shape.tp > 1 else set()
    comms = [Collectives(mesh[dim].get_group()) for dim in ("tp", "pp") if getattr(shape, dim) > 1]
    return ModelParallelNorm(replicated, shape.tp, comms)


class MeshEngine(ZeroEngine):
    """A ZeRO engine over the dp group of a device mesh, with this rank's
    tensor-parallel shards: every method of :class:`~worker.engine.ZeroEngine`
    (one surface for every layout, worker/surface.py), over the local shards.
    What differs is addressed by FULL parameter: :meth:`full_state_dict`
    (gathered over dp and tp), checkpoints ([Note: tensor-parallel
    checkpoints]), pretrained weights and their export.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: OptimizerArg,
        *,
        config: ZeroConfig,
        mesh: DeviceMesh,
        shape: MeshShape,
        coords: MeshCoords,
        tp: TensorParallel | None,
        lr_scheduler: SchedulerArg | None = None,
        device: torch.device | str | None = None,
        init: Init | None = None,
        metrics: MetricsServer | None = None,
        initial_state: Literal["module", "peers"] = "module",
        inventory: Inventory | None = None,
        loss_fn: LossFn | None = None,
    ) -> None:
        super().__init__(
            module,
            optimizer,
            config=config,
            group=mesh["dp"].get_group(),
            lr_scheduler=lr_scheduler,
            device=device,
            init=init,
            metrics=metrics,
            initial_state=initial_state,
            inventory=inventory,
            loss_fn=loss_fn,
        )
        self.tp = tp
        self._place(mesh, shape, coords)
        if tp is not None:
            tp.activate(sharded=self.state.params.sharded)

    def _place(self, mesh: DeviceMesh, shape: MeshShape, coords: MeshCoords) -> None:
        """This rank's mesh, its shape and coordinates, and what depends on them."""
        self.mesh, self.shape, self.coords = mesh, shape, coords
        self.tp_comm = Collectives(mesh["tp"].get_group()) if shape.tp > 1 else Collectives(None)
        self.mesh_labels = coords.labels()
        self.norm_scope = norm_scope(self, mesh, shape, self.tp)
        self.publish_snapshot()

    def rebind_mesh(self, mesh: DeviceMesh, shape: MeshShape, coords: MeshCoords) -> None:
        """Move to the mesh of a re-formed job (worker/elastic/rings.py): the
        same tp (and pp) degree and this rank's tp index, another dp width. The
        shard state is rebuilt for the new dp group by the caller (``adopt``)."""
        if (shape.tp, shape.pp) != (self.shape.tp, self.shape.pp):
            raise ValueError(
                f"an elastic mesh job keeps tp={self.shape.tp}, pp={self.shape.pp}; "
                f"the new mesh has tp={shape.tp}, pp={shape.pp}"
            )
        if self.tp is not None:
            self.tp.rebind(mesh["tp"])
        self._place(mesh, shape, coords)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._peer_loss():
            return super().forward(*args, **kwargs)

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False) -> None:
        with self._peer_loss():
            super().backward(loss, retain_graph=retain_graph)

    @contextlib.contextmanager
    def _peer_loss(self) -> Iterator[None]:
        """The tensor-parallel collectives run inside torch's DTensor (and a pipeline's
        sends inside torch's schedule), whose errors are plain RuntimeErrors: in an
        elastic session, one raised from torch.distributed is a peer lost if the
        coordinator confirms it (a newer generation), and the session recovers
        (worker/elastic/rings.py); so does a failed collective of this engine's
        own outside the engine's guarded methods."""
        try:
            yield
        except StepAborted:
            raise
        except CollectiveError as exc:
            if self.membership is None:
                raise
            self.membership.recover(self, exc)  # as the engine's guarded methods do
        except RuntimeError as exc:
            confirm = getattr(self.membership, "peer_lost", None)
            if confirm is None or not _from_distributed(exc) or not confirm():
                raise
            self.membership.recover(self, CollectiveError(f"tensor parallel: {exc}"))  # type: ignore[union-attr]

    @property
    def engine(self) -> ZeroEngine:
        """The ZeRO engine over the dp group: this engine (kept for scripts that
        reached it through ``engine.engine`` before the surfaces were one)."""
        return self

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every full parameter by name, fp32; a collective over the whole mesh."""
        local = super().full_state_dict()
        if self.tp is None:
            return local
        return gather_full(local, self.tp.slices, self.tp_comm)

    def _checkpoint_view(self) -> Any:
        # [Note: tensor-parallel checkpoints]: loads at any tp, dp and stage
        slices = self.tp.slices if self.tp is not None else {}
        view = FullView(self.state, slices, Collectives(None), self.coords.tp)
        if self.experts is None:
            return view
        from worker.moe.checkpoint import ExpertParallelView  # [Note: expert-parallel checkpoints]

        return ExpertParallelView(view, self.experts, tp_rank=self.coords.tp)

    def _full_export(self) -> FullExport:
        return FullExport(
            slices=self.tp.slices if self.tp is not None else {},
            comm=self.tp_comm,
            writer=not any((self.coords.pp, self.coords.dp, self.coords.tp)),
        )

    def close(self) -> None:
        if self.tp is not None:
            self.tp.deactivate()
        super().close()


def _from_distributed(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside torch.distributed (a collective's wait or
    its transport), by where it came from, not by its message."""
    tb = exc.__traceback__
    while tb is not None:
        if f"torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False
