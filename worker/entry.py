"""``worker.initialize``: a ZeRO engine for a script, alone, under a launcher, or in
a coordinator's job (as an attached or an elastic session), from a ZeroConfig or a
DeepSpeed config: the call read into one spec (worker/spec.py), one placement
chosen for it (worker/placement.py), that placement's route, and the one factory
(worker/factory.py) ([Note: one way in])."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from worker.attached import AttachedSession
from worker.birth import Init
from worker.config import ZeroConfig
from worker.elastic.session import ElasticSession
from worker.engine import LossFn, OptimizerArg, ZeroEngine
from worker.factory import build_engine
from worker.placement import Placement, Situation, describe, form_launcher_group, place
from worker.schedule import SchedulerArg
from worker.spec import EngineSpec

if TYPE_CHECKING:
    from worker.parallel import ParallelConfig
    from worker.splits import Split

__all__ = ["initialize"]

logger = logging.getLogger(__name__)


def initialize(
    model: nn.Module,
    optimizer: OptimizerArg | None = None,
    *,
    config: ZeroConfig | Mapping[str, Any] | str | os.PathLike | None = None,
    group: dist.ProcessGroup | None = None,
    coordinator: str | None = None,
    lr_scheduler: SchedulerArg | None = None,
    device: torch.device | str | None = None,
    init: Init | None = None,
    parallel: ParallelConfig | None = None,
    plan: Any = None,
    split: Split | None = None,
    loss_fn: LossFn | None = None,
) -> ZeroEngine:
    """Wrap ``model`` and ``optimizer`` in a ZeRO engine over ``group``.

    ``model`` must be identical on every rank (rank 0's values are broadcast
    regardless). ``optimizer`` is an optimizer over the model's parameters with
    no state yet, or a callable that takes param groups and returns one.
    ``lr_scheduler``: a torch LR scheduler of that optimizer, or a callable that
    builds one from it. The engine steps it after every optimizer step (do not
    step it yourself), saves it in checkpoints and keeps it at the engine's step
    when workers join, leave or crash (worker/schedule.py).

    ``config``: a :class:`ZeroConfig`, or a DeepSpeed config (a dict, or the
    path of its JSON file) read by :meth:`ZeroConfig.from_deepspeed`. As
    ``deepspeed.initialize`` does, its ``optimizer`` and ``scheduler`` sections
    build the optimizer and the LR schedule when the script passes none
    (worker/ds_sections.py); passing one and configuring one is an error.

    With a coordinator (``coordinator="host:port"`` or ``$ZEROPLANE_COORDINATOR``)
    and torch.distributed not yet initialized, the worker registers, is given
    a rank, and forms the process group itself; the coordinator's stage and
    layout apply. Otherwise torch.distributed must be initialized already (as
    under torchrun), or not at all for one process.

    ``device``: where the model trains. By default a model on the CPU moves to
    ``cuda:$LOCAL_RANK`` when a launcher named a local rank and CUDA is there (as
    ``deepspeed.initialize`` does), a model on another device stays there, and a
    model built on the meta device comes to life on the local rank's GPU or the
    CPU (worker/birth.py). The process group's backend follows it (NCCL on CUDA).

    A model built under ``torch.device("meta")`` (or :func:`worker.meta_parameters`)
    comes to life sharded, one module at a time, never whole on a rank: each
    module's ``reset_parameters()`` initializes it, or ``init(module)`` when given
    (in ``model.apply``'s order; ``worker.birth.skip_init`` for weights that
    ``engine.load_weights`` brings next). See worker/birth.py [Note: birth on the
    meta device].

    ``parallel``: a :class:`worker.mesh.ParallelConfig` for tensor and pipeline
    parallelism beside ZeRO (default: what ``$ZEROPLANE_TP``/``$ZEROPLANE_PP`` ask
    for, as ``zeroplane run --tp/--pp`` sets them; else none). The engine is then
    a :class:`~worker.mesh.MeshEngine` (``plan``: the tensor-parallel plan, default
    :func:`worker.tp.gpt_plan`) or a :class:`~worker.pipeline.PipelineEngine`
    (``split``: the model into stages, default the built-in one for a GPT or a
    Hugging Face decoder laid out as Llama, :func:`worker.pipeline.split_for`),
    with the same surface as every engine (worker/surface.py). ``loss_fn(output,
    targets)``: the loss :meth:`ZeroEngine.train_batch` takes of each micro-batch
    (a pipeline's last stage computes it; default there the language-model
    loss), for scripts whose model does not return its loss; ``train_batch`` is
    the step that runs under every layout.

    In a coordinator's job a mesh worker registers like any other: it reports,
    heartbeats and serves metrics, and takes its mesh, stage and bucket size from
    the generation, which carries the mesh and every rank's coordinates
    (``zeroplane status`` lists them). ``$ZEROPLANE_MESH=auto`` (``zeroplane run
    --mesh auto``) leaves tp and pp to the coordinator, which chooses them from
    the model and the workers' device memory (worker/attached.py [Note: mesh
    jobs in the coordinator's job]).
    """
    spec = EngineSpec.of(
        model, optimizer, config=config, group=group, coordinator=coordinator,
        lr_scheduler=lr_scheduler, device=device, init=init, parallel=parallel, plan=plan,
        split=split, loss_fn=loss_fn,
    )  # fmt: skip
    placement = place(Situation.of(spec))
    spec.place_model()
    logger.info(describe(placement, spec))
    return ROUTES[placement](spec)


def _direct(spec: EngineSpec) -> ZeroEngine:
    """No coordinator: alone, or over the script's or the launcher's group (formed
    from the launcher's environment when the script formed none)."""
    if spec.group is None:
        form_launcher_group(spec.device or torch.device("cpu"))
    return build_engine(spec)


def _mesh_auto(spec: EngineSpec) -> ZeroEngine:
    """A ``--mesh auto`` worker's ranks are its launcher's (the group forms from
    ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``), its mesh the coordinator's."""
    form_launcher_group(spec.device or torch.device("cpu"))
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "a --mesh auto worker in a coordinator's job takes its rank from its launcher "
            "(zeroplane run and torchrun set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), "
            "and none is set; a worker given tp and pp ($ZEROPLANE_TP, $ZEROPLANE_PP) has "
            "its group formed by zeroplane (worker/elastic/rings.py)"
        )
    return AttachedSession.attach_mesh(spec)


# [Note: one way in] in worker/spec.py: each placement's route, ending in
# worker/factory.py build_engine
ROUTES: dict[Placement, Callable[[EngineSpec], ZeroEngine]] = {
    Placement.ALONE: _direct,
    Placement.GROUP: _direct,
    Placement.MESH: _direct,
    Placement.ATTACHED: AttachedSession.attach,
    Placement.ELASTIC: ElasticSession.join,
    Placement.ELASTIC_MESH: ElasticSession.join,  # by whole tp x pp groups
    Placement.MESH_AUTO: _mesh_auto,
}
