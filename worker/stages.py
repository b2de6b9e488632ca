"""The pieces a ZeRO stage is made of, and the table that puts them together.

A stage is three choices (docs/design.md, "ZeRO, stated correctly"):

* whether the optimizer's fp32 master weights and state are partitioned
  (stages 1–3) or whole on every rank (stage 0);
* a gradient reducer (worker/reducers.py): :class:`AllReduce` into replicated
  buffers (stage 0), :class:`ReduceScatterPersistent` of full gradient buffers
  kept across micro-steps (stage 1), or :class:`ReduceScatterStaging` of a
  transient staging buffer into a persistent gradient shard (stages 2–3).
  Compression wraps any of them (:class:`Compressed`);
* a parameter storage: :class:`ReplicatedParams` (stages 0–2: every rank
  holds the full compute parameters, rewritten after the step) or
  :class:`ShardedParams` (stage 3: a shard per rank, units gathered for
  their forward and backward and freed after).

:data:`STAGES` is the table. The engine (worker/engine.py) drives the pieces
in the same order for every stage: hooks → buckets → reduce → step → publish.

[Note: bucket progress]
A bucket goes IDLE → FILLING (its gradients arrive, ``pending`` counts those
still expected) → READY (every expected gradient is in) → REDUCING (its
collective is launched; buckets launch strictly in index order, see
worker/grad_hooks.py [Note: bucket order]) → REDUCED (waited on, result in place)
and back to IDLE when gradients are zeroed after the step. A bucket that is
not reduced this micro-step (stages 0–1 between accumulation boundaries)
stays IDLE while its gradients accumulate in place.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.profiler import record_function
from torch.utils._pytree import tree_leaves

from worker.collectives import Collectives, Handle
from worker.compat import eager
from worker.compression import (
    Codec,
    PendingAllGather,
    WireBuffers,
    start_all_gather,
)
from worker.flat import (
    BucketState,
    FlatBucket,
    GatheredStorages,
    GatherUnit,
    HierarchicalUnit,
    LiveElements,
    NodeGroup,
    UnitState,
    Zeros,
)
from worker.gather_check import GatherAgreement
from worker.reducers import (
    AllReduce,
    Compressed,
    GradReducer,
    ReduceScatterPersistent,
    ReduceScatterStaging,
    StagingPool,
    nbytes_of,
)
from worker.sharded import mark_sharded, name_params, reads_data

__all__ = [
    "STAGES",
    "AllReduce",
    "Compressed",
    "GradReducer",
    "ParamStorage",
    "ReduceScatterPersistent",
    "ReduceScatterStaging",
    "ReplicatedParams",
    "ShardHome",
    "ShardedParams",
    "Stage",
    "StagingPool",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- parameter storage


class ParamStorage:
    """Where a bucket's compute parameters live between steps.

    ``master_apart``: the fp32 master partition is a tensor of its own (mixed
    precision, or offloaded: worker/offload.py), not a view of the compute
    parameters, so publishing copies it over (cast, and moved to the device).
    ``gather_codec``: parameter all-gathers send each shard encoded
    (worker/compression.py [Note: quantized parameter gathers]); the compute
    parameters are then the master only in this rank's own slice.
    """

    sharded: ClassVar[bool]

    def __init__(
        self, dtype: torch.dtype, master_apart: bool, *, gather_codec: Codec | None = None
    ) -> None:
        self.dtype, self.master_apart = dtype, master_apart
        self.gather_codec = gather_codec

    def place(self, b: FlatBucket, zeros: Zeros | None = None) -> None:
        """Set up ``b``'s compute parameters once its master values are in (a buffer
        it makes, with ``zeros``)."""
        b.param_views()
        if not self.master_apart:
            b.master = b.full[b.lo : b.hi]

    def attach(self, buckets: list[FlatBucket], comm: Collectives, units: dict) -> None:
        """Bind to a freshly built set of buckets (module hooks, if any)."""

    def detach(self) -> None:
        """Remove what :meth:`attach` registered."""

    def publish(self, buckets: list[FlatBucket], comm: Collectives) -> None:
        """Write the updated master partition into the compute parameters."""
        handles = [self.start_publish(b, comm) for b in buckets]
        for h in handles:
            if h is not None:
                h.wait()

    def start_publish(self, b: FlatBucket, comm: Collectives) -> Handle | PendingAllGather | None:
        """Start writing ``b``'s updated master partition into its compute parameters;
        a collective to wait on, if one was needed."""
        with torch.no_grad():
            if b.lo == 0 and b.hi == b.spec.padded_numel:
                # the optimizer holds the whole bucket (stage 0): no collective
                if self.master_apart:
                    b.full.copy_(b.master)
                return None
            if self.master_apart:
                # from an offloaded (pinned) master this is an asynchronous copy,
                # ordered before the all-gather that reads it
                src = b.master.to(device=b.full.device, dtype=self.dtype, non_blocking=True)
            else:
                src = b.full[b.lo : b.hi]
            codec = (
                None if self.gather_codec is None else self.gather_codec.bind(b.spec, b.full.dtype)
            )
            if codec is None or not comm.distributed:
                return comm.all_gather(b.full, src, async_op=True)
            # qwZ: this rank's slot keeps ``src`` exact (in fp32 it is the master)
            if b.gather_wire is None:
                b.gather_wire = WireBuffers()
            return start_all_gather(comm, codec, src, b.full, buffers=b.gather_wire, exact_own=True)

    def nbytes(self, b: FlatBucket) -> int:
        return nbytes_of(b.full)

    def after_launch(self, b: FlatBucket) -> None:
        """``b``'s gradients are handed to a collective (the storage may free it)."""

    def begin_backward(self) -> None:
        """Backward starts on this rank (forwards from now on are recomputations)."""

    def end_backward(self) -> None:
        """Backward has finished on this rank."""

    def forward_context(self) -> contextlib.AbstractContextManager:
        """What the engine's forward runs under (stage 3's first forward: discovery)."""
        return contextlib.nullcontext()

    def gathered(self) -> contextlib.AbstractContextManager:
        """Every compute parameter whole on this rank for the duration (a collective)."""
        return contextlib.nullcontext()

    def release_pooled(self) -> None:
        """Give back the memory kept for the next gathers (stage 3's pool)."""


class ReplicatedParams(ParamStorage):
    """Stages 0–2: every rank holds the full compute parameters. With a
    ``gather_codec`` (stages 1–2) they are rewritten from quantized shards after
    each step, all but this rank's own slice (worker/compression.py [Note:
    quantized parameter gathers])."""

    sharded = False


class ShardHome(Protocol):
    """Where stage-3 parameter shards live (worker/offload.py ``Placement``)."""

    def new_shard(self, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A shard holding ``master``'s values in ``dtype``."""
        ...

    def fetch(self, shard: torch.Tensor) -> torch.Tensor:
        """``shard`` on the device, for the gather to send from."""
        ...


class _OnDevice:
    """Shards on the compute device, beside the master partition."""

    def new_shard(self, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return master.to(dtype)

    def fetch(self, shard: torch.Tensor) -> torch.Tensor:
        return shard


class ShardedParams(ParamStorage):
    """Stage 3: each rank holds a shard of every bucket; a gather unit's buckets are
    all-gathered before its module's forward and again before its backward,
    and freed after each (see worker/flat.py [Note: stage-3 storage]).

    Prefetch follows the order of the first forward: after a unit is gathered,
    the next ``prefetch`` units in forward order (previous ones in backward)
    start gathering, as long as the elements gathered (and gathering) stay
    within ``max_live`` (DeepSpeed's ``stage3_max_live_parameters``).

    [Note: modules whose forward never runs]
    A unit is gathered by its module's forward hooks, but some modules hold
    parameters their parent reads without calling them: ``nn.MultiheadAttention``
    hands ``out_proj.weight`` to the functional op and never runs
    ``out_proj.forward``, so at stage 3 that weight would still be freed when it
    is read. The first forward through the engine therefore runs under a
    torch-function mode that looks at every tensor an op is given: a parameter
    of a unit that is not gathered is read inside the forward of some unit
    that is running (the root's, at least), and its unit joins the innermost
    running unit whose module contains it, for good: its buckets are gathered
    now and from then on with that unit, before its forward and its backward.
    The shard layout is untouched (units merge only in how they are
    gathered), so every rank and the coordinator keep the same layout. After
    the first forward no mode runs.

    [Note: hierarchical partitioning]
    ZeRO++'s hpZ (``ZeroConfig.hpz_partition_size`` k > 1): the world's ranks
    form node groups of k consecutive ranks, ``[0, k)``, ``[k, 2k)``, ...
    (:meth:`Collectives.split`, formed at the first gather that needs them,
    since forming a group is a collective and a newcomer attaches before its
    group exists). Besides its primary shard (1/N of each bucket, the
    layout's), each rank keeps a secondary slice: 1/k of each bucket, the
    elements ``[j·padded/k, (j+1)·padded/k)`` for its place j in its node
    group, which are the primary shards of N/k consecutive ranks. A unit's
    gather is the world's all-gather, as without hpZ, unless every one of its
    buckets' secondary slices is fresh; when the unit is released
    (:class:`HierarchicalUnit`), each rank copies its slice out of the full
    buffer and marks it fresh. A gather while fresh (the backward's, a
    recomputation's, the next micro-batch's forward under accumulation) is an
    all-gather of the slices within the node group: nothing crosses nodes.
    Publishing after the optimizer step marks every slice stale (so does a
    rebuild, and an import publishes), and the next forward's world gather
    refreshes them. The decision is made from the same sequence of gathers on
    every rank, so every rank issues the same collectives. The slices are
    copies of what the world gather gave, so the results are plain stage 3's
    bit for bit; with qwZ (a quantized world gather) the node gather is not
    quantized, and a rank then reads, in backward, another rank's slot as the
    slot's keeper decoded it (its own exactly): within the codec's bound, as
    before. The cost is p·Ψ/k bytes per rank (``params`` in ``memory_report``
    and coordinator/core/memory.py), and a copy of p·Ψ/k per step. qgZ, when it
    runs too (``ZeroConfig.hierarchical_reduce``, the same k), reduces gradients
    over this node group and its cross-node counterpart (worker/compression.py
    [Note: hierarchical gradient reduce-scatter]; ShardState._bind_hierarchy).

    Node groups are consecutive ranks because the launchers number a host's
    ranks consecutively (torchrun's ``node_rank·nproc + local_rank``) and the
    coordinator admits joiners sorted by host (coordinator/control/
    membership.py ``propose``: "Joiners grouped by host"); survivors of a
    membership change keep their order, so after one a group may span hosts,
    which costs speed, not correctness. Each generation's build forms the
    groups anew; a world that k does not divide runs without hpZ, with a
    warning (the first build refuses it), and so does a world of k ranks
    (one node: every gather is intra-node already). hpZ needs the engine on
    the default process group, where new groups can be formed from every
    rank: a subgroup (tensor or pipeline parallelism, ``engine.reconfigure``
    onto a subgroup) is refused.
    """

    sharded = True

    def __init__(
        self,
        dtype: torch.dtype,
        master_apart: bool,
        *,
        prefetch: int,
        gather_codec: Codec | None,
        home: ShardHome | None = None,
        max_reuse_distance: int = 0,
        max_live: int = 10**9,
        hpz: int = 1,
        check_gathers: bool | str = "first",
    ) -> None:
        super().__init__(dtype, master_apart, gather_codec=gather_codec)
        self.prefetch = prefetch
        # worker/gather_check.py [Note: gathers the ranks agree on]
        self.check_gathers = check_gathers
        self.agreement = GatherAgreement(Collectives(None), {}, when=False)
        # [Note: hierarchical partitioning]: the ranks per node asked for, and this
        # world's node group (None: hpZ off in this world)
        self.hpz = hpz
        self.node: NodeGroup | None = None
        self.max_reuse_distance, self.max_live = max_reuse_distance, max_live
        self.live = LiveElements()
        # [Note: gathered storages from a pool] in worker/flat.py
        self.storages = GatheredStorages()
        self.home: ShardHome = home or _OnDevice()
        self.units: list[GatherUnit] = []
        self._unit_by_index: dict[int, GatherUnit] = {}
        self._unit_of_param: dict[nn.Parameter, GatherUnit] = {}
        self._hooks: list[Any] = []
        self._order: list[GatherUnit] = []
        self._order_recorded = False
        # [Note: units kept gathered into backward]: the first forward's units in the
        # order their forward ended, and those that then stay gathered into backward
        self._finish_order: list[GatherUnit] = []
        self._kept: set[GatherUnit] = set()
        # [Note: modules whose forward never runs]: units running their forward now
        self._discovered = False
        self._running: list[GatherUnit] = []
        # a forward in backward recomputes a checkpointed module: its unit stays
        # gathered until its gradients are reduced, and nothing is prefetched ahead
        self._in_backward = False

    def place(self, b: FlatBucket, zeros: Zeros | None = None) -> None:
        b.param_views()
        name_params(b.params, (s.name for s in b.spec.slots))
        b.shard = self.home.new_shard(b.master, self.dtype, zeros)
        if not self.master_apart:
            b.master = b.shard
        self.storages.empty(b.full)  # the built values' memory serves the first gathers
        mark_sharded(b.params)

    def attach(self, buckets: list[FlatBucket], comm: Collectives, units: dict) -> None:
        self.detach()
        self.comm = comm
        self.agreement = GatherAgreement(comm, units, when=self.check_gathers)
        self.live = LiveElements()
        self.node = self._node_group(comm)
        for b in buckets:
            b.secondary_fresh = False
            b.secondary = None
            if self.node is not None:
                b.secondary = torch.empty(
                    b.spec.padded_numel // self.node.size, dtype=b.full.dtype, device=b.full.device
                )
        by_unit: dict[int, list[FlatBucket]] = {}
        for b in buckets:
            by_unit.setdefault(b.spec.unit, []).append(b)
        for index, module in units.items():
            if index not in by_unit and index != 0:
                continue
            # the root is always a unit, if only to host the units it reads
            unit = GatherUnit(
                index,
                module,
                by_unit.get(index, []),
                self.gather_codec,
                fetch=self.home.fetch,
                live=self.live,
                storages=self.storages,
            )
            if self.node is not None:
                unit = HierarchicalUnit(
                    index,
                    module,
                    unit.buckets,
                    self.gather_codec,
                    fetch=self.home.fetch,
                    live=self.live,
                    storages=self.storages,
                    node=self.node,
                )
            self.units.append(unit)
            self._hooks += [
                # [Note: compiling at stage 3]: the gathers stay out of every graph
                module.register_forward_pre_hook(eager(self._pre_forward_hook(unit))),
                module.register_forward_hook(eager(self._post_forward_hook(unit))),
            ]
        self._unit_by_index = {u.index: u for u in self.units}
        self._unit_of_param = {p: u for u in self.units for b in u.buckets for p in b.params}

    def _node_group(self, comm: Collectives) -> NodeGroup | None:
        """This world's node group under hpZ, or None where it runs without
        ([Note: hierarchical partitioning])."""
        k, world = self.hpz, comm.world_size
        if k == 1 or world == 1:
            return None
        if not comm.on_default_group:
            raise ValueError(
                f"ZeroConfig.hpz_partition_size={k} needs the engine on the default "
                "process group, whose ranks form the node groups; this engine runs on "
                "a subgroup (tensor or pipeline parallelism, or engine.reconfigure onto "
                "a new group), where hpZ is not supported: set hpz_partition_size=1"
            )
        if world % k:
            logger.warning(
                "hpZ off in this world: ZeroConfig.hpz_partition_size=%d does not divide "
                "its %d ranks (stage 3 gathers across the world in backward too)",
                k,
                world,
            )
            return None
        if world == k:
            logger.info(
                "hpZ off in this world: its %d ranks are one node group "
                "(ZeroConfig.hpz_partition_size=%d), every gather stays within it",
                world,
                k,
            )
            return None
        return NodeGroup(comm, k)

    @property
    def node_comm(self) -> Collectives | None:
        """hpZ's node-group collectives, once formed (their bytes, apart from the world's)."""
        return None if self.node is None else self.node.formed

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.units, self._unit_by_index, self._unit_of_param = [], {}, {}
        self._order, self._order_recorded = [], False
        self._finish_order, self._kept = [], set()
        self._discovered, self._running = False, []
        # a backward cut short by a lost peer never reached end_backward(): left set,
        # the next forward would skip its backward gathers while a newcomer's did not
        self._in_backward = False

    def release_pooled(self) -> None:
        self.storages.clear()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        for unit in self.units:
            self._gather(unit)
        for unit in self.units:
            unit.wait()
        try:
            yield
        finally:
            for unit in self.units:
                unit.reshard()

    def forward_context(self) -> contextlib.AbstractContextManager:
        if self._discovered:
            return contextlib.nullcontext()
        return _DiscoverReads(self)

    def _read_while_sharded(self, unit: GatherUnit, param: nn.Parameter) -> None:
        """A parameter of ``unit`` was read while it was not gathered: it joins the
        innermost running unit that contains it ([Note: modules whose forward never runs])."""
        host = next(
            (
                r
                for r in reversed(self._running)
                if any(m is unit.module for m in r.module.modules())
            ),
            None,
        )
        if host is None or host is unit:
            name = next(
                (
                    s.name
                    for b in unit.buckets
                    for p, s in zip(b.params, b.spec.slots, strict=True)
                    if p is param
                ),
                type(unit.module).__name__,
            )
            raise RuntimeError(
                f"parameter {name!r} was read outside the forward of every module that "
                "holds it; at stage 3 parameters exist only inside the model's forward "
                "(engine(...)) and backward: read it there"
            )
        self._gather(unit)
        unit.wait()
        host.buckets.extend(unit.buckets)
        for b in unit.buckets:
            self._unit_by_index[b.spec.unit] = host
            for p in b.params:
                self._unit_of_param[p] = host
        self._unit_by_index[unit.index] = host
        host._counted, unit._counted = host._counted + unit._counted, 0
        unit.buckets, unit.state = [], UnitState.SHARDED
        self.units.remove(unit)
        logger.debug(
            "stage 3: %s's parameters are read in %s's forward; gathered with it",
            type(unit.module).__name__,
            type(host.module).__name__,
        )

    def start_publish(self, b: FlatBucket, comm: Collectives) -> Handle | None:
        b.secondary_fresh = False  # [Note: hierarchical partitioning]
        if self.master_apart:
            with torch.no_grad():
                b.shard.copy_(b.master, non_blocking=True)
        return None

    def nbytes(self, b: FlatBucket) -> int:
        return nbytes_of(b.shard) + nbytes_of(b.secondary)

    def after_launch(self, b: FlatBucket) -> None:
        unit = self._unit_by_index[b.spec.unit]
        if all(x.state in (BucketState.REDUCING, BucketState.REDUCED) for x in unit.buckets):
            unit.reshard()

    def begin_backward(self) -> None:
        self._in_backward = True

    def end_backward(self) -> None:
        self._in_backward = False
        self.agreement.ended(backward=True)
        for unit in self.units:
            unit.reshard()
        if not self._order_recorded:
            self._kept = self._kept_into_backward()
        self._order_recorded = bool(self.units)

    # the hooks: gather, wait, prefetch; free after use

    def _pre_forward_hook(self, unit: GatherUnit):
        def hook(module: nn.Module, args: Any) -> None:
            with record_function("zeroplane.gather"):
                self._gather(unit)
                unit.wait()
            if not self._discovered:
                self._running.append(unit)
            if not self._order_recorded and unit not in self._order:
                self._order.append(unit)
            if not self._in_backward:
                self._prefetch(unit, +1)

        return hook

    def _kept_into_backward(self) -> set[GatherUnit]:
        """[Note: units kept gathered into backward]

        Freeing a unit after its forward pays off only if much runs before its
        backward gathers it again. The root is read first in backward (its
        forward ends last, usually with the loss) and always stays gathered.
        Another unit's *reuse distance* is the number of parameter elements of
        the units whose forward ends after its own: the backward reads those
        before it. A unit whose distance is at most ``max_reuse_distance``
        (``ZeroConfig.stage3_max_reuse_distance``, DeepSpeed's key of that name)
        stays gathered from its forward into its backward and is freed once its
        gradients are reduced: one all-gather per step less each. The default 0
        keeps only the last unit to finish, whose backward comes first anyway, so
        the peak is unchanged; FSDP2 keeps only the root. DeepSpeed's default
        (1e9) keeps every unit of a model under a billion parameters: stage 3
        then communicates as little as stage 2, with stage 2's peak.

        The distances come from the first forward with gradients (as the prefetch
        order does), so every rank skips the same gathers.
        """
        last: dict[GatherUnit, int] = {}
        for i, unit in enumerate(self._finish_order):
            last[unit] = i  # a unit run twice is reused after its last forward
        kept, distance = set(), 0
        for unit in sorted(last, key=last.__getitem__, reverse=True):
            if distance > self.max_reuse_distance:
                break
            kept.add(unit)
            distance += sum(b.full.numel() for b in unit.buckets)
        return kept

    def _post_forward_hook(self, unit: GatherUnit):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if unit.index == 0 and not self._in_backward:
                self.agreement.ended(backward=False)
            if not self._discovered and unit in self._running:
                del self._running[len(self._running) - 1 - self._running[::-1].index(unit)]
            if self._in_backward:
                return  # a recomputation: the backward about to run reads these parameters
            if torch.is_grad_enabled():
                if not self._order_recorded and unit.index != 0:
                    self._finish_order.append(unit)
                outputs = [
                    t
                    for t in tree_leaves(output)
                    if isinstance(t, torch.Tensor) and t.requires_grad
                ]
                if outputs:
                    torch.autograd.graph.register_multi_grad_hook(
                        outputs, lambda grads: self._pre_backward(unit), mode="any"
                    )
                    if unit.index == 0 or unit in self._kept:
                        return  # [Note: units kept gathered into backward]
            unit.reshard()

        return hook

    def _pre_backward(self, unit: GatherUnit) -> None:
        with record_function("zeroplane.gather"):
            self._gather(unit)
            unit.wait()
        self._prefetch(unit, -1)

    def _prefetch(self, unit: GatherUnit, direction: int) -> None:
        if not self._order_recorded or not self.prefetch:
            return
        try:
            pos = self._order.index(unit)
        except ValueError:
            return
        for k in range(1, self.prefetch + 1):
            j = pos + direction * k
            if not 0 <= j < len(self._order):
                return
            ahead = self._order[j]
            if ahead.state is UnitState.SHARDED:
                # ZeroConfig.stage3_max_live_parameters: a prefetch never takes the
                # gathered elements past it (the unit needed now always is gathered)
                if self.live.numel + ahead.numel > self.max_live:
                    return
                self._gather(ahead)

    def _gather(self, unit: GatherUnit) -> None:
        """Start gathering ``unit``, once the ranks agree on it ([Note: gathers the
        ranks agree on]) where that issues a collective."""
        if unit.state is UnitState.SHARDED and unit.buckets:
            self.agreement.gathering(unit.index, backward=self._in_backward)
        unit.gather(self.comm)


class _DiscoverReads(TorchFunctionMode):
    """The first forward at stage 3: find parameters read outside their unit's forward
    ([Note: modules whose forward never runs])."""

    def __init__(self, storage: ShardedParams) -> None:
        super().__init__()
        self.storage = storage

    def __enter__(self):
        self.storage._running = []
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.storage._discovered = True
        self.storage._running = []
        return super().__exit__(exc_type, exc, tb)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not reads_data(func):
            return func(*args, **kwargs)
        unit_of = self.storage._unit_of_param
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, nn.Parameter):
                unit = unit_of.get(t)
                if unit is not None and unit.state is UnitState.SHARDED:
                    self.storage._read_while_sharded(unit, t)
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Stage:
    """One row of docs/design.md's stage table ("Stages as composition"), as the pieces
    that implement it."""

    number: int
    optimizer_sharded: bool
    reducer: type[GradReducer]
    params: type[ParamStorage]


STAGES: tuple[Stage, ...] = (
    Stage(0, optimizer_sharded=False, reducer=AllReduce, params=ReplicatedParams),
    Stage(1, optimizer_sharded=True, reducer=ReduceScatterPersistent, params=ReplicatedParams),
    Stage(2, optimizer_sharded=True, reducer=ReduceScatterStaging, params=ReplicatedParams),
    Stage(3, optimizer_sharded=True, reducer=ReduceScatterStaging, params=ShardedParams),
)
