"""ZeRO-Offload on CPU: this rank's optimizer partition and stage-3 parameter shards
in host memory.

Two switches of :class:`~worker.config.ZeroConfig`, two pieces here that the
shard state (worker/state.py) composes with a stage's reducer and parameter
storage (worker/stages.py):

* :class:`Placement` says where each of a rank's tensors is allocated: the
  fp32 master partition (and so the optimizer state torch creates beside it)
  on the host with ``offload_optimizer="cpu"``, the stage-3 parameter shards
  on the host with ``offload_params="cpu"``, everything else on the device.
  It allocates those buffers (page-locked where the device is CUDA and
  ``pin_memory`` is on) and brings a host shard to the device
  (:meth:`Placement.fetch`).
* :class:`OffloadedGrads` wraps a stage's gradient reducer: when a bucket's
  reduction is done at the accumulation boundary, its reduced gradient shard
  is copied into a reused fp32 host buffer at once (on CUDA on a side stream,
  non-blocking, so the copy overlaps the rest of backward), and that host
  buffer is what the optimizer step reads.

[Note: optimizer offload]
The step is the same sequence as without offload (worker/engine.py): the
gradient shards, now on the host, are unscaled and averaged, their global
norm is reduced across ranks (clipping, fp16 overflow and skipped steps
decide exactly as before), and the user's optimizer class steps the
per-parameter views of the host master partition (worker/optim.py), so its
state tensors are created on the host too. Publishing then copies the
updated partition to the device in the compute dtype: at stages 1-2 into the
send buffer of the parameter all-gather, at stage 3 into the parameter shard
(the shard itself stays on the host with ``offload_params``). On CPU the
"device" is host memory as well: the same copies run, synchronously, so
every path is exercised by the CPU tests.

What stays on the device with optimizer offload: the compute parameters (all
of them at stages 1-2, a shard at stage 3), the gradient buffers the reducer
needs (stage 1: the full gradient; stages 2-3: this rank's gradient shard,
accumulated there over micro-steps) and transient staging and publish buffers.

[Note: parameter offload]
At stage 3 a unit's gather is an all-gather of every rank's shard into the
unit's flat buffer. With ``offload_params`` the shard lives on the host, so
the gather first copies it into a transient device buffer (non-blocking from
pinned memory), all-gathers from there and drops the copy once the gather is
waited on. Prefetch already starts the next unit's gather ahead of its use
(worker/stages.py, ``ShardedParams``), so the next unit's host-to-device copy
is issued with it. The device holds only the units in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from coordinator.core.layout import Bucket
from worker.collectives import Collectives
from worker.config import ZeroConfig
from worker.flat import BucketState, FlatBucket, Zeros
from worker.stages import GradReducer

__all__ = ["HOST", "Location", "OffloadedGrads", "Placement"]

logger = logging.getLogger(__name__)

HOST = torch.device("cpu")
Location = Literal["device", "host"]


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one rank's state lives (see the module notes)."""

    device: torch.device
    optimizer_on_host: bool = False
    params_on_host: bool = False
    pin_memory: bool = False

    @classmethod
    def from_config(cls, config: ZeroConfig, device: torch.device) -> Placement:
        return cls(
            device=device,
            optimizer_on_host=config.offload_optimizer == "cpu",
            params_on_host=config.offload_params == "cpu",
            # page-locked memory exists only beside a CUDA device
            pin_memory=config.pin_memory and device.type == "cuda",
        )

    @property
    def offloads(self) -> bool:
        return self.optimizer_on_host or self.params_on_host

    def master_apart(self, mixed_precision: bool) -> bool:
        """Whether the fp32 master partition is a tensor of its own rather than a view
        of the compute parameters: in mixed precision, and wherever offload puts
        one of them on the host and the other on the device."""
        return mixed_precision or self.offloads

    @property
    def master_location(self) -> Location:
        return "host" if self.optimizer_on_host else "device"

    @property
    def shard_location(self) -> Location:
        """Where stage-3 parameter shards live."""
        return "host" if self.params_on_host else "device"

    def _on(self, location: Location) -> torch.device:
        return HOST if location == "host" else self.device

    def host_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype, device=HOST, pin_memory=self.pin_memory)
        return t.zero_()

    def zeros(
        self, numel: int, dtype: torch.dtype, location: Location, device_zeros: Zeros | None = None
    ) -> torch.Tensor:
        """Zeros at ``location``; on the device made by ``device_zeros`` when given
        (worker/build_ahead.py [Note: a build from buffers written ahead])."""
        if location == "host":
            return self.host_zeros(numel, dtype)
        if device_zeros is not None:
            return device_zeros(numel, dtype, self.device)
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def new_master(self, numel: int, device_zeros: Zeros | None = None) -> torch.Tensor:
        """This rank's fp32 master partition, zeroed, where the optimizer runs."""
        return self.zeros(numel, torch.float32, self.master_location, device_zeros)

    def new_shard(
        self, master: torch.Tensor, dtype: torch.dtype, device_zeros: Zeros | None = None
    ) -> torch.Tensor:
        """A stage-3 parameter shard holding ``master``'s values in ``dtype``."""
        shard = self.zeros(master.numel(), dtype, self.shard_location, device_zeros)
        shard.copy_(master)
        return shard

    def fetch(self, shard: torch.Tensor) -> torch.Tensor:
        """``shard`` on the device, for a collective to send from ([Note: parameter
        offload]): a fresh device copy of a host shard (non-blocking from pinned
        memory; on CPU a plain copy), the shard itself where it already lives on
        the device."""
        if not self.params_on_host:
            return shard
        out = torch.empty(shard.numel(), dtype=shard.dtype, device=self.device)
        out.copy_(shard, non_blocking=self.pin_memory)
        return out


class _Copier:
    """Device-to-host copies that overlap compute: on CUDA on a side stream, each
    with an event to wait on; elsewhere synchronous."""

    def __init__(self, device: torch.device, non_blocking: bool) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.non_blocking = non_blocking

    def start(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
        if self.stream is None:
            dst.copy_(src)
            return None
        # the copy reads what the compute stream wrote (the reduction's result)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=self.non_blocking)
            done = torch.cuda.Event()
            done.record(self.stream)
        src.record_stream(self.stream)
        return done


class OffloadedGrads(GradReducer):
    """Any reducer, with each bucket's reduced gradient shard copied to a host buffer
    as soon as its reduction is done at the accumulation boundary ([Note: optimizer
    offload]). ``boundary()`` says whether the backward running now ends an
    accumulation window (stages 2-3 reduce after every micro-step; only the last
    result is the step's)."""

    def __init__(
        self, inner: GradReducer, placement: Placement, boundary: Callable[[], bool]
    ) -> None:
        super().__init__(inner.reduce_dtype)
        self.inner, self.placement, self.boundary = inner, placement, boundary
        self.grads_in_place = inner.grads_in_place  # type: ignore[misc]
        self.every_micro_step = inner.every_micro_step  # type: ignore[misc]
        self.result = inner.result  # type: ignore[misc]
        self.copier = _Copier(placement.device, placement.pin_memory)
        # bucket index -> reused fp32 host buffer, and the copies started this step
        self.host: dict[int, torch.Tensor] = {}
        self.copies: dict[int, torch.cuda.Event | None] = {}

    def grad_numel(self, spec: Bucket) -> int:
        return self.inner.grad_numel(spec)

    def allocate(self, b: FlatBucket, dtype: torch.dtype, zeros: Zeros) -> None:
        self.inner.allocate(b, dtype, zeros)
        self.host[b.spec.index] = self.placement.host_zeros(b.hi - b.lo, torch.float32)
        self.copies.pop(b.spec.index, None)

    def on_grad(self, b: FlatBucket, pos: int, p: nn.Parameter) -> None:
        self.inner.on_grad(b, pos, p)

    def source(self, b: FlatBucket) -> torch.Tensor:
        return self.inner.source(b)

    def launch(self, b: FlatBucket, comm: Collectives) -> None:
        self.inner.launch(b, comm)

    def finish(self, b: FlatBucket) -> None:
        self.inner.finish(b)
        if b.state is BucketState.REDUCED and b.spec.index not in self.copies and self.boundary():
            self._copy_out(b)

    def accept(self, b: FlatBucket, reduced: torch.Tensor) -> None:
        self.inner.accept(b, reduced)

    def _copy_out(self, b: FlatBucket) -> None:
        dst = self.host[b.spec.index]
        self.copies[b.spec.index] = self.copier.start(dst, self.inner.partition_grad(b))

    def partition_grad(self, b: FlatBucket) -> torch.Tensor:
        """The host copy of ``b``'s reduced gradient shard (fp32), once it has landed."""
        if b.spec.index not in self.copies:
            # not reduced this step (stage 1 with nothing to reduce): copy what there is
            self._copy_out(b)
        done = self.copies[b.spec.index]
        if done is not None:
            done.synchronize()
        return self.host[b.spec.index]

    def zero(self, b: FlatBucket) -> None:
        self.inner.zero(b)
        self.copies.pop(b.spec.index, None)

    def nbytes(self, b: FlatBucket) -> int:
        return self.inner.nbytes(b)

    def host_nbytes(self, b: FlatBucket) -> int:
        t = self.host.get(b.spec.index)
        return 0 if t is None else t.numel() * t.element_size()

    def release(self) -> None:
        """Drop every host buffer (before the buckets are rebuilt)."""
        self.host.clear()
        self.copies.clear()
