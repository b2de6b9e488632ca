"""The gradient reducers a ZeRO stage chooses from (worker/stages.py puts them together).

:class:`AllReduce` into replicated buffers (stage 0), :class:`ReduceScatterPersistent`
of full gradient buffers kept across micro-steps (stage 1), or
:class:`ReduceScatterStaging` of a transient staging buffer (from a
:class:`StagingPool`) into a persistent gradient shard (stages 2–3).
:class:`Compressed` wraps any of them (worker/compression.py). A bucket's
progress through them is worker/stages.py's [Note: bucket progress].
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ClassVar, Literal

import torch
from torch import nn

from coordinator.core.layout import Bucket
from worker.collectives import Collectives, grained, smallest_fit
from worker.compression import (
    Codec,
    PendingHierarchicalReduceScatter,
    WireBuffers,
    start_all_gather,
    start_hierarchical_reduce_scatter,
    start_reduce_scatter,
)
from worker.flat import BucketState, FlatBucket, NodeGroup, Zeros

__all__ = [
    "AllReduce",
    "Compressed",
    "GradReducer",
    "ReduceScatterPersistent",
    "ReduceScatterStaging",
    "StagingPool",
]

logger = logging.getLogger(__name__)


def nbytes_of(t: torch.Tensor | None) -> int:
    """Bytes ``t`` holds; 0 for a buffer not allocated."""
    return 0 if t is None else t.numel() * t.element_size()


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


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
        return nbytes_of(b.grad_full) + nbytes_of(b.grad_shard)


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

    [Note: staging buffers by need]
    Each buffer is made as large as the bucket that takes it needs (rounded up by
    BUFFER_GRAIN), and a bucket takes the smallest free one that fits. Made at the
    largest bucket's size every one, at stage 3 the pool held two of the root unit's
    (a GPT's embedding and head: 32 MiB each, 8 ranks, bench/birth.py's model) where
    the backward needs one of those and one of a block's (8 MiB): the root's bucket
    is taken by the head's gradients first and kept until the embedding's come last.
    Where small buckets take buffers before a large one in every backward, the pool
    still ends with two of the large one's size, as before.

    A bucket takes one when its first gradient of a backward arrives and gives
    it back once its reduce-scatter is waited on, or at once where the collective
    no longer reads it (a shared exchange writes its input out as it is issued:
    worker/shared_exchange.py; a reduction in another dtype reads a copy), so
    that one buffer serves bucket after bucket. A bucket of one parameter that
    fills it takes none: its gradient is reduced as it is (``_is_the_bucket``),
    which spares a copy and a buffer of an embedding's or a head's size. When both are taken, the
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
        fit = smallest_fit(self._free, numel, b.full)
        if fit is not None:
            buf = self._free.pop(fit)
        else:
            if self._free and self._count >= self.size:
                # none fits: give one back rather than hold a buffer more
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))
                self._count -= 1
            self._count += 1
            if self._count > self.size:
                logger.debug("staging pool grew to %d buffers", self._count)
            # as large as this bucket needs ([Note: staging buffers by need]), rounded up
            # so that the next world's buckets fit too (see reset)
            buf = b.full.new_empty(grained(numel))
        self._holders.append(b)
        return buf[:numel]

    def release(self, b: FlatBucket) -> None:
        if b.staging is None:
            return
        if b in self._holders:  # not a gradient reduced in place of a buffer
            self._holders.remove(b)
            base = b.staging._base if b.staging._base is not None else b.staging
            self._free.append(base)
        b.staging = None

    def trim(self) -> None:
        """Drop the free buffers beyond the pool's size (a pipeline's step grows it to
        every bucket of its stage: worker/pipeline_engine.py [Note: pipeline gradients into
        ZeRO])."""
        keep = max(0, self.size - len(self._holders))
        if len(self._free) > keep:
            del self._free[keep:]
            self._count = len(self._free) + len(self._holders)

    def warm(self, like: torch.Tensor, numels: list[int]) -> None:
        """Make the pool's buffers now, written once, as ``like``'s dtype and device, for
        the largest of the buckets' ``numels`` (one each): a backward then takes them
        without a page fault per 4 KiB."""
        for numel in sorted(numels, reverse=True)[: max(0, self.size - self._count)]:
            self._free.append(like.new_zeros(grained(numel)))
            self._count += 1

    def reset(self, largest: int) -> None:
        """After a rebuild (``largest``: the largest bucket now; 0 drops every buffer):
        the free buffers are kept (a membership change keeps every bucket's size within a
        few padding elements, and a buffer taken afresh there is a page fault per
        4 KiB in the first backward of the new world); held ones are not reused
        (a backward cut short may still be reducing from them)."""
        self._free = self._free[: self.size] if largest > 0 else []
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

    def _is_the_bucket(self, b: FlatBucket, grad: torch.Tensor) -> bool:
        """Whether ``grad`` can be reduced as it is, in the place of a staging buffer:
        the gradient of a bucket's only parameter, filling it (no padding), contiguous,
        in the dtype and on the device the bucket reduces in ([Note: staging buffers by
        need]). An embedding's or an output head's bucket is often that."""
        return (
            b.staging is None
            and len(b.params) == 1
            and b.spec.padded_numel == b.spec.numel == grad.numel()
            and grad.dtype == self.reduce_dtype
            and grad.device == b.full.device
            and grad.is_contiguous()
        )

    def on_grad(self, b: FlatBucket, pos: int, p: nn.Parameter) -> None:
        grad = p.grad.reshape(-1)
        if self._is_the_bucket(b, grad):  # the bucket is the gradient: no copy
            b.staging, b.staged = grad, [True]
            p.grad = None
            return
        slot = b.spec.slots[pos]
        dst = self._staging(b)[slot.offset : slot.offset + slot.numel]
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
        staging = self.source(b)
        src = _as(staging, self.reduce_dtype)
        assert b.grad_shard is not None
        direct = not b.accumulated and src.dtype == b.grad_shard.dtype
        b.reduced = b.grad_shard if direct else src.new_empty(b.spec.shard_numel)
        b.handle = comm.reduce_scatter(b.reduced, src, async_op=True)
        if src is not staging or b.handle.input_free:
            self.pool.release(b)  # nothing reads it any more: the next bucket may take it

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
