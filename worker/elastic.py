"""Moving live training state between world sizes: no restart, no disk.

[Note: live reshard]
A membership change goes from layout L_old (the old world size) to L_new.
Both are pure functions of the parameter inventory and a world size, so
every rank, newcomers included, computes both without being told. State is
addressed by (parameter name, element range) as in a checkpoint
(worker/checkpoint.py): old rank o is the source of the elements in range o
of every bucket of L_old; new rank n needs the elements its optimizer owns
in L_new. Each rank packs, for each destination, the slices of its entries
that destination needs, packed for all destinations into one buffer (one
copy), and one all-to-all over a group holding every old and every new member
moves them all. Elements whose owner does not change never leave the process
and are not packed: the hand-over gives them to the caller as views of what
it holds, and adopting copies them into the new buffers.

The transfer runs over the larger of the two memberships: the new group for
a scale-up (newcomers join it), the old group for a graceful scale-down
(leavers hand over before they exit). After a crash the dead rank's entries
come from the replica a neighbour keeps (see :class:`Replica`), brought
forward to the survivors' step by that neighbour's log of its gradients (see
:class:`GradientLog`).

Entries cross the wire in a small self-describing format (a JSON header of
names, dtypes and shapes, then raw bytes): no pickle.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from coordinator.core.ranges import Range, RangeIndex, owned_ranges
from worker.collectives import CollectiveError, Collectives, Handle
from worker.state import Counters, Entries, MissingRange, ShardState

__all__ = [
    "GradientLog",
    "Handover",
    "Holding",
    "LoggedStep",
    "PendingRefresh",
    "Replica",
    "RestorePlan",
    "adopt",
    "buffer_of",
    "exchange",
    "pack_entries",
    "plan_restore",
    "refresh_replica",
    "roll_forward",
    "start_refresh",
    "unpack_entries",
]

logger = logging.getLogger(__name__)


@dataclass
class _Packing:
    """Where each tensor of some entries goes in a packed buffer: the prefix (length
    and JSON header), then every tensor's bytes at a 16-byte aligned offset."""

    prefix: bytes
    tensors: list[tuple[torch.Tensor, int]]  # (raw bytes, offset after the prefix)
    nbytes: int

    @classmethod
    def of(cls, entries: Entries) -> _Packing:
        header: list[dict[str, Any]] = []
        tensors: list[tuple[torch.Tensor, int]] = []
        offset = 0
        for key, entry in entries.items():
            row: dict[str, Any] = {"key": key, "tensors": [], "scalars": {}}
            fields = {"master": entry["master"]}
            for k, v in entry["state"].items():
                if isinstance(v, torch.Tensor):
                    fields[f"state.{k}"] = v
                else:
                    row["scalars"][k] = v
            for field, t in fields.items():
                raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
                row["tensors"].append(
                    [field, str(t.dtype).removeprefix("torch."), list(t.shape), offset]
                )
                tensors.append((raw, offset))
                # every tensor starts aligned, so that it can be read as a view
                offset += raw.numel() + (-raw.numel() % _ALIGN)
            header.append(row)
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-(8 + len(head)) % _ALIGN)  # JSON ignores the padding
        prefix = struct.pack("<Q", len(head)) + head
        return cls(prefix, tensors, len(prefix) + offset)

    def write(self, out: torch.Tensor) -> None:
        """Fill ``out`` (``nbytes`` bytes, on any device): the one copy of the values."""
        out[: len(self.prefix)] = torch.frombuffer(bytearray(self.prefix), dtype=torch.uint8)
        body = out[len(self.prefix) :]
        for raw, offset in self.tensors:
            body[offset : offset + raw.numel()].copy_(raw)


def pack_entries(entries: Entries, *, into: torch.Tensor | None = None) -> torch.Tensor:
    """Serialise checkpoint-style entries into one uint8 tensor (no pickle): the
    first bytes of ``into`` when it is large enough (a host buffer to reuse), else
    a new one."""
    packing = _Packing.of(entries)
    if into is not None and into.numel() >= packing.nbytes:
        out = into[: packing.nbytes]
    else:
        out = torch.empty(packing.nbytes, dtype=torch.uint8)
    packing.write(out)
    return out


# tensors in a packed buffer start at multiples of this many bytes from its start
_ALIGN = 16


def unpack_entries(buf: torch.Tensor, *, copy: bool = True) -> Entries:
    """The entries ``buf`` holds: copies, or (``copy=False``) views into ``buf``,
    which then must not change while they are in use."""
    if buf.numel() == 0:
        return {}
    (n,) = struct.unpack("<Q", bytes(buf[:8].tolist()))
    header = json.loads(bytes(buf[8 : 8 + n].tolist()))
    body = buf[8 + n :]
    out: Entries = {}
    for row in header:
        entry: dict[str, Any] = {"state": dict(row["scalars"])}
        for field, dtype_name, shape, offset in row["tensors"]:
            dtype = getattr(torch, dtype_name)
            numel = 1
            for d in shape:
                numel *= d
            size = torch.empty((), dtype=dtype).element_size()
            raw = body[offset : offset + numel * size]
            # a view needs its elements aligned (a buffer cut from a larger one may not be)
            view = not copy and raw.data_ptr() % size == 0
            t = (raw if view else raw.clone()).view(dtype).reshape(shape)
            if field == "master":
                entry["master"] = t
            else:
                entry["state"][field.removeprefix("state.")] = t
        out[row["key"]] = entry
    return out


def _slice_entry(entry: dict[str, Any], lo: int, hi: int, numel: int) -> dict[str, Any]:
    """Elements [lo, hi) of ``entry``, as views (packing copies them)."""
    state = {
        k: v[lo:hi] if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == numel else v
        for k, v in entry["state"].items()
    }
    return {"master": entry["master"][lo:hi], "state": state}


@dataclass
class Handover:
    """What a rank received in a transfer, to adopt once its new group is up."""

    entries: Entries
    counters: Counters
    # no rank of the transfer held state: a job that never formed a group yet
    # (its first generation was superseded before it formed; see worker/session.py)
    nobody_held: bool = False
    # the lowest new rank that held state: its frozen parameters and module buffers
    # are the job's (a newcomer's are its fresh module's)
    unsharded_from: int | None = None
    # the host buffer the received entries are views of: free once adopted, for a
    # snapshot to reuse ([Note: a snapshot into the last one's buffer])
    received: torch.Tensor | None = None


def exchange(
    state: ShardState,
    *,
    holds_state: bool,
    via: dist.ProcessGroup | None,
    new_members: Sequence[int],
    entries: Entries | None = None,
    counters: Counters | None = None,
    buffers: ExchangeBuffers | None = None,
) -> Handover:
    """Send what this rank holds to its new owners; receive what it will own.

    Every rank of ``via`` calls this at the same step boundary. ``new_members``
    lists the ranks of ``via`` that form the new world, in new-rank order; a
    rank not among them is leaving and receives nothing. ``holds_state``: an
    old member (a newcomer holds nothing yet). ``entries``/``counters``: send
    these (a replica's snapshot) instead of the engine's live state.
    ``buffers``: written ahead, to pack into and receive into where they are large
    enough (worker/control.py [Note: meeting ahead]).
    """
    via_comm = Collectives(via)
    new_world = len(new_members)
    if entries is None:
        # views: they are packed (copied) below, before anything changes the state
        entries = state.export_ranges(copy=False) if holds_state else {}
    if counters is None:
        counters = state.counters()
    # a holder's new rank, as (new_world - rank) so that the max picks the lowest
    holder = (
        new_world - list(new_members).index(via_comm.rank)
        if holds_state and via_comm.rank in new_members
        else 0
    )
    shared = torch.tensor(
        [
            counters.global_steps,
            counters.loss_scale,
            counters.skipped_steps,
            counters.good_steps,
            counters.overflows_left,
            1,
            holder,
        ]
        if holds_state
        else [0] * 7,
        dtype=torch.float64,
        device=state.device,
    )
    via_comm.all_reduce(shared, op="max", control=True)

    # what each destination needs, sliced from what this rank holds
    held = RangeIndex.of_keys(entries)
    new_layout = state.layout_for(new_world)
    partitioned = state.stage.optimizer_sharded
    parts: list[Entries] = []
    for d in range(via_comm.world_size):
        out: Entries = {}
        if d in new_members:
            for want in owned_ranges(new_layout, new_members.index(d), partitioned=partitioned):
                for have, a, b, _ in held.overlapping(want):
                    sub = _slice_entry(
                        entries[have.key], a - have.start, b - have.start, have.numel
                    )
                    out[Range(want.name, a, b).key] = sub
        parts.append(out)
    # What stays on this rank does not go through the wire: its views are read
    # (copied into the new buffers) once the caller adopts the hand-over.
    incoming: Entries = {}
    if via_comm.distributed:
        incoming, parts[via_comm.rank] = parts[via_comm.rank], {}
    sizes, send = _packed_sends(parts, wire_device(via_comm), into=buffers and buffers.send)
    bufs = _exchange(via_comm, send, sizes, into=buffers and buffers.recv)
    for buf in bufs:
        # views into the received buffer, which nothing else holds
        for key, entry in unpack_entries(buf.cpu(), copy=False).items():
            entry["master"] = entry["master"].to(state.master_device)
            entry["state"] = {
                k: v.to(state.master_device) if isinstance(v, torch.Tensor) else v
                for k, v in entry["state"].items()
            }
            incoming[key] = entry
    steps, scale, skipped, good, left, held_any, holder = shared.tolist()
    counters = Counters(int(steps), scale, int(skipped), int(good), int(left))
    unsharded_from = new_world - int(holder) if holder else None
    received = bufs[0]._base if bufs and bufs[0].device.type == "cpu" else None
    return Handover(
        incoming,
        counters,
        nobody_held=held_any == 0,
        unsharded_from=unsharded_from,
        received=received,
    )


def adopt(state: ShardState, handover: Handover, comm: Collectives | None) -> None:
    """Fill ``state`` from a hand-over: rebuilt for ``comm``'s world (its new one),
    or in the buffers it has (``None``: already built for the new world)."""
    if comm is not None:
        state.build(comm, from_module=False)
    state.import_ranges(handover.entries)
    state.restore_counters(handover.counters)
    state.sync_unsharded(handover.unsharded_from)


def wire_device(comm: Collectives) -> torch.device:
    return torch.device("cuda") if comm.backend == "nccl" else torch.device("cpu")


def _packed_sends(
    parts: Sequence[Entries], device: torch.device, into: torch.Tensor | None = None
) -> tuple[list[int], torch.Tensor]:
    """Byte counts per destination and one buffer with every part packed in order;
    a destination with nothing to receive gets no bytes at all. ``into``: a buffer
    to pack into when it is large enough."""
    filled = [i for i, part in enumerate(parts) if part]
    packings = {i: _Packing.of(parts[i]) for i in filled}
    sizes = [packings[i].nbytes if i in packings else 0 for i in range(len(parts))]
    send = _bytes(sum(sizes), device, into)
    start = 0
    for i in filled:
        packings[i].write(send[start : start + sizes[i]])
        start += sizes[i]
    return sizes, send


def _exchange(
    comm: Collectives, send: torch.Tensor, sizes: list[int], into: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """All-to-all of variable-size byte buffers: ``send`` holds ``sizes[d]`` bytes for
    each rank ``d`` in order; the sizes go first, then the bytes."""
    parts, handle = _start_exchange(comm, send, sizes, into)
    handle.wait()
    return parts


def _bytes(n: int, device: torch.device, into: torch.Tensor | None) -> torch.Tensor:
    """``n`` bytes: the first of ``into`` when it is large enough and on ``device``."""
    if into is not None and into.numel() >= n and into.device.type == device.type:
        return into[:n]
    return torch.empty(n, dtype=torch.uint8, device=device)


@dataclass
class ExchangeBuffers:
    """Host or device byte buffers written ahead for one exchange: to pack what
    this rank sends into, and to receive into."""

    send: torch.Tensor
    recv: torch.Tensor

    @classmethod
    def make(cls, send_bytes: int, recv_bytes: int, device: torch.device) -> ExchangeBuffers:
        return cls(
            torch.zeros(send_bytes, dtype=torch.uint8, device=device),
            torch.zeros(recv_bytes, dtype=torch.uint8, device=device),
        )


def packed_bound(
    state: ShardState, rank: int, world_size: int, fields: dict[str, torch.dtype] | None = None
) -> int:
    """At least as many bytes as the state ``rank`` of ``world_size`` owns takes
    packed (:func:`pack_entries`), however it is split into entries: its master
    values and per-element optimizer state, every tensor's alignment, and a
    generous allowance for the header and the scalar state. ``fields``: the
    optimizer state's, when the caller has them (else read, or probed, here)."""
    ranges = owned_ranges(
        state.layout_for(world_size), rank, partitioned=state.stage.optimizer_sharded
    )
    return _packed_bytes(state, sum(r.numel for r in ranges), len(ranges) + world_size, fields)


def sent_bound(state: ShardState, new_rank: int | None, new_world: int) -> int:
    """At least as many bytes as this rank packs to send in the exchange to
    ``new_world`` ranks, where it becomes ``new_rank`` (None: it leaves): what it
    owns now less what it keeps. Sized so, a scale-down's first survivor, which
    keeps all it owns, writes no send buffer ahead (with :func:`packed_bound`,
    its whole share)."""
    partitioned = state.stage.optimizer_sharded
    held = owned_ranges(state.layout, state.rank, partitioned=partitioned)
    numel = sum(r.numel for r in held)
    if not partitioned:  # every other new rank gets everything
        others = new_world - (new_rank is not None)
        return _packed_bytes(state, numel * others, (len(held) + new_world) * others)
    kept = 0
    if new_rank is not None:
        index = RangeIndex((r, "") for r in held)
        for want in owned_ranges(state.layout_for(new_world), new_rank, partitioned=True):
            kept += sum(b - a for _, a, b, _ in index.overlapping(want))
    return _packed_bytes(state, numel - kept, len(held) + new_world)


def _packed_bytes(
    state: ShardState, numel: int, entries: int, fields: dict[str, torch.dtype] | None = None
) -> int:
    """:func:`packed_bound` of ``numel`` elements in at most ``entries`` entries."""
    fields = state.state_fields() if fields is None else fields
    per_element = 4 + sum(torch.empty((), dtype=d).element_size() for d in fields.values())
    tensors = 1 + len(fields) + 2  # the master, the fields, scalar tensors (Adam's step)
    return numel * per_element + entries * tensors * (_ALIGN + 128) + entries * 256 + 4096


def _start_exchange(
    comm: Collectives, send: torch.Tensor, sizes: list[int], into: torch.Tensor | None = None
) -> tuple[list[torch.Tensor], Handle]:
    """:func:`_exchange` with the bytes still moving: the parts are valid once the
    handle is waited on. ``into``: a buffer to receive into when it is large enough."""
    if not comm.distributed:
        return list(torch.split(send, sizes)), Handle(None, None, 0.0)
    device = wire_device(comm)
    counts = torch.tensor(sizes, dtype=torch.int64, device=device)
    recv_counts = torch.empty_like(counts)
    comm.all_to_all(recv_counts, counts, as_op="control")
    recv = _bytes(int(recv_counts.sum()), device, into)
    handle = comm.all_to_all(
        recv,
        send.to(device),
        output_split_sizes=recv_counts.tolist(),
        input_split_sizes=sizes,
        async_op=True,
    )
    return list(torch.split(recv, recv_counts.tolist())), handle


# ---------------------------------------------------------------------------- replicas


@dataclass
class Replica:
    """This rank's state at ``step`` and its left neighbour's, kept in memory.

    [Note: in-memory replicas]
    Every ``replica_interval`` optimizer steps each rank copies its own state
    ranges (as a checkpoint would write them) and sends a copy to its right
    neighbour, ``(rank + 1) % N``. When a rank dies, its right neighbour holds
    its state as of the last refresh; every survivor also holds its own state
    as of that same step, so the whole job can roll back consistently to it
    without touching the disk. Two adjacent ranks lost together leave a gap,
    and recovery falls back to the last checkpoint. The cost is twice this
    rank's share of the model state (reported as the ``replica`` kind).

    A refresh is two-phase. The swap is one collective, and a peer lost in the
    middle of it leaves some survivors with the new copies and some without:
    restoring each from what it holds would mix two steps, silently. So a rank
    keeps its previous replica until a barrier after the swap passes (passing
    it proves every rank finished the swap), and recovery restores the newest
    step every member holds a replica of (:func:`plan_restore`). For one
    refresh in ``replica_interval`` steps both copies are held.
    """

    generation: int
    world_size: int
    rank: int
    counters: Counters
    # packed (pack_entries): one copy each, read as views when a recovery needs them
    own_packed: torch.Tensor
    neighbour_packed: torch.Tensor

    @property
    def own(self) -> Entries:
        return unpack_entries(self.own_packed, copy=False)

    @property
    def neighbour(self) -> Entries:
        return unpack_entries(self.neighbour_packed, copy=False)

    @property
    def neighbour_rank(self) -> int:
        return (self.rank - 1) % self.world_size

    @property
    def ident(self) -> ReplicaId:
        return (self.generation, self.counters.global_steps, self.rank, self.world_size)

    def nbytes(self) -> int:
        return self.own_packed.numel() + self.neighbour_packed.numel()


@dataclass(eq=False)
class PendingRefresh:
    """A refresh whose copies are still on the wire ([Note: a refresh overlaps a step]).

    [Note: a refresh overlaps a step]
    A refresh snapshots this rank's state at a step boundary (one copy, into
    ``own``) and starts the swap with the neighbours; the next step trains
    while the bytes move, and the following boundary waits for them
    (:meth:`finish`) and confirms the replica. Until then it is not a replica
    a recovery may use: a loss inside that step restores from the replica
    before it, as a loss inside a synchronous refresh did. The pause after a
    membership change, which must refresh (the old replicas hold another
    layout), is the snapshot's copy instead of the whole swap.
    """

    generation: int
    world_size: int
    rank: int
    counters: Counters
    own: torch.Tensor
    received: torch.Tensor  # the left neighbour's packed state, once the handle is done
    handle: Handle
    comm: Collectives  # the group it runs on

    def finish(self) -> Replica:
        """Wait for the swap (raises :class:`CollectiveError` if a peer was lost)."""
        self.handle.wait()
        return Replica(
            self.generation, self.world_size, self.rank, self.counters, self.own,
            self.received.cpu(),
        )  # fmt: skip

    def nbytes(self) -> int:
        return self.own.numel() + self.received.numel()


def buffer_of(replica: Replica) -> torch.Tensor:
    """The whole host buffer ``replica``'s own snapshot was packed into (a reused
    buffer may be larger than the snapshot).

    [Note: a snapshot into the last one's buffer]
    A snapshot is a host copy of this rank's share of the model state, made at a
    step boundary, where training waits for it (and inside the pause after a
    membership change, which must refresh). Into fresh memory it costs a page
    fault per 4 KiB: measured here, 0.04 s for 72 MB on an idle core against
    0.007 s into a buffer written before, and 0.14-0.27 s under the load of three
    ranks on two cores. So the session keeps one spare host buffer, the largest
    of those nothing reads any more: the own buffer of a replica that a confirmed
    refresh (or a restore, or a load) retires, and the buffer a hand-over arrived
    in, once adopted. The next snapshot is packed into it when it fits: always
    within one generation; after a scale-up the shares shrink; a newcomer's
    first snapshot goes where its shards arrived. The cost: that buffer stays
    held between refreshes, where it was freed before; the ``replica`` memory
    kind counts it. A refresh dropped after a loss is never reused: the broken
    group's transport may still read it.
    """
    own = replica.own_packed
    return own if own._base is None else own._base


def start_refresh(
    state: ShardState, generation: int, *, into: torch.Tensor | None = None
) -> PendingRefresh:
    """Snapshot this rank's state and start swapping copies with the neighbours (a
    collective: the sizes go now, the bytes in the background). ``into``: a host
    buffer no replica uses any more, to snapshot into if it is large enough
    ([Note: a snapshot into the last one's buffer])."""
    comm = state.comm
    # The one copy of this rank's state: packed from views of the live state (the
    # optimizer does not step while this runs), and sent as it is.
    own = pack_entries(state.export_ranges(copy=False), into=into)
    n = comm.world_size
    received, handle = own.new_empty(0), Handle(None, None, 0.0)
    if n > 1:
        sizes = [own.numel() if d == (comm.rank + 1) % n else 0 for d in range(n)]
        parts, handle = _start_exchange(comm, own, sizes)
        received = parts[(comm.rank - 1) % n]
    return PendingRefresh(generation, n, comm.rank, state.counters(), own, received, handle, comm)


def refresh_replica(state: ShardState, generation: int) -> Replica:
    """Snapshot this rank's state and swap copies with the neighbours (a collective)."""
    return start_refresh(state, generation).finish()


# ---------------------------------------------------------------------------- gradient log


@dataclass(eq=False)
class LoggedStep:
    """One optimizer step of the left neighbour, as its optimizer saw it."""

    step: int  # the global step it produced
    grads: list[torch.Tensor]  # its partition gradient per bucket: averaged, unscaled, clipped
    used: list[int]  # per trainable parameter, 1 if any rank used it
    groups: list[dict]  # the param groups' hyperparameters of that step

    def nbytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.grads)


class GradientLog:
    """The left neighbour's optimizer inputs since the oldest replica this rank holds.

    [Note: rolling a lost rank forward]
    A replica alone rolls the whole job back to its step: every survivor
    restores its own copy and the steps since are trained again (up to
    ``replica_interval`` of them per loss). But an optimizer step is a pure
    function of the state and of what the optimizer is given: the gradient
    partition (final: averaged, unscaled, clipped), which parameters had a
    gradient and the hyperparameters. So each rank sends its partition
    gradients to its right neighbour at every step, the neighbour that holds
    its replica (one send and one receive per rank, 1/N of the gradient's
    bytes). After a loss at step T the survivors keep their live state, and
    each lost rank's right neighbour replays the logged steps S+1..T on the
    lost rank's replica of step S, with the same optimizer class,
    hyperparameters and pieces (bit for bit what the lost rank computed).
    Nothing is trained again.

    The log must never be shorter than the survivors' state: a rank that dies
    after its peers stepped but before its gradients reached its neighbour
    would force the rollback. So each rank waits for its exchange before
    stepping, and the step's loss all-reduce (which every rank starts only
    then) is the go: a rank lost before delivering fails every rank before any
    of them steps. A rank lost after delivering, before the go completes,
    leaves its neighbour's log one step ahead of the survivors, which is
    harmless. Only a loss inside the go's own few microseconds can let some
    survivors step and not others; that falls back to the rollback.

    It applies when every rank that holds state is whole at the same step T of
    one generation and each lost rank's right neighbour logged at least up to
    T (:func:`plan_restore`); otherwise recovery rolls back to the replicas.
    The log is as long as the refresh interval (its bytes count as ``replica``
    memory); a refresh (or a new generation) trims it.
    """

    _SPARE = 2  # received buffers kept for reuse once their steps are trimmed

    def __init__(self) -> None:
        self.generation = -1
        self.after = -1  # entries are for steps after+1 .. after+len(steps)
        self.steps: list[LoggedStep] = []
        self._pending: tuple[LoggedStep, Handle] | None = None
        self._spare: list[list[torch.Tensor]] = []

    def start(
        self,
        comm: Collectives,
        generation: int,
        step: int,
        grads: list[torch.Tensor],
        used: list[int],
        groups: list[dict],
    ) -> Handle:
        """Send this rank's ``grads`` (of the step that will make global step ``step``)
        right and receive the left neighbour's (the same sizes: partitions are
        equal); :meth:`commit` once the step is done."""
        recv = self._buffers([g.numel() for g in grads], grads[0].device if grads else None)
        n = comm.world_size
        handle = comm.send_recv(
            grads, (comm.rank + 1) % n, recv, (comm.rank - 1) % n, async_op=True
        )
        logged = generation == self.generation  # else no replica of this generation yet
        self._pending = (LoggedStep(step, recv, used, groups), handle) if logged else None
        return handle

    def commit(self, step: int) -> None:
        """Global step ``step`` is done: keep the pending gradients if they are its
        own and fully received. After a failure, also those of step ``step + 1``:
        they were delivered, and the loss came at that step's go."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        logged, handle = pending
        if logged.step not in (step, step + 1) or not handle.done():
            return
        try:
            handle.wait()
        except CollectiveError:
            return
        if logged.step != self.after + len(self.steps) + 1:  # a gap: start again after it
            self.reset(self.generation, logged.step)
            return
        self.steps.append(logged)

    def reset(self, generation: int, after: int) -> None:
        """Log from step ``after`` of ``generation`` on (a replica of that step exists)."""
        same = generation == self.generation
        keep = [e for e in self.steps if same and e.step > after]
        self._spare += [e.grads for e in self.steps[: len(self.steps) - len(keep)]]
        del self._spare[self._SPARE :]
        self.generation, self.after, self.steps = generation, after, keep
        if keep:
            self.after = keep[0].step - 1

    def coverage(self) -> tuple[int, int, int] | None:
        """``(generation, after, last)``: steps after+1..last are logged."""
        if self.generation < 0:
            return None
        return (self.generation, self.after, self.after + len(self.steps))

    def between(self, after: int, last: int) -> list[LoggedStep]:
        """The logged steps after+1 .. last."""
        return [e for e in self.steps if after < e.step <= last]

    def nbytes(self) -> int:
        return sum(e.nbytes() for e in self.steps) + sum(
            g.numel() * g.element_size() for spare in self._spare for g in spare
        )

    def _buffers(self, sizes: list[int], device: torch.device | None) -> list[torch.Tensor]:
        for i, spare in enumerate(self._spare):
            if [t.numel() for t in spare] == sizes and (not spare or spare[0].device == device):
                return self._spare.pop(i)
        return [torch.empty(n, dtype=torch.float32, device=device) for n in sizes]


def _placed(value: Any, numel: int, device: torch.device) -> Any:
    """A copy of one optimizer state value of a ``numel``-element piece: per-element
    state where the master is (a replica may be on the host), scalars such as
    Adam's step where they were, as :meth:`ShardState.import_ranges` places them."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 1 and value.numel() == numel:
        return value.to(device, copy=True)
    return value.clone()


def roll_forward(
    state: ShardState, rank: int, entries: Entries, steps: Sequence[LoggedStep]
) -> Entries:
    """Rank ``rank``'s state after ``steps``, from ``entries`` (its replica, in this
    generation's layout, which ``state`` still holds): the same optimizer steps the
    lost rank ran ([Note: rolling a lost rank forward]). ``entries`` is not changed."""
    assert state.layout is not None
    shards = []
    for spec in state.layout.buckets:
        lo, hi = spec.shard_range(rank)
        shards.append((spec, spec.pieces(lo, hi), torch.zeros(hi - lo, device=state.master_device)))
    optimizer = state.shard_optimizer(shards)
    with torch.no_grad():
        for piece in optimizer.pieces:
            key = Range(piece.name, piece.param_start, piece.param_start + piece.view.numel()).key
            if key not in entries:
                raise MissingRange(f"the replica of rank {rank} has no {key}")
            entry, n = entries[key], piece.view.numel()
            piece.view.copy_(entry["master"])
            if entry["state"]:
                optimizer.inner.state[piece.view] = {
                    k: _placed(v, n, piece.view.device) for k, v in entry["state"].items()
                }
    for logged in steps:
        optimizer.step(optimizer.piece_grads(logged.grads, logged.used), groups=logged.groups)
    return {
        Range(p.name, p.param_start, p.param_start + p.view.numel()).key: {
            "master": p.view,
            "state": dict(optimizer.inner.state.get(p.view, {})),
        }
        for p in optimizer.pieces
    }


# ---------------------------------------------------------------------------- recovery

# (generation id, rank, world size): whose state a rank holds
StateId = tuple[int, int, int]
# (generation id, step, rank, world size): whose state a replica is, and of when
ReplicaId = tuple[int, int, int, int]

# room for the checkpoint directory in a Holding row (one int64 per byte)
_PATH_BYTES = 1024


@dataclass(frozen=True)
class Holding:
    """What one rank of the new group can restore from after a loss.

    [Note: recovery sources]
    After a peer is lost, every rank of the new group must restore the same
    consistent state, from the best source the group holds between them:
    1. live state: the engine's own shards, when they are intact at a step
       boundary (no optimizer update was under way) and every rank of the
       generation they belong to survived. This is the case when the rank
       lost was a newcomer that died while joining: the members still hold
       the whole job as of the last step, and nothing is rolled back.
    2. in-memory replicas of the generation the loss happened in, when they
       cover every one of its ranks (see :class:`Replica`);
    3. the last checkpoint;
    4. nothing, when no rank of the group holds any state: every holder of the
       job's state was lost (all members killed, or the last survivors gave up
       after a loss nothing covered, below). The group starts again from the
       module as the script built it, as a restart under torchrun would: a
       script that loads its checkpoint at start resumes there.
    A group in which some ranks hold state but nothing covers the rest cannot
    go on: those ranks raise, and the launcher's restarts bring fresh processes
    that take path 4.
    Ranks share their holdings (one small all-reduce) and each runs
    :func:`plan_restore` on the same table, so all take the same path.
    """

    live: StateId | None
    # the confirmed replica and, while a refresh is unconfirmed, the new one
    replicas: tuple[ReplicaId, ...]
    holds_state: bool
    checkpoint: str | None
    # the global step of the live state; the left neighbour's gradient log
    # (generation, after, last): steps after+1..last ([Note: rolling a lost rank forward])
    live_step: int = -1
    log: tuple[int, int, int] | None = None

    _REPLICAS = 2
    _LOG = 3 + 4 * _REPLICAS  # live_step, log
    _HEAD = _LOG + 4 + 2  # holds_state, path length
    WIDTH = _HEAD + _PATH_BYTES

    def encode(self) -> torch.Tensor:
        if len(self.replicas) > self._REPLICAS:
            raise ValueError(f"at most {self._REPLICAS} replicas, got {len(self.replicas)}")
        row = torch.full((self.WIDTH,), -1, dtype=torch.int64)
        if self.live is not None:
            row[0:3] = torch.tensor(self.live)
        for i, ident in enumerate(self.replicas):
            row[3 + 4 * i : 7 + 4 * i] = torch.tensor(ident)
        row[self._LOG] = self.live_step
        if self.log is not None:
            row[self._LOG + 1 : self._LOG + 4] = torch.tensor(self.log)
        head = self._HEAD
        row[head - 2] = int(self.holds_state)
        raw = (self.checkpoint or "").encode()
        if len(raw) > _PATH_BYTES:
            raise ValueError(f"checkpoint path longer than {_PATH_BYTES} bytes: {self.checkpoint}")
        row[head - 1] = len(raw)
        row[head : head + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
        return row

    @classmethod
    def decode(cls, row: torch.Tensor) -> Holding:
        v = row.tolist()
        head = cls._HEAD
        length = v[head - 1]
        path = bytes(v[head : head + length]).decode() if length > 0 else None
        slots = (tuple(v[3 + 4 * i : 7 + 4 * i]) for i in range(cls._REPLICAS))
        log = tuple(v[cls._LOG + 1 : cls._LOG + 4])
        return cls(
            live=tuple(v[0:3]) if v[0] >= 0 else None,  # type: ignore[arg-type]
            replicas=tuple(r for r in slots if r[0] >= 0),  # type: ignore[misc]
            holds_state=bool(v[head - 2]),
            checkpoint=path,
            live_step=v[cls._LOG],
            log=log if log[0] >= 0 else None,  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class RestorePlan:
    """``source``: "live" (ranks whose live state is of ``generation`` send it),
    "forward" (the same, and the state of each rank in ``lost`` is its replica
    brought forward to ``step`` by its right neighbour's gradient log),
    "replica" (the replicas of ``generation`` at ``step``; ``lost``: its ranks no
    member is, whose state comes from their right neighbour's copy), "checkpoint" (load
    ``checkpoint``) or "module" (nobody holds anything: start from the module)."""

    source: str
    generation: int | None = None
    step: int | None = None
    checkpoint: str | None = None
    lost: frozenset[int] = frozenset()


def plan_restore(holdings: Sequence[Holding]) -> RestorePlan:
    """Pick the recovery source every rank will use ([Note: recovery sources]).

    Everything is read from the holdings themselves, not from the generation's
    reshard schedule: the group that restores may not be the one the coordinator
    formed right after the loss (a rendezvous superseded by a newer generation
    skips it), and the state ids say what each rank really holds.
    Raises when nothing the group holds covers the whole job.
    """
    by_generation: dict[int, set[int]] = {}
    worlds: dict[int, int] = {}
    for h in holdings:
        if h.live is not None:
            gen, rank, world = h.live
            by_generation.setdefault(gen, set()).add(rank)
            worlds[gen] = world
    for gen in sorted(by_generation, reverse=True):
        if by_generation[gen] == set(range(worlds[gen])):
            return RestorePlan("live", generation=gen)

    forward = _roll_forward_plan(holdings)
    if forward is not None:
        return forward

    # newest first; a member without a replica of that (generation, step) would
    # restore ahead of (or behind) the others: replicas are all or nothing
    for gen, step in sorted({r[:2] for h in holdings for r in h.replicas}, reverse=True):
        usable = all(
            any(r[:2] == (gen, step) for r in h.replicas) for h in holdings if h.holds_state
        )
        ranks = [r[2:] for h in holdings for r in h.replicas if r[:2] == (gen, step)]
        world = ranks[0][1]
        present = {rank for rank, _ in ranks}
        lost = frozenset(set(range(world)) - present)
        # each rank keeps its own state and its left neighbour's
        covered = present | {(r - 1) % world for r in present if (r - 1) % world in lost}
        if usable and covered == set(range(world)):
            return RestorePlan("replica", generation=gen, step=step, lost=lost)

    for h in holdings:
        if h.checkpoint is not None:
            return RestorePlan("checkpoint", checkpoint=h.checkpoint)
    if not any(h.holds_state for h in holdings):
        return RestorePlan("module")
    raise RuntimeError(
        "a worker was lost and neither in-memory replicas nor a checkpoint cover "
        "its state; set ZeroConfig.replica_interval or save checkpoints (under an "
        "elastic launcher the job restarts from its script's checkpoint or the start)"
    )


def _roll_forward_plan(holdings: Sequence[Holding]) -> RestorePlan | None:
    """Keep the survivors' live state when every holder is whole at one step of one
    generation and each lost rank's right neighbour can bring that rank's replica
    up to it ([Note: rolling a lost rank forward]). A log one step longer is the
    loss at a step's go: the gradients were delivered, no rank stepped."""
    holders = [h for h in holdings if h.holds_state]
    lives = {(h.live[0], h.live[2], h.live_step) if h.live else None for h in holders}
    if len(lives) != 1 or None in lives:
        return None
    ((gen, world, step),) = lives  # type: ignore[misc]
    by_rank = {h.live[1]: h for h in holders if h.live is not None}
    lost = set(range(world)) - set(by_rank)

    def brings_forward(lost_rank: int) -> bool:
        right = by_rank.get((lost_rank + 1) % world)
        if right is None or right.log is None:
            return False
        log_gen, after, last = right.log
        return (
            log_gen == gen
            and last >= step
            and any(r[0] == gen and r[3] == world and after <= r[1] <= step for r in right.replicas)
        )

    if not lost or not all(brings_forward(r) for r in lost):
        return None
    return RestorePlan("forward", generation=gen, step=step, lost=frozenset(lost))
