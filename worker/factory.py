"""The one place that constructs an engine of any layout ([Note: one way in] in
worker/spec.py): a :class:`~worker.engine.ZeroEngine` for a data-parallel job, a
:class:`~worker.mesh_engine.MeshEngine` tensor-parallel over a mesh's tp group, or
a :class:`~worker.pipeline_engine.PipelineEngine` for this rank's pipeline stage,
each from an :class:`~worker.spec.EngineSpec`, with the coordinator's plan for
this rank applied once here."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from coordinator.core.meshplan import MeshCoords, MeshShape
from coordinator.core.messages import Generation
from worker.birth import Init, SlicedInit, meta_names, skip_init
from worker.collectives import Collectives
from worker.config import ZeroConfig
from worker.engine import OptimizerArg, ZeroEngine, module_device
from worker.metrics import MetricsServer
from worker.moe.dispatch import ExpertGroups, ExpertParallel
from worker.parallel import ParallelConfig, build_mesh, check_combination, check_heads
from worker.reporting import planned_config
from worker.spec import EngineSpec, default_plan
from worker.splits import lm_loss, split_for

__all__ = ["build_engine", "rebuild_optimizer"]

logger = logging.getLogger(__name__)

# the mesh engines (and tensor parallelism, torch's DTensor and pipelining under
# them) load when a mesh is built, not with `import worker`: every worker process
# of a data-parallel job would pay for them at start
if TYPE_CHECKING:
    from worker.context import ContextParallel
    from worker.mesh_engine import MeshEngine
    from worker.pipeline_engine import PipelineEngine
    from worker.tp import TensorParallel

E = TypeVar("E", bound="MeshEngine")


def build_engine(
    spec: EngineSpec,
    *,
    generation: Generation | None = None,
    rank: int = 0,
    shape: MeshShape | None = None,
    mesh: DeviceMesh | None = None,
    coords: MeshCoords | None = None,
    metrics: MetricsServer | None = None,
    initial_state: Literal["module", "peers"] = "module",
    build_for: Collectives | None = None,
) -> ZeroEngine:
    """The engine ``spec`` asks for, at this rank.

    ``generation``: the coordinator's generation this rank (``rank``) builds for:
    its stage and bucket size apply (worker/reporting.py ``planned_config``), and
    a data-parallel engine takes its alignment. ``shape``: the mesh this rank is
    in (the generation's, or by default the spec's layout over the process
    group); ``mesh`` and ``coords``: torch's DeviceMesh and this rank's place in
    it, built from ``shape`` when not given. ``metrics``: the endpoint a
    coordinator's job started before the engine. ``initial_state``, ``build_for``:
    :class:`~worker.engine.ZeroEngine`'s (a newcomer builds empty, for peers to
    fill)."""
    engine = _construct(
        spec, generation, rank, shape, mesh, coords, metrics, initial_state, build_for
    )
    if spec.compiled or spec.config.compile:
        compile_model(engine)
    return engine


def compile_model(engine: ZeroEngine) -> None:
    """[Note: compiling at stage 3]
    A script compiles its model (``torch.compile(model)``) before ``initialize``, or
    its blocks (``block.compile()``) after, or asks the engine to
    (``ZeroConfig(compile=True)``, which does as the first). At stages 0-2 the parameters are whole
    and the engine's hooks run in backward only, so the whole module compiles as
    it is (``module.compile()``, which keeps the parameter names). At stage 3 a
    unit's parameters exist only between its gather and its release, which run in
    its forward hooks: the hooks are kept out of every graph (worker/compat.py
    ``eager``, a graph break on each side), so each unit's own computation is a
    graph and its gathers and releases are its edges, what compiling each unit's
    forward gives; the model is compiled unit by unit (the root, which holds the
    others' calls, stays eager). A block compiled after ``initialize`` gets the
    same edges from the same hooks. The first forward at stage 3 runs eager
    (worker/compat.py ``compile_disabled``): it watches every op's tensors for
    parameters read outside their unit (worker/stages.py [Note: modules whose
    forward never runs]), which dynamo cannot trace; compilation starts with the
    second. Parameter names stay the model's own (no ``_orig_mod.``)."""
    if engine.state.params.sharded:
        for unit in engine.units:
            if unit.module is not engine.module:
                unit.module.compile()
    else:
        engine.module.compile()
    how = "unit by unit" if engine.state.params.sharded else "whole"
    logger.info("compiling the model %s (torch.compile)", how)


def _construct(
    spec: EngineSpec,
    generation: Generation | None,
    rank: int,
    shape: MeshShape | None,
    mesh: DeviceMesh | None,
    coords: MeshCoords | None,
    metrics: MetricsServer | None,
    initial_state: Literal["module", "peers"],
    build_for: Collectives | None,
) -> ZeroEngine:
    config = spec.config if generation is None else planned_config(spec.config, generation, rank)
    if shape is None and spec.model_parallel:
        assert spec.parallel is not None
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        shape = spec.parallel.shape(world)
    if shape is None:
        optimizer = spec.optimizer
        if spec.parallel is not None:
            check_combination(config, spec.parallel)
        if spec.expert_parallel > 1:
            assert spec.parallel is not None
            optimizer = _expert_parallel(spec, spec.parallel)
        context = _context_parallel(spec, spec.parallel)
        engine = ZeroEngine(
            spec.model,
            optimizer,
            config=config,
            group=spec.group,
            initial_state=initial_state,
            inventory=spec.inventory,
            align=1 if generation is None else generation.align,
            metrics=metrics,
            lr_scheduler=spec.lr_scheduler,
            build_for=build_for,
            device=spec.device,
            init=spec.init,
            loss_fn=spec.loss_fn,
        )
        engine.context = context
        return engine
    parallel = _layout_of(spec.parallel, shape)
    check_combination(config, parallel)
    if mesh is None:
        device_type = (spec.device or module_device(spec.model)).type
        mesh = build_mesh(shape, device_type)
    if coords is None:
        coords = shape.coords(dist.get_rank() if shape.world_size > 1 else 0)
    from worker.mesh_engine import MeshEngine

    if shape.pp > 1:
        if spec.init is not None:
            raise ValueError("init= with pipeline parallelism is not supported yet")
        engine: MeshEngine = _stage_engine(
            spec, config, parallel, mesh, shape, coords, metrics, initial_state
        )
    else:
        optimizer = _mesh_experts(spec, parallel, shape, mesh)
        engine = _tp_engine(
            MeshEngine, spec.model, optimizer, spec.model, config, mesh, shape, coords,
            spec.plan, spec.lr_scheduler, device=spec.device, init=spec.init, metrics=metrics,
            initial_state=initial_state, loss_fn=spec.loss_fn,
        )  # fmt: skip
        if parallel.context_parallel > 1:
            engine.context = _context_parallel(spec, parallel, shape=shape, mesh=mesh)
    logger.info(
        "mesh pp=%d dp=%d tp=%d: this rank is pp=%d dp=%d tp=%d",
        shape.pp, shape.dp, shape.tp, coords.pp, coords.dp, coords.tp,
    )  # fmt: skip
    return engine


def _expert_parallel(
    spec: EngineSpec, parallel: ParallelConfig, groups: ExpertGroups | None = None
) -> OptimizerArg:
    """Split ``spec.model``'s experts over ep groups of the process group (or
    ``groups``, a mesh's), this rank keeping its share (worker/moe/dispatch.py
    [Note: expert parallelism]); returns the optimizer over the parameters the
    model now holds."""
    from worker.moe.dispatch import apply_expert_parallel

    before = dict(spec.model.named_parameters(remove_duplicate=False))
    if meta_names(spec.model) and spec.init is not skip_init:
        raise ValueError(
            "expert parallelism of a model on the meta device takes its weights from "
            "files (worker.from_pretrained): initializing a rank's share of the experts "
            "would not draw what the whole model's construction draws; build the model "
            "on the CPU, or load it"
        )
    if groups is None:
        groups = ExpertGroups.form(Collectives(spec.group), parallel.expert_parallel)
    apply_expert_parallel(spec.model, groups, capacity_factor=parallel.capacity_factor)
    logger.info(
        "expert parallel: ep=%d, this rank holds place %d of its ep group; the experts' "
        "state is sharded over %d ranks, the rest over %d",
        groups.size, groups.place, groups.edp.world_size, groups.world,
    )  # fmt: skip
    return rebuild_optimizer(spec.optimizer, before, spec.model, dropped_ok=True)


def _context_parallel(
    spec: EngineSpec,
    parallel: ParallelConfig | None,
    *,
    shape: MeshShape | None = None,
    mesh: DeviceMesh | None = None,
) -> ContextParallel | None:
    """The cp groups of the process group and the model switched to their attention
    (worker/context/parallel.py [Note: context parallelism]); None without cp. On a
    mesh (``shape``), a cp group is ``cp`` consecutive dp indices at one tp position:
    the dp dimension split in two (dp/cp, cp)."""
    if parallel is None or parallel.context_parallel == 1:
        return None
    from worker.context import ContextParallel

    cp, within = parallel.context_parallel, None
    if shape is not None and mesh is not None:
        within = Collectives(_split_dp(shape, mesh, cp, "context_parallel")["inner"].get_group())
    context = ContextParallel(
        Collectives(spec.group), cp, parallel.context_parallel_kind, comm=within
    )
    context.install(spec.model)
    logger.info(
        "context parallel: cp=%d (%s), this rank holds shard %d of each sequence; the "
        "state is sharded over all %d ranks",
        context.size, context.kind, context.rank, context.world.world_size,
    )  # fmt: skip
    return context


def _split_dp(shape: MeshShape, mesh: DeviceMesh, k: int, what: str) -> DeviceMesh:
    """``mesh`` with its dp dimension split in two, ``(pp, outer, inner, tp)``: an
    inner group is ``k`` consecutive dp indices at one tp position (a cp or an ep
    group), an outer one the dp indices at the same inner place (every rank
    creates every group, as the mesh's own)."""
    if shape.dp % k:
        raise ValueError(f"{what}={k} must divide the mesh's dp={shape.dp}")
    return init_device_mesh(
        mesh.device_type, (shape.pp, shape.dp // k, k, shape.tp),
        mesh_dim_names=("pp", "outer", "inner", "tp"),
    )  # fmt: skip


def _mesh_experts(
    spec: EngineSpec, parallel: ParallelConfig, shape: MeshShape, mesh: DeviceMesh
) -> OptimizerArg:
    """The script's optimizer, or with expert parallelism on a mesh the one over the
    experts this rank keeps: its ep group is ``ep`` consecutive dp indices at one tp
    and pp position, its expert-data-parallel group the dp indices at the same
    place; the experts are whole on every tp rank (worker/moe/dispatch.py [Note:
    experts on a mesh])."""
    ep = parallel.expert_parallel
    if ep == 1:
        return spec.optimizer
    split = _split_dp(shape, mesh, ep, "expert_parallel")
    ep_comm = Collectives(split["inner"].get_group())
    if ep == shape.dp:
        edp = Collectives.ahead(0, 1, ep_comm.backend)
    else:
        edp = Collectives(split["outer"].get_group())
    return _expert_parallel(spec, parallel, ExpertGroups(ep=ep_comm, edp=edp, world=shape.dp))


def _layout_of(asked: ParallelConfig | None, shape: MeshShape) -> ParallelConfig:
    """The layout an engine on ``shape`` runs: the script's, with the degrees the
    mesh has (a coordinator's ``--mesh auto`` choice), and enough micro-batches to
    fill the pipeline."""
    base = asked or ParallelConfig()
    if (base.tensor_parallel, base.pipeline_parallel) == (shape.tp, shape.pp):
        return base
    return dataclasses.replace(
        base,
        tensor_parallel=shape.tp,
        pipeline_parallel=shape.pp,
        microbatches=max(base.microbatches, shape.pp),
    )


def _stage_engine(
    spec: EngineSpec,
    config: ZeroConfig,
    parallel: ParallelConfig,
    mesh: DeviceMesh,
    shape: MeshShape,
    coords: MeshCoords,
    metrics: MetricsServer | None,
    initial_state: Literal["module", "peers"],
) -> PipelineEngine:
    """This rank's stage of ``spec.model`` (split by ``spec.split`` or the built-in
    split for the model) on ``mesh`` at ``coords``."""
    from worker.pipeline_engine import PipelineEngine

    # each stage's experts split over the ep groups at its pp position
    model, optimizer = spec.model, _mesh_experts(spec, parallel, shape, mesh)
    stage_module = split_for(model, spec.split)(model, coords.pp, shape.pp)
    kept = set(stage_module.parameters())
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError("the optimizer already has state; pass one that has not stepped")
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if p in kept]
    # the stage module keeps the model's names, so the model's plan applies to it
    engine = _tp_engine(
        PipelineEngine, stage_module, optimizer, model, config, mesh, shape, coords, spec.plan,
        spec.lr_scheduler, device=spec.device, parallel=parallel,
        loss_fn=spec.loss_fn or lm_loss, metrics=metrics, initial_state=initial_state,
    )  # fmt: skip
    # the whole model's (a Hugging Face config.json), for save_pretrained
    engine.model_config = getattr(model, "config", None)
    logger.info(
        "pipeline stage %d of %d (dp rank %d of %d), schedule %s, %d micro-batches",
        coords.pp, shape.pp, coords.dp, shape.dp, parallel.pipeline_schedule,
        parallel.microbatches,
    )  # fmt: skip
    return engine


def _tp_engine(
    cls: type[E],
    module: nn.Module,
    optimizer: OptimizerArg,
    model: nn.Module,
    config: ZeroConfig,
    mesh: DeviceMesh,
    shape: MeshShape,
    coords: MeshCoords,
    plan: object,
    lr_scheduler: object,
    *,
    device: torch.device | None = None,
    init: Init | None = None,
    **extra: object,
) -> E:
    """A ``cls`` engine over the dp group of ``mesh`` for ``module`` (the model, or
    its pipeline stage, which keeps the model's parameter names), tensor-parallel
    over tp by ``plan`` (default: the built-in GPT's, or a Hugging Face model's,
    worker/spec.py ``default_plan``); ``extra``: ``cls``'s own keyword arguments."""
    tp: TensorParallel | None = None
    if shape.tp > 1:
        from worker.tp import apply_tp, stage_plan

        before = dict(module.named_parameters(remove_duplicate=False))
        chosen = default_plan(model, plan)
        chosen = chosen(model) if callable(chosen) else chosen
        if module is not model:  # a pipeline stage: the plan's entries it holds
            chosen = stage_plan(chosen, module, model)
        check_heads(model, shape.tp)
        experts = tuple(n for n, m in module.named_modules() if isinstance(m, ExpertParallel))
        tp = apply_tp(module, mesh["tp"], chosen, whole=experts)  # meta tensors stay meta
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


def rebuild_optimizer(
    optimizer: OptimizerArg,
    before: dict[str, nn.Parameter],
    model: nn.Module,
    *,
    dropped_ok: bool = False,
) -> torch.optim.Optimizer:
    """The user's optimizer over ``model``'s current parameters: a factory is
    called; an optimizer built over the parameters as they were (``before``, by
    name) gets the new ones in its param groups (it has no state yet).
    ``dropped_ok``: a parameter the model no longer holds (another rank's expert)
    leaves its group."""
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
        group["params"] = [
            now[name_of[p]] for p in group["params"] if not dropped_ok or name_of[p] in now
        ]
    return optimizer
