"""Pipeline parallelism with torch's ``torch.distributed.pipelining``, under ZeRO.

    engine = worker.pipeline.pipeline(model, optimizer, config=ZeroConfig(stage=1),
                                      parallel=ParallelConfig(pipeline_parallel=2))
    loss = engine.train_step(inputs, targets)   # None on stages other than the last

The model is split by layer index (:func:`split_gpt` for worker.models GPT,
or the caller's ``split(model, stage, stages) -> nn.Module``); each rank holds
its stage's module, keeping the model's parameter names, and runs torch's
``PipelineStage`` with a ``ScheduleGPipe`` or ``Schedule1F1B`` over the pp
group. With ``tensor_parallel > 1`` the stage's modules are tensor-parallel
over the tp group by the model's plan (worker/tp.py), as in
:func:`worker.mesh.parallelize`. ZeRO runs on the stage's (local) parameters
over the dp group.

[Note: pipeline gradients into ZeRO]
The schedule runs the backward of every micro-batch itself and divides the
accumulated gradients by the number of micro-batches (``scale_grads``), so
the gradients sit in ``.grad`` (at stages 0-1 the engine's flat buffers)
when it returns, as after gradient accumulation. The engine then reduces
them across dp: :meth:`PipelineEngine.train_step` calls ``engine.backward``
on a zero that depends on every stage parameter, which adds zeros to each
gradient and runs the engine's usual boundary path (used-parameter ballot,
buckets launched in order, reduce-scatter or all-reduce) with no change to
the engine. Stages 2-3 are refused: they reduce or gather per backward, and
the schedule interleaves backwards of several micro-batches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from coordinator.core.meshplan import MeshCoords, MeshShape
from worker.collectives import Collectives
from worker.config import ZeroConfig
from worker.engine import OptimizerArg, ZeroEngine, module_device
from worker.mesh import ParallelConfig, build_mesh, check_combination, engine_on_mesh
from worker.schedule import SchedulerArg
from worker.tp import TensorParallel, gather_full

__all__ = ["GPTStage", "PipelineEngine", "layer_bounds", "pipeline", "split_gpt"]

logger = logging.getLogger(__name__)

Split = Callable[[nn.Module, int, int], nn.Module]


def layer_bounds(layers: int, stage: int, stages: int) -> tuple[int, int]:
    """Layers ``[lo, hi)`` of ``stage``: as even as possible, earlier stages one more."""
    if layers < stages:
        raise ValueError(f"{layers} layers cannot fill {stages} pipeline stages")
    base, extra = divmod(layers, stages)
    lo = stage * base + min(stage, extra)
    return lo, lo + base + (1 if stage < extra else 0)


class GPTStage(nn.Module):
    """One pipeline stage of worker.models GPT, under the model's parameter names:
    the embeddings on the first, ``blocks.{lo..hi-1}``, the norm and head on the last."""

    def __init__(self, model: nn.Module, stage: int, stages: int) -> None:
        super().__init__()
        if getattr(model.cfg, "tie_weights", False) and stages > 1:
            raise ValueError(
                "a GPT with tie_weights=True cannot be split into pipeline stages: its "
                "embedding and head are one parameter on the first and last stage"
            )
        lo, hi = layer_bounds(len(model.blocks), stage, stages)
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
        if self.last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def split_gpt(model: nn.Module, stage: int, stages: int) -> nn.Module:
    return GPTStage(model, stage, stages)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, as worker.models GPT computes it."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class PipelineEngine:
    """This rank's pipeline stage under ZeRO over dp ([Note: pipeline gradients into ZeRO])."""

    def __init__(
        self,
        engine: ZeroEngine,
        schedule,
        *,
        shape: MeshShape,
        coords: MeshCoords,
        tp: TensorParallel | None = None,
        tp_comm: Collectives | None = None,
    ) -> None:
        self.engine, self.schedule, self.shape, self.coords = engine, schedule, shape, coords
        self.tp, self.tp_comm = tp, tp_comm
        self._trainable = [p for p in dict.fromkeys(engine.module.parameters()) if p.requires_grad]

    @property
    def is_last(self) -> bool:
        return self.coords.pp == self.shape.pp - 1

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """One optimizer step on this dp rank's batch (split into the micro-batches);
        every rank of the pipeline passes the same batch. Returns the batch's mean
        loss on the last stage, None elsewhere."""
        losses: list[torch.Tensor] = []
        coords = self.coords
        if coords.pp == 0:
            self.schedule.step(inputs)
        elif self.is_last:
            self.schedule.step(target=targets, losses=losses)
        else:
            self.schedule.step()
        # [Note: pipeline gradients into ZeRO]
        zero = torch.stack([p.reshape(-1)[0] for p in self._trainable]).sum() * 0.0
        self.engine.backward(zero)
        self.engine.step()
        if not self.is_last:
            return None
        return float(torch.stack([loss.detach() for loss in losses]).mean())

    def memory_report(self) -> dict[str, int]:
        return self.engine.memory_report()

    def comm_report(self) -> dict[str, dict[str, int]]:
        return self.engine.comm_report()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's full parameters by the model's names (fp32, gathered over dp
        and tp); a collective over the dp and tp groups."""
        local = self.engine.full_state_dict()
        if self.tp is None or self.tp_comm is None:
            return local
        return gather_full(local, self.tp.slices, self.tp_comm)

    def close(self) -> None:
        if self.tp is not None:
            self.tp.deactivate()
        self.engine.close()


def pipeline(
    model: nn.Module,
    optimizer: OptimizerArg,
    *,
    config: ZeroConfig,
    parallel: ParallelConfig,
    split: Split = split_gpt,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
    plan: dict | Callable[[nn.Module], dict] | None = None,
    lr_scheduler: SchedulerArg | None = None,
) -> PipelineEngine:
    """``model`` split into ``parallel.pipeline_parallel`` stages by ``split``, this
    rank's stage run by torch's pipelining schedule, ZeRO ``config`` over dp; with
    ``parallel.tensor_parallel > 1`` each stage's modules also tensor-parallel by
    ``plan`` (as :func:`worker.mesh.parallelize`; default the GPT plan).
    ``lr_scheduler``: as :func:`worker.initialize`'s, stepped by the engine."""
    check_combination(config, parallel)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    shape = parallel.shape(world)
    device = module_device(model)
    mesh = build_mesh(shape, device.type)
    coords = shape.coords(dist.get_rank())
    stage_module = split(model, coords.pp, shape.pp)
    kept = set(stage_module.parameters())
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError("the optimizer already has state; pass one that has not stepped")
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if p in kept]
    # the stage module keeps the model's names, so the model's plan applies to it
    engine, tp = engine_on_mesh(
        stage_module, optimizer, model, config, mesh, shape, coords, plan, lr_scheduler
    )
    stage = PipelineStage(stage_module, coords.pp, shape.pp, device, group=mesh["pp"].get_group())
    schedule_cls = ScheduleGPipe if parallel.pipeline_schedule == "gpipe" else Schedule1F1B
    schedule = schedule_cls(stage, parallel.microbatches, loss_fn=loss_fn)
    logger.info(
        "pipeline stage %d of %d (dp rank %d of %d), schedule %s, %d micro-batches",
        coords.pp, shape.pp, coords.dp, shape.dp, parallel.pipeline_schedule,
        parallel.microbatches,
    )  # fmt: skip
    tp_comm = Collectives(mesh["tp"].get_group()) if tp is not None else None
    return PipelineEngine(engine, schedule, shape=shape, coords=coords, tp=tp, tp_comm=tp_comm)
