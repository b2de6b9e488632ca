"""The shard state of one rank: buckets, the optimizer over shards, the counters.

:class:`ShardState` is the one owner of what a rank holds between steps. The
engine (worker/engine.py) drives it through a step; checkpoints
(worker/checkpoint.py), the live exchange between world sizes
(worker/live/exchange.py) and the metrics exporter use only its public methods:

* :meth:`build` for a world (``Collectives``), from the module's values or
  empty for a transfer to fill; :meth:`release` before building again;
* :meth:`publish_params` (master partition → compute parameters) and
  :meth:`zero_grads`;
* :meth:`export_ranges` / :meth:`import_ranges`: state addressed by
  (parameter name, element range), see coordinator/core/ranges.py
  [Note: element ranges];
* :meth:`counters` / :meth:`restore_counters`, :meth:`memory_report` and
  :meth:`memory_by_location`.

Where each buffer is allocated, device or host, is the ``placement``'s
(worker/offload.py): with offload the master partition and optimizer state,
or the stage-3 parameter shards, live in host memory; state is addressed by
name and element range wherever it lives.

``whole`` says whether the state is complete at a step boundary (not half
stepped, not half rebuilt): only then is it a source for recovery after a
peer is lost (worker/live/restore_plan.py [Note: recovery sources]).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import record_function

from coordinator.core.layout import Bucket, Layout, SlotShard, compute_layout
from coordinator.core.ranges import Range, RangeIndex, owned_ranges
from worker import build_ahead
from worker.birth import Birth, Init, materialize_empty, meta_names
from worker.collectives import CollectiveError, Collectives, Handle
from worker.compression import Codec, PendingAllGather, make_codec
from worker.config import ZeroConfig
from worker.entries import Entries, check_covered, export_entries, import_entries, owned_by
from worker.flat import BucketState, FlatBucket, GatherUnit, NodeGroup, Reserve
from worker.float8 import float8_gather
from worker.inventory import Inventory, persistent_buffers
from worker.offload import HOST, Location, OffloadedGrads, Placement
from worker.optim import Piece, ShardOptimizer
from worker.precision import MixedPrecision
from worker.sharded import mark_gathered
from worker.stages import (
    STAGES,
    Compressed,
    GradReducer,
    ParamStorage,
    ReduceScatterStaging,
    ShardedParams,
    Stage,
    StagingPool,
)

__all__ = ["PUBLISH_CHUNKS", "Counters", "ShardState"]

logger = logging.getLogger(__name__)

# optimizer-step chunks whose all-gathers overlap the next chunk's update
PUBLISH_CHUNKS = 4


@dataclass(frozen=True)
class Counters:
    """What a rank carries besides its shards, identical on every rank."""

    global_steps: int
    loss_scale: float
    skipped_steps: int
    # the dynamic fp16 scaler's position in its growth window and hysteresis: a
    # newcomer or a rollback that reset them would double or halve the scale at
    # another step than its peers (0 overflows left: the scaler's own default)
    good_steps: int = 0
    overflows_left: int = 0


class ShardState:
    """This rank's buffers, optimizer and counters for one world (see the module notes)."""

    def __init__(
        self,
        module: nn.Module,
        user_optimizer: torch.optim.Optimizer,
        inventory: Inventory,
        config: ZeroConfig,
        *,
        dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        device: torch.device,
        align: int = 1,
        init: Init | None = None,
    ) -> None:
        self.module, self.user_optimizer, self.inventory = module, user_optimizer, inventory
        # how a module built on the meta device is initialized (worker/birth.py)
        self.init = init
        self.config, self.dtype, self.device, self.align = config, dtype, device, align
        self.stage: Stage = STAGES[config.stage]
        self.placement = Placement.from_config(config, device)
        self.index = {name: i for i, name in enumerate(inventory.trainable)}
        self.scaler = MixedPrecision.loss_scaler(config)
        self.global_steps = self.micro_steps = self.skipped_steps = 0
        # micro-batches counted since the last optimizer step
        self.micro_in_step = 0
        self.pool = StagingPool()
        self.reducer = self._make_reducer(reduce_dtype)
        self.params: ParamStorage = self._make_storage()
        self.comm = Collectives(None)
        self.layout: Layout | None = None
        self.buckets: list[FlatBucket] = []
        self.bucket_of: dict[nn.Parameter, tuple[FlatBucket, int]] = {}
        self.optimizer = ShardOptimizer(user_optimizer, [[] for _ in user_optimizer.param_groups])
        self.whole = False
        # a state whose group is one rank by the layout chosen (the experts of ep = world)
        self.alone_by_design = False
        self.builds = 0  # how many times the buffers were (re)built
        # a fresh process built for its peers' state keeps the module's own values
        # until it is a member: if no peer holds anything, the job starts from them
        self._module_values: dict[str, torch.Tensor] | None = None
        self._publish_chunks: list[set[int]] = []
        # buffers written ahead for the next build and import (worker/build_ahead.py
        # [Note: a build from buffers written ahead]); the build takes from it
        self.reserve = Reserve()

    def _make_reducer(self, reduce_dtype: torch.dtype) -> GradReducer:
        cls = self.stage.reducer
        if cls.grads_in_place:
            reducer = cls(reduce_dtype)
        else:
            reducer = cls(reduce_dtype, self.pool, lambda b: self.reducer.finish(b))  # type: ignore[call-arg]
        codec = make_codec(self.config.compression, self.config.compression_block)
        # the compressed reducer, which qgZ binds to each world's node groups
        self.compressed: Compressed | None = None
        if codec is not None:
            warmup = self.config.compression_warmup_steps
            reducer = self.compressed = Compressed(
                reducer,
                codec,
                error_feedback=self.config.error_feedback,
                active=lambda: self.global_steps >= warmup,
            )
        if self.placement.optimizer_on_host:
            reducer = OffloadedGrads(reducer, self.placement, self.at_boundary)
        return reducer

    def _make_storage(self) -> ParamStorage:
        apart = self.placement.master_apart(self.config.mixed_precision)
        # qwZ at stages 1–3 (worker/compression.py [Note: quantized parameter gathers])
        if self.config.stage3_gather_compression == "float8":  # worker/float8.py
            codec: Codec | None = float8_gather(self.module)
        else:
            codec = make_codec(self.config.stage3_gather_compression, self.config.compression_block)
        if self.stage.params is ShardedParams:
            return ShardedParams(
                self.dtype,
                apart,
                prefetch=self.config.stage3_prefetch,
                max_reuse_distance=self.config.stage3_max_reuse_distance,
                max_live=self.config.stage3_max_live_parameters,
                gather_codec=codec,
                home=self.placement,
                hpz=self.config.hpz_partition_size,
                check_gathers=self.config.stage3_check_gathers,
            )
        return self.stage.params(self.dtype, apart, gather_codec=codec)

    # ------------------------------------------------------------ world

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def master_device(self) -> torch.device:
        """Where the master partition and optimizer state live: the device, or the
        host with optimizer offload. Loads and transfers land there."""
        return HOST if self.placement.optimizer_on_host else self.device

    def comm_groups(self) -> dict[str, Collectives]:
        """The groups this state's collectives run on, by scope: ``world`` (the
        engine's group); once hpZ or qgZ has formed it, ``node`` (worker/stages.py
        [Note: hierarchical partitioning]); once qgZ has formed it, ``cross``, the
        cross-node group of qgZ's second leg (worker/compression.py [Note:
        hierarchical gradient reduce-scatter]). Only ``world`` and ``cross``
        collectives cross nodes."""
        groups = {"world": self.comm}
        node = self.params.node_comm if isinstance(self.params, ShardedParams) else None
        qgz = None if self.compressed is None else self.compressed.hierarchy
        if node is None and qgz is not None:
            node = qgz.formed
        if node is not None:
            groups["node"] = node
        if qgz is not None and qgz.cross_formed is not None:
            groups["cross"] = qgz.cross_formed
        return groups

    def _bind_hierarchy(self, comm: Collectives) -> None:
        """qgZ's node groups for ``comm``'s world, or flat compression where it cannot
        run (worker/compression.py [Note: hierarchical gradient reduce-scatter]): hpZ's
        node group where hpZ runs (the same k), else one of its own, formed at the
        first compressed reduction. The cases mirror hpZ's (ShardedParams._node_group)."""
        if self.compressed is None:
            return
        k, world = self.config.hierarchical_reduce, comm.world_size
        node: NodeGroup | None = None
        if k > 1 and world > 1:
            if not comm.on_default_group:
                raise ValueError(
                    f"ZeroConfig.hierarchical_reduce={k} needs the engine on the default "
                    "process group, whose ranks form the node groups; this engine runs on "
                    "a subgroup (tensor or pipeline parallelism, or engine.reconfigure onto "
                    "a new group), where qgZ is not supported: set hierarchical_reduce=1"
                )
            if world % k:
                logger.warning(
                    "qgZ off in this world: ZeroConfig.hierarchical_reduce=%d does not divide "
                    "its %d ranks (gradients are reduce-scattered across the world, compressed)",
                    k,
                    world,
                )
            elif world == k:
                logger.info(
                    "qgZ off in this world: its %d ranks are one node group "
                    "(ZeroConfig.hierarchical_reduce=%d); gradients are reduce-scattered "
                    "across it, compressed",
                    world,
                    k,
                )
            else:
                hpz = self.params.node if isinstance(self.params, ShardedParams) else None
                node = hpz if hpz is not None and hpz.size == k else NodeGroup(comm, k)
        self.compressed.bind(node)

    @property
    def units(self) -> list[GatherUnit]:
        return self.params.units if isinstance(self.params, ShardedParams) else []

    def layout_for(self, world_size: int) -> Layout:
        """The shard layout of this model at ``world_size`` ranks."""
        return compute_layout(
            self.inventory.specs,
            world_size,
            bucket_numel=self.config.bucket_numel,
            align=self.align,
            by_unit=self.stage.params.sharded,
        )

    def build(self, comm: Collectives, *, from_module: bool) -> None:
        """Build this rank's buffers and optimizer for ``comm``'s world.

        ``from_module``: take values from the module's parameters (after a
        broadcast from rank 0, as DDP does); otherwise start from zeros, for
        state that a transfer or a checkpoint then fills in.
        """
        self.release(keep_buffers=True)
        comm.inherit_scratch(self.comm)
        self.comm = comm
        if comm.world_size == 1 and self.stage.number > 0 and not self.alone_by_design:
            logger.warning(
                "ZeRO stage %d on a single rank saves no memory and costs time; "
                "stage 0 with mixed precision or activation checkpointing is the lever here",
                self.stage.number,
            )
        birth = self._birth() if from_module else None
        if not from_module:
            materialize_empty(self.module, self.device)  # values come from peers or a file
        if from_module:
            self._broadcast_module_states()
        self.layout = self.layout_for(comm.world_size)
        if birth is None:
            self.buckets = [self._build_bucket(s, from_module) for s in self.layout.buckets]
        else:
            self.buckets = birth.build(
                self.layout.buckets, self._bucket_params, lambda s: self._build_bucket(s, True)
            )
        if from_module:  # no import follows, which would take the optimizer state's
            self.reserve = Reserve()
        self.bucket_of = {p: (b, pos) for b in self.buckets for pos, p in enumerate(b.params)}
        self.pool.reset(max((b.spec.padded_numel for b in self.buckets), default=0))
        self.optimizer = self.shard_optimizer([(b.spec, b.pieces, b.master) for b in self.buckets])
        self.params.attach(self.buckets, comm, self.inventory.unit_modules)
        self._bind_hierarchy(comm)
        self._publish_chunks = self._chunks()
        self.whole = from_module
        self.builds += 1

    def rebind(self, comm: Collectives) -> None:
        """Run on ``comm`` with the buffers as built: the group that formed for the
        rank and world they were built for (:meth:`Collectives.ahead`)."""
        if (comm.rank, comm.world_size) != (self.comm.rank, self.comm.world_size):
            raise ValueError(
                f"built for rank {self.comm.rank} of {self.comm.world_size}, "
                f"not rank {comm.rank} of {comm.world_size}"
            )
        comm.inherit_scratch(self.comm)
        self.comm = comm
        self.params.attach(self.buckets, comm, self.inventory.unit_modules)
        self._bind_hierarchy(comm)

    def warm(self) -> None:
        """Make now, written once, the transient buffers a stage 2-3 backward takes
        (gradient staging; gloo's receive buffers): a newcomer does while it waits
        for its group (worker/elastic/joining.py [Note: a newcomer builds ahead]), where its
        first backward, which every member waits for, would fault them in."""
        if not isinstance(self.reducer, ReduceScatterStaging) or not self.buckets:
            return
        numels = [b.spec.padded_numel for b in self.buckets]
        self.pool.warm(self.buckets[0].full, numels)
        self.comm.warm_scratch(numels, self.reducer.reduce_dtype, self.buckets[0].full.device)

    def shard_optimizer(
        self, shards: list[tuple[Bucket, list[SlotShard], torch.Tensor]]
    ) -> ShardOptimizer:
        """The user's optimizer over one rank's master shards: per bucket, its spec,
        the slots' pieces in the shard and the shard's fp32 master values
        ([Note: per-parameter shard views] in worker/optim.py)."""
        pieces: list[list[Piece]] = [[] for _ in self.user_optimizer.param_groups]
        for spec, slot_pieces, master in shards:
            for piece in slot_pieces:
                pieces[spec.group].append(
                    Piece(
                        param_index=self.index[piece.slot.name],
                        view=master[piece.shard_start : piece.shard_start + piece.numel],
                        bucket=spec.index,
                        grad_offset=piece.shard_start,
                        name=piece.slot.name,
                        param_start=piece.param_start,
                    )
                )
        return ShardOptimizer(self.user_optimizer, pieces, on_host=self.placement.optimizer_on_host)

    def keep_module_values(self) -> None:
        """Before a build that does not take the module's values (``from_module=False``):
        hold on to them (no copy: the tensors the parameters pointed at)."""
        self._module_values = {name: p.detach() for name, p in self.inventory.params.items()}

    def drop_module_values(self) -> None:
        self._module_values = None

    def build_from_kept_module(self, comm: Collectives) -> None:
        """Build from the module's values as they were before the first build (the
        job starts again after every holder of its state was lost)."""
        if self._module_values is None:
            raise RuntimeError("this rank did not keep its module's values (it holds state)")
        params = self.inventory.params
        self.release()
        mark_gathered(params.values())  # stage 3 marked them sharded: they hold values again
        with torch.no_grad():
            for name, p in params.items():
                kept = self._module_values[name]
                if kept.is_meta:  # a model built on meta comes to life again (worker/birth.py)
                    torch.utils.swap_tensors(p, nn.Parameter(kept, requires_grad=p.requires_grad))
                else:
                    p.data = kept
        self._module_values = None
        self.build(comm, from_module=True)

    def release(self, *, keep_buffers: bool = False) -> None:
        """Drop this rank's buffers and hooks (before building for another world).
        ``keep_buffers``: keep the free transient ones (gradient staging) for the
        next build to reuse."""
        self.whole = False
        self.params.detach()
        self.params.release_pooled()  # a build for another world has other sizes
        # a backward cut short (a lost peer) can leave a gradient the engine never
        # took (stages 2-3 take each from .grad as it arrives): the next backward
        # would add to it. Stages 0-1 point .grad at the new buffers when built.
        for p in self.inventory.params.values():
            p.grad = None
        self.buckets, self.bucket_of = [], {}
        self.pool.reset(self.pool.largest if keep_buffers else 0)
        if isinstance(self.reducer, OffloadedGrads):
            self.reducer.release()
        self.optimizer = ShardOptimizer(
            self.user_optimizer, [[] for _ in self.user_optimizer.param_groups]
        )

    def trim_staging(self) -> None:
        """Hand back the staging buffers a pipeline's step took beyond the pool's own."""
        self.pool.trim()

    def _birth(self) -> Birth | None:
        """How the module's meta tensors come to life as the buckets are built; None
        when it has none ([Note: birth on the meta device] in worker/birth.py)."""
        if not meta_names(self.module):
            return None
        return Birth(
            self.module,
            device=self.device,
            init=self.init,
            broadcast=functools.partial(broadcast_tensors, self.comm, self.device, src=0),
            cast=MixedPrecision.from_config(self.config).cast_module,
        )

    def _broadcast_module_states(self) -> None:
        """Rank 0's values of the inventory's parameters and the module's buffers on
        every rank (those with values: a meta tensor gets rank 0's when it comes to
        life; an expert-parallel model's experts are another state's)."""
        tensors = [*self.inventory.params.values(), *self.module.buffers()]
        broadcast_tensors(self.comm, self.device, [t for t in tensors if not t.is_meta], src=0)

    def _bucket_params(self, spec: Bucket) -> list[nn.Parameter]:
        return [self.inventory.params[s.name] for s in spec.slots]

    def sync_unsharded(self, source: int | None) -> None:
        """Give every rank ``source``'s frozen parameters and persistent module
        buffers (BatchNorm's running statistics, say): what the shards do not hold.
        A rank that joined, or restored from a hand-over, still holds its own
        module's; DDP broadcasts buffers before every forward, this once per change
        of world. ``None``: no rank holds trained ones."""
        if source is None:
            return
        frozen = [p for p in self.inventory.params.values() if p not in self.bucket_of]
        buffers = persistent_buffers(self.module).values()
        broadcast_tensors(self.comm, self.device, [*frozen, *buffers], src=source)

    def _build_bucket(self, spec, from_module: bool) -> FlatBucket:
        params = self._bucket_params(spec)
        lo, hi = self.shard_range(spec, self.rank)
        pieces = spec.pieces(lo, hi)
        zeros = self.reserve.zeros
        sharded = self.stage.params.sharded
        if sharded:
            # stage 3: resharded once placed (worker/flat.py [Note: stage-3 storage])
            full = torch.empty(spec.padded_numel, dtype=self.dtype, device=self.device)
        else:
            full = zeros(spec.padded_numel, self.dtype, self.device)
        # fp32 master values come from the original parameters, before any cast;
        # stages 0-2 without a master apart keep them in ``full`` itself
        apart = self.params.master_apart
        master = self.placement.new_master(hi - lo, zeros) if apart or sharded else full[lo:hi]
        with torch.no_grad():
            for piece in pieces if from_module and (apart or sharded) else ():
                src = params[spec.slots.index(piece.slot)].detach().reshape(-1)
                master[piece.shard_start : piece.shard_start + piece.numel] = src[
                    piece.param_start : piece.param_start + piece.numel
                ]
            if from_module and not sharded:
                for p, slot in zip(params, spec.slots, strict=True):
                    full[slot.offset : slot.offset + slot.numel] = p.detach().reshape(-1)
        bucket = FlatBucket(
            spec=spec,
            params=params,
            param_index=[self.index[s.name] for s in spec.slots],
            lo=lo,
            hi=hi,
            pieces=pieces,
            full=full,
            master=master,
        )
        self.params.place(bucket, zeros)
        self.reducer.allocate(bucket, self.dtype, zeros)
        return bucket

    def shard_range(self, spec: Bucket, rank: int) -> tuple[int, int]:
        """The elements of bucket ``spec`` whose optimizer state ``rank`` holds."""
        return spec.shard_range(rank) if self.stage.optimizer_sharded else (0, spec.padded_numel)

    def reserve_plan(
        self,
        rank: int,
        world_size: int,
        *,
        buffers: bool = True,
        fields: dict[str, torch.dtype] | None = None,
    ) -> list[tuple[int, torch.dtype, torch.device]]:
        """What :meth:`build` and :meth:`import_ranges` make on the device for ``rank``
        of ``world_size``: (numel, dtype, device) per tensor; without ``buffers``,
        only the optimizer state's (a newcomer built its buffers already); ``fields``:
        the optimizer state's (:meth:`state_fields` when None). Read beside training;
        making them is safe in another thread (worker/build_ahead.py [Note: a build
        from buffers written ahead])."""
        if fields is None:
            fields = {} if self.placement.optimizer_on_host else self.state_fields()
        return build_ahead.reserve_plan(self, rank, world_size, buffers=buffers, fields=fields)

    def state_fields(self) -> dict[str, torch.dtype]:
        """The optimizer state's per-element fields and their dtypes (Adam's two
        moments, say), as this rank's optimizer holds them now; holding none yet
        (a newcomer), as one step of a fresh optimizer of its class makes them."""
        return build_ahead.state_fields(self.optimizer, self.user_optimizer, self.master_device)

    # ------------------------------------------------------------ the step's last phases

    def publish_params(self) -> None:
        """Write the updated master partition back into the compute parameters."""
        self.params.publish(self.buckets, self.comm)

    def step_and_publish(self, grads: list[torch.Tensor | None]) -> CollectiveError | None:
        """The optimizer step on this rank's partition, then publish it. Returns the
        error of a publish that failed (a peer lost), once the whole partition is
        stepped anyway: the state is then whole at the new step, and only the
        compute parameters missed it (a recovery publishes them again).

        [Note: publish while stepping]
        Where publishing is an all-gather (stages 1–2), the buckets are stepped
        in a few chunks and each chunk's all-gathers start as soon as it is
        updated, so they run while the next chunk is (DDP has no such
        all-gather; this hides most of it). Every chunk calls the optimizer
        with the other chunks' gradients absent, which torch.optim skips, so
        the numbers are those of one step over all.
        """
        if not self.optimizer.inner.state:
            # the optimizer's state is made in this first step: let it take the memory
            # the gathers keep ([Note: gathered storages from a pool] in worker/flat.py)
            self.params.release_pooled()
        chunks = self._publish_chunks
        if len(chunks) <= 1:
            with record_function("zeroplane.optimizer_step"):
                self.optimizer.step(grads)
            with record_function("zeroplane.publish"):
                try:
                    self.publish_params()
                except CollectiveError as exc:
                    return exc
            return None
        handles: list[Handle | PendingAllGather] = []
        failed: CollectiveError | None = None
        for chunk in chunks:
            with record_function("zeroplane.optimizer_step"):
                self.optimizer.step(grads, buckets=chunk)
            if failed is not None:
                continue  # step the rest: a stepped partition is a whole one
            with record_function("zeroplane.publish"):
                try:
                    for i in chunk:
                        h = self.params.start_publish(self.buckets[i], self.comm)
                        if h is not None:
                            handles.append(h)
                except CollectiveError as exc:
                    failed = exc
        with record_function("zeroplane.publish"):
            try:
                for h in handles if failed is None else ():
                    h.wait()
            except CollectiveError as exc:
                failed = exc
        return failed

    def _chunks(self) -> list[set[int]]:
        """Buckets in index order, in up to ``PUBLISH_CHUNKS`` runs of similar size
        ([Note: publish while stepping]); one run where publishing is local."""
        everything = [set(range(len(self.buckets)))]
        if not (self.comm.distributed and self.stage.optimizer_sharded) or self.params.sharded:
            return everything
        total = sum(b.spec.padded_numel for b in self.buckets)
        chunks: list[set[int]] = [set()]
        filled = 0
        for i, b in enumerate(self.buckets):
            if filled >= total * len(chunks) / PUBLISH_CHUNKS and chunks[-1]:
                chunks.append(set())
            chunks[-1].add(i)
            filled += b.spec.padded_numel
        return chunks

    def zero_grads(self) -> None:
        for b in self.buckets:
            self.reducer.zero(b)
            b.state = BucketState.IDLE

    def counters(self) -> Counters:
        return Counters(
            self.global_steps,
            self.scaler.scale,
            self.skipped_steps,
            *self.scaler.position(),
        )

    def at_boundary(self) -> bool:
        """Whether the micro-batch being trained is the step's last."""
        return self.micro_in_step + 1 >= self.config.gradient_accumulation_steps

    def restore_counters(self, counters: Counters) -> None:
        self.global_steps = counters.global_steps
        # at a step boundary: a step abandoned between its micro-batches (a lost
        # peer) is trained again from its first one
        steps = counters.global_steps + counters.skipped_steps
        self.micro_steps = steps * self.config.gradient_accumulation_steps
        self.micro_in_step = 0
        self.scaler.scale = counters.loss_scale
        self.scaler.move_to(counters.good_steps, counters.overflows_left)
        self.skipped_steps = counters.skipped_steps

    # ------------------------------------------------------------ state by element range

    def owned(self) -> list[Range]:
        """The ranges this rank's optimizer owns (those of ``owned_ranges``), in the
        order of the optimizer's pieces."""
        return owned_by(self.optimizer)

    def written_ranges(self) -> list[Range]:
        """The ranges this rank writes to a checkpoint or a replica: range ``rank`` of
        every bucket, whatever the stage (at stage 0 each rank writes only its
        part, so writes still run in parallel)."""
        assert self.layout is not None
        return owned_ranges(self.layout, self.rank, partitioned=True)

    def export_ranges(self, *, copy: bool = True) -> Entries:
        """Master values and optimizer state for :meth:`written_ranges`: copies, or
        (``copy=False``) views of the live state, for a caller that serialises them
        at once before the next optimizer step (worker/entries.py)."""
        return export_entries(self.optimizer, self.written_ranges(), self.rank, copy=copy)

    def import_ranges(self, entries: Entries, index: RangeIndex | None = None) -> None:
        """Set the master values and optimizer state of every range this rank owns
        from ``entries`` (``index`` says which keys hold what; by default, the
        keys themselves), then publish the parameters.

        Coverage is checked before anything is assigned: a range missing from
        ``entries`` raises :class:`MissingRange` and leaves the state as it was.
        The values are then copied straight into place (one copy; worker/entries.py).
        """
        index = index or RangeIndex.of_keys(entries)
        owned = self.owned()
        check_covered(owned, index)
        # every range is covered: from here on, copy straight into place
        self.whole = False
        import_entries(self.optimizer, owned, entries, index, self.reserve.zeros)
        self.reserve = Reserve()  # what the build and this import did not take
        self.publish_params()
        self.zero_grads()
        self.whole = True

    # ------------------------------------------------------------ reports

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter by name (tied ones under each name), fp32 master values
        where they exist; identical on every rank. A collective."""
        values: dict[str, torch.Tensor] = {}
        for b in self.buckets:
            full = self.gather_master(b)
            for slot in b.spec.slots:
                values[slot.name] = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
        out = {}
        for name, first in self.inventory.aliases.items():
            if first in values:
                out[name] = values[first].clone()
            else:
                out[name] = self.inventory.params[first].detach().clone()
        return out

    def gather_master(self, b: FlatBucket) -> torch.Tensor:
        """Bucket ``b``'s fp32 master values, whole, on every rank (a collective)."""
        if not self.stage.optimizer_sharded:
            return b.master.detach()
        if not (
            self.stage.params.sharded or self.master_apart or self.params.gather_codec is not None
        ):
            # the compute parameters are the master partitions, whole (not after a
            # quantized gather: there other ranks' slices are rounded)
            return b.full.detach()
        full = torch.empty(b.spec.padded_numel, dtype=b.master.dtype, device=self.device)
        self.comm.all_gather(full, b.master.detach().to(self.device))
        return full

    @property
    def master_apart(self) -> bool:
        return self.placement.master_apart(self.config.mixed_precision)

    def frozen_bytes(self) -> int:
        return sum(_nbytes(p) for p in self.inventory.params.values() if p not in self.bucket_of)

    def memory_report(self) -> dict[str, int]:
        """Bytes of model state this rank holds, by kind (padding included), wherever
        they live (:meth:`memory_by_location` splits them)."""
        split = self.memory_by_location()
        return {k: split["device"][k] + split["host"][k] for k in split["device"]}

    def memory_by_location(self) -> dict[Location, dict[str, int]]:
        """:meth:`memory_report`'s bytes by where they live: ``device`` (the compute
        device; on a CPU-only run that is host memory too) and ``host`` (what
        offload put in host memory). Same kinds in both; they add up to the report."""
        place = self.placement
        shards = sum(self.params.nbytes(b) for b in self.buckets)
        master = sum(_nbytes(b.master) for b in self.buckets) if self.master_apart else 0
        optimizer = self.optimizer.state_bytes()
        host_grads = (
            sum(self.reducer.host_nbytes(b) for b in self.buckets)
            if isinstance(self.reducer, OffloadedGrads)
            else 0
        )
        shards_host = self.params.sharded and place.shard_location == "host"
        master_host = place.master_location == "host"
        device = {
            "params": (0 if shards_host else shards) + self.frozen_bytes(),
            "grads": sum(self.reducer.nbytes(b) for b in self.buckets),
            "master": 0 if master_host else master,
            "optimizer": 0 if master_host else optimizer,
            "buffers": sum(_nbytes(t) for t in self.module.buffers()),
            "compression": sum(
                _nbytes(b.residual) + _nbytes(b.server_residual) for b in self.buckets
            ),
        }
        host = dict.fromkeys(device, 0)
        host["params"] = shards if shards_host else 0
        host["grads"] = host_grads
        host["master"] = master if master_host else 0
        host["optimizer"] = optimizer if master_host else 0
        return {"device": device, "host": host}


def broadcast_tensors(
    comm: Collectives, device: torch.device, tensors: list[torch.Tensor], *, src: int
) -> None:
    """``src``'s values of ``tensors`` on every rank of ``comm`` (one broadcast per dtype,
    through ``device``)."""
    if not comm.distributed:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in dict.fromkeys(tensors):  # a tied tensor once
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1).to(device) for t in group])
            comm.broadcast(flat, src=src)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
