"""Pipeline parallelism with torch's ``torch.distributed.pipelining``, under ZeRO.

    engine = worker.initialize(model, optimizer, config=ZeroConfig(stage=1),
                               parallel=ParallelConfig(pipeline_parallel=2))
    loss = engine.train_batch([(inputs, targets)])  # the step's mean loss, every rank

The model is split by layer index (:func:`split_gpt` for worker.models GPT,
:func:`split_decoder` for a Hugging Face decoder laid out as Llama, or the
caller's ``split(model, stage, stages) -> nn.Module``; :func:`split_for` picks
one of the first two); each rank holds
its stage's module, keeping the model's parameter names, and runs torch's
``PipelineStage`` with a ``ScheduleGPipe`` or ``Schedule1F1B`` over the pp
group. With ``tensor_parallel > 1`` the stage's modules are tensor-parallel
over the tp group by the model's plan (worker/tp.py), as in
:func:`worker.mesh.parallelize`. ZeRO runs on the stage's (local) parameters
over the dp group.

The engine and its Notes are worker/pipeline_engine.py; the splits
worker/splits.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from worker.config import ZeroConfig
from worker.engine import LossFn, OptimizerArg
from worker.factory import build_engine
from worker.metrics import MetricsServer
from worker.parallel import ParallelConfig, check_combination
from worker.pipeline_engine import PipelineEngine
from worker.schedule import SchedulerArg
from worker.spec import EngineSpec
from worker.splits import (
    DecoderStage,
    GPTStage,
    Split,
    layer_bounds,
    lm_loss,
    split_decoder,
    split_for,
    split_gpt,
    splittable,
)

__all__ = [
    "DecoderStage",
    "GPTStage",
    "PipelineEngine",
    "Split",
    "layer_bounds",
    "lm_loss",
    "pipeline",
    "split_decoder",
    "split_for",
    "split_gpt",
    "splittable",
]


def pipeline(
    model: nn.Module,
    optimizer: OptimizerArg,
    *,
    config: ZeroConfig,
    parallel: ParallelConfig,
    split: Split | None = None,
    loss_fn: LossFn = lm_loss,
    plan: dict | Callable[[nn.Module], dict] | None = None,
    lr_scheduler: SchedulerArg | None = None,
    metrics: MetricsServer | None = None,
) -> PipelineEngine:
    """``model`` split into ``parallel.pipeline_parallel`` stages by ``split``, this
    rank's stage run by torch's pipelining schedule, ZeRO ``config`` over dp; with
    ``parallel.tensor_parallel > 1`` each stage's modules also tensor-parallel by
    ``plan`` (as :func:`worker.mesh.parallelize`; default the GPT plan).
    ``lr_scheduler``: as :func:`worker.initialize`'s, stepped by the engine.
    ``metrics``: an endpoint started before the engine."""
    check_combination(config, parallel)
    spec = EngineSpec(
        model=model,
        optimizer=optimizer,
        config=config,
        parallel=parallel,
        split=split,
        loss_fn=loss_fn,
        plan=plan,
        lr_scheduler=lr_scheduler,
    )
    spec.place_model()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    engine = build_engine(spec, shape=parallel.shape(world), metrics=metrics)
    assert isinstance(engine, PipelineEngine)
    return engine
