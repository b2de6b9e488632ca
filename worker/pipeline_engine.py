"""A pipeline stage's engine (:class:`PipelineEngine`): this rank's stage run by
torch's pipelining schedule, ZeRO over dp. Built by worker/factory.py; entered
through ``worker.initialize(parallel=ParallelConfig(pipeline_parallel=...))`` or
:func:`worker.pipeline.pipeline`.

[Note: pipeline gradients into ZeRO]
The schedule runs the backward of every micro-batch itself and divides the
accumulated gradients by the number of micro-batches (``scale_grads``), so
the gradients sit in ``.grad`` (at stages 0-1 the engine's flat buffers)
when it returns, as after gradient accumulation. The engine then reduces
them across dp: :meth:`PipelineEngine.train_step` calls ``engine.backward``
on a zero that depends on every stage parameter, which adds zeros to each
gradient and runs the engine's usual boundary path (used-parameter ballot,
buckets launched in order, reduce-scatter or all-reduce) with no change to
the engine.

At stage 2 a gradient goes to its bucket's staging buffer as it arrives and
``.grad`` is freed (worker/reducers.py ``ReduceScatterStaging``); outside
``engine.backward`` nothing is launched, so the staging buffers sum the
micro-batches' gradients, and the zero's backward reduce-scatters each once,
into the persistent gradient shard: one reduce-scatter per bucket and step,
as torchtitan reduces FSDP's gradients only on a pipeline's last micro-batch.
The schedule's ``scale_grads`` then finds no ``.grad`` to divide, so the
micro-batch losses carry the ``1 / microbatches`` themselves; and the staging
buffers, which hold the stage's whole gradient during the schedule, go back
after the step (``StagingPool.trim``), so between steps a rank holds its
gradient shard alone. Stage 3 is refused: it gathers each unit per forward
and backward, which the schedule interleaves over micro-batches.

[Note: pipeline micro-batches of equal shape]
torch's stages infer the shapes they send and receive from the first step
and keep them, so every micro-batch of every step must have the same rows.
:meth:`PipelineEngine.train_batch` joins the rank's samples (an attached
loader's micro-batches, padding left out) and cuts them into
``ParallelConfig.microbatches`` pieces of ``ceil(largest dp share /
microbatches)`` rows, the largest share being ``ceil(global batch / dp)``, so
the width is the same on every rank and at every step; the rows past the
rank's samples are copies of its first, and count 0. The loss the schedule
runs is the user's ``loss_fn`` on a micro-batch's real rows, scaled by
``real rows x microbatches x N·share/B / share``: after the schedule divides
by the number of micro-batches and the engine sums over dp and divides by N,
the gradient is the mean over the global batch, whatever the shares (the
same weights as worker/data/sampler.py [Note: uneven shares]). The loss the
step reports is the last stage's, weighted alike, summed over dp and then
broadcast over pp, so ``mean_loss()`` and ``train_batch``'s result are the
global batch's on every rank.

[Note: pipeline checkpoints]
A checkpoint is written by every rank of the job, each its owned ranges of
its stage's parameters by full name (worker/tp_checkpoint.py [Note:
tensor-parallel checkpoints]), but the manifest is rank 0's, and rank 0 holds
the first stage. The stages therefore exchange their inventories once (names,
full shapes, param groups; JSON over the pp group) and each rank's view of the
state lists them all: the manifest names every parameter, the ranges of all
the files cover them once, and a loader at any layout reads the files that
overlap what it owns, so a checkpoint saved at pp=2 x dp=2 loads at dp=4,
at pp=2 x tp=2, or at pp=2 again. What rank 0 writes alone (frozen
parameters, persistent buffers) would be its stage's only, so a pipeline
whose stages hold any is refused, on every rank alike, naming one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from coordinator.core.layout import ParamSpec
from coordinator.core.meshplan import MeshCoords, MeshShape
from worker.checkpoint import DEFAULT_SHARD_BYTES, Planned, write_safetensors_shards
from worker.collectives import Collectives
from worker.engine import LossFn, OptimizerArg, ZeroEngine
from worker.inventory import Inventory, persistent_buffers
from worker.mesh_engine import MeshEngine
from worker.parallel import ParallelConfig
from worker.tp_checkpoint import FullView

__all__ = ["PipelineEngine"]

logger = logging.getLogger(__name__)


class PipelineEngine(MeshEngine):
    """This rank's pipeline stage under ZeRO over dp ([Note: pipeline gradients into
    ZeRO]): the surface of every engine (worker/surface.py), trained through
    :meth:`train_batch`, since a stage's forward and backward run only inside the
    schedule. :meth:`mean_loss` and :meth:`train_batch`'s result are the step's loss
    over the global batch on every rank, not only the last stage's."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: OptimizerArg,
        *,
        parallel: ParallelConfig,
        loss_fn: LossFn,
        **kwargs: Any,
    ) -> None:
        super().__init__(module, optimizer, **kwargs)
        self.loss_fn = loss_fn
        self.model_config: Any = getattr(module, "config", None)
        self._trainable = [p for p in dict.fromkeys(module.parameters()) if p.requires_grad]
        self.pp_comm = Collectives(self.mesh["pp"].get_group())
        # this rank's share of the coming step's global batch, as set_micro_batches says
        self._share: tuple[int, int] | None = None
        self._counts: list[int] = []
        # the step the schedule runs now: each micro-batch's real rows, loss scale
        # and (as the last stage computes them) loss
        self._real: list[int] = []
        self._scales: list[float] = []
        self._losses: dict[int, torch.Tensor] = {}
        self._targets, self._width = torch.zeros(1), 1
        # every stage's parameters, for checkpoints ([Note: pipeline checkpoints])
        self._whole: tuple[tuple[ParamSpec, ...], dict[str, str], list[str]] | None = None
        self.parallel = parallel
        self.microbatches = parallel.microbatches
        self._build_schedule()

    def _build_schedule(self) -> None:
        """torch's stage and schedule over this mesh's pp group (they infer the
        shapes they send at their first step)."""
        stage = PipelineStage(
            self.module, self.coords.pp, self.shape.pp, self.device,
            group=self.mesh["pp"].get_group(),
        )  # fmt: skip
        gpipe = self.parallel.pipeline_schedule == "gpipe"
        schedule_cls = ScheduleGPipe if gpipe else Schedule1F1B
        self.schedule = schedule_cls(stage, self.microbatches, loss_fn=self._weighted_loss)

    def rebind_mesh(self, mesh: DeviceMesh, shape: MeshShape, coords: MeshCoords) -> None:
        """:meth:`MeshEngine.rebind_mesh`, and the stage and schedule over the new pp
        group (this rank keeps its stage: worker/elastic/rings.py)."""
        if coords.pp != self.coords.pp:
            raise ValueError(f"pipeline stage {self.coords.pp} cannot move to stage {coords.pp}")
        super().rebind_mesh(mesh, shape, coords)
        self.pp_comm = Collectives(mesh["pp"].get_group())
        # the stages exchange their inventories again over the new pp group, as a
        # newcomer does: a view kept from before would leave it alone in the exchange
        self._whole = None
        self._build_schedule()

    @property
    def is_last(self) -> bool:
        return self.coords.pp == self.shape.pp - 1

    def _refuse(self, what: str) -> NoReturn:
        raise RuntimeError(
            f"engine.{what} on a pipeline stage: a stage's forward and backward run only "
            "inside the pipeline schedule; train with engine.train_batch(batches), which "
            "works under every layout"
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse("forward(...)")

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False) -> None:
        self._refuse("backward(...)")

    def step(self, *, samples: int = 0, tokens: int = 0) -> bool:
        self._refuse("step()")

    def set_micro_batches(self, counts: Sequence[int], global_batch: int) -> None:
        """The coming step's share of the global batch on this dp rank (an attached
        loader's micro-batches): the schedule runs them as one batch cut into
        ``ParallelConfig.microbatches``, weighted by their share of the global batch
        (worker/data/sampler.py [Note: uneven shares])."""
        if not counts or any(c < 0 for c in counts) or global_batch < max(1, sum(counts)):
            raise ValueError(
                f"set_micro_batches needs sample counts >= 0 within global_batch, got "
                f"{list(counts)!r} of {global_batch!r}"
            )
        self._share, self._counts = (sum(counts), global_batch), list(counts)

    def _weighted_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one micro-batch: the padding rows left out, the real
        ones weighed by their share of the global batch ([Note: pipeline micro-batches
        of equal shape])."""
        j = self._micro_index(target)
        real, scale = self._real[j], self._scales[j]
        if real == 0:
            self._losses[j] = torch.zeros((), device=output.device)
            return output.sum() * 0.0
        loss = self.loss_fn(output[:real], target[:real])
        self._losses[j] = loss.detach().float()
        # fp16: scaled as ZeroEngine.backward scales a loss (the step divides by it)
        return loss * (scale * self.state.scaler.scale)

    def _micro_index(self, target: torch.Tensor) -> int:
        """Which of this step's micro-batches ``target`` is: a view of the targets the
        schedule split (by its offset), or a copy of one (by its values; torch's
        first step also calls the loss on a copy of the first, to infer shapes)."""
        whole, rows = self._targets, self._width
        row = whole[0].numel()
        if target.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr():
            return (target.storage_offset() - whole.storage_offset()) // (row * rows)
        chunks = [whole[j * rows : (j + 1) * rows] for j in range(self.microbatches)]
        same = [j for j, c in enumerate(chunks) if torch.equal(c.to(target.device), target)]
        if not same:
            raise RuntimeError("the pipeline's loss got targets that are none of the step's")
        return next((j for j in same if j not in self._losses), same[0])

    def _cut(self, batches: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """This rank's samples as the schedule's input and targets, padded to
        ``microbatches`` equal micro-batches, and the rank's weight in the step."""
        share, self._share = self._share, None
        m = self.microbatches
        if share is not None and len(self._counts) == len(batches):
            # padding micro-batches stay out; an empty share runs one at weight 0
            kept = [b for b, c in zip(batches, self._counts, strict=True) if c] or [batches[0]]
            real, global_batch = share
            # the largest share of any dp rank sets the shape, the same on every rank
            width = math.ceil(math.ceil(global_batch / self.world_size) / m)
            weight = self.world_size * real / global_batch
        else:
            kept, real, weight = list(batches), -1, 1.0
        inputs = torch.cat([torch.as_tensor(b[0]) for b in kept])
        targets = torch.cat([torch.as_tensor(b[1]) for b in kept])
        rows = inputs.shape[0]
        if real < 0:
            real, width = rows, math.ceil(rows / m)
        real = min(real, rows)
        if width * m > rows:  # pad with copies of the first row, which count 0
            pad = width * m - rows
            inputs = torch.cat([inputs, inputs[:1].expand(pad, *inputs.shape[1:])])
            targets = torch.cat([targets, targets[:1].expand(pad, *targets.shape[1:])])
        self._real = [max(0, min(width, real - j * width)) for j in range(m)]
        self._targets, self._width = targets, width
        # sum_j scale_j * mean_j, divided by m in the schedule (at stage 2 here: the
        # schedule finds no .grad to divide, [Note: pipeline gradients into ZeRO]),
        # then summed over dp and divided by N: the mean over the global batch
        per = 1.0 if self.state.reducer.grads_in_place else 1.0 / m
        self._scales = [n * m * weight / real * per if real else 0.0 for n in self._real]
        self._losses = {}
        return inputs, targets, weight

    def train_batch(self, batches: Sequence[Any], loss_fn: LossFn | None = None) -> float | None:
        """One optimizer step on this dp rank's micro-batches ``batches`` (a list of
        ``(inputs, targets)``, as ``loader.current()`` returns them: they are joined
        and cut into ``ParallelConfig.microbatches`` for the schedule); every rank of
        the pipeline passes the same. Returns the step's mean loss over the global
        batch, on every rank. ``loss_fn``: the one the engine was built with."""
        if loss_fn is not None and loss_fn is not self.loss_fn:
            raise ValueError("a pipeline's loss_fn is fixed when it is built: pass it there")
        inputs, targets, weight = self._cut(batches)
        with self._peer_loss():  # the schedule's sends and receives are torch's
            if self.coords.pp == 0:
                self.schedule.step(inputs)
            elif self.is_last:
                self.schedule.step(target=targets)
            else:
                self.schedule.step()
        # [Note: pipeline gradients into ZeRO]
        zero = torch.stack([p.reshape(-1)[0] for p in self._trainable]).sum() * 0.0
        ZeroEngine.backward(self, zero)
        # the rank's mean loss replaces the zero's in the loss the step sums. The last
        # stage computed it; every stage takes it now, so that each stage's dp sum in
        # the step is the global loss. Now, not after the step: the step's boundary
        # may re-form the pipeline, and a broadcast on the new pp group would meet a
        # returning standby's schedule instead (#51)
        loss = torch.zeros((), dtype=torch.float64, device=self.state.device)
        if self.is_last:
            real = sum(self._real)
            rank_loss = sum(n * self._losses[j] for j, n in enumerate(self._real))
            loss += torch.as_tensor(rank_loss, dtype=torch.float64, device=loss.device) / max(
                real, 1
            )
        if self.shape.pp > 1:
            with self._peer_loss():
                self.pp_comm.broadcast(loss, src=self.shape.pp - 1)
        self.stats.replace_window_loss(loss, weight)
        ZeroEngine.step(self, samples=sum(self._real) if self.coords.pp == 0 else 0)
        self.state.trim_staging()
        return self.mean_loss()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """One optimizer step on this dp rank's batch ``(inputs, targets)``; returns
        the step's mean loss. Kept for scripts written before :meth:`train_batch`."""
        return self.train_batch([(inputs, targets)])

    def _checkpoint_view(self) -> FullView:
        """This stage's state, addressed by full parameter, as a state of the whole
        model: the inventory every stage holds, so that the manifest rank 0 writes
        lists them all and a checkpoint loads at any pp, tp, dp and stage
        ([Note: pipeline checkpoints])."""
        view = super()._checkpoint_view()
        if self.shape.pp == 1:
            return view
        if self._whole is None:  # once: the stages' inventories never change
            inv = view.inventory
            unsharded = [n for n, p in inv.params.items() if p not in view.bucket_of]
            unsharded += list(persistent_buffers(self.module))
            mine = {
                "specs": [dataclasses.asdict(spec) for spec in inv.specs],
                "aliases": inv.aliases,
                "unsharded": unsharded,
            }
            stages = [
                self._share_json(mine if k == self.coords.pp else None, k)
                for k in range(self.shape.pp)
            ]
            held = [n for stage in stages for n in stage["unsharded"]]
            specs = tuple(
                ParamSpec(**{**d, "shape": tuple(d["shape"])})
                for stage in stages
                for d in stage["specs"]
            )
            aliases = {a: n for stage in stages for a, n in stage["aliases"].items()}
            self._whole = (specs, aliases, held)
        specs, aliases, held = self._whole
        if held:
            # rank 0 alone writes what is not sharded, and it holds one stage's
            raise RuntimeError(
                "checkpoints of a pipeline whose stages hold frozen parameters or persistent "
                f"buffers are not supported yet ({held[0]!r})"
            )
        view.inventory = Inventory(specs, view.inventory.params, aliases, {})
        return view

    def save_pretrained(
        self, out: str | os.PathLike, *, merged: bool = False, **options: Any
    ) -> list[Path]:
        """The whole model's weights in the directory ``out`` as ``save_pretrained``
        writes them (``model.safetensors``, or shards and their index), fp32 masters
        cast to ``dtype`` if given; rank 0 writes; a collective over the mesh. Unlike
        a data- or tensor-parallel engine's export, which gathers one bucket at a
        time, this gathers the whole model on every rank first (:meth:`full_state_dict`):
        the stages' buckets are not on one rank to be walked in turn.
        :meth:`load_weights` (inherited) reads such a directory by range. ``options``:
        ``dtype`` and ``max_shard_bytes``, as :meth:`ZeroEngine.save_pretrained`'s;
        ``merged`` (PEFT adapters merged into their base) is not for a pipeline."""
        if merged:
            raise ValueError(
                "save_pretrained(merged=True) merges PEFT adapters, which a pipeline's "
                "stages do not hold as one model: save a checkpoint"
            )
        dtype: torch.dtype | None = options.pop("dtype", None)
        max_shard_bytes: int = options.pop("max_shard_bytes", DEFAULT_SHARD_BYTES)
        if options:
            raise TypeError(f"save_pretrained got unexpected options {sorted(options)}")
        whole = self.full_state_dict()
        directory = Path(out)
        writer = dist.get_rank() == 0
        if writer:
            directory.mkdir(parents=True, exist_ok=True)

        def cast(t: torch.Tensor) -> torch.Tensor:
            t = t.detach().cpu()
            return t.to(dtype) if dtype is not None and t.is_floating_point() else t

        size = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
        plan = [
            Planned(n, t.numel() * (size or t.element_size()), functools.partial(cast, t))
            for n, t in whole.items()
        ]
        metadata = {"format": "pt", "global_steps": str(self.global_steps)}
        files = write_safetensors_shards(
            plan, directory / "model.safetensors", metadata, max_shard_bytes, write=writer
        )
        config = self.model_config
        if writer and hasattr(config, "save_pretrained"):
            config.save_pretrained(directory)
        return files

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's full parameters by the model's names (fp32, gathered over dp
        and tp); a collective over the dp and tp groups."""
        return super().full_state_dict()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every full parameter of the whole model by name, fp32, on every rank: each
        stage's gathered over dp and tp, then sent to the other stages (one header of
        names and shapes and one flat tensor per stage); a collective over the mesh."""
        mine = self.state_dict()
        if self.shape.pp == 1:
            return mine
        whole: dict[str, torch.Tensor] = {}
        for stage in range(self.shape.pp):
            sending = stage == self.coords.pp
            sent = self._share_json(
                [[n, list(t.shape)] for n, t in mine.items()] if sending else None, stage
            )
            shapes = {n: tuple(shape) for n, shape in sent}
            flat = torch.empty(sum(math.prod(s) for s in shapes.values()), device=self.device)
            if sending:
                torch.cat([mine[n].reshape(-1).to(flat) for n in shapes], out=flat)
            self.pp_comm.broadcast(flat, src=stage)
            for (name, shape), piece in zip(
                shapes.items(), flat.split([math.prod(s) for s in shapes.values()]), strict=True
            ):
                whole[name] = piece.view(shape)
        return whole

    def _share_json(self, value: Any, src: int) -> Any:
        """``value`` (plain JSON data) of stage ``src``, on every stage: one length
        and one byte tensor over the pp group (no pickle between ranks)."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        if value is not None:
            raw = json.dumps(value).encode()
            size[0] = len(raw)
        self.pp_comm.broadcast(size, src=src)
        data = torch.zeros(int(size.item()), dtype=torch.uint8, device=self.device)
        if value is not None:
            data.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        self.pp_comm.broadcast(data, src=src)
        return json.loads(bytes(data.cpu().tolist()))
