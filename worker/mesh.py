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

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from worker.birth import Init
from worker.config import ZeroConfig
from worker.engine import OptimizerArg
from worker.factory import build_engine, rebuild_optimizer
from worker.mesh_engine import MeshEngine, ModelParallelNorm, norm_scope
from worker.metrics import MetricsServer
from worker.parallel import ParallelConfig, build_mesh, check_combination, check_heads
from worker.schedule import SchedulerArg
from worker.spec import EngineSpec

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
    :func:`worker.tp.gpt_plan`, or :func:`worker.tp.hf_plan` for a Hugging Face
    model). ``model`` must be identical on every rank. Pipeline parallelism is
    :func:`worker.pipeline.pipeline` (a different step). ``lr_scheduler``,
    ``device``: as :func:`worker.initialize`'s.

    A model built on the meta device comes to life sharded as with
    :func:`worker.initialize`: each module by its ``reset_parameters()`` or by
    ``init(module)`` (``worker.skip_init`` for weights that
    :meth:`MeshEngine.load_weights` brings next), on its whole tensors, each rank
    keeping its tp slice (worker/tp.py [Note: birth under tensor parallelism]).
    ``metrics``: an endpoint started before the engine."""
    if parallel.pipeline_parallel > 1:
        raise ValueError("pipeline_parallel > 1: use worker.pipeline.pipeline(...)")
    check_combination(config, parallel)
    spec = EngineSpec(
        model=model,
        optimizer=optimizer,
        config=config,
        parallel=parallel,
        plan=plan,
        lr_scheduler=lr_scheduler,
        device=None if device is None else torch.device(device),
        init=init,
    )
    spec.place_model()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    engine = build_engine(spec, shape=parallel.shape(world), mesh=mesh, metrics=metrics)
    assert isinstance(engine, MeshEngine)
    return engine
