"""One bucket's flat buffers on this rank, and the stage-3 gather units.

[Note: flat buffers]
A bucket's parameters are views into one flat buffer (``full``) so the
all-gather after the optimizer step, and the stage-3 gather before forward,
write every parameter with one collective. At stages 0–1 the gradients are
views into one flat buffer (``grad_full``) that autograd accumulates into in
place, so a bucket's all-reduce or reduce-scatter runs on that buffer with no
copy. At stages 2–3 gradients are copied into a transient ``staging`` buffer
as they arrive (buffers from a pool of two, worker/stages.py), reduce-scattered,
and accumulated into the persistent ``grad_shard``; the full gradient never
persists.

[Note: stage-3 storage]
At stage 3 a unit's parameters stay views into ``full`` for the whole run;
what changes is whether ``full``'s storage is allocated. Resharding resizes
the storage to zero bytes; gathering resizes it back and all-gathers into it.
Autograd's saved references to the parameters then see the re-gathered
values in backward, with nothing re-registered on the module.

[Note: gathered storages from a pool]
On the CPU, where the memory comes from glibc's malloc, a gather's storage made
anew each time (``resize_``) and freed at the reshard was carved up by the
activations allocated meanwhile: the next unit's gather no longer fitted the
hole and the heap grew, about 5 MiB a step per 8 MiB unit (bench/birth.py, 8
ranks: a first step's peak 299 MiB of resident memory over a model state of 113).
So a CPU unit's storage takes its memory from :class:`GatheredStorages`: the
gather swaps the data of a pooled storage of the bucket's size into ``full``'s
(``UntypedStorage._swap_data_ptr_``, worker/compat.py; the views see it as they
saw a resize), the reshard swaps it back out into the pool, which keeps two free
of each size for the next gathers and frees the rest. The gathers' memory is
then made once and reused, never given to activations; a build puts the memory
of the values it shards there for the first gathers, and a release (before a
build for another world) empties it. Accelerators keep
``resize_`` (their caching allocators pool it already), as do torch versions
without the swap.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from coordinator.core.layout import Bucket, SlotShard
from worker.collectives import Collectives, Handle
from worker.compat import can_swap_storages
from worker.compression import (
    Codec,
    PendingAllGather,
    PendingHierarchicalReduceScatter,
    PendingReduceScatter,
    WireBuffers,
    start_all_gather,
)
from worker.sharded import mark_gathered, mark_sharded
from worker.whereabouts import TRACKER

__all__ = [
    "BucketState",
    "FlatBucket",
    "GatherUnit",
    "GatheredStorages",
    "HierarchicalUnit",
    "LiveElements",
    "NodeGroup",
    "Reserve",
    "UnitState",
    "Zeros",
]

# makes a zeroed 1-D tensor: (numel, dtype, device)
Zeros = Callable[[int, torch.dtype, torch.device], torch.Tensor]


class Reserve:
    """Zeroed tensors made ahead of a build, which the build takes instead of
    allocating, matched by size, dtype and device (worker/build_ahead.py [Note: a
    build from buffers written ahead]). What a build does not take is dropped
    once it is done."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}

    @classmethod
    def make(cls, requests: list[tuple[int, torch.dtype, torch.device]]) -> Reserve:
        """Every tensor of ``requests`` made and written now (its pages faulted in)."""
        reserve = cls()
        for numel, dtype, device in requests:
            t = torch.zeros(numel, dtype=dtype, device=device)
            reserve._free.setdefault((numel, dtype, t.device), []).append(t)
        return reserve

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A reserved tensor of this size, dtype and device, else a new one."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        free = self._free.get((numel, dtype, device))
        if free:
            return free.pop()
        return torch.zeros(numel, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)


class BucketState(enum.Enum):
    """A bucket's progress through one backward (worker/stages.py [Note: bucket progress])."""

    IDLE = "idle"
    FILLING = "filling"
    READY = "ready"
    REDUCING = "reducing"
    REDUCED = "reduced"


@dataclass(eq=False)
class FlatBucket:
    spec: Bucket
    params: list[nn.Parameter]
    param_index: list[int]
    lo: int
    hi: int
    pieces: list[SlotShard]
    full: torch.Tensor
    master: torch.Tensor
    shard: torch.Tensor | None = None
    grad_full: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None
    staging: torch.Tensor | None = None
    reduced: torch.Tensor | None = None
    exchange: PendingReduceScatter | PendingHierarchicalReduceScatter | None = None
    residual: torch.Tensor | None = None
    server_residual: torch.Tensor | None = None
    accumulated: bool = False
    state: BucketState = BucketState.IDLE
    # gradients still expected this backward (FILLING), which slots of ``staging``
    # were written, and the compressed path's reused payload buffers and group
    pending: int = 0
    staged: list[bool] = field(default_factory=list)
    wire: WireBuffers | None = None
    # the quantized parameter all-gather's payload buffers (stages 1–2), apart from
    # the gradient exchange's
    gather_wire: WireBuffers | None = None
    comm: Collectives | None = None
    handle: Handle | None = None
    # hpZ (stage 3): this rank's node-local slice of the gathered bucket, and whether
    # it holds the current values (worker/stages.py [Note: hierarchical partitioning])
    secondary: torch.Tensor | None = None
    secondary_fresh: bool = False

    @functools.cached_property
    def label(self) -> str:
        """The module path of this bucket's parameters, for naming its collectives
        (worker/whereabouts.py [Note: naming a stall])."""
        return modules_of(s.name for s in self.spec.slots)

    def param_views(self) -> None:
        """Point every parameter's ``.data`` at its slot in ``full``."""
        mark_gathered(self.params)
        for p, slot in zip(self.params, self.spec.slots, strict=True):
            p.data = self.full[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def grad_views(self) -> None:
        """Point every parameter's ``.grad`` at its slot in ``grad_full``."""
        assert self.grad_full is not None
        for p, slot in zip(self.params, self.spec.slots, strict=True):
            p.grad = self.grad_full[slot.offset : slot.offset + slot.numel].view(slot.shape)


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class GatheredStorages:
    """The memory of gathered stage-3 buckets ([Note: gathered storages from a pool]):
    :meth:`fill` gives a bucket's empty ``full`` its memory, :meth:`empty` takes it
    back; up to ``keep`` free storages of each size are kept for the next fills."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: dict[tuple[torch.device, int], list[torch.UntypedStorage]] = {}

    @staticmethod
    def pooled(full: torch.Tensor) -> bool:
        return full.device.type == "cpu" and can_swap_storages()

    def fill(self, full: torch.Tensor) -> None:
        nbytes = full.numel() * full.element_size()
        if not self.pooled(full):
            full.untyped_storage().resize_(nbytes)
            return
        free = self._free.get((full.device, nbytes))
        if free:
            donor = free.pop()
        else:
            donor = torch.empty(nbytes, dtype=torch.uint8, device=full.device).untyped_storage()
        full.untyped_storage()._swap_data_ptr_(donor)

    def empty(self, full: torch.Tensor) -> None:
        storage = full.untyped_storage()
        if not self.pooled(full) or storage.nbytes() == 0:
            storage.resize_(0)
            return
        nbytes = storage.nbytes()
        holder = torch.empty(0, dtype=torch.uint8, device=full.device).untyped_storage()
        storage._swap_data_ptr_(holder)
        free = self._free.setdefault((full.device, nbytes), [])
        if len(free) < self.keep:
            free.append(holder)

    def clear(self) -> None:
        self._free.clear()

    @property
    def held(self) -> int:
        """Bytes of the free storages kept."""
        return sum(s.nbytes() for free in self._free.values() for s in free)

    @property
    def sizes(self) -> set[int]:
        """The sizes in bytes of the free storages kept."""
        return {nbytes for (_, nbytes), free in self._free.items() if free}


@dataclass
class LiveElements:
    """The parameter elements of the gather units that are gathered or gathering."""

    numel: int = 0


def modules_of(names: Iterable[str]) -> str:
    """The deepest module path that holds every one of the parameter ``names``
    ("blocks.3.mlp" for blocks.3.mlp.fc.weight and blocks.3.mlp.proj.bias), or the
    first parameter's module and a count where they share none."""
    names = list(names)
    if not names:
        return ""
    paths = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for parts in zip(*paths, strict=False):
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    if common or len(names) == 1:
        return ".".join(common) or "(root)"
    return f"{'.'.join(paths[0]) or '(root)'} and {len(names) - 1} more parameters"


@dataclass(eq=False)
class GatherUnit:
    """A stage-3 gather unit: one module's parameters, gathered and freed together.

    ``fetch`` gives a bucket's shard on the device to send from (a copy of an
    offloaded shard, worker/offload.py [Note: parameter offload]); such copies
    are kept in ``inbound`` until the gather is waited on."""

    index: int
    module: nn.Module
    buckets: list[FlatBucket]
    codec: Codec | None = None
    state: UnitState = UnitState.SHARDED
    handles: list[Handle | PendingAllGather] = field(default_factory=list)
    wire: list[WireBuffers] = field(default_factory=list)
    fetch: Callable[[torch.Tensor], torch.Tensor] | None = None
    inbound: list[torch.Tensor] = field(default_factory=list)
    live: LiveElements = field(default_factory=LiveElements)  # shared by a model's units
    storages: GatheredStorages = field(default_factory=GatheredStorages)  # shared alike
    _counted: int = 0  # what this unit added to ``live``

    @property
    def numel(self) -> int:
        return sum(b.full.numel() for b in self.buckets)

    @functools.cached_property
    def name(self) -> str:
        """The module path of this unit's parameters (its module's, where it owns
        every one of them)."""
        return modules_of(s.name for b in self.buckets for s in b.spec.slots)

    def gather(self, comm: Collectives) -> None:
        """Start gathering (asynchronously) if sharded."""
        if self.state is not UnitState.SHARDED:
            return
        with TRACKER.labelled(self.name):
            self._gather(comm)

    def _gather(self, comm: Collectives) -> None:
        self._counted = self.numel
        self.live.numel += self._counted
        if self.codec is not None:
            self.wire += [WireBuffers() for _ in self.buckets[len(self.wire) :]]
        for i, b in enumerate(self.buckets):
            self.storages.fill(b.full)
            mark_gathered(b.params)
            assert b.shard is not None
            src = b.shard if self.fetch is None else self.fetch(b.shard)
            if src is not b.shard:
                self.inbound.append(src)
            codec = None if self.codec is None else self.codec.bind(b.spec, b.full.dtype)
            if codec is None:
                self.handles.append(comm.all_gather(b.full, src, async_op=True))
            else:
                self.handles.append(
                    start_all_gather(comm, codec, src, b.full, buffers=self.wire[i], exact_own=True)
                )
        self.state = UnitState.GATHERING

    def wait(self) -> None:
        if self.state is UnitState.GATHERING:
            for h in self.handles:
                h.finish() if isinstance(h, PendingAllGather) else h.wait()
            self.handles.clear()
            self.inbound.clear()
            self.state = UnitState.GATHERED

    def reshard(self) -> None:
        self.wait()
        if self.state is UnitState.GATHERED:
            for b in self.buckets:
                self.storages.empty(b.full)
                mark_sharded(b.params)
            self.state = UnitState.SHARDED
            self.live.numel -= self._counted
            self._counted = 0


class NodeGroup:
    """hpZ's and qgZ's node group of this rank: the ``size`` consecutive ranks of
    ``world`` that hold it, formed at its first use (worker/stages.py [Note:
    hierarchical partitioning]); ``rank`` is this rank's place in it. ``cross``:
    qgZ's cross-node group, the ranks of every node at this rank's place
    (worker/compression.py [Note: hierarchical gradient reduce-scatter]), also
    formed at its first use."""

    def __init__(self, world: Collectives, size: int) -> None:
        self.world, self.size = world, size
        self.rank = world.rank % size
        self._comm: Collectives | None = None
        self._cross: Collectives | None = None

    @property
    def comm(self) -> Collectives:
        if self._comm is None:
            self._comm = self.world.split(self.size)
        return self._comm

    @property
    def cross(self) -> Collectives:
        if self._cross is None:
            self._cross = self.world.across(self.size)
        return self._cross

    @property
    def formed(self) -> Collectives | None:
        """The group's collectives if it has been formed, else None."""
        return self._comm

    @property
    def cross_formed(self) -> Collectives | None:
        """The cross-node group's collectives if it has been formed, else None."""
        return self._cross


@dataclass(eq=False)
class HierarchicalUnit(GatherUnit):
    """A stage-3 gather unit under hpZ: released, it keeps its node-local slice of
    each bucket (``secondary``); gathered again before the next optimizer step,
    it all-gathers those slices within its node group instead of the world."""

    node: NodeGroup | None = None

    def gather(self, comm: Collectives) -> None:
        if self.state is not UnitState.SHARDED:
            return
        if not self.buckets or not all(b.secondary_fresh for b in self.buckets):
            super().gather(comm)  # the world's all-gather, which refreshes the slices
            return
        assert self.node is not None
        node = self.node.comm
        self._counted = self.numel
        self.live.numel += self._counted
        for b in self.buckets:
            self.storages.fill(b.full)
            mark_gathered(b.params)
            assert b.secondary is not None
            self.handles.append(node.all_gather(b.full, b.secondary, async_op=True))
        self.state = UnitState.GATHERING

    def reshard(self) -> None:
        self.wait()
        if self.state is UnitState.GATHERED:
            assert self.node is not None
            with torch.no_grad():
                for b in self.buckets:
                    if not b.secondary_fresh:
                        assert b.secondary is not None
                        n = b.secondary.numel()
                        b.secondary.copy_(b.full[self.node.rank * n : (self.node.rank + 1) * n])
                        b.secondary_fresh = True
        super().reshard()
