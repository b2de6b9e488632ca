"""The ZeRO engine: the data path of one training step, for every stage.

    forward   (stage 3: gather each unit before its forward, free it after)
    backward  gradient hooks fill buckets; a full bucket starts its reduction
    step      clip or skip (fp16), the optimizer on this rank's fp32 partition,
              publish the updated parameters, zero the gradients

What differs between stages is which pieces the shard state was built with
(worker/stages.py: the gradient reducer and the parameter storage, one row
of ``STAGES`` per stage); this module drives them the same way for all.
Where the state lives and how it is rebuilt for another world is
worker/state.py; mixed precision is worker/precision.py; joining a
coordinator's job and following its membership is worker/elastic/session.py.

See ``coordinator/core/layout.py`` [Note: shard layout], ``worker/flat.py``
[Note: flat buffers] and ``worker/optim.py`` [Note: per-parameter shard views].
The backward's gradient hooks and the launch of buckets in order are
worker/grad_hooks.py ([Note: bucket order], [Note: graphs that grow during
backward]).

[Note: unused parameters]
A parameter that no rank used this step must behave as in torch.optim: no
update, state untouched. The used-parameter flags of each rank are known
before backward (the graph walk, worker/grad_hooks.py), OR-ed over micro-steps, and MAX
all-reduced once per optimizer step in the step-boundary ballot
(worker/ballot.py), overlapped with backward.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from coordinator.core.layout import Layout
from worker import accounting, checkpoint, live
from worker.activations import (
    SavedBytes,
    checkpoint_modules,
    choose_modules,
    unwrap,
    without_kv_cache,
)
from worker.ballot import Ballot, BoundaryVote
from worker.birth import Init, default_device, place_module
from worker.clipping import NormScope, clip_or_skip
from worker.collectives import CollectiveError, Collectives, Handle
from worker.compat import compile_disabled
from worker.compile_report import CompileReport, CompileWatch
from worker.config import ZeroConfig
from worker.engine_checkpoints import Checkpointing, guarded
from worker.flat import FlatBucket, GatherUnit
from worker.grad_hooks import GradHooks
from worker.inventory import Inventory, build_inventory
from worker.metrics import MetricsServer, Snapshot, SnapshotBoard, start_metrics
from worker.moe.shards import ExpertShards, dense_only
from worker.optim import ShardOptimizer
from worker.precision import LossScaler, MixedPrecision
from worker.schedule import LrSchedule, SchedulerArg, resolve_scheduler
from worker.state import ShardState
from worker.stats import StepStats
from worker.tiling import tile_mlps, tiled_loss_forward
from worker.whereabouts import during

if TYPE_CHECKING:  # (loaded with context parallelism: worker/factory.py)
    from worker.context import ContextParallel

__all__ = [
    "Membership",
    "NormScope",
    "OptimizerArg",
    "ZeroEngine",
    "build_inventory_for",
    "module_device",
    "resolve_optimizer",
]

logger = logging.getLogger(__name__)

OptimizerArg = torch.optim.Optimizer | Callable[[list[dict]], torch.optim.Optimizer]
# a loss of a model's output and the batch's targets (train_batch, pipelines)
LossFn = Callable[[Any, Any], torch.Tensor]


class Membership(Protocol):
    """What the engine asks of an elastic session (worker/elastic/session.py) at its seams."""

    def vote(self, engine: ZeroEngine) -> BoundaryVote:
        """This rank's membership proposal for the coming step boundary."""
        ...

    def log_gradients(
        self, engine: ZeroEngine, grads: list[torch.Tensor], used: list[int]
    ) -> Handle | None:
        """Before the optimizer step: start sending this step's final partition
        gradients to the neighbour that keeps this rank's replica; the engine waits
        on the handle before it steps (worker/live/replicas.py [Note: rolling a lost rank
        forward])."""
        ...

    def after_load(self, engine: ZeroEngine) -> None:
        """A checkpoint was just loaded on every rank: what was kept of the state
        before it (replicas, the gradient log) is of another history now."""
        ...

    def after_step(self, engine: ZeroEngine, agreed: BoundaryVote, stepped: bool) -> None:
        """The step is done on every rank; act on what the ranks agreed."""
        ...

    def recover(self, engine: ZeroEngine, exc: CollectiveError) -> NoReturn:
        """A collective failed: restore a consistent state, then raise StepAborted."""
        ...

    def generation_id(self) -> int: ...

    def replica_bytes(self) -> int: ...

    def close(self) -> None: ...


def _check_hpz(config: ZeroConfig, world: Collectives) -> None:
    """An engine's first world must be one hpZ and qgZ run in (a session's later
    worlds run without them where they cannot; worker/stages.py [Note: hierarchical
    partitioning], worker/compression.py [Note: hierarchical gradient
    reduce-scatter])."""
    for name in ("hpz_partition_size", "hierarchical_reduce"):
        k = getattr(config, name)
        if k > 1 and world.world_size % k:
            raise ValueError(
                f"ZeroConfig.{name} must divide the world size ({world.world_size} ranks), got {k}"
            )


def build_inventory_for(
    module: nn.Module,
    user_optimizer: torch.optim.Optimizer,
    config: ZeroConfig,
    keep: Callable[[nn.Parameter], bool] | None = None,
) -> Inventory:
    """The parameter inventory an engine with ``config`` builds for ``module``
    (of the parameters ``keep`` takes: every one but an expert-parallel model's
    experts, worker/moe/shards.py)."""
    if keep is None:
        keep = dense_only(module)
    return build_inventory(
        module,
        user_optimizer.param_groups,
        compute_dtype=MixedPrecision.from_config(config).param_dtype,
        min_unit_numel=config.stage3_min_unit_numel,
        keep=keep,
    )


class ZeroEngine(Checkpointing):
    """``module`` and ``optimizer`` under ZeRO ``config.stage`` over ``group``.

    ``initial_state``: ``"module"`` takes the module's values (rank 0's,
    broadcast); ``"peers"`` builds empty buffers for a transfer from the
    ranks that hold the state (a worker joining a running job; see
    :meth:`reconfigure` and worker/elastic/session.py). ``inventory``, ``align`` and
    ``metrics`` let a session pass what it prepared before the group existed;
    ``build_for`` builds the buffers for a rank of a group still to form
    (:meth:`Collectives.ahead`, bound with ``state.rebind`` once it has).
    ``device``: where to train (worker/birth.py :func:`place_module` when None).
    ``init``: how a module built on the meta device is initialized, ``init(module)``
    for each module in order (its ``reset_parameters()`` when None; worker/birth.py
    [Note: birth on the meta device]).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: OptimizerArg,
        *,
        config: ZeroConfig,
        group: dist.ProcessGroup | None = None,
        initial_state: Literal["module", "peers"] = "module",
        inventory: Inventory | None = None,
        align: int = 1,
        metrics: MetricsServer | None = None,
        lr_scheduler: SchedulerArg | None = None,
        build_for: Collectives | None = None,
        device: torch.device | str | None = None,
        init: Init | None = None,
        loss_fn: LossFn | None = None,
    ) -> None:
        if initial_state not in ("module", "peers"):
            raise ValueError(f"initial_state must be 'module' or 'peers', got {initial_state!r}")
        self.module = module
        self.config = config
        self.precision = MixedPrecision.from_config(config)
        self.user_optimizer = resolve_optimizer(module, optimizer)
        self.inventory = inventory or build_inventory_for(module, self.user_optimizer, config)
        # worker/birth.py: an explicit device, the launcher's GPU, or where the model is
        self.device = place_module(module, device)
        self.precision.cast_model(module)
        # [Note: activation checkpointing] in worker/activations.py
        self.checkpointed = choose_modules(
            module, self.inventory, getattr(config, "activation_checkpointing", "none")
        )
        checkpoint_modules(self.checkpointed)
        if self.checkpointed:  # [Note: no cache under recomputation]
            without_kv_cache(module)
        if config.tiled_mlp:  # worker/tiling.py [Note: tiles]
            tile_mlps(module, config.tiled_mlp)
        self.saved_activations = SavedBytes(
            self._parameter_storages, offload=config.offload_activations
        )
        self.state = ShardState(
            module,
            self.user_optimizer,
            self.inventory,
            config,
            dtype=self.precision.param_dtype,
            reduce_dtype=self.precision.reduce_dtype,
            device=self.device,
            align=align,
            init=init,
        )
        self.ballot = Ballot(len(self.state.index), self.device)
        self.membership: Membership | None = None
        self.stats = StepStats()
        self.last_grad_norm: float | None = None
        # what torch.compile made of the model from here on (worker/compile_report.py)
        self.compiled = CompileWatch()
        self.last_checkpoint: Path | None = None
        self._saved_at = -1  # the step of the last checkpoint saved or loaded
        self._extras: dict[str, checkpoint.Stateful] = {}  # saved with every checkpoint
        # stepped with the optimizer and kept at global_steps through every restore
        # (worker/schedule.py [Note: a scheduler that follows the step])
        self.lr_scheduler = resolve_scheduler(lr_scheduler, self.user_optimizer)
        self._schedule: LrSchedule | None = None
        if self.lr_scheduler is not None:
            self._schedule = LrSchedule(self.lr_scheduler, self.user_optimizer, step=0)
            self._extras["lr_scheduler"] = self._schedule
        # the weights of this step's micro-batches when they are not 1/accumulation
        # (set_micro_batches: shares of different sizes)
        self._micro_weights: list[float] | None = None
        self._micro_counts: list[int] = []
        # train_batch's loss of (output, targets), when the model does not return one
        self.loss_fn = loss_fn  # train_batch's, where the model returns no loss
        if initial_state == "peers":
            self.state.keep_module_values()
        world = build_for or Collectives(group)
        if build_for is None:
            _check_hpz(config, world)
        self.state.build(world, from_module=initial_state == "module")
        self._hooks = GradHooks(self.state, self.ballot, self.inventory.params.values())
        # an expert-parallel model's experts: their own state over their group
        # (worker/moe/shards.py [Note: two shard states])
        self.experts: ExpertShards | None = None
        # context parallelism: the cp groups and the batch split by sequence (set by
        # worker/factory.py; worker/context/parallel.py [Note: context parallelism])
        self.context: ContextParallel | None = None
        if dense_only(module) is not None:
            self.experts = ExpertShards.of(
                module, self.user_optimizer, config, precision=self.precision,
                device=self.device, from_module=initial_state == "module" and build_for is None,
            )  # fmt: skip
        # None unless config.metrics_port or $ZEROPLANE_METRICS_PORT asks for it
        self.board = SnapshotBoard() if metrics is None else metrics.board
        self.metrics = metrics if metrics is not None else start_metrics(config, self.board)
        self._memory = accounting.MemoryReadings()
        # metric labels of this rank's device-mesh position, and how the gradient
        # norm spans the model-parallel ranks (both set by worker/mesh.py)
        self.mesh_labels: dict[str, str] = {}
        self.norm_scope: NormScope | None = None
        self.publish_snapshot()

    # ------------------------------------------------------------ what the state holds

    @property
    def stage(self) -> int:
        return self.state.stage.number

    @property
    def comm(self) -> Collectives:
        return self.state.comm

    @property
    def rank(self) -> int:
        return self.state.rank

    @property
    def world_size(self) -> int:
        return self.state.world_size

    @property
    def data_rank(self) -> tuple[int, int]:
        """(this rank's index, the number of shares) of data parallelism: a step's global
        batch splits by these (the loaders and ``share_of`` do); the ranks of a
        context-parallel group share one."""
        cp = 1 if self.context is None else self.context.size
        return self.rank // cp, self.world_size // cp

    @property
    def layout(self) -> Layout:
        assert self.state.layout is not None
        return self.state.layout

    @property
    def buckets(self) -> list[FlatBucket]:
        return self.state.buckets

    @property
    def units(self) -> list[GatherUnit]:
        return self.state.units

    @property
    def optimizer(self) -> ShardOptimizer:
        return self.state.optimizer

    @property
    def scaler(self) -> LossScaler:
        return self.state.scaler

    @property
    def loss_scale(self) -> float:
        return self.state.scaler.scale

    def get_lr(self) -> list[float]:
        """The learning rate of each of the optimizer's param groups (as DeepSpeed's)."""
        return [group["lr"] for group in self.user_optimizer.param_groups]

    @property
    def global_steps(self) -> int:
        return self.state.global_steps

    def mean_loss(self) -> float | None:
        """The last optimizer step's loss averaged over every rank (each rank's mean
        over its micro-batches): what a job should log; None before the first step.

        Not a collective: the engine sums it over the ranks at each step, in an
        all-reduce of two numbers that overlaps the optimizer step, so any rank
        may ask at any time (rank 0 alone, every k steps).
        """
        return self.stats.mean_loss()

    def progress(self, *, total: int) -> None:
        """Say how many optimizer steps this job means to train for: the launcher's
        progress display (``zeroplane run``) shows step / total and an ETA. Sent to
        the coordinator with this rank's reports; no effect without one."""
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"engine.progress(total=...) must be an integer >= 1, got {total!r}")
        self.stats.total_steps = total

    @property
    def micro_steps(self) -> int:
        return self.state.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self.state.skipped_steps

    @property
    def control(self) -> Any:
        """The coordinator connection of this worker's session, if any."""
        return getattr(self.membership, "control", None)

    def layout_for(self, world_size: int) -> Layout:
        """The shard layout of this model at ``world_size`` ranks."""
        return self.state.layout_for(world_size)

    # ------------------------------------------------------------ forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    @guarded
    @during("forward")
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.stats.begin()
        if self.context is not None and "input_ids" in kwargs:  # a transformers call
            kwargs = self.context.prepare(kwargs)
        if self.precision.enabled:
            args, kwargs = tree_map(self.precision.cast_input, (args, kwargs))
        call: Callable[..., Any] = self.module
        if self.config.tiled_loss and "labels" in kwargs:  # [Note: tiles]
            call = functools.partial(tiled_loss_forward, self.module, self.config.tiled_loss)
        with (
            self.saved_activations.measuring(),
            self.state.params.forward_context() as mode,
            ExpertShards.forward_context_of(self.experts) as watching,
        ):
            if mode is not None or watching:
                # the first forward at stage 3 looks at every op's tensors, which
                # torch.compile cannot trace: it runs eager ([Note: compiling at stage 3])
                with compile_disabled():
                    return call(*args, **kwargs)
            return call(*args, **kwargs)

    def _parameter_storages(self) -> set[int]:
        """What autograd may save that is not an activation: parameters and buffers."""
        states = [self.state] if self.experts is None else [self.state, self.experts.state]
        tensors = [b.full for st in states for b in st.buckets]
        tensors += [*self.module.parameters(), *self.module.buffers()]
        return {t.untyped_storage()._cdata for t in tensors}

    @property
    def is_accumulation_boundary(self) -> bool:
        return self.state.at_boundary()

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def set_gradient_accumulation_steps(self, n: int) -> None:
        """The micro-batches each optimizer step accumulates from now on; only between
        optimizer steps. A loader attached to the engine sets it from the number of
        micro-batches it hands this rank, which changes with the world size when the
        global batch is constant ([Note: accumulation that follows the world])."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {n!r}")
        self._micro_weights = None
        if n == self.config.gradient_accumulation_steps:
            return
        if self.state.micro_in_step:
            raise RuntimeError(
                f"gradient_accumulation_steps changed to {n} after {self.state.micro_in_step} "
                f"of the step's {self.config.gradient_accumulation_steps} micro-batches: "
                "change it between optimizer steps"
            )
        self.config = self.state.config = self.config.replace(gradient_accumulation_steps=n)

    def set_micro_batches(self, counts: Sequence[int], global_batch: int) -> None:
        """The next optimizer step's micro-batches on this rank: ``counts[j]`` samples
        in the j-th (0 for a padding one), of a step of ``global_batch`` samples over
        all ranks. The engine accumulates ``len(counts)`` micro-batches and weighs the
        j-th by ``world_size * counts[j] / global_batch`` instead of ``1 / len(counts)``,
        so that shares of different sizes still make the mean over the global batch
        (worker/data/sampler.py [Note: uneven shares]). Only between optimizer steps;
        an attached loader calls it at every step."""
        if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 0
                             for c in counts):  # fmt: skip
            raise ValueError(
                f"set_micro_batches needs one sample count >= 0 per micro-batch, got {counts!r}"
            )
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) \
                or global_batch < max(1, sum(counts)):  # fmt: skip
            raise ValueError(
                f"global_batch must be an int >= the {sum(counts)} samples of this rank's "
                f"micro-batches (and >= 1), got {global_batch!r}"
            )
        self.set_gradient_accumulation_steps(len(counts))
        n = self.data_rank[1]
        self._micro_counts = list(counts)
        self._micro_weights = [n * c / global_batch for c in counts]

    def _micro_weight(self) -> float:
        """The weight of the micro-batch being trained: its share of the step."""
        if self._micro_weights is None:
            return 1.0 / self.config.gradient_accumulation_steps
        return self._micro_weights[self.state.micro_in_step]

    # ---------------------------------------------------- backward: hooks → buckets → reduce

    @guarded
    @during("backward")
    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False) -> None:
        """Backward of one micro-batch loss, with gradient reduction overlapped."""
        if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
            raise ValueError("engine.backward expects a loss tensor that requires grad")
        self.stats.begin()
        weight = self._micro_weight()
        self.stats.add_loss(loss, weight)
        st, hooks = self.state, self._hooks
        boundary = self.is_accumulation_boundary
        in_graph = hooks.walk(loss.grad_fn)
        if boundary and hooks.exact:
            self._cast_ballot()
        reduce_now = st.reducer.every_micro_step or boundary
        hooks.arm(in_graph, reduce_now=reduce_now)

        if self.experts is not None:
            self.experts.before_backward(loss.grad_fn, boundary=boundary, reduce_now=reduce_now)
        scale = st.scaler.scale * weight
        st.params.begin_backward()
        try:
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        except BaseException:
            st.params.end_backward()
            if self.experts is not None:
                self.experts.state.params.end_backward()
            raise

        if boundary and not hooks.exact:
            # worker/grad_hooks.py [Note: graphs that grow during backward]
            self._cast_ballot()
        if reduce_now:
            hooks.drain()
        st.params.end_backward()
        if self.experts is not None:
            self.experts.after_backward(reduce_now=reduce_now)

    def _cast_ballot(self) -> None:
        vote = self.membership.vote(self) if self.membership is not None else BoundaryVote()
        self.ballot.start(self.state.comm, vote)

    def train_batch(self, batches: Sequence[Any], loss_fn: LossFn | None = None) -> float | None:
        """One optimizer step on this rank's micro-batches ``batches`` (what
        ``loader.current()`` returns): the step a script writes once and runs under
        every layout, data, tensor or pipeline parallel (a pipeline stage trains
        only through it). Each micro-batch is the model's input: a tuple of its
        arguments, a dict of keyword arguments, or one tensor, and the model returns
        the loss (or an output with ``.loss``); with ``loss_fn`` (here, or given to
        ``worker.initialize``) a micro-batch is ``(inputs, targets)`` and its loss
        ``loss_fn(model(inputs), targets)`` (of a Hugging Face model's output, its
        ``.logits``, as a pipeline's last stage gives them, so one ``loss_fn`` serves
        every layout). Returns the step's mean loss over the global batch
        (:meth:`mean_loss`), on every rank."""
        if not batches:
            raise ValueError("train_batch needs at least one micro-batch")
        if self._micro_weights is None:
            self.set_gradient_accumulation_steps(len(batches))
        elif len(batches) != len(self._micro_weights):
            raise ValueError(
                f"train_batch got {len(batches)} micro-batches, set_micro_batches said "
                f"{len(self._micro_weights)}"
            )
        loss_fn = loss_fn or self.loss_fn
        for batch in batches:
            if loss_fn is not None and self.context is not None:
                loss = self._sequence_shard_loss(loss_fn, *batch)
            elif loss_fn is not None:
                inputs, targets = batch
                loss = loss_fn(_logits(self(inputs)), targets)
            elif isinstance(batch, Mapping):
                loss = self(**batch)
            else:
                loss = self(*batch) if isinstance(batch, tuple | list) else self(batch)
            self.backward(getattr(loss, "loss", loss))
            self.step(**_sizes(batch))
        return self.mean_loss()

    def _sequence_shard_loss(self, loss_fn: LossFn, inputs: Any, targets: Any) -> torch.Tensor:
        """Under context parallelism, ``loss_fn`` of this rank's shard of the sequence:
        the token ids go in as a Hugging Face causal LM takes them (split by
        :meth:`ContextParallel.prepare`), the targets split the same way. Each rank's
        loss is the mean over its shard, so the step's is the mean over every token
        where the shards count as many tokens each (``lm_loss``, no ignored targets)."""
        if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
            raise ValueError(
                "under context parallelism train_batch's micro-batch is (token ids, targets), "
                "two tensors of batch x sequence"
            )
        assert self.context is not None
        logits = _logits(self(input_ids=inputs))
        assert self.context.batch is not None
        index = self.context.batch.index.to(targets.device)
        return loss_fn(logits, targets.index_select(1, index))

    # ---------------------------------------------------- step: clip → optimizer → publish

    @guarded
    @during("step")
    def step(self, *, samples: int = 0, tokens: int = 0) -> bool:
        """Count a micro-step; at the accumulation boundary, step the optimizer.

        Returns True when the optimizer stepped (False between boundaries and
        on an fp16 overflow, which skips the step). ``samples`` and ``tokens``:
        what this rank's micro-batch held, for the throughput metrics.
        """
        st = self.state
        if self._micro_weights is not None and not self._micro_counts[st.micro_in_step]:
            samples = tokens = 0  # a padding micro-batch: no sample of the step
        self.stats.record(samples, tokens)
        boundary = self.is_accumulation_boundary
        st.micro_steps += 1
        if not boundary:
            st.micro_in_step += 1
            return False
        st.micro_in_step = 0
        self.ballot.wait()
        grads = [_fp32(st.reducer.partition_grad(b)) for b in st.buckets]
        factor = 1.0 / (st.world_size * st.scaler.scale)
        for g in grads:
            g.mul_(factor)
        experts = self.experts
        expert_grads = [] if experts is None else experts.partition_grads(factor)
        stepped, norm = clip_or_skip(grads, st, self.config, self.norm_scope, experts, expert_grads)
        if norm is not None:
            self.last_grad_norm = norm
        if not stepped:
            logger.info("fp16 gradient overflow: step skipped, loss scale now %g", st.scaler.scale)
        used = self.ballot.used() if stepped else []
        logged: Handle | None = None
        if stepped and self.membership is not None:
            # the right neighbour's copy, for a recovery that rolls this rank forward
            logged = self.membership.log_gradients(self, grads, used)
        if logged is not None:
            logged.wait()
        # the step's loss summed over the ranks, overlapping the optimizer step; with
        # the log, it is also the step's go: no rank steps before every rank's log is
        # delivered (worker/live/replicas.py [Note: rolling a lost rank forward])
        loss_pair = self.stats.close_window_loss(st.device)
        loss_sum = st.comm.all_reduce(loss_pair, async_op=True, control=True)
        if logged is not None:
            loss_sum.wait()
        if stepped:
            piece_grads = st.optimizer.piece_grads(grads, used)
            # from here until the step is whole, a lost peer leaves this state torn
            st.whole = False
            failed = st.step_and_publish(piece_grads)
            if experts is not None:
                experts.step(expert_grads)
            st.global_steps += 1
            st.whole = True
            if self._schedule is not None:
                self._schedule.step()
            self.compiled.poll()
            if failed is not None:  # stepped, not published: whole, for the recovery
                raise failed
        else:
            st.skipped_steps += 1
        agreed = self.ballot.agreed()
        loss_sum.wait()
        self.stats.global_loss = loss_pair
        st.zero_grads()
        self.ballot.clear()
        if experts is not None:
            experts.finish_step()
        self.stats.end_step()
        if self.membership is not None:
            self.membership.after_step(self, agreed, stepped)
        self.publish_snapshot()
        return stepped

    # ------------------------------------------------------------ reports

    @contextlib.contextmanager
    def gathered_params(self) -> Iterator[None]:
        """Every parameter's full compute values on every rank for the duration, as
        FSDP's ``summon_full_params``: at stage 3 its parameters are gathered on entry
        (a collective: every rank enters) and freed on exit; at stages 0-2 they are
        always whole and this does nothing. Read-only: writes are not kept, and a
        tensor that views a parameter is freed with it (clone what you keep). Under
        expert parallelism, the experts this rank holds too (gathered over the ranks
        holding the same experts)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.state.params.gathered())
            if self.experts is not None:
                stack.enter_context(self.experts.state.params.gathered())
            yield

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter by name (tied ones under each name), fp32 master values
        where they exist; identical on every rank. A collective: call on all ranks."""
        full = self.state.full_state_dict()
        if self.experts is not None:
            full.update(self.experts.full_state_dict())
        return full

    def compile_report(self) -> CompileReport:
        """The graphs ``torch.compile`` captured since this engine was built, and its
        graph breaks by reason (worker/compile_report.py [Note: the compile report])."""
        return self.compiled.report()

    def memory_report(self) -> dict[str, int]:
        """Bytes of model state this rank holds, by kind (padding included)."""
        return accounting.memory_report(
            self.state,
            replica=self._replica_bytes(),
            activations=self.saved_activations.last,
            also=[] if self.experts is None else [self.experts.state],
        )

    def memory_by_location(self) -> dict[str, dict[str, int]]:
        """:meth:`memory_report`'s model-state bytes split by where they live,
        ``{"device": {kind: bytes}, "host": {kind: bytes}}`` (host: what
        ``offload_optimizer`` / ``offload_params`` put in host memory, see
        worker/offload.py); each side has a ``total``."""
        return accounting.memory_by_location(
            self.state,
            replica=self._replica_bytes(),
            also=[] if self.experts is None else [self.experts.state],
        )

    def _replica_bytes(self) -> int:
        return 0 if self.membership is None else self.membership.replica_bytes()

    def comm_report(self, *, by_group: bool = False) -> dict[str, dict[str, Any]]:
        """Collective calls and logical bytes by op since start (see worker.collectives),
        over every group the engine uses. ``by_group``: ``{scope: {op: ...}}`` instead,
        the scopes of ``ShardState.comm_groups`` (``world``; ``node`` for hpZ's and
        qgZ's node groups, whose bytes never cross nodes; ``cross`` for qgZ's
        cross-node groups, whose payloads do; ``experts`` and ``ep``, an expert-parallel
        engine's groups, worker/moe/shards.py)."""
        return accounting.comm_report(self.state, by_group=by_group, experts=self.experts)

    def snapshot(self) -> Snapshot:
        """What this rank's metrics show now (worker/metrics.py)."""
        memory, host = self._memory.read(
            self.state.builds, lambda: (self.memory_report(), self.memory_by_location()["host"])
        )
        return accounting.snapshot(
            self.state,
            self.stats,
            memory=memory,
            memory_host=host,
            generation=0 if self.membership is None else self.membership.generation_id(),
            device=self.device,
            config=self.config,
            mesh=self.mesh_labels,
            experts=self.experts,
        )

    def publish_snapshot(self) -> None:
        """Hand the metrics endpoint (if any) this rank's state as of now."""
        if self.board.watched:
            self.board.publish(self.snapshot())

    # ------------------------------------------------------------ membership without a coordinator

    def reconfigure(
        self,
        new_group: dist.ProcessGroup | None,
        *,
        via: dist.ProcessGroup | None,
        new_members: list[int],
        holds_state: bool = True,
    ) -> None:
        """Re-shard live onto ``new_group`` without a restart (a collective over ``via``).

        Every rank of ``via`` calls this at the same step boundary: the old
        members (``holds_state``), the new members (``new_members``, ranks
        of ``via`` in new-rank order; a newcomer built its engine with
        ``initial_state="peers"`` and passes ``holds_state=False``) and any
        leaving ranks (not in ``new_members``; their engine ends detached). See
        worker/live/exchange.py [Note: live reshard]. With a coordinator, the session
        does this by itself when the coordinator changes the membership.
        """
        if self.state.micro_in_step:
            raise RuntimeError("reconfigure() must be called at an accumulation boundary")
        if self.experts is not None or self.context is not None:
            raise RuntimeError(
                "reconfigure() of an expert- or context-parallel engine: its groups are "
                "re-formed by the elastic session (zeroplane run); a script's own groups "
                "save a checkpoint and load it at the new size (it loads at any size)"
            )
        for name, what in (("hpz_partition_size", "hpZ"), ("hierarchical_reduce", "qgZ")):
            k = getattr(self.config, name)
            if k > 1 and new_group not in (None, dist.group.WORLD):
                raise ValueError(
                    f"ZeroConfig.{name}={k}: engine.reconfigure() onto a new group cannot "
                    f"form {what}'s node groups, which are made from the default process "
                    "group (the coordinator's sessions re-form that one); nothing was "
                    f"moved. Use {name}=1 to reconfigure onto subgroups"
                )
        handover = live.exchange(
            self.state, holds_state=holds_state, via=via, new_members=new_members
        )
        if new_group is None and Collectives(via).rank not in new_members:
            self.state.release()
            return
        self.adopt(handover, Collectives(new_group))

    def adopt(self, handover: live.Handover, comm: Collectives | None) -> None:
        """Take this rank's state from a hand-over: rebuilt for ``comm``'s world, or
        (``None``) into the buffers already built for it (a newcomer's)."""
        live.adopt(self.state, handover, comm)
        self.ballot.clear()
        self.after_restore()

    # ------------------------------------------------------------ module passthrough

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        return self.train(False)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def close(self) -> None:
        """Leave the coordinator's job (if any), stop serving metrics and unhook the
        model; the engine must not be used after."""
        self._hooks.remove()
        unwrap(self.checkpointed)
        self.state.params.detach()
        if self.experts is not None:
            self.experts.close()
        if self.context is not None:
            self.context.close()
        if self.membership is not None:
            self.membership.close()
            self.membership = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


def _fp32(g: torch.Tensor) -> torch.Tensor:
    return g if g.dtype == torch.float32 else g.float()


def _logits(output: Any) -> Any:
    """A model output as ``loss_fn`` takes it: a Hugging Face ``ModelOutput``'s logits,
    anything else as it is."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    return output if logits is None else logits


def _sizes(batch: Any) -> dict[str, int]:
    """A micro-batch's samples (its first tensor's rows) and tokens (that tensor's
    elements, when it holds token ids), for the throughput metrics."""
    first = next((t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        return {}
    tokens = first.numel() if not first.is_floating_point() else 0
    return {"samples": first.shape[0], "tokens": tokens}


def module_device(module: nn.Module) -> torch.device:
    """Where ``module``'s parameters are; for a model built on the meta device, where
    it will come to life (worker/birth.py :func:`default_device`)."""
    devices = {p.device for p in module.parameters() if not p.is_meta}
    if len(devices) > 1:
        raise ValueError(
            f"the model's parameters are on several devices: {sorted(map(str, devices))}"
        )
    if devices:
        return devices.pop()
    return default_device() if any(True for _ in module.parameters()) else torch.device("cpu")


def resolve_optimizer(module: nn.Module, optimizer: OptimizerArg) -> torch.optim.Optimizer:
    """The user's optimizer, built from a factory if one was given; never one with state."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError(
                "the optimizer already has state; pass one that has not stepped yet "
                "(zeroplane rebuilds its state on shards)"
            )
        return optimizer
    if callable(optimizer):
        params = [p for p in dict.fromkeys(module.parameters()) if p.requires_grad]
        built = optimizer([{"params": params}])
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(
                f"the optimizer factory returned {type(built).__name__}, "
                "not a torch.optim.Optimizer"
            )
        return built
    raise TypeError(
        f"optimizer must be a torch.optim.Optimizer or a callable, got {type(optimizer).__name__}"
    )
