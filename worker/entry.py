"""``worker.initialize``: a ZeRO engine for a script, alone, under a launcher, or in
a coordinator's job (as an attached or an elastic session), from a ZeroConfig or a
DeepSpeed config."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from coordinator.core.meshplan import MESH_ENV, PP_ENV, TP_ENV, MeshShape
from worker import ds_sections
from worker.attached import AttachedSession
from worker.birth import Init, place_module
from worker.compat import backend_for
from worker.config import ZeroConfig
from worker.elastic.session import ElasticSession
from worker.engine import LossFn, OptimizerArg, ZeroEngine
from worker.metrics import MetricsServer
from worker.rendezvous import coordinator_address
from worker.schedule import SchedulerArg

if TYPE_CHECKING:
    from worker.mesh import ParallelConfig
    from worker.pipeline import Split

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
    config, optimizer, lr_scheduler = _resolve_config(config, optimizer, lr_scheduler)
    parallel = parallel if parallel is not None else _parallel_from_env()
    address = coordinator_address(coordinator)
    auto = _mesh_auto()
    if address is not None and group is None and (auto or _model_parallel(parallel)):
        return _mesh_in_job(
            model, optimizer, config, parallel, address, auto=auto, plan=plan, split=split,
            loss_fn=loss_fn, lr_scheduler=lr_scheduler, device=device, init=init,
        )  # fmt: skip
    if auto:
        raise ValueError(
            f"${MESH_ENV}=auto leaves the mesh to a coordinator, and this worker has none "
            "(run it under zeroplane run, or set $ZEROPLANE_COORDINATOR)"
        )
    if _model_parallel(parallel):
        return _on_mesh(
            model, optimizer, config, parallel, plan=_plan_for(model, plan), split=split,
            loss_fn=loss_fn, lr_scheduler=lr_scheduler, device=device, init=init,
        )  # fmt: skip
    for name, given in (("plan", plan), ("split", split)):
        if given is not None:
            raise ValueError(
                f"worker.initialize(..., {name}=...) is for tensor/pipeline parallelism: "
                "pass parallel=ParallelConfig(tensor_parallel=..., pipeline_parallel=...)"
            )
    engine = _data_parallel(
        model, optimizer, config, group, coordinator, lr_scheduler, device, init
    )
    engine.loss_fn = loss_fn
    return engine


def _data_parallel(
    model: nn.Module,
    optimizer: OptimizerArg,
    config: ZeroConfig,
    group: dist.ProcessGroup | None,
    coordinator: str | None,
    lr_scheduler: SchedulerArg | None,
    device: torch.device | str | None,
    init: Init | None,
) -> ZeroEngine:
    """The engine of a data-parallel job: alone, under a launcher's group, or in a
    coordinator's job (attached to a group the script formed, or elastic)."""
    device = place_module(model, device)
    address = coordinator_address(coordinator)
    if address is None and group is None:
        _init_from_launcher_env(device)
    own_group = group is not None or (dist.is_available() and dist.is_initialized())
    born = {"device": device, "init": init}
    if address is None:
        return ZeroEngine(
            model, optimizer, config=config, group=group, lr_scheduler=lr_scheduler, **born
        )
    if own_group:
        return AttachedSession.attach(
            model,
            optimizer,
            config=config,
            address=address,
            group=group,
            scheduler=lr_scheduler,
            **born,
        )
    return ElasticSession.join(
        model, optimizer, config=config, address=address, scheduler=lr_scheduler, **born
    )


def _model_parallel(parallel: ParallelConfig | None) -> bool:
    return parallel is not None and parallel.tensor_parallel * parallel.pipeline_parallel > 1


def _mesh_auto() -> bool:
    raw = os.environ.get(MESH_ENV)
    if raw is None or raw == "":
        return False
    if raw != "auto":
        raise ValueError(f"${MESH_ENV} must be 'auto' (or unset), got {raw!r}")
    if TP_ENV in os.environ or PP_ENV in os.environ:
        raise ValueError(f"${MESH_ENV}=auto and ${TP_ENV}/${PP_ENV} ask for the mesh twice")
    return True


def _mesh_in_job(
    model: nn.Module,
    optimizer: OptimizerArg,
    config: ZeroConfig,
    parallel: ParallelConfig | None,
    address: str,
    *,
    auto: bool,
    plan: Any,
    split: Split | None,
    loss_fn: LossFn | None,
    lr_scheduler: SchedulerArg | None,
    device: torch.device | str | None,
    init: Init | None,
) -> ZeroEngine:
    """A mesh worker in a coordinator's job. One given its tp and pp is an elastic
    member whose group zeroplane forms (worker/elastic/mesh_session.py); a ``--mesh
    auto`` one's ranks are its launcher's (the group forms from
    ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``), its mesh the generation's."""
    from worker.mesh import ParallelConfig

    device = place_module(model, device)
    if not auto and parallel is not None:
        # an elastic member whose group zeroplane forms and re-forms by whole
        # model-parallel groups (worker/elastic/mesh_session.py [Note: elastic by whole
        # groups])
        from worker.elastic.mesh_session import MeshSession

        if parallel.pipeline_parallel > 1 and init is not None:
            raise ValueError("init= with pipeline parallelism is not supported yet")
        return MeshSession.join(
            model, optimizer, config=config, address=address, parallel=parallel,
            plan=_plan_for(model, plan), device=device, split=split, loss_fn=loss_fn,
            scheduler=lr_scheduler, init=init,
        )  # fmt: skip
    _init_from_launcher_env(device)
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "a --mesh auto worker in a coordinator's job takes its rank from its launcher "
            "(zeroplane run and torchrun set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), "
            "and none is set; a worker given tp and pp ($ZEROPLANE_TP, $ZEROPLANE_PP) has "
            "its group formed by zeroplane (worker/elastic/mesh_session.py)"
        )
    base = parallel or ParallelConfig()
    ask = (
        _open_degrees(model, plan, split)
        if auto
        else (base.tensor_parallel, base.pipeline_parallel)
    )

    def build(
        opt: torch.optim.Optimizer, planned: ZeroConfig, shape: MeshShape, metrics: Any
    ) -> ZeroEngine:
        if shape.group_size == 1:
            engine = ZeroEngine(
                model, opt, config=planned, lr_scheduler=lr_scheduler, device=device,
                init=init, metrics=metrics,
            )  # fmt: skip
            engine.loss_fn = loss_fn
            return engine
        chosen = dataclasses.replace(
            base,
            tensor_parallel=shape.tp,
            pipeline_parallel=shape.pp,
            microbatches=max(base.microbatches, shape.pp),
        )
        return _on_mesh(
            model, opt, planned, chosen, plan=_plan_for(model, plan), split=split,
            loss_fn=loss_fn, lr_scheduler=lr_scheduler, device=device, init=init,
            metrics=metrics,
        )  # fmt: skip

    return AttachedSession.attach_mesh(
        model, optimizer, config=config, address=address, ask=ask, device=device, build=build
    )


def _open_degrees(model: nn.Module, plan: Any, split: Split | None) -> tuple[int, int]:
    """The degrees a ``--mesh auto`` worker leaves to the coordinator (0) and those it
    fixes at 1: tensor parallelism needs a plan (given, or the built-in GPT's, or a
    Hugging Face model's known to worker.tp.hf_plan), a pipeline a split (given, or
    a built-in one for an untied GPT or Llama-like decoder). Asking for what the
    script cannot build would fail every worker once the generation formed."""
    from worker.models import GPT
    from worker.pipeline import splittable
    from worker.tp import hf_plan

    gpt = isinstance(model, GPT)
    tp_ok = plan is not None or gpt
    if not tp_ok:
        try:
            hf_plan(model)
            tp_ok = True
        except ValueError:
            pass
    pp_ok = split is not None or splittable(model)
    return (0 if tp_ok else 1, 0 if pp_ok else 1)


def _plan_for(model: nn.Module, plan: Any) -> Any:
    """``plan``, or where none was given the built-in GPT's (the default) or, for a
    Hugging Face model, :func:`worker.tp.hf_plan`."""
    from worker.models import GPT
    from worker.tp import hf_plan

    if plan is None and not isinstance(model, GPT) and hasattr(model, "config"):
        return hf_plan
    return plan


def _parallel_from_env() -> ParallelConfig | None:
    """The mesh the launcher asked for (``zeroplane run --tp/--pp``, the job spec:
    ``$ZEROPLANE_TP``/``$ZEROPLANE_PP``), or None where it asked for none."""
    if TP_ENV not in os.environ and PP_ENV not in os.environ:
        return None
    from worker.mesh import ParallelConfig

    return ParallelConfig.from_env()


def _on_mesh(
    model: nn.Module,
    optimizer: OptimizerArg,
    config: ZeroConfig,
    parallel: ParallelConfig,
    *,
    plan: Any,
    split: Split | None,
    loss_fn: LossFn | None,
    lr_scheduler: SchedulerArg | None,
    device: torch.device | str | None,
    init: Init | None,
    metrics: MetricsServer | None = None,
) -> ZeroEngine:
    """A mesh engine: :func:`worker.mesh.parallelize` (tensor parallel) or
    :func:`worker.pipeline.pipeline` (pipeline stages, tensor parallel within)."""
    from worker.mesh import parallelize
    from worker.pipeline import lm_loss, pipeline

    device = place_module(model, device)
    _init_from_launcher_env(device)
    if parallel.pipeline_parallel > 1:
        if init is not None:
            raise ValueError("init= with pipeline parallelism is not supported yet")
        return pipeline(
            model, optimizer, config=config, parallel=parallel, split=split,
            loss_fn=loss_fn or lm_loss, plan=plan, lr_scheduler=lr_scheduler, metrics=metrics,
        )  # fmt: skip
    if split is not None:
        raise ValueError("split= is for pipeline parallelism (ParallelConfig.pipeline_parallel)")
    engine = parallelize(
        model, optimizer, config=config, parallel=parallel, plan=plan,
        lr_scheduler=lr_scheduler, device=device, init=init, metrics=metrics,
    )  # fmt: skip
    engine.loss_fn = loss_fn
    return engine


def _resolve_config(
    config: ZeroConfig | Mapping[str, Any] | str | os.PathLike | None,
    optimizer: OptimizerArg | None,
    lr_scheduler: SchedulerArg | None,
) -> tuple[ZeroConfig, OptimizerArg, SchedulerArg | None]:
    """The ZeroConfig, optimizer and scheduler that :func:`initialize` was given or
    that a DeepSpeed config's sections describe."""
    if config is None or isinstance(config, ZeroConfig):
        if optimizer is None:
            raise ValueError(
                "worker.initialize needs an optimizer, or a DeepSpeed config with an "
                "'optimizer' section"
            )
        return config or ZeroConfig(), optimizer, lr_scheduler
    if isinstance(config, str | os.PathLike):
        path = Path(config)
        try:
            ds = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read the DeepSpeed config {path}: {exc}") from exc
    else:
        ds = config
    if not isinstance(ds, Mapping):
        raise ValueError(f"a DeepSpeed config is a JSON object, got {type(ds).__name__}")
    ds = dict(ds)
    optimizer_section, scheduler_section = ds.pop("optimizer", None), ds.pop("scheduler", None)
    for given, section, what in (
        (optimizer, optimizer_section, "optimizer"),
        (lr_scheduler, scheduler_section, "scheduler"),
    ):
        if given is not None and section is not None:
            raise ValueError(
                f"a {what} was passed to worker.initialize and the DeepSpeed config has a "
                f"{what!r} section: give one of them"
            )
    if optimizer is None:
        if optimizer_section is None:
            raise ValueError(
                "worker.initialize needs an optimizer: pass one, or give the DeepSpeed "
                "config an 'optimizer' section"
            )
        ds_sections.optimizer_from_deepspeed(optimizer_section, [torch.zeros(1)])  # checked now
        optimizer = functools.partial(ds_sections.optimizer_from_deepspeed, optimizer_section)
    if scheduler_section is not None:
        lr_scheduler = ds_sections.scheduler_from_deepspeed(scheduler_section)
    return ZeroConfig.from_deepspeed(ds), optimizer, lr_scheduler


def _init_from_launcher_env(device: torch.device) -> None:
    """Under torchrun (or any launcher that sets ``WORLD_SIZE`` > 1 and
    ``MASTER_ADDR``) with no process group yet, form the default group from that
    environment, as ``deepspeed.initialize`` does: a script that forgot
    ``dist.init_process_group`` must not silently train ``WORLD_SIZE`` separate
    copies of the model."""
    if not dist.is_available() or dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
        return
    backend = backend_for(device)
    dist.init_process_group(backend)
    logger.info(
        "formed the process group from the launcher's environment (%s, rank %d of %d)",
        backend,
        dist.get_rank(),
        dist.get_world_size(),
    )
