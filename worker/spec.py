"""What a script asked for (:class:`EngineSpec`): the model, its optimizer (or the
factory of one), the ZeroConfig, the parallel layout, the scheduler, ``init``, the
tensor-parallel plan, the pipeline split, the loss and the device, read once from a
call's arguments, the launcher's environment and a DeepSpeed config.

[Note: one way in]
Every engine is built the same way: the entry points read a call into an
:class:`EngineSpec` (:meth:`EngineSpec.of`); one pure function of the spec and the
process's situation chooses where the engine runs (worker/placement.py
``place``: alone, the launcher's group, a mesh, attached to a coordinator,
elastic, elastic by whole tp x pp groups, or a mesh the coordinator chooses); that
placement's route registers and forms the group if it must; and the route's last
act is worker/factory.py ``build_engine``, the one place that constructs an
engine of any layout, which applies the coordinator's plan and places the model.
The session a route starts is the engine's membership from then on.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from coordinator.core.meshplan import CP_ENV, EP_ENV, MESH_ENV, PP_ENV, TP_ENV
from worker import ds_sections
from worker.birth import Init, place_module
from worker.config import ZeroConfig
from worker.engine import LossFn, OptimizerArg, build_inventory_for, resolve_optimizer
from worker.inventory import Inventory
from worker.parallel import ParallelConfig
from worker.rendezvous import coordinator_address
from worker.schedule import SchedulerArg, resolve_scheduler
from worker.splits import Split

__all__ = ["ConfigArg", "EngineSpec", "default_plan", "resolve_config"]

# a ZeroConfig, a DeepSpeed config as a dict, or the path of its JSON file
ConfigArg = ZeroConfig | Mapping[str, Any] | str | os.PathLike


@dataclass(eq=False, kw_only=True)
class EngineSpec:
    """One engine as the script asked for it ([Note: one way in]).

    ``optimizer`` and ``lr_scheduler`` are what the script gave (an optimizer or a
    factory of one; a scheduler or a factory of one) until a route that registers
    with a coordinator resolves them (:meth:`resolve`): it needs the optimizer's
    param groups for the inventory it registers, before the engine exists.
    ``device`` is the device asked for until :meth:`place_model` places the model,
    then where it trains.
    ``coordinator`` is the address of the job's coordinator, if any; ``mesh_auto``
    says the coordinator chooses tp and pp (``zeroplane run --mesh auto``).
    """

    model: nn.Module
    optimizer: OptimizerArg
    config: ZeroConfig = field(default_factory=ZeroConfig)
    lr_scheduler: SchedulerArg | None = None
    device: torch.device | None = None
    init: Init | None = None
    parallel: ParallelConfig | None = None
    plan: Any = None
    split: Split | None = None
    loss_fn: LossFn | None = None
    group: dist.ProcessGroup | None = None
    coordinator: str | None = None
    mesh_auto: bool = False
    # what resolve() made: the inventory a route registers
    inventory: Inventory | None = None
    # the script compiled the model (torch.compile) before handing it over: the
    # engine takes the module inside and compiles it as the stage allows
    # (worker/factory.py [Note: compiling at stage 3])
    compiled: bool = False

    def __post_init__(self) -> None:
        # torch.compile's wrapper, known by name: importing torch._dynamo to test its
        # class would load dynamo in every worker process (test_engine_structure.py)
        inner = getattr(self.model, "_orig_mod", None)
        if isinstance(inner, nn.Module) and type(self.model).__name__ == "OptimizedModule":
            self.model, self.compiled = inner, True

    @classmethod
    def of(
        cls,
        model: nn.Module,
        optimizer: OptimizerArg | None = None,
        *,
        config: ConfigArg | None = None,
        group: dist.ProcessGroup | None = None,
        coordinator: str | None = None,
        lr_scheduler: SchedulerArg | None = None,
        device: torch.device | str | None = None,
        init: Init | None = None,
        parallel: ParallelConfig | None = None,
        plan: Any = None,
        split: Split | None = None,
        loss_fn: LossFn | None = None,
    ) -> EngineSpec:
        """A call to :func:`worker.initialize` as one spec: its DeepSpeed config read
        (its optimizer and scheduler sections built), the launcher's environment
        (``$ZEROPLANE_TP``/``$ZEROPLANE_PP``, ``$ZEROPLANE_MESH``,
        ``$ZEROPLANE_COORDINATOR``) taken where the call left them open, and the
        model placed on its device. Bad input fails here, before anything moves."""
        zero, optimizer, lr_scheduler = resolve_config(config, optimizer, lr_scheduler)
        parallel = parallel if parallel is not None else _parallel_from_env()
        auto = _mesh_auto_from_env()
        spec = cls(
            model=model,
            optimizer=optimizer,
            config=zero,
            lr_scheduler=lr_scheduler,
            init=init,
            parallel=parallel,
            plan=plan,
            split=split,
            loss_fn=loss_fn,
            group=group,
            coordinator=coordinator_address(coordinator),
            device=None if device is None else torch.device(device),
            mesh_auto=auto,
        )
        if not (auto or spec.model_parallel):
            for name, given in (("plan", plan), ("split", split)):
                if given is not None:
                    raise ValueError(
                        f"worker.initialize(..., {name}=...) is for tensor/pipeline "
                        "parallelism: pass parallel=ParallelConfig(tensor_parallel=..., "
                        "pipeline_parallel=...)"
                    )
        if spec.expert_parallel > 1 and auto:
            raise ValueError(
                "expert_parallel > 1 with --mesh auto: the coordinator does not choose ep "
                "yet; give --ep without --mesh auto (docs/guides/moe.md)"
            )
        if spec.pipeline and init is not None:
            raise ValueError("init= with pipeline parallelism is not supported yet")
        return spec

    def place_model(self) -> torch.device:
        """Put the model where it trains, once (worker/birth.py ``place_module``: the
        device asked for, the launcher's GPU, or where the model is)."""
        self.device = place_module(self.model, self.device)
        return self.device

    @property
    def model_parallel(self) -> bool:
        """Whether the script asked for tensor or pipeline parallelism."""
        p = self.parallel
        return p is not None and p.tensor_parallel * p.pipeline_parallel > 1

    @property
    def expert_parallel(self) -> int:
        return 1 if self.parallel is None else self.parallel.expert_parallel

    @property
    def context_parallel(self) -> int:
        return 1 if self.parallel is None else self.parallel.context_parallel

    def experts_request(self) -> tuple[int, int] | None:
        """(expert_parallel, the experts' elements) a worker registers when it splits
        its experts over ranks (the inventory leaves them out); None otherwise."""
        if self.expert_parallel == 1:
            return None
        from worker.moe.dispatch import expert_modules

        numel = sum(p.numel() for _, m in expert_modules(self.model) for p in m.parameters())
        return self.expert_parallel, numel

    @property
    def pipeline(self) -> bool:
        return self.parallel is not None and self.parallel.pipeline_parallel > 1

    def resolve(self) -> Inventory:
        """The optimizer built from its factory, the scheduler from its, and the
        whole model's inventory (what a worker registers: the coordinator plans
        for the model as it is, before tp slices it or a pipeline splits it; under
        expert parallelism, for every parameter but the experts, which each rank
        shards over its own group, worker/moe/shards.py)."""
        if self.inventory is None:
            self.optimizer = resolve_optimizer(self.model, self.optimizer)
            self.lr_scheduler = resolve_scheduler(self.lr_scheduler, self.optimizer)
            keep = None
            if self.expert_parallel > 1:  # the experts are their own state's
                from worker.moe.dispatch import expert_modules

                experts = {p for _, m in expert_modules(self.model) for p in m.parameters()}
                keep = lambda p: p not in experts  # noqa: E731
            self.inventory = build_inventory_for(self.model, self.optimizer, self.config, keep=keep)
        return self.inventory

    def asked_degrees(self) -> tuple[int, int]:
        """The tp and pp this worker asks a coordinator for: the layout's, or with
        ``--mesh auto`` 0 for each degree the coordinator may choose and 1 where the
        script cannot build it: tensor parallelism needs a plan (given, the
        built-in GPT's, or a Hugging Face model's known to worker.tp.hf_plan), a
        pipeline a split (given, or a built-in one for an untied GPT or Llama-like
        decoder). Asking for what the script cannot build would fail every worker
        once the generation formed."""
        if not self.mesh_auto:
            p = self.parallel or ParallelConfig()
            return (p.tensor_parallel, p.pipeline_parallel)
        from worker.models import GPT
        from worker.splits import splittable
        from worker.tp import hf_plan

        tp_ok = self.plan is not None or isinstance(self.model, GPT)
        if not tp_ok:
            try:
                hf_plan(self.model)
                tp_ok = True
            except ValueError:
                pass
        pp_ok = self.split is not None or splittable(self.model)
        return (0 if tp_ok else 1, 0 if pp_ok else 1)


def default_plan(model: nn.Module, plan: Any) -> Any:
    """``plan``, or where none was given the built-in GPT's (the default) or, for a
    Hugging Face model, :func:`worker.tp.hf_plan`."""
    from worker.models import GPT
    from worker.tp import gpt_plan, hf_plan

    if plan is not None:
        return plan
    if not isinstance(model, GPT) and hasattr(model, "config"):
        return hf_plan
    return gpt_plan


def _parallel_from_env() -> ParallelConfig | None:
    """The layout the launcher asked for (``zeroplane run --tp/--pp/--ep``, the job
    spec: ``$ZEROPLANE_TP``/``$ZEROPLANE_PP``/``$ZEROPLANE_EP``), or None where it
    asked for none."""
    if not any(env in os.environ for env in (TP_ENV, PP_ENV, EP_ENV, CP_ENV)):
        return None
    return ParallelConfig.from_env()


def _mesh_auto_from_env() -> bool:
    raw = os.environ.get(MESH_ENV)
    if raw is None or raw == "":
        return False
    if raw != "auto":
        raise ValueError(f"${MESH_ENV} must be 'auto' (or unset), got {raw!r}")
    if TP_ENV in os.environ or PP_ENV in os.environ:
        raise ValueError(f"${MESH_ENV}=auto and ${TP_ENV}/${PP_ENV} ask for the mesh twice")
    return True


def read_deepspeed_config(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """A DeepSpeed config as a dict: the mapping given, or its JSON file read."""
    if isinstance(config, str | os.PathLike):
        path = Path(config)
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read the DeepSpeed config {path}: {exc}") from exc
    if not isinstance(config, Mapping):
        raise ValueError(f"a DeepSpeed config is a JSON object, got {type(config).__name__}")
    return dict(config)


def resolve_config(
    config: ConfigArg | None,
    optimizer: OptimizerArg | None,
    lr_scheduler: SchedulerArg | None,
) -> tuple[ZeroConfig, OptimizerArg, SchedulerArg | None]:
    """The ZeroConfig, optimizer and scheduler that :func:`worker.initialize` was
    given or that a DeepSpeed config's sections describe."""
    if config is None or isinstance(config, ZeroConfig):
        if optimizer is None:
            raise ValueError(
                "worker.initialize needs an optimizer, or a DeepSpeed config with an "
                "'optimizer' section"
            )
        return config or ZeroConfig(), optimizer, lr_scheduler
    ds = read_deepspeed_config(config)
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
