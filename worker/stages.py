"""The pieces a ZeRO stage is made of, and the table that puts them together.

A stage is three choices (docs/design.md, "ZeRO, stated correctly"):

* whether the optimizer's fp32 master weights and state are partitioned
  (stages 1–3) or whole on every rank (stage 0);
* a gradient reducer: :class:`AllReduce` into replicated buffers (stage 0),
  :class:`ReduceScatterPersistent` of full gradient buffers kept across
  micro-steps (stage 1), or :class:`ReduceScatterStaging` of a transient
  staging buffer into a persistent gradient shard (stages 2–3). Compression
  wraps any of them (:class:`Compressed`);
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
worker/engine.py [Note: bucket order]) → REDUCED (waited on, result in place)
and back to IDLE when gradients are zeroed after the step. A bucket that is
not reduced this micro-step (stages 0–1 between accumulation boundaries)
stays IDLE while its gradients accumulate in place.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.profiler import record_function
from torch.utils._pytree import tree_leaves

from coordinator.core.layout import Bucket
from worker.collectives import Collectives, Handle, grained
from worker.compression import (
    Codec,
    PendingAllGather,
    PendingHierarchicalReduceScatter,
    WireBuffers,
    start_all_gather,
    start_hierarchical_reduce_scatter,
    start_reduce_scatter,
)
from worker.flat import (
    BucketState,
    FlatBucket,
    GatherUnit,
    HierarchicalUnit,
    LiveElements,
    NodeGroup,
    UnitState,
    Zeros,
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


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


# ---------------------------------------------------------------------------- reducers


class GradReducer:
    """How a bucket's gradients are reduced across the data-parallel ranks.

    ``grads_in_place``: parameters' ``.grad`` are views into the bucket's
    persistent ``grad_full``, so autograd accumulates into it (stages 0–1);
    otherwise each gradient is handed to :meth:`on_grad` as it is produced.
    ``every_micro_step``: reduce after every backward, not only at the
    accumulation boundary. ``result``: what :meth:`accept` takes, the whole
    reduced bucket or this rank's shard of it.
    """

    grads_in_place: ClassVar[bool]
    every_micro_step: ClassVar[bool]
    result: ClassVar[Literal["full", "shard"]]

    def __init__(self, reduce_dtype: torch.dtype) -> None:
        self.reduce_dtype = reduce_dtype

    def grad_numel(self, spec: Bucket) -> int:
        """Elements of a bucket's persistent gradient buffer (on the device)."""
        return spec.padded_numel

    def allocate(self, b: FlatBucket, dtype: torch.dtype, zeros: Zeros) -> None:
        """Create the bucket's persistent gradient buffer (with ``zeros``)."""
        b.grad_full = zeros(self.grad_numel(b.spec), dtype, b.full.device)
        b.grad_views()

    def on_grad(self, b: FlatBucket, pos: int, p: nn.Parameter) -> None:
        """Parameter ``pos`` of ``b`` has its gradient for this backward in ``p.grad``."""

    def source(self, b: FlatBucket) -> torch.Tensor:
        """The bucket's local (unreduced) gradient, padded."""
        assert b.grad_full is not None
        return b.grad_full

    def launch(self, b: FlatBucket, comm: Collectives) -> None:
        raise NotImplementedError

    def finish(self, b: FlatBucket) -> None:
        """Wait for the bucket's collective and put the result in place (once)."""
        if b.state is not BucketState.REDUCING:
            return
        if b.handle is not None:
            b.handle.wait()
            b.handle = None
        self.done(b)

    def accept(self, b: FlatBucket, reduced: torch.Tensor) -> None:
        """Take a result reduced elsewhere (a compressed exchange)."""
        b.reduced = reduced
        self.done(b)

    def done(self, b: FlatBucket) -> None:
        b.state = BucketState.REDUCED

    def partition_grad(self, b: FlatBucket) -> torch.Tensor:
        """The reduced gradient over this rank's optimizer partition (any dtype)."""
        raise NotImplementedError

    def zero(self, b: FlatBucket) -> None:
        if b.grad_full is not None:
            b.grad_full.zero_()
        b.reduced = None

    def nbytes(self, b: FlatBucket) -> int:
        return _nbytes(b.grad_full) + _nbytes(b.grad_shard)


class AllReduce(GradReducer):
    """Stage 0: all-reduce of the whole bucket; every rank steps the whole model."""

    grads_in_place = True
    every_micro_step = False
    result = "full"

    def launch(self, b: FlatBucket, comm: Collectives) -> None:
        b.reduced = _as(self.source(b), self.reduce_dtype)
        b.handle = comm.all_reduce(b.reduced[: b.spec.numel], async_op=True)

    def partition_grad(self, b: FlatBucket) -> torch.Tensor:
        return b.reduced if b.reduced is not None else self.source(b)


class ReduceScatterPersistent(GradReducer):
    """Stage 1: gradients accumulate in a full buffer over the micro-steps and are
    reduce-scattered once per optimizer step."""

    grads_in_place = True
    every_micro_step = False
    result = "shard"

    def launch(self, b: FlatBucket, comm: Collectives) -> None:
        src = _as(self.source(b), self.reduce_dtype)
        b.reduced = src.new_empty(b.spec.shard_numel)
        b.handle = comm.reduce_scatter(b.reduced, src, async_op=True)

    def partition_grad(self, b: FlatBucket) -> torch.Tensor:
        if b.reduced is not None:
            return b.reduced
        return b.full.new_zeros(b.hi - b.lo, dtype=torch.float32)


class StagingPool:
    """Transient staging buffers for stage 2–3 gradients: normally two, bucket-sized.

    A bucket takes one when its first gradient of a backward arrives and gives
    it back once its reduce-scatter is waited on. When both are taken, the
    oldest bucket already reducing is waited on to free one (its collective
    was issued long before, so this rarely blocks); only when no holder is
    reducing yet (gradients of several buckets arrive interleaved) does the
    pool grow.
    """

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self._free: list[torch.Tensor] = []
        self._holders: list[FlatBucket] = []
        self._count = 0
        self._largest = 0

    def acquire(self, b: FlatBucket, finish: Callable[[FlatBucket], None]) -> torch.Tensor:
        if not self._free and self._count >= self.size:
            reducing = [h for h in self._holders if h.state is BucketState.REDUCING]
            if reducing:
                finish(reducing[0])
        numel = b.spec.padded_numel
        for i, buf in enumerate(self._free):
            if buf.numel() >= numel and buf.dtype == b.full.dtype and buf.device == b.full.device:
                self._free.pop(i)
                break
        else:
            self._count += 1
            if self._count > self.size:
                logger.debug("staging pool grew to %d buffers", self._count)
            # rounded up, so that the next world's buckets fit too (see reset)
            buf = b.full.new_empty(grained(max(numel, self._largest)))
        self._holders.append(b)
        return buf[:numel]

    def release(self, b: FlatBucket) -> None:
        if b.staging is None:
            return
        self._holders.remove(b)
        base = b.staging._base if b.staging._base is not None else b.staging
        self._free.append(base)
        b.staging = None

    def trim(self) -> None:
        """Drop the free buffers beyond the pool's size (a pipeline's step grows it to
        every bucket of its stage: worker/pipeline.py [Note: pipeline gradients into
        ZeRO])."""
        keep = max(0, self.size - len(self._holders))
        if len(self._free) > keep:
            del self._free[keep:]
            self._count = len(self._free) + len(self._holders)

    def warm(self, like: torch.Tensor) -> None:
        """Make the pool's buffers now, written once, as ``like``'s dtype and device:
        a backward then takes them without a page fault per 4 KiB."""
        while self._largest and self._count < self.size:
            self._free.append(like.new_zeros(grained(self._largest)))
            self._count += 1

    def reset(self, largest: int) -> None:
        """After a rebuild: new buffers hold ``largest`` elements. The free buffers that
        still do are kept (a membership change keeps every bucket's size within a
        few padding elements, and a buffer taken afresh there is a page fault per
        4 KiB in the first backward of the new world); held ones are not reused
        (a backward cut short may still be reducing from them)."""
        self._free = [buf for buf in self._free if buf.numel() >= largest > 0]
        self._holders.clear()
        self._count = len(self._free)
        self._largest = largest

    @property
    def free(self) -> tuple[torch.Tensor, ...]:
        """The buffers no bucket holds now, for the next to take."""
        return tuple(self._free)

    @property
    def largest(self) -> int:
        """The elements a new buffer holds (the largest bucket of this build)."""
        return self._largest

    @property
    def allocated(self) -> int:
        """Buffers the pool has made since it was last reset."""
        return self._count


class ReduceScatterStaging(GradReducer):
    """Stages 2–3: each gradient is copied into a transient staging buffer as it
    arrives and freed; the bucket is reduce-scattered after every backward and
    accumulated into this rank's persistent gradient shard. The full gradient
    never persists (see worker/flat.py [Note: flat buffers])."""

    grads_in_place = False
    every_micro_step = True
    result = "shard"

    def __init__(self, reduce_dtype: torch.dtype, pool: StagingPool, finish: Callable) -> None:
        super().__init__(reduce_dtype)
        self.pool = pool
        self._finish = finish

    def grad_numel(self, spec: Bucket) -> int:
        return spec.shard_numel

    def allocate(self, b: FlatBucket, dtype: torch.dtype, zeros: Zeros) -> None:
        b.grad_shard = zeros(self.grad_numel(b.spec), dtype, b.full.device)

    def _staging(self, b: FlatBucket) -> torch.Tensor:
        """``b``'s staging buffer for this backward, taken from the pool on first use."""
        if b.staging is None:
            b.staging = self.pool.acquire(b, self._finish)
            b.staged = [False] * len(b.params)
        return b.staging

    def on_grad(self, b: FlatBucket, pos: int, p: nn.Parameter) -> None:
        slot = b.spec.slots[pos]
        dst = self._staging(b)[slot.offset : slot.offset + slot.numel]
        grad = p.grad.reshape(-1)
        # a parameter can receive its gradient in several pieces within one
        # backward (a reentrant checkpoint runs a backward of its own)
        dst.add_(grad) if b.staged[pos] else dst.copy_(grad)
        b.staged[pos] = True
        p.grad = None

    def source(self, b: FlatBucket) -> torch.Tensor:
        staging = self._staging(b)
        # the pool's buffers are reused: clear what no gradient wrote this time
        for pos, slot in enumerate(b.spec.slots):
            if not b.staged[pos]:
                staging[slot.offset : slot.offset + slot.numel].zero_()
        staging[b.spec.numel :].zero_()
        return staging

    def launch(self, b: FlatBucket, comm: Collectives) -> None:
        src = _as(self.source(b), self.reduce_dtype)
        assert b.grad_shard is not None
        direct = not b.accumulated and src.dtype == b.grad_shard.dtype
        b.reduced = b.grad_shard if direct else src.new_empty(b.spec.shard_numel)
        b.handle = comm.reduce_scatter(b.reduced, src, async_op=True)

    def done(self, b: FlatBucket) -> None:
        assert b.grad_shard is not None and b.reduced is not None
        if b.reduced is not b.grad_shard:
            if b.accumulated:
                b.grad_shard.add_(b.reduced)
            else:
                b.grad_shard.copy_(b.reduced)
        b.accumulated = True
        b.reduced = None
        self.pool.release(b)
        super().done(b)

    def partition_grad(self, b: FlatBucket) -> torch.Tensor:
        assert b.grad_shard is not None
        return b.grad_shard

    def zero(self, b: FlatBucket) -> None:
        assert b.grad_shard is not None
        b.grad_shard.zero_()
        b.reduced = None
        b.accumulated = False


class Compressed(GradReducer):
    """Any reducer, with its gradients sent compressed once warm-up is over.

    A compressed reduction is a reduce-scatter of encoded chunks (see
    worker/compression.py [Note: compressed reduce-scatter]); where the inner
    reducer wants the whole reduced bucket (stage 0) a compressed all-gather of
    the summed shards follows. With a ``hierarchy`` (qgZ, stages 2–3: this world's
    node groups, set by the state for each world it runs in) the reduce-scatter is
    hierarchical: full precision within the node, encoded across nodes
    (worker/compression.py [Note: hierarchical gradient reduce-scatter]).
    """

    def __init__(
        self,
        inner: GradReducer,
        codec: Codec,
        *,
        error_feedback: bool,
        active: Callable[[], bool],
    ) -> None:
        super().__init__(inner.reduce_dtype)
        self.inner, self.codec = inner, codec
        self.error_feedback = error_feedback
        self.active = active
        self.grads_in_place = inner.grads_in_place  # type: ignore[misc]
        self.every_micro_step = inner.every_micro_step  # type: ignore[misc]
        self.result = inner.result  # type: ignore[misc]
        self.hierarchy: NodeGroup | None = None
        # qgZ's exchanges whose cross leg has not started, in launch order
        self._unstarted: list[PendingHierarchicalReduceScatter] = []

    def bind(self, hierarchy: NodeGroup | None) -> None:
        """Reduce hierarchically over ``hierarchy``'s groups from now on (None: flat);
        exchanges of an earlier world are forgotten."""
        self.hierarchy = hierarchy
        self._unstarted.clear()

    def grad_numel(self, spec: Bucket) -> int:
        return self.inner.grad_numel(spec)

    def allocate(self, b: FlatBucket, dtype: torch.dtype, zeros: Zeros) -> None:
        self.inner.allocate(b, dtype, zeros)
        b.wire = WireBuffers()

    def on_grad(self, b: FlatBucket, pos: int, p: nn.Parameter) -> None:
        self.inner.on_grad(b, pos, p)

    def _residual(self, b: FlatBucket, numel: int, device: torch.device) -> torch.Tensor | None:
        """``b``'s error-feedback residual of ``numel`` elements (None without feedback)."""
        if not self.error_feedback:
            return None
        if b.residual is None or b.residual.numel() != numel:
            b.residual = torch.zeros(numel, device=device)
        return b.residual

    def launch(self, b: FlatBucket, comm: Collectives) -> None:
        if not (comm.distributed and self.active()):
            self.inner.launch(b, comm)
            return
        src = self.inner.source(b)
        b.comm = comm
        node = self.hierarchy
        if node is not None and node.world is comm:
            # [Note: hierarchical gradient reduce-scatter]: the cross legs of earlier
            # buckets whose node leg is done start now, in launch order
            while self._unstarted and self._unstarted[0].node_done():
                self._unstarted.pop(0).start_cross()
            exchange = start_hierarchical_reduce_scatter(
                node.comm,
                node.cross,
                self.codec,
                src,
                self._residual(b, b.spec.padded_numel // node.size, src.device),
                dtype=self.reduce_dtype,
                buffers=b.wire,
            )
            self._unstarted.append(exchange)
            b.exchange = exchange
            return
        b.exchange = start_reduce_scatter(
            comm,
            self.codec,
            src,
            self._residual(b, b.spec.padded_numel, src.device),
            logical_bytes=src.numel() * src.element_size(),
            buffers=b.wire,
        )

    def finish(self, b: FlatBucket) -> None:
        if b.exchange is None:
            self.inner.finish(b)
            return
        if b.state is not BucketState.REDUCING:
            return
        if isinstance(b.exchange, PendingHierarchicalReduceScatter):
            # the cross legs start in launch order, up to this bucket's
            while b.exchange in self._unstarted:
                self._unstarted.pop(0).start_cross()
        shard = b.exchange.finish()
        b.exchange = None
        if self.inner.result == "full":
            # the all-reduce's second half: every rank's summed shard to everyone
            if self.error_feedback and b.server_residual is None:
                b.server_residual = torch.zeros(b.spec.shard_numel, device=shard.device)
            full = torch.empty(b.spec.padded_numel, device=shard.device)
            start_all_gather(
                b.comm, self.codec, shard, full, b.server_residual, buffers=b.wire
            ).finish()
            shard = full
        self.inner.accept(b, shard)

    def partition_grad(self, b: FlatBucket) -> torch.Tensor:
        return self.inner.partition_grad(b)

    def zero(self, b: FlatBucket) -> None:
        self.inner.zero(b)

    def nbytes(self, b: FlatBucket) -> int:
        return self.inner.nbytes(b)


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
            if self.gather_codec is None or not comm.distributed:
                return comm.all_gather(b.full, src, async_op=True)
            # qwZ: this rank's slot keeps ``src`` exact (in fp32 it is the master)
            if b.gather_wire is None:
                b.gather_wire = WireBuffers()
            return start_all_gather(
                comm, self.gather_codec, src, b.full, buffers=b.gather_wire, exact_own=True
            )

    def nbytes(self, b: FlatBucket) -> int:
        return _nbytes(b.full)

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
    ) -> None:
        super().__init__(dtype, master_apart, gather_codec=gather_codec)
        self.prefetch = prefetch
        # [Note: hierarchical partitioning]: the ranks per node asked for, and this
        # world's node group (None: hpZ off in this world)
        self.hpz = hpz
        self.node: NodeGroup | None = None
        self.max_reuse_distance, self.max_live = max_reuse_distance, max_live
        self.live = LiveElements()
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
        b.full.untyped_storage().resize_(0)
        mark_sharded(b.params)

    def attach(self, buckets: list[FlatBucket], comm: Collectives, units: dict) -> None:
        self.detach()
        self.comm = comm
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
            )
            if self.node is not None:
                unit = HierarchicalUnit(
                    index,
                    module,
                    unit.buckets,
                    self.gather_codec,
                    fetch=self.home.fetch,
                    live=self.live,
                    node=self.node,
                )
            self.units.append(unit)
            self._hooks += [
                module.register_forward_pre_hook(self._pre_forward_hook(unit)),
                module.register_forward_hook(self._post_forward_hook(unit)),
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

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        for unit in self.units:
            unit.gather(self.comm)
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
        unit.gather(self.comm)
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
        return _nbytes(b.shard) + _nbytes(b.secondary)

    def after_launch(self, b: FlatBucket) -> None:
        unit = self._unit_by_index[b.spec.unit]
        if all(x.state in (BucketState.REDUCING, BucketState.REDUCED) for x in unit.buckets):
            unit.reshard()

    def begin_backward(self) -> None:
        self._in_backward = True

    def end_backward(self) -> None:
        self._in_backward = False
        for unit in self.units:
            unit.reshard()
        if not self._order_recorded:
            self._kept = self._kept_into_backward()
        self._order_recorded = bool(self.units)

    # the hooks: gather, wait, prefetch; free after use

    def _pre_forward_hook(self, unit: GatherUnit):
        def hook(module: nn.Module, args: Any) -> None:
            with record_function("zeroplane.gather"):
                unit.gather(self.comm)
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
            unit.gather(self.comm)
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
                ahead.gather(self.comm)


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


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
