"""ZeRO on a device mesh ``(pp, dp, tp)``: tensor and pipeline parallelism from torch.

    engine = worker.mesh.parallelize(model, optimizer, config=ZeroConfig(stage=1),
                                     parallel=ParallelConfig(tensor_parallel=2))

composes, as torchtitan's ``parallelize`` does, over one ``DeviceMesh``:

* tensor parallelism: torch's ``parallelize_module`` with a plan (worker/tp.py);
* pipeline parallelism: torch's ``PipelineStage`` and a GPipe or 1F1B schedule
  over a split by layer index (worker/pipeline.py);
* ZeRO (worker/engine.py) over the **dp** sub-group only: its layout, buckets
  and collectives see the local shards of this rank's pipeline stage and
  tensor-parallel rank, and shard those across the ``dp`` ranks that hold the
  same ones.

A model built on the meta device (``torch.device("meta")``,
:func:`worker.meta_parameters`) is planned there and comes to life a module
at a time, each rank keeping its tp slice of values drawn whole
(worker/tp.py [Note: birth under tensor parallelism]); pretrained weights
load by range (:meth:`MeshEngine.load_weights`, ``worker.from_pretrained(...,
parallel=...)``) and export whole (:meth:`MeshEngine.save_pretrained`).

The mesh's rank order is coordinator/core/meshplan.py's [Note: mesh rank order].
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from coordinator.core.meshplan import PP_ENV, TP_ENV, MeshCoords, MeshShape
from worker.birth import Init, SlicedInit, meta_names, skip_init
from worker.collectives import CollectiveError, Collectives, StepAborted
from worker.config import ZeroConfig
from worker.engine import OptimizerArg, ZeroEngine, module_device
from worker.inventory import Inventory
from worker.metrics import MetricsServer
from worker.schedule import SchedulerArg
from worker.tp import TensorParallel, apply_tp, gather_full, gpt_plan, stage_plan
from worker.tp_checkpoint import FullExport, FullView

__all__ = [
    "MeshEngine",
    "ModelParallelNorm",
    "ParallelConfig",
    "build_mesh",
    "check_combination",
    "check_heads",
    "norm_scope",
    "parallelize",
    "rebuild_optimizer",
]

logger = logging.getLogger(__name__)

E = TypeVar("E", bound="MeshEngine")

Schedule = Literal["gpipe", "1f1b"]


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Model parallelism beside ZeRO (which runs over the data-parallel rest).

    Attributes:
        tensor_parallel: ranks that split each planned layer (tp); 1 = off.
        pipeline_parallel: pipeline stages (pp), split by layer index; 1 = off.
        pipeline_schedule: ``"gpipe"`` (all forwards, then all backwards) or
            ``"1f1b"`` (one forward, one backward: fewer micro-batches in flight).
        microbatches: micro-batches per pipeline step (>= pipeline_parallel).
    """

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_schedule: Schedule = "gpipe"
    microbatches: int = 4

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be an integer >= 1, got {value!r}")
        if self.pipeline_schedule not in ("gpipe", "1f1b"):
            raise ValueError(
                f"ParallelConfig.pipeline_schedule must be 'gpipe' or '1f1b', "
                f"got {self.pipeline_schedule!r}"
            )
        if self.pipeline_parallel > 1 and self.microbatches < self.pipeline_parallel:
            raise ValueError(
                f"ParallelConfig.microbatches ({self.microbatches}) must be >= "
                f"pipeline_parallel ({self.pipeline_parallel}) to fill the pipeline"
            )

    @classmethod
    def from_env(cls, **overrides: Any) -> ParallelConfig:
        """tp and pp as the launcher set them (``zeroplane run --tp/--pp``, the job
        spec: ``$ZEROPLANE_TP``/``$ZEROPLANE_PP``); 1 where unset."""
        values: dict[str, Any] = {}
        for field_name, env in (("tensor_parallel", TP_ENV), ("pipeline_parallel", PP_ENV)):
            raw = os.environ.get(env)
            if raw is not None:
                if not raw.isdigit():
                    raise ValueError(f"${env} must be an integer >= 1, got {raw!r}")
                values[field_name] = int(raw)
        return cls(**{**values, **overrides})

    def shape(self, world_size: int) -> MeshShape:
        return MeshShape.for_world(world_size, tp=self.tensor_parallel, pp=self.pipeline_parallel)


def check_combination(config: ZeroConfig, parallel: ParallelConfig) -> None:
    """Refuse, with the reason, what this composition does not do (README, "The mesh")."""
    pp = parallel.pipeline_parallel
    if pp > 1 and config.stage > 2:
        raise ValueError(
            f"pipeline_parallel > 1 runs with ZeRO stages 0-2, got stage {config.stage}: "
            "stage 3 gathers each unit per forward and backward, which the pipeline "
            "schedule interleaves over micro-batches (worker/pipeline.py [Note: pipeline "
            "gradients into ZeRO])"
        )
    if pp > 1 and config.gradient_accumulation_steps != 1:
        raise ValueError(
            "with pipeline_parallel > 1 the pipeline's micro-batches are the accumulation: "
            "set ParallelConfig.microbatches, and gradient_accumulation_steps=1"
        )


def build_mesh(shape: MeshShape, device_type: str = "cpu") -> DeviceMesh:
    """torch's DeviceMesh over the default group, dims named ``pp``, ``dp``, ``tp``."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("build_mesh needs torch.distributed initialized (all ranks)")
    world = dist.get_world_size()
    if world != shape.world_size:
        raise ValueError(
            f"mesh pp={shape.pp} x dp={shape.dp} x tp={shape.tp} needs {shape.world_size} "
            f"ranks, the process group has {world}"
        )
    return init_device_mesh(
        device_type, (shape.pp, shape.dp, shape.tp), mesh_dim_names=("pp", "dp", "tp")
    )


def rebuild_optimizer(
    optimizer: OptimizerArg, before: dict[str, nn.Parameter], model: nn.Module
) -> torch.optim.Optimizer:
    """The user's optimizer over ``model``'s current parameters: a factory is
    called; an optimizer built over the parameters as they were (``before``, by
    name) gets the new ones in its param groups (it has no state yet)."""
    now = dict(model.named_parameters(remove_duplicate=False))
    if not isinstance(optimizer, torch.optim.Optimizer):
        params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        return optimizer([{"params": params}])
    if optimizer.state:
        raise ValueError("the optimizer already has state; pass one that has not stepped yet")
    name_of = {p: n for n, p in before.items()}
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if p not in name_of]
        if missing:
            raise ValueError(
                f"the optimizer holds a tensor of shape {tuple(missing[0].shape)} that is not "
                "a parameter of the model"
            )
    # no state yet: the groups' parameter lists are all that refers to the old ones
    for group in optimizer.param_groups:
        group["params"] = [now[name_of[p]] for p in group["params"]]
    return optimizer


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
        return 1.0 / self.tp if name in self.replicated else 1.0

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
        )
        self.tp = tp
        self._place(mesh, shape, coords)
        if tp is not None:
            tp.activate()

    def _place(self, mesh: DeviceMesh, shape: MeshShape, coords: MeshCoords) -> None:
        """This rank's mesh, its shape and coordinates, and what depends on them."""
        self.mesh, self.shape, self.coords = mesh, shape, coords
        self.tp_comm = Collectives(mesh["tp"].get_group()) if shape.tp > 1 else Collectives(None)
        self.mesh_labels = coords.labels()
        self.norm_scope = norm_scope(self, mesh, shape, self.tp)
        self.publish_snapshot()

    def rebind_mesh(self, mesh: DeviceMesh, shape: MeshShape, coords: MeshCoords) -> None:
        """Move to the mesh of a re-formed job (worker/elastic/mesh_session.py): the
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
        (worker/elastic/mesh_session.py); so does a failed collective of this engine's
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

    def _checkpoint_view(self) -> FullView:
        # [Note: tensor-parallel checkpoints]: loads at any tp, dp and stage
        slices = self.tp.slices if self.tp is not None else {}
        return FullView(self.state, slices, Collectives(None), self.coords.tp)

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


def parallelize(
    model: nn.Module,
    optimizer: OptimizerArg,
    *,
    config: ZeroConfig,
    parallel: ParallelConfig,
    plan: dict | Callable[[nn.Module], dict] | None = None,
    mesh: DeviceMesh | None = None,
    lr_scheduler: SchedulerArg | None = None,
    device: torch.device | str | None = None,
    init: Init | None = None,
    metrics: MetricsServer | None = None,
) -> MeshEngine:
    """ZeRO ``config`` over the dp dimension of a ``(pp, dp, tp)`` mesh, with
    ``model`` tensor-parallel over tp by ``plan`` (a dict of torch ParallelStyles
    by module-name pattern, or a function of the model returning one; default:
    :func:`worker.tp.gpt_plan`). ``model`` must be identical on every rank.
    Pipeline parallelism is :func:`worker.pipeline.pipeline` (a different step).
    ``lr_scheduler``, ``device``: as :func:`worker.initialize`'s.

    A model built on the meta device comes to life sharded as with
    :func:`worker.initialize`: each module by its ``reset_parameters()`` or by
    ``init(module)`` (``worker.skip_init`` for weights that
    :meth:`MeshEngine.load_weights` brings next), on its whole tensors, each rank
    keeping its tp slice (worker/tp.py [Note: birth under tensor parallelism]).
    ``metrics``: the endpoint a coordinator's job started before the engine."""
    if parallel.pipeline_parallel > 1:
        raise ValueError("pipeline_parallel > 1: use worker.pipeline.pipeline(...)")
    check_combination(config, parallel)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    shape = parallel.shape(world)
    device_type = torch.device(device).type if device is not None else module_device(model).type
    mesh = mesh if mesh is not None else build_mesh(shape, device_type)
    coords = shape.coords(dist.get_rank() if world > 1 else 0)
    engine = engine_on_mesh(
        MeshEngine, model, optimizer, model, config, mesh, shape, coords, plan, lr_scheduler,
        device=device, init=init, metrics=metrics,
    )  # fmt: skip
    logger.info(
        "mesh pp=%d dp=%d tp=%d: this rank is pp=%d dp=%d tp=%d",
        shape.pp, shape.dp, shape.tp, coords.pp, coords.dp, coords.tp,
    )  # fmt: skip
    return engine


def engine_on_mesh(
    cls: type[E],
    module: nn.Module,
    optimizer: OptimizerArg,
    model: nn.Module,
    config: ZeroConfig,
    mesh: DeviceMesh,
    shape: MeshShape,
    coords: MeshCoords,
    plan: Any,
    lr_scheduler: SchedulerArg | None = None,
    *,
    device: torch.device | str | None = None,
    init: Init | None = None,
    **extra: Any,
) -> E:
    """A ``cls`` engine (:class:`MeshEngine` or a subclass) over the dp group of
    ``mesh`` for ``module`` (the model, or its pipeline stage, which keeps the
    model's parameter names), tensor-parallel over tp by ``plan`` (default
    :func:`worker.tp.gpt_plan` of the whole ``model``). ``device``, ``init``:
    :func:`parallelize`'s; ``extra``: ``cls``'s own keyword arguments."""
    tp = None
    if shape.tp > 1:
        before = dict(module.named_parameters(remove_duplicate=False))
        chosen = plan if plan is not None else gpt_plan
        chosen = chosen(model) if callable(chosen) else chosen
        if module is not model:  # a pipeline stage: the plan's entries it holds
            chosen = stage_plan(chosen, module, model)
        check_heads(model, shape.tp)
        tp = apply_tp(module, mesh["tp"], chosen)  # meta tensors stay meta
        optimizer = rebuild_optimizer(optimizer, before, module)
        if meta_names(module) and init is not skip_init:
            # each planned module initializes whole, keeps its slice
            init = SlicedInit(init, tp.whole)
    return cls(
        module,
        optimizer,
        config=config,
        mesh=mesh,
        shape=shape,
        coords=coords,
        tp=tp,
        lr_scheduler=lr_scheduler,
        device=device,
        init=init,
        **extra,
    )


def check_heads(model: nn.Module, tp: int) -> None:
    """Attention heads must split evenly over tp (worker.models GPT, HF configs)."""
    configs = [getattr(model, "cfg", None), getattr(model, "config", None)]
    for cfg in configs:
        for key in ("n_head", "num_attention_heads", "num_key_value_heads"):
            heads = getattr(cfg, key, None)
            if isinstance(heads, int) and heads % tp:
                raise ValueError(
                    f"the model's {key}={heads} cannot be split over tensor_parallel={tp}"
                )
