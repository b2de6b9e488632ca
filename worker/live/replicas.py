"""What a rank keeps of its own and its left neighbour's state, in memory, to
recover from a lost peer without the disk: the replicas ([Note: in-memory
replicas]), their refresh ([Note: a refresh overlaps a step], [Note: a snapshot
into the last one's buffer]), the gradient log that brings a lost rank's replica
forward ([Note: rolling a lost rank forward]), and :class:`ReplicaKeeper`, which
holds all of it for an elastic session (worker/elastic/session.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from coordinator.core.ranges import Range
from worker.collectives import CollectiveError, Collectives, Handle
from worker.entries import Entries, MissingRange
from worker.live.exchange import _start_exchange, pack_entries, unpack_entries
from worker.live.restore_plan import ReplicaId
from worker.state import Counters, ShardState

__all__ = [
    "GradientLog",
    "LoggedStep",
    "PendingRefresh",
    "Replica",
    "ReplicaKeeper",
    "buffer_of",
    "refresh_replica",
    "roll_forward",
    "start_refresh",
]


@dataclass
class Replica:
    """This rank's state at ``step`` and its left neighbour's, kept in memory.

    [Note: in-memory replicas]
    Every ``replica_interval`` optimizer steps each rank copies its own state
    ranges (as a checkpoint would write them) and sends a copy to its right
    neighbour, ``(rank + stride) % N`` (``stride`` 1; in a job of blocks, the
    block's size: worker/elastic/blocks.py [Note: a lost block]). When a rank
    dies, its right neighbour holds its state as of the last refresh; every
    survivor also holds its own state as of that same step, so the whole job can
    roll back consistently to it without touching the disk. Two adjacent ranks
    lost together leave a gap, and recovery falls back to the last checkpoint.
    The cost is twice this rank's share of the model state (reported as the
    ``replica`` kind).

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
    # how far its neighbour is: it holds rank ``(rank - stride) % world_size``'s state
    stride: int = 1

    @property
    def own(self) -> Entries:
        return unpack_entries(self.own_packed, copy=False)

    @property
    def neighbour(self) -> Entries:
        return unpack_entries(self.neighbour_packed, copy=False)

    @property
    def neighbour_rank(self) -> int:
        return (self.rank - self.stride) % self.world_size

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
    stride: int = 1

    def finish(self) -> Replica:
        """Wait for the swap (raises :class:`CollectiveError` if a peer was lost)."""
        self.handle.wait()
        return Replica(
            self.generation, self.world_size, self.rank, self.counters, self.own,
            self.received.cpu(), self.stride,
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
    state: ShardState,
    generation: int,
    *,
    into: torch.Tensor | None = None,
    stride: int = 1,
    also: Sequence[ShardState] = (),
) -> PendingRefresh:
    """Snapshot this rank's state and start swapping copies with the neighbours (a
    collective: the sizes go now, the bytes in the background). ``into``: a host
    buffer no replica uses any more, to snapshot into if it is large enough
    ([Note: a snapshot into the last one's buffer]); ``stride``: how far the
    neighbours are; ``also``: more states of this rank to keep with it (an
    expert-parallel rank's experts: their entries' names are their own)."""
    comm = state.comm
    # The one copy of this rank's state: packed from views of the live state (the
    # optimizer does not step while this runs), and sent as it is.
    entries = state.export_ranges(copy=False)
    for more in also:
        entries.update(more.export_ranges(copy=False))
    own = pack_entries(entries, into=into)
    n = comm.world_size
    received, handle = own.new_empty(0), Handle(None, None, 0.0)
    if n > 1 and stride % n:
        sizes = [own.numel() if d == (comm.rank + stride) % n else 0 for d in range(n)]
        parts, handle = _start_exchange(comm, own, sizes)
        received = parts[(comm.rank - stride) % n]
    return PendingRefresh(
        generation, n, comm.rank, state.counters(), own, received, handle, comm, stride
    )


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


# ---------------------------------------------------------------------------- the session's hold


class ReplicaKeeper:
    """An elastic session's replica state: the confirmed replicas, the refresh in
    flight, a spare host buffer and the left neighbour's gradient log, and the
    two-phase refresh over them."""

    def __init__(self) -> None:
        # the confirmed replica, then (while a refresh is unconfirmed) the new one
        self.replicas: list[Replica] = []
        # a refresh whose copies are on the wire ([Note: a refresh overlaps a step])
        self.refreshing: PendingRefresh | None = None
        # a host buffer nothing reads any more (a retired replica's snapshot, or
        # where an adopted hand-over arrived), for the next snapshot to reuse
        # ([Note: a snapshot into the last one's buffer])
        self.spare: torch.Tensor | None = None
        # the left neighbour's steps since the oldest replica ([Note: rolling a lost rank forward])
        self.log = GradientLog()

    def nbytes(self) -> int:
        pending = 0 if self.refreshing is None else self.refreshing.nbytes()
        spare = 0 if self.spare is None else self.spare.numel()
        return sum(r.nbytes() for r in self.replicas) + self.log.nbytes() + pending + spare

    def refresh(
        self,
        state: ShardState,
        generation: int,
        *,
        stride: int = 1,
        also: Sequence[ShardState] = (),
    ) -> None:
        """Confirm the refresh before (if any), then snapshot ``state`` (and ``also``)
        and start swapping it with the neighbours ``stride`` ranks away as
        ``generation``'s replica."""
        self.confirm()
        spare, self.spare = self.spare, None
        self.refreshing = start_refresh(state, generation, into=spare, stride=stride, also=also)
        if self.log.generation != self.refreshing.generation:
            # a new generation: its log starts at the snapshot (a recovery uses it
            # only with a replica of this generation, i.e. once this one is confirmed)
            self.log.reset(self.refreshing.generation, self.refreshing.counters.global_steps)

    def confirm(self) -> None:
        """Two-phase ([Note: in-memory replicas]): the previous replica is dropped
        only once the barrier proves every rank has the new one."""
        pending, self.refreshing = self.refreshing, None
        if pending is None:
            return
        fresh = pending.finish()
        self.replicas = [*self.replicas[-1:], fresh]
        pending.comm.barrier()
        self.retire(self.replicas[:-1])
        self.replicas = [fresh]
        self.log.reset(fresh.generation, fresh.counters.global_steps)

    def retire(self, replicas: list[Replica]) -> None:
        """``replicas`` are dropped: their snapshot buffers may serve the next one."""
        self.keep_spare(*(buffer_of(r) for r in replicas))

    def keep_spare(self, *buffers: torch.Tensor | None) -> None:
        """Keep the largest of ``buffers`` (host buffers nothing reads any more) and
        the spare held, for the next snapshot to reuse ([Note: a snapshot into the
        last one's buffer])."""
        held = [b for b in (self.spare, *buffers) if b is not None]
        self.spare = max(held, key=lambda b: b.numel(), default=None)

    def drop_refresh(self, *, wait: bool) -> None:
        """Forget a refresh in flight (after a loss; ``wait``: let its bytes land first,
        so that no peer's send meets a closed connection)."""
        pending, self.refreshing = self.refreshing, None
        if pending is not None and wait:
            with contextlib.suppress(CollectiveError):
                pending.handle.wait()
