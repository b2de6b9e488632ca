"""Moving live training state between world sizes: no restart, no disk.

[Note: live reshard]
A membership change goes from layout L_old (the old world size) to L_new.
Both are pure functions of the parameter inventory and a world size, so
every rank, newcomers included, computes both without being told. State is
addressed by (parameter name, element range) as in a checkpoint
(worker/checkpoint.py): old rank o is the source of the elements in range o
of every bucket of L_old; new rank n needs the elements its optimizer owns
in L_new. Each rank packs, for each destination, the slices of its entries
that destination needs, and one all-to-all over a group holding every old
and every new member moves them all. Elements whose owner does not change
never leave the process (they go to itself through the same code path,
as a local copy).

The transfer runs over the larger of the two memberships: the new group for
a scale-up (newcomers join it), the old group for a graceful scale-down
(leavers hand over before they exit). After a crash the dead rank's entries
come from the replica a neighbour keeps (see :class:`Replica`).

Entries cross the wire in a small self-describing format (a JSON header of
names, dtypes and shapes, then raw bytes): no pickle.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from worker import checkpoint
from worker.collectives import Collectives

if TYPE_CHECKING:
    from worker.engine import ZeroEngine

__all__ = ["pack_entries", "reconfigure", "unpack_entries"]

logger = logging.getLogger(__name__)

Entries = dict[str, dict[str, Any]]


def pack_entries(entries: Entries) -> torch.Tensor:
    """Serialise checkpoint-style entries into one uint8 tensor (no pickle)."""
    header: list[dict[str, Any]] = []
    blobs: list[torch.Tensor] = []
    offset = 0
    for key, entry in entries.items():
        row: dict[str, Any] = {"key": key, "tensors": [], "scalars": {}}
        tensors = {"master": entry["master"]}
        for k, v in entry["state"].items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{k}"] = v
            else:
                row["scalars"][k] = v
        for field, t in tensors.items():
            raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            row["tensors"].append(
                [field, str(t.dtype).removeprefix("torch."), list(t.shape), offset]
            )
            blobs.append(raw)
            offset += raw.numel()
        header.append(row)
    head = json.dumps(header, separators=(",", ":")).encode()
    prefix = torch.frombuffer(bytearray(struct.pack("<Q", len(head)) + head), dtype=torch.uint8)
    return torch.cat([prefix, *blobs]) if blobs else prefix


def unpack_entries(buf: torch.Tensor) -> Entries:
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
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            t = body[offset : offset + nbytes].clone().view(dtype).reshape(shape)
            if field == "master":
                entry["master"] = t
            else:
                entry["state"][field.removeprefix("state.")] = t
        out[row["key"]] = entry
    return out


def _slice_entry(entry: dict[str, Any], lo: int, hi: int, numel: int) -> dict[str, Any]:
    state = {
        k: v[lo:hi].clone()
        if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == numel
        else v
        for k, v in entry["state"].items()
    }
    return {"master": entry["master"][lo:hi].clone(), "state": state}


def _wanted_ranges(engine: ZeroEngine, world_size: int, rank: int) -> list[tuple[str, int, int]]:
    """(name, start, stop) the optimizer of new rank ``rank`` owns at ``world_size``."""
    layout = engine.layout_for(world_size)
    out = []
    for bucket in layout.buckets:
        if engine.stage == 0:
            pieces = bucket.pieces(0, bucket.padded_numel)
        else:
            pieces = bucket.slot_shards(rank)
        out += [(p.slot.name, p.param_start, p.param_start + p.numel) for p in pieces]
    return out


def reconfigure(
    engine: ZeroEngine,
    *,
    entries: Entries,
    new_group: dist.ProcessGroup | None,
    via: dist.ProcessGroup | None,
    new_members: Sequence[int],
    global_steps: int,
) -> None:
    """Move ``entries`` (what this rank is the source of) to their new owners.

    Every rank of ``via`` calls this. ``new_members`` lists the ranks of
    ``via`` that form the new group, in new-rank order; a rank not among
    them is leaving and ends with the engine detached. ``new_group`` is the
    process group of the new members (``None`` on a leaving rank).
    """
    via_comm = Collectives(via)
    me = via_comm.rank
    new_world = len(new_members)

    # what each destination needs, sliced from what this rank holds
    sends: list[torch.Tensor] = []
    by_name: dict[str, list[tuple[int, int, str]]] = {}
    for key in entries:
        name, start, stop = _parse_key(key)
        by_name.setdefault(name, []).append((start, stop, key))
    for d in range(via_comm.world_size):
        out: Entries = {}
        if d in new_members:
            for name, start, stop in _wanted_ranges(engine, new_world, new_members.index(d)):
                for lo, hi, key in by_name.get(name, []):
                    a, b = max(lo, start), min(hi, stop)
                    if a < b:
                        sub = _slice_entry(entries[key], a - lo, b - lo, hi - lo)
                        out[checkpoint.Range(name, a, b).key] = sub
        sends.append(pack_entries(out))

    received = _exchange(via_comm, [buf.cpu() for buf in sends])
    incoming: Entries = {}
    for buf in received:
        for key, entry in unpack_entries(buf.cpu()).items():
            entry["master"] = entry["master"].to(engine.device)
            entry["state"] = {
                k: v.to(engine.device) if isinstance(v, torch.Tensor) else v
                for k, v in entry["state"].items()
            }
            incoming[key] = entry

    engine._detach()
    if me not in new_members:
        logger.info("left the job after handing over %d state ranges", len(entries))
        return
    engine._attach(Collectives(new_group), from_module=False)
    index: dict[str, list[tuple[int, int, str]]] = {}
    for key in incoming:
        name, start, stop = _parse_key(key)
        index.setdefault(name, []).append((start, stop, "transfer"))
    checkpoint._import_ranges(engine, incoming, index)
    engine.global_steps = global_steps
    engine._publish_params()
    engine._zero_grads()


def _exchange(comm: Collectives, sends: list[torch.Tensor]) -> list[torch.Tensor]:
    """All-to-all of variable-size byte buffers: sizes first, then the bytes."""
    if not comm.distributed:
        return sends
    device = torch.device("cuda") if comm.backend == "nccl" else torch.device("cpu")
    sizes = torch.tensor([t.numel() for t in sends], dtype=torch.int64, device=device)
    recv_sizes = torch.empty_like(sizes)
    comm.all_to_all(recv_sizes, sizes, as_op="control")
    send = torch.cat(sends).to(device)
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8, device=device)
    comm.all_to_all(
        recv, send, output_split_sizes=recv_sizes.tolist(), input_split_sizes=sizes.tolist()
    )
    return list(torch.split(recv, recv_sizes.tolist()))


def _parse_key(key: str) -> tuple[str, int, int]:
    name, _, rng = key.rpartition("[")
    start, stop = rng.rstrip("]").split(":")
    return name, int(start), int(stop)
