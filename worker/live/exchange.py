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
:class:`GradientLog`; both in worker/live/replicas.py).

Entries cross the wire in a small self-describing format (a JSON header of
names, dtypes and shapes, then raw bytes): no pickle.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from coordinator.core.ranges import Range, RangeIndex, owned_ranges
from worker.collectives import Collectives, Handle
from worker.entries import Entries
from worker.state import Counters, ShardState

__all__ = [
    "ExchangeBuffers",
    "Handover",
    "adopt",
    "exchange",
    "pack_entries",
    "packed_bound",
    "sent_bound",
    "unpack_entries",
    "wire_device",
]


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
    # (its first generation was superseded before it formed; see worker/elastic/joining.py)
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
    enough (worker/rendezvous.py [Note: meeting ahead]).
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
