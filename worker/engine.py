"""The ZeRO engine: stages 0–3 as compositions of three pieces.

* parameter storage: replicated flat buffers (stages 0–2) or sharded with
  per-unit gather and release (stage 3);
* gradient reduction: all-reduce into replicated buffers (stage 0),
  reduce-scatter of persistent full buffers (stage 1), or reduce-scatter of
  transient staging buffers into persistent shards (stages 2–3);
* the optimizer on this rank's partition of fp32 master weights: the whole
  model at stage 0, one ``1/N`` range of every bucket at stages 1–3,
  followed by an all-gather of the updated range at stages 1–2.

See ``coordinator/layout.py`` [Note: shard layout], ``worker/flat.py``
[Note: flat buffers] and ``worker/optim.py`` [Note: per-parameter shard views].

[Note: bucket order]
Collectives must be issued in the same order on every rank, but which
parameters get gradients, and when, can differ by rank. Buckets are
therefore launched strictly in index order: a bucket whose gradients are
complete waits for every bucket before it. Parameters that are not in this
micro-step's autograd graph are known before backward starts (a walk over
``loss.grad_fn``) and count as complete from the start.

[Note: unused parameters]
A parameter that no rank used this step must behave as in torch.optim: no
update, state untouched. The used-parameter bitmap of each rank is known
before backward (the graph walk above), OR-ed over micro-steps, and MAX
all-reduced once per optimizer step (a few bytes, overlapped with backward).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from coordinator.layout import Layout, compute_layout
from worker import checkpoint, elastic
from worker.collectives import Collectives, Handle
from worker.compression import Codec, make_codec, start_all_gather, start_reduce_scatter
from worker.config import ZeroConfig
from worker.control import ControlPlane, LeftBeforeAdmission, coordinator_address
from worker.flat import FlatBucket, GatherUnit
from worker.inventory import Inventory, build_inventory
from worker.metrics import MetricsServer, start_metrics
from worker.optim import LossScaler, Piece, ShardOptimizer
from worker.stats import StepStats

__all__ = ["StepAborted", "ZeroEngine", "initialize"]

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

OptimizerArg = torch.optim.Optimizer | Callable[[list[dict]], torch.optim.Optimizer]


class StepAborted(RuntimeError):
    """A peer was lost mid-step. The engine has re-formed the job and rolled back to
    ``engine.global_steps``: carry on with the training loop from that step."""


class _PeerLost(RuntimeError):
    pass


_COLLECTIVE_FAILURE = ("gloo", "NCCL", "Connection closed", "Connection reset", "imed out")


def _collective_failed(exc: BaseException) -> bool:
    if isinstance(exc, _PeerLost | dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(k in str(exc) for k in _COLLECTIVE_FAILURE)


def _recovering(method):
    """With a coordinator, turn a failed collective into recovery plus StepAborted."""

    @functools.wraps(method)
    def wrapper(self: ZeroEngine, *args: Any, **kwargs: Any) -> Any:
        if self.control is None:
            return method(self, *args, **kwargs)
        try:
            return method(self, *args, **kwargs)
        except (RuntimeError, _PeerLost) as exc:
            if not _collective_failed(exc) or isinstance(exc, StepAborted):
                raise
            self._recover(exc)
            raise StepAborted(
                f"step abandoned after a lost peer; resume at step {self.global_steps}"
            ) from exc

    return wrapper


def initialize(
    model: nn.Module,
    optimizer: OptimizerArg,
    *,
    config: ZeroConfig | None = None,
    group: dist.ProcessGroup | None = None,
    coordinator: str | None = None,
) -> ZeroEngine:
    """Wrap ``model`` and ``optimizer`` in a ZeRO engine over ``group``.

    ``model`` must be identical on every rank (rank 0's values are broadcast
    regardless). ``optimizer`` is an optimizer over the model's parameters with
    no state yet, or a callable that takes param groups and returns one.

    With a coordinator (``coordinator="host:port"`` or ``$ZEROPLANE_COORDINATOR``)
    and torch.distributed not yet initialized, the worker registers, is given
    a rank, and forms the process group itself; the coordinator's stage and
    layout apply. Otherwise torch.distributed must be initialized already (as
    under torchrun), or not at all for one process.
    """
    config = config or ZeroConfig()
    address = coordinator_address(coordinator)
    if address is None or group is not None or (dist.is_available() and dist.is_initialized()):
        return ZeroEngine(model, optimizer, config=config, group=group)
    engine = ZeroEngine(model, optimizer, config=config, joining=True)
    engine._join_control_plane(address)
    return engine


class ZeroEngine:
    def __init__(
        self,
        module: nn.Module,
        optimizer: OptimizerArg,
        *,
        config: ZeroConfig,
        group: dist.ProcessGroup | None = None,
        joining: bool = False,
    ) -> None:
        self.module = module
        self.config = config
        self.stage = config.stage
        self.dtype = _TORCH_DTYPES[config.dtype]
        self.reduce_dtype = _TORCH_DTYPES[config.reduce_dtype or config.dtype]
        self.user_optimizer = _resolve_optimizer(module, optimizer)
        self.inventory: Inventory = build_inventory(
            module,
            self.user_optimizer.param_groups,
            compute_dtype=self.dtype,
            min_unit_numel=config.stage3_min_unit_numel,
        )
        self._index = {name: i for i, name in enumerate(self.inventory.trainable)}
        self.scaler = LossScaler(
            scale=(config.loss_scale or 2.0**config.initial_scale_power)
            if config.dtype == "fp16"
            else 1.0,
            dynamic=config.dtype == "fp16" and config.loss_scale == 0,
            window=config.loss_scale_window,
            hysteresis=config.hysteresis,
            min_scale=config.min_loss_scale,
        )
        self.grad_codec = make_codec(config.compression, config.compression_block)
        self.device = _module_device(module)
        # one flag per trainable parameter, then two control slots that ride on the
        # same all-reduce: the newest generation id any rank knows of, and 1 + the
        # rank of a worker asking to leave (see [Note: membership changes])
        self._used = torch.zeros(len(self._index) + 2, dtype=torch.int32, device=self.device)
        self._used_handle: Handle | None = None
        self._next_bucket = 0
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        # read by the metrics exporter at scrape time (worker/metrics.py)
        self.stats = StepStats()
        self._module_hooks: list = []
        self._align = 1
        self.control: ControlPlane | None = None
        self._leave_requested = False
        self.last_checkpoint: Path | None = None
        self._replica: elastic.Replica | None = None
        # whose state this engine's shards are, while whole ([Note: recovery sources])
        self._live: elastic.StateId | None = None
        self._saved_at = -1  # the step of the last checkpoint saved or loaded
        self.units: list[GatherUnit] = []
        self.buckets: list[FlatBucket] = []
        self._bucket_of: dict[nn.Parameter, tuple[FlatBucket, int]] = {}

        self._cast_frozen_and_buffers()
        if not joining:
            self._attach(Collectives(group), from_module=True)
        self._grad_hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
            for p in self.inventory.params.values()
            if p.requires_grad
        ]
        # None unless config.metrics_port or $ZEROPLANE_METRICS_PORT asks for it
        self.metrics: MetricsServer | None = start_metrics(self)

    def _attach(self, comm: Collectives, *, from_module: bool) -> None:
        """Build this rank's buffers, optimizer and hooks for ``comm``'s world.

        ``from_module``: take values from the module's parameters (after a
        broadcast from rank 0); otherwise start from zeros, for state that a
        transfer or a checkpoint then fills in.
        """
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        if self.world_size == 1 and self.stage > 0:
            logger.warning(
                "ZeRO stage %d on a single rank saves no memory and costs time; "
                "stage 0 with mixed precision or activation checkpointing is the lever here",
                self.stage,
            )
        if from_module:
            self._sync_module_states()
        self.layout: Layout = self.layout_for(self.world_size)
        self.buckets = [self._build_bucket(spec, from_module) for spec in self.layout.buckets]
        self._bucket_of = {p: (b, pos) for b in self.buckets for pos, p in enumerate(b.params)}

        pieces: list[list[Piece]] = [[] for _ in self.user_optimizer.param_groups]
        for b in self.buckets:
            for piece in b.pieces:
                view = b.master[piece.shard_start : piece.shard_start + piece.numel]
                pieces[b.spec.group].append(
                    Piece(
                        param_index=self._index[piece.slot.name],
                        view=view,
                        bucket=b.spec.index,
                        grad_offset=piece.shard_start,
                        name=piece.slot.name,
                        param_start=piece.param_start,
                    )
                )
        self.optimizer = ShardOptimizer(self.user_optimizer, pieces)
        if self.stage == 3:
            self._build_units()

    def _join_control_plane(self, address: str) -> None:
        if threading.current_thread() is threading.main_thread():
            # before registering: a SIGTERM while joining (a pod deleted as it
            # starts) is then a graceful leave at the first step boundary
            signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            control = ControlPlane.join(
                address,
                self.inventory,
                device=self.device,
                metrics_port=None if self.metrics is None else self.metrics.port,
                stop=lambda: self._leave_requested,
            )
        except LeftBeforeAdmission:
            logger.info("SIGTERM before this worker was given a rank: left the job")
            self.close()
            raise SystemExit(0) from None
        gen = control.generation
        changes: dict[str, Any] = {"bucket_numel": gen.bucket_numel}
        if gen.stage != self.stage:
            logger.info("stage %d (coordinator: %s)", gen.stage, gen.stage_reason or "planned")
            changes["stage"] = gen.stage
            if gen.stage != 3:
                changes["stage3_gather_compression"] = "none"
        self.config = self.config.replace(**changes)
        self.stage, self._align = gen.stage, gen.align
        control.init_process_group()
        self.control = control
        me = gen.member(control.client.worker_id)
        if gen.reshard is not None and gen.reshard.lost_ranks and me.previous_rank is None:
            # joining in the generation that replaces a lost rank (e.g. a restarted pod
            # under its old name): roll back with the survivors, holding nothing
            self._restore_after_loss(
                gen,
                gen.reshard.from_generation_id,
                gen.reshard.from_world_size,
                holds_state=False,
            )
        elif gen.reshard is not None and me is not None and me.previous_rank is None:
            # joining a running job: the members hand this rank its shards
            handover = elastic.exchange(
                self, holds_state=False, via=None, new_members=list(range(gen.world_size))
            )
            self._adopt(handover)
            logger.info("joined at step %d as rank %d", self.global_steps, self.rank)
        else:
            self._attach(Collectives(None), from_module=True)
        if self.layout != gen.layout:
            raise RuntimeError(
                "the coordinator's bucket layout differs from this worker's: "
                "are all workers running the same model and zeroplane version?"
            )
        self._mark_live()
        control.report(self.memory_report(), self.global_steps)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        logger.info("SIGTERM: handing this rank's shards over at the next step boundary")
        self._leave_requested = True

    # [Note: membership changes]
    # Every rank must change membership at the same step boundary, so the
    # decision rides on the used-parameter all-reduce of each optimizer step:
    # its two last slots carry the newest generation id any rank has heard of
    # and the rank (plus one) of a worker that got SIGTERM. After the step:
    # * a leaving rank: all ranks hand its shards to the survivors over the
    #   current group (it is still alive), then it tells the coordinator it
    #   leaves and exits 0; the survivors form the generation without it;
    # * a newer generation with newcomers: the members form the new group at
    #   its rendezvous and move shards to the newcomers over it;
    # * a collective that fails (a peer died): the step is abandoned, the
    #   survivors wait for the coordinator's generation without the dead rank
    #   (its lease expires), form it, and roll back to the last checkpoint.
    #   ``StepAborted`` tells the training loop to carry on from
    #   ``engine.global_steps``.

    def _follow_membership(self, target: int, leaving: int) -> None:
        control = self.control
        assert control is not None
        start = time.perf_counter()
        if leaving >= 0:
            self._hand_over_and_maybe_leave(leaving)
            self.stats.record_pause("scale_down", time.perf_counter() - start)
        elif target > control.generation.id:
            gen = control.wait_newer()
            while gen.id < target:
                control.generation, gen = gen, control.wait_newer()
            self._grow_to(gen)
            self.stats.record_pause("scale_up", time.perf_counter() - start)

    def _hand_over_and_maybe_leave(self, leaving: int) -> None:
        control = self.control
        survivors = [r for r in range(self.world_size) if r != leaving]
        handover = elastic.exchange(self, holds_state=True, via=None, new_members=survivors)
        if self.rank == leaving:
            self._detach()
            dist.destroy_process_group()
            control.close(leave=True)
            self.control = None
            logger.info("handed over at step %d; leaving", handover.global_steps)
            raise SystemExit(0)
        old = control.generation
        gen = control.wait_to_re_form()
        survivor_ids = [m.worker_id for m in old.members if m.rank != leaving]
        others_lost = gen.reshard is not None and set(gen.reshard.lost_ranks) - {leaving}
        if others_lost or [m.worker_id for m in gen.members[: len(survivor_ids)]] != survivor_ids:
            # another member vanished meanwhile: recover like a crash
            raise _PeerLost(
                f"generation {gen.id} lost more of generation {old.id} than rank {leaving}"
            )
        control.move_to(gen)
        if gen.world_size > len(survivor_ids):
            # workers admitted in the same generation: pass them their shards of what
            # the survivors were just handed (they run the join exchange)
            handover = elastic.exchange(
                self,
                holds_state=True,
                via=None,
                new_members=list(range(gen.world_size)),
                entries=handover.entries,
                counters=(handover.global_steps, handover.loss_scale, handover.skipped_steps),
            )
        self._adopt(handover)
        logger.info("rank %d left; now rank %d of %d", leaving, self.rank, self.world_size)

    def _grow_to(self, gen) -> None:
        control = self.control
        old = control.generation
        old_ids = [m.worker_id for m in old.members]
        lost = gen.reshard is not None and (gen.reshard.lost_ranks or gen.reshard.left_ranks)
        if lost or [m.worker_id for m in gen.members[: len(old_ids)]] != old_ids:
            # a member vanished without a graceful hand-over: recover like a crash
            raise _PeerLost(f"generation {gen.id} lost members of generation {old.id}")
        control.move_to(gen)
        # exchange() exports from the old layout and rank, which this engine still holds
        handover = elastic.exchange(
            self, holds_state=True, via=None, new_members=list(range(gen.world_size))
        )
        self._adopt(handover)
        logger.info("grew to %d ranks at step %d", self.world_size, self.global_steps)

    def _recover(self, exc: BaseException) -> None:
        """A peer is gone: form the coordinator's next generation and roll back."""
        control = self.control
        assert control is not None
        logger.warning("step abandoned (%s); waiting for the coordinator's next generation", exc)
        start = time.perf_counter()
        old = control.generation
        gen = control.wait_to_re_form()
        control.move_to(gen, broken=True)
        # the generation the loss happened in: this rank may not have formed it yet
        from_id, from_world = (
            (gen.reshard.from_generation_id, gen.reshard.from_world_size)
            if gen.reshard is not None
            else (old.id, old.world_size)
        )
        self._restore_after_loss(gen, from_id, from_world, holds_state=True)
        self.stats.record_pause("crash", time.perf_counter() - start)

    def _restore_after_loss(self, gen, old_id: int, old_world: int, *, holds_state: bool) -> None:
        """Bring every rank of ``gen`` to one consistent state after a loss, from the
        best source the group holds (see worker/elastic.py [Note: recovery
        sources]). A collective of the new group; a worker that joins in the same
        generation (a restarted pod under its old name) takes part holding
        nothing (``holds_state=False``)."""
        replica, self._replica = (self._replica if holds_state else None), None
        live = self._live if holds_state else None
        # a rank that left without handing over (its script failed) is gone too
        lost = set() if gen.reshard is None else {*gen.reshard.lost_ranks, *gen.reshard.left_ranks}
        mine = elastic.Holding(
            live=live,
            replica=None
            if replica is None
            else (replica.generation, replica.rank, replica.world_size),
            holds_state=holds_state,
            checkpoint=None if self.last_checkpoint is None else str(self.last_checkpoint),
        )
        table = torch.zeros(gen.world_size, mine.WIDTH, dtype=torch.int64, device=self.device)
        table[self.control.rank] = mine.encode()
        Collectives(None).all_reduce(table, op="sum", control=True)
        plan = elastic.plan_restore(
            [elastic.Holding.decode(row) for row in table.cpu()],
            lost_from=old_id,
            lost_world=old_world,
            lost=lost,
        )
        if plan.source == "live":
            sends = live is not None and live[0] == plan.generation
            handover = elastic.exchange(
                self,
                holds_state=sends,
                via=None,
                new_members=list(range(gen.world_size)),
                entries=None if sends else {},
            )
            self._adopt(handover)
            source = "live state, nothing rolled back"
        elif plan.source == "replica":
            entries: dict = {}
            if replica is not None:
                entries = dict(replica.own)
                if replica.neighbour_rank in lost:
                    entries.update(replica.neighbour)
            handover = elastic.exchange(
                self,
                holds_state=holds_state,
                via=None,
                new_members=list(range(gen.world_size)),
                entries=entries,
                counters=None if replica is None else replica.counters,
            )
            self._adopt(handover)
            source = "in-memory replicas"
        else:
            checkpoint_dir = Path(plan.checkpoint)
            self._live = None  # torn from here until the checkpoint is in
            self._detach()
            self._attach(Collectives(None), from_module=False)
            self.load_checkpoint(checkpoint_dir)
            self.last_checkpoint = checkpoint_dir
            source = str(checkpoint_dir)
        self._used_handle = None
        self._saved_at = self.global_steps  # the rollback point is not saved again
        logger.warning(
            "recovered as rank %d of %d at step %d (from %s)",
            self.rank,
            self.world_size,
            self.global_steps,
            source,
        )

    def _adopt(self, handover: elastic.Handover) -> None:
        self._live = None  # torn while the buffers are rebuilt
        elastic.adopt(self, handover, None)
        self._mark_live()

    def _mark_live(self) -> None:
        """The engine's shards are whole and at a step boundary of the applied
        generation: after a loss they can be the recovery source."""
        gen = None if self.control is None else self.control.generation.id
        self._live = None if gen is None else (gen, self.rank, self.world_size)

    def close(self) -> None:
        """Leave the coordinator's job (if any); the engine must not be used after."""
        if self.control is not None:
            self.control.close(leave=True)
            self.control = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def _detach(self) -> None:
        """Drop this rank's buffers and hooks (before re-attaching to another world)."""
        for handle in self._module_hooks:
            handle.remove()
        self._module_hooks.clear()
        self.units, self.buckets, self._bucket_of = [], [], {}
        self.optimizer = ShardOptimizer(
            self.user_optimizer, [[] for _ in self.user_optimizer.param_groups]
        )

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
        ``joining=True`` and passes ``holds_state=False``) and any leaving
        ranks (not in ``new_members``; their engine ends detached). See
        worker/elastic.py [Note: live reshard]. With a coordinator, the engine
        does this by itself when the coordinator changes the membership.
        """
        if self.micro_steps % self.config.gradient_accumulation_steps:
            raise RuntimeError("reconfigure() must be called at an accumulation boundary")
        handover = elastic.exchange(self, holds_state=holds_state, via=via, new_members=new_members)
        if new_group is None and Collectives(via).rank not in new_members:
            self._detach()
            return
        elastic.adopt(self, handover, new_group)

    def layout_for(self, world_size: int) -> Layout:
        """The shard layout of this model at ``world_size`` ranks."""
        return compute_layout(
            self.inventory.specs,
            world_size,
            bucket_numel=self.config.bucket_numel,
            align=self._align,
            by_unit=self.stage == 3,
        )

    # ------------------------------------------------------------------ setup

    def _sync_module_states(self) -> None:
        """Broadcast rank 0's parameters and buffers, as DDP does at construction."""
        if not self.comm.distributed:
            return
        tensors = list(dict.fromkeys([*self.module.parameters(), *self.module.buffers()]))
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                self.comm.broadcast(flat, src=0)
                offset = 0
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _build_bucket(self, spec, from_module: bool) -> FlatBucket:
        params = [self.inventory.params[s.name] for s in spec.slots]
        lo, hi = (0, spec.padded_numel) if self.stage == 0 else spec.shard_range(self.rank)
        pieces = spec.pieces(lo, hi)
        # fp32 master values come from the original parameters, before any cast.
        master = torch.zeros(hi - lo, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for piece in pieces if from_module else ():
                src = params[spec.slots.index(piece.slot)].detach().reshape(-1)
                master[piece.shard_start : piece.shard_start + piece.numel] = src[
                    piece.param_start : piece.param_start + piece.numel
                ]
            full = torch.zeros(spec.padded_numel, dtype=self.dtype, device=self.device)
            if self.stage < 3 and from_module:
                for p, slot in zip(params, spec.slots, strict=True):
                    full[slot.offset : slot.offset + slot.numel] = p.detach().reshape(-1)
        bucket = FlatBucket(
            spec=spec,
            params=params,
            param_index=[self._index[s.name] for s in spec.slots],
            lo=lo,
            hi=hi,
            pieces=pieces,
            full=full,
            master=master,
        )
        bucket.param_views()
        if self.stage == 3:
            bucket.shard = master.to(self.dtype)
            if not self.config.mixed_precision:
                bucket.master = bucket.shard
            full.untyped_storage().resize_(0)
        elif not self.config.mixed_precision:
            bucket.master = full[lo:hi]
        if self.stage <= 1:
            bucket.grad_full = torch.zeros(spec.padded_numel, dtype=self.dtype, device=self.device)
            bucket.grad_views()
        else:
            bucket.grad_shard = torch.zeros(spec.shard_numel, dtype=self.dtype, device=self.device)
        return bucket

    def _cast_frozen_and_buffers(self) -> None:
        if not self.config.mixed_precision:
            return
        with torch.no_grad():
            for p in self.inventory.params.values():
                if not p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(self.dtype)
            for b in self.module.buffers():
                if b.is_floating_point():
                    b.data = b.data.to(self.dtype)

    def _build_units(self) -> None:
        for handle in self._module_hooks:
            handle.remove()
        self._module_hooks.clear()
        self.units = []
        by_unit: dict[int, list[FlatBucket]] = {}
        for b in self.buckets:
            by_unit.setdefault(b.spec.unit, []).append(b)
        codec = make_codec(self.config.stage3_gather_compression, self.config.compression_block)
        for index, module in self.inventory.unit_modules.items():
            if index not in by_unit:
                continue
            unit = GatherUnit(index, module, by_unit[index], codec)
            self.units.append(unit)
            self._module_hooks += [
                module.register_forward_pre_hook(self._pre_forward_hook(unit)),
                module.register_forward_hook(self._post_forward_hook(unit)),
            ]
        self._unit_by_index = {u.index: u for u in self.units}
        self._forward_order: list[GatherUnit] = []
        self._order_recorded = False

    # ------------------------------------------------------------ stage 3

    def _pre_forward_hook(self, unit: GatherUnit):
        def hook(module: nn.Module, args: Any) -> None:
            unit.gather(self.comm)
            unit.wait()
            if not self._order_recorded and unit not in self._forward_order:
                self._forward_order.append(unit)
            self._prefetch(unit, +1)

        return hook

    def _post_forward_hook(self, unit: GatherUnit):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                outputs = [
                    t
                    for t in tree_leaves(output)
                    if isinstance(t, torch.Tensor) and t.requires_grad
                ]
                if outputs:
                    torch.autograd.graph.register_multi_grad_hook(
                        outputs, lambda grads: self._pre_backward(unit), mode="any"
                    )
                if unit.index == 0:
                    return  # the root's parameters are used first in backward: keep them
            unit.reshard()

        return hook

    def _pre_backward(self, unit: GatherUnit) -> None:
        unit.gather(self.comm)
        unit.wait()
        self._prefetch(unit, -1)

    def _prefetch(self, unit: GatherUnit, direction: int) -> None:
        if not self._order_recorded or not self.config.stage3_prefetch:
            return
        try:
            pos = self._forward_order.index(unit)
        except ValueError:
            return
        for k in range(1, self.config.stage3_prefetch + 1):
            j = pos + direction * k
            if 0 <= j < len(self._forward_order):
                self._forward_order[j].gather(self.comm)

    # ------------------------------------------------------------ forward/backward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    @_recovering
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.stats.begin()
        if self.config.mixed_precision:
            args, kwargs = tree_map(self._cast_input, (args, kwargs))
        return self.module(*args, **kwargs)

    def _cast_input(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(self.dtype)
        return x

    @property
    def is_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    @_recovering
    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False) -> None:
        """Backward of one micro-batch loss, with gradient reduction overlapped."""
        if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
            raise ValueError("engine.backward expects a loss tensor that requires grad")
        self.stats.begin()
        self.stats.loss = loss.detach()
        boundary = self.is_accumulation_boundary
        in_graph = _params_in_graph(loss.grad_fn)
        for p in in_graph:
            if p in self._bucket_of:
                b, pos = self._bucket_of[p]
                self._used[b.param_index[pos]] = 1
        reduce_now = self.stage >= 2 or boundary
        if boundary and self.control is not None:
            self._used[-2] = self.control.latest_id
            self._used[-1] = self.rank + 1 if self._leave_requested else 0
        if boundary and self.comm.distributed:
            self._used_handle = self.comm.all_reduce(
                self._used, op="max", async_op=True, control=True
            )
        if self.stage <= 1:
            self._restore_grad_views()
        self._next_bucket = 0
        for b in self.buckets:
            b.pending = sum(1 for p in b.params if p in in_graph) if reduce_now else -1
            b.ready = b.launched = False
        if reduce_now and self.config.overlap_comm:
            for b in self.buckets:
                if b.pending == 0:
                    self._mark_ready(b)

        scale = self.scaler.scale / self.config.gradient_accumulation_steps
        (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)

        if reduce_now:
            for b in self.buckets:
                b.ready = True
            self._launch_ready()
            for b in self.buckets:
                self._finish(b)
        for unit in self.units:
            unit.reshard()
        self._order_recorded = bool(self.units)

    def _restore_grad_views(self) -> None:
        # A user's model.zero_grad() sets .grad to None; put the views back.
        for b in self.buckets:
            if any(p.grad is None for p in b.params):
                b.grad_views()

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        b, pos = self._bucket_of[p]
        if self.stage >= 2:
            b.stage_grad(pos, p.grad)
            p.grad = None
        if b.pending <= 0:
            return
        b.pending -= 1
        if b.pending == 0 and self.config.overlap_comm:
            self._mark_ready(b)

    def _mark_ready(self, b: FlatBucket) -> None:
        b.ready = True
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch buckets in index order (see [Note: bucket order])."""
        while self._next_bucket < len(self.buckets):
            b = self.buckets[self._next_bucket]
            if not b.ready:
                return
            self._launch(b)
            self._next_bucket += 1

    def _active_codec(self) -> Codec | None:
        if self.global_steps < self.config.compression_warmup_steps:
            return None
        return self.grad_codec

    def _launch(self, b: FlatBucket) -> None:
        b.launched = True
        codec = self._active_codec() if self.comm.distributed else None
        if codec is not None:
            src = b.grad_full if self.stage <= 1 else b.staging
            if src is None:
                src = b.staging = b.full.new_zeros(b.spec.padded_numel)
            if self.config.error_feedback and b.residual is None:
                b.residual = torch.zeros(b.spec.padded_numel, device=self.device)
            b.exchange = start_reduce_scatter(
                self.comm,
                codec,
                src,
                b.residual if self.config.error_feedback else None,
                logical_bytes=src.numel() * src.element_size(),
            )
        elif self.stage == 0:
            b.reduced = self._to_reduce_dtype(b.grad_full)
            b.handle = self.comm.all_reduce(b.reduced[: b.spec.numel], async_op=True)
        else:
            if self.stage == 1:
                src = b.grad_full
            else:
                if b.staging is None:
                    b.staging = b.full.new_zeros(b.spec.padded_numel)
                src = b.staging
            src = self._to_reduce_dtype(src)
            direct = self.stage >= 2 and not b.accumulated and src.dtype == b.grad_shard.dtype
            b.reduced = b.grad_shard if direct else src.new_empty(b.spec.shard_numel)
            b.handle = self.comm.reduce_scatter(b.reduced, src, async_op=True)
        if self.stage == 3:
            unit = self._unit_by_index[b.spec.unit]
            if all(x.launched for x in unit.buckets):
                unit.reshard()

    def _to_reduce_dtype(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == self.reduce_dtype else t.to(self.reduce_dtype)

    def _finish(self, b: FlatBucket) -> None:
        if b.exchange is not None:
            shard = b.exchange.finish()
            b.exchange = None
            if self.stage == 0:
                # the all-reduce's second half: every rank's summed shard to everyone
                if self.config.error_feedback and b.server_residual is None:
                    b.server_residual = torch.zeros(b.spec.shard_numel, device=self.device)
                b.reduced = torch.empty(b.spec.padded_numel, device=self.device)
                start_all_gather(
                    self.comm, self._active_codec(), shard, b.reduced, b.server_residual
                ).finish()
                return
            b.reduced = shard
        elif b.handle is not None:
            b.handle.wait()
            b.handle = None
        else:
            return
        if self.stage >= 2:
            if b.reduced is not b.grad_shard:
                if b.accumulated:
                    b.grad_shard.add_(b.reduced)
                else:
                    b.grad_shard.copy_(b.reduced)
            b.accumulated = True
            b.reduced = None
            b.staging = None

    # ------------------------------------------------------------ step

    @_recovering
    def step(self, *, samples: int = 0, tokens: int = 0) -> bool:
        """Count a micro-step; at the accumulation boundary, step the optimizer.

        Returns True when the optimizer stepped (False between boundaries and
        on an fp16 overflow, which skips the step). ``samples`` and ``tokens``:
        what this rank's micro-batch held, for the throughput metrics.
        """
        self.stats.record(samples, tokens)
        boundary = self.is_accumulation_boundary
        self.micro_steps += 1
        if not boundary:
            return False
        if self._used_handle is not None:
            self._used_handle.wait()
            self._used_handle = None
        grads = [self._fp32_partition_grad(b) for b in self.buckets]
        factor = 1.0 / (self.world_size * self.scaler.scale)
        for g in grads:
            g.mul_(factor)
        stepped = self._clip_or_skip(grads)
        if stepped:
            used = self._used.tolist()
            piece_grads = [
                grads[piece.bucket][piece.grad_offset : piece.grad_offset + piece.view.numel()]
                if used[piece.param_index]
                else None
                for piece in self.optimizer.pieces
            ]
            # from here until the step is whole, a lost peer leaves this state torn
            live, self._live = self._live, None
            self.optimizer.step(piece_grads)
            self._publish_params()
            self.global_steps += 1
            self._live = live
            interval = self.config.replica_interval
            if interval and self.control is not None and self.global_steps % interval == 0:
                self._replica = elastic.refresh_replica(self, self.control.generation.id)
            if self.control is not None and self.control.report_due():
                self.control.report(self.memory_report(), self.global_steps)
        else:
            self.skipped_steps += 1
        target, leaving = int(self._used[-2]), int(self._used[-1])
        self._zero_grads()
        self.stats.end_step()
        if self.control is not None:
            self._follow_membership(target, leaving - 1)
        return stepped

    def _fp32_partition_grad(self, b: FlatBucket) -> torch.Tensor:
        """This rank's reduced gradient over its optimizer partition, in fp32."""
        if self.stage == 0:
            g = b.reduced if b.reduced is not None else b.grad_full
        elif self.stage == 1:
            g = b.reduced if b.reduced is not None else b.grad_full.new_zeros(b.hi - b.lo)
        else:
            g = b.grad_shard
        return g if g.dtype == torch.float32 else g.float()

    def _clip_or_skip(self, grads: list[torch.Tensor]) -> bool:
        clip = self.config.gradient_clipping
        fp16 = self.config.dtype == "fp16"
        if not clip and not fp16:
            return True
        sumsq = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in grads:
            sumsq += g.pow(2).sum()
        if self.stage >= 1:
            self.comm.all_reduce(sumsq, control=True)
        norm = math.sqrt(sumsq.item()) if math.isfinite(sumsq.item()) else math.inf
        self.last_grad_norm = norm
        overflow = not math.isfinite(norm)
        self.scaler.update(overflow)
        if fp16 and overflow:
            logger.info(
                "fp16 gradient overflow: step skipped, loss scale now %g", self.scaler.scale
            )
            return False
        if clip:
            coef = clip / (norm + 1e-6)
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        return True

    def _publish_params(self) -> None:
        """Write the updated master partition back into the compute parameters."""
        handles = []
        with torch.no_grad():
            for b in self.buckets:
                if self.stage == 0:
                    if self.config.mixed_precision:
                        b.full.copy_(b.master)
                elif self.stage == 3:
                    if self.config.mixed_precision:
                        b.shard.copy_(b.master)
                else:
                    src = b.full[b.lo : b.hi]
                    if self.config.mixed_precision:
                        src = b.master.to(self.dtype)
                    handles.append(self.comm.all_gather(b.full, src, async_op=True))
        for h in handles:
            h.wait()

    def _zero_grads(self) -> None:
        for b in self.buckets:
            if b.grad_full is not None:
                b.grad_full.zero_()
            if b.grad_shard is not None:
                b.grad_shard.zero_()
            b.reduced = None
            b.accumulated = False
        self._used.zero_()

    # ------------------------------------------------------------ reports

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter by name (tied ones under each name), fp32 master values
        where they exist; identical on every rank. A collective: call on all ranks."""
        values: dict[str, torch.Tensor] = {}
        for b in self.buckets:
            full = self._gather_master(b)
            for slot in b.spec.slots:
                values[slot.name] = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
        out = {}
        for name, first in self.inventory.aliases.items():
            if first in values:
                out[name] = values[first].clone()
            else:
                out[name] = self.inventory.params[first].detach().clone()
        return out

    def _gather_master(self, b: FlatBucket) -> torch.Tensor:
        if self.stage == 0:
            return b.master.detach()
        if self.stage < 3 and not self.config.mixed_precision:
            return b.full.detach()
        full = torch.empty(b.spec.padded_numel, dtype=b.master.dtype, device=self.device)
        self.comm.all_gather(full, b.master.detach())
        return full

    def memory_report(self) -> dict[str, int]:
        """Bytes of model state this rank holds, by kind (padding included)."""

        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        in_bucket = set(self._bucket_of)
        frozen = sum(nbytes(p) for p in self.inventory.params.values() if p not in in_bucket)
        params = sum(nbytes(b.shard) if self.stage == 3 else nbytes(b.full) for b in self.buckets)
        report = {
            "params": params + frozen,
            "grads": sum(nbytes(b.grad_full) + nbytes(b.grad_shard) for b in self.buckets),
            "master": sum(nbytes(b.master) for b in self.buckets)
            if self.config.mixed_precision
            else 0,
            "optimizer": self.optimizer.state_bytes(),
            "buffers": sum(nbytes(t) for t in self.module.buffers()),
            "compression": sum(
                nbytes(b.residual) + nbytes(b.server_residual) for b in self.buckets
            ),
            "replica": 0 if self._replica is None else self._replica.nbytes(),
        }
        report["total"] = sum(report.values())
        return report

    def comm_report(self) -> dict[str, dict[str, int]]:
        """Collective calls and logical bytes by op since start (see worker.collectives)."""
        return self.comm.report()

    # ------------------------------------------------------------ checkpoints

    def checkpoint_due(self, every: int) -> bool:
        """Whether a loop that saves every ``every`` steps should save now.

        The same answer on every rank, newcomers included: a rank that joined a
        running job at step N saves N with the members (they have not saved it
        yet), and after a rollback nobody re-saves the step it rolled back to.
        """
        steps = self.global_steps
        return steps > 0 and steps % every == 0 and steps != self._saved_at

    @_recovering
    def save_checkpoint(self, path: str | os.PathLike, *, client_state: dict | None = None) -> Path:
        """Save a checkpoint loadable at any world size and stage (all ranks call this).

        ``client_state`` (tensors and plain Python values, e.g. a sampler's
        ``state_dict()``) is stored with it and returned by ``load_checkpoint``.
        See worker/checkpoint.py [Note: checkpoint format].
        """
        saved = checkpoint.save_checkpoint(self, path, client_state)
        self.last_checkpoint = Path(path)
        self._saved_at = self.global_steps
        return saved

    def load_checkpoint(self, path: str | os.PathLike) -> dict:
        """Load a checkpoint saved at any world size and stage; returns its client_state."""
        self._live = None
        state = checkpoint.load_checkpoint(self, path)
        self._saved_at = self.global_steps
        self._mark_live()
        return state

    # ------------------------------------------------------------ module passthrough

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        return self.train(False)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale


def _module_device(module: nn.Module) -> torch.device:
    devices = {p.device for p in module.parameters()}
    if len(devices) > 1:
        raise ValueError(
            f"the model's parameters are on several devices: {sorted(map(str, devices))}"
        )
    return devices.pop() if devices else torch.device("cpu")


def _resolve_optimizer(module: nn.Module, optimizer: OptimizerArg) -> torch.optim.Optimizer:
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


def _params_in_graph(root: Any) -> set[torch.Tensor]:
    """The leaf tensors (parameters) whose AccumulateGrad nodes ``root`` reaches."""
    seen, stack, found = set(), [root], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            found.add(var)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found
