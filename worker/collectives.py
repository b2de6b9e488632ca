"""The one module that calls ``torch.distributed`` collectives, and counts them.

Every collective the engine issues goes through :class:`Collectives`, which
records calls, bytes, wire bytes and seconds per op. Bytes are the size of the
full (unsharded) logical tensor of the call: the input of an all-reduce, the
input of a reduce-scatter, the output of an all-gather. Wire bytes are what
the call actually moved: the same, unless the payload was compressed.
Seconds run from issue to completion (for an async op, to its ``wait``).
Small bookkeeping reductions (the used-parameter bitmap, the gradient norm,
the fp16 overflow flag) are counted under ``"control"`` so the data-plane
numbers can be checked against the ZeRO formulas exactly.

gloo's ``ReduceOp.AVG`` has had a silent wrong-result bug (pytorch#162338), so
averages are a SUM followed by a division by the caller.

[Note: gloo's flat collectives]
gloo's ``reduce_scatter_tensor`` sends the whole input, as an all-reduce
would, and its ``all_gather_into_tensor`` is slower than an all-reduce of
the full tensor. Measured on this project's CPU machines, 2 ranks, 10M fp32
elements: reduce-scatter 94-127 ms, all-to-all plus a local sum 25-32 ms;
all-gather 60 ms, one broadcast per rank of its own slot 18 ms; all-reduce
35-50 ms. On gloo the two ops are therefore built from those; NCCL keeps its
native ones. The local sum adds the ranks' chunks one after another in rank
order, in fp32 for bf16/fp16 inputs (``sum_chunks``), the same sum whether they
came over gloo or through shared memory, where a reduce-scatter reads and adds
them one at a time, with no buffer as large as its input
(worker/shared_exchange.py).
"""

from __future__ import annotations

import functools
import os
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from worker.compat import all_gather_flat, reduce_scatter_flat
from worker.shared_exchange import (
    MIN_SHARED_BYTES,
    SHM_DISABLE_ENV,
    SharedExchange,
    Started,
    sum_chunks,
)
from worker.whereabouts import TRACKER, Call, GroupTag

__all__ = ["CollectiveError", "Collectives", "Handle", "OpStats", "StepAborted"]

Op = Literal[
    "all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "send_recv", "control"
]
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, the group was aborted or timed out.

    Raised by this module only, from any error torch.distributed raised while
    issuing or waiting on a collective, so callers tell a broken group from
    their own bugs by type, never by message text.
    """


class StepAborted(RuntimeError):
    """A peer was lost mid-step. The session has re-formed the job and rolled back to
    ``engine.global_steps``: carry on with the training loop from that step
    (``worker.StepAborted``; raised by the sessions above the engine, worker/elastic/,
    and caught by the engines that retry a step, worker/mesh.py)."""


@contextmanager
def _translated(op: str) -> Iterator[None]:
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:  # dist.DistError and gloo/NCCL errors alike
        raise CollectiveError(f"{op} failed: {exc}") from exc


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    wire_bytes: int = 0
    seconds: float = 0.0


# gloo works this process waited on last, kept referenced ([Note: the last works
# are freed by the interpreter, not by gloo])
_FINISHED: deque[dist.Work] = deque(maxlen=8)


class Handle:
    """A pending collective. ``wait()`` blocks until done and books its time.

    It may stand for several works and a local step to run once they are done
    (gloo's reduce-scatter below is an all-to-all followed by a sum).

    [Note: the last works are freed by the interpreter, not by gloo]
    A gloo work holds the tensors of its collective, and gloo's worker thread
    drops its reference to the work just after marking it complete, racing
    the thread that waited for it. When the Python side has dropped the work
    and those tensors first (the usual case: a temporary buffer, a replica
    refresh forgotten after ``wait()``), that worker thread frees the
    tensors, and freeing a tensor that had a Python object takes the GIL. At
    interpreter exit that is fatal: a thread that takes the GIL during
    finalization exits through a frame that must not unwind, and the process
    dies with SIGABRT ("terminate called without an active exception") after
    its script finished. Seen in the goodput benchmark (a core dump: frames
    ``ProcessGroupGloo::runLoop`` → ``~AsyncAlltoallWork`` →
    ``THPVariable_dealloc`` → ``take_gil`` → ``pthread_exit``) and reproduced
    with torch alone: three processes that each start an async all-to-all,
    wait, drop it and exit; 7 of 60 aborted. Keeping the works referenced
    after the wait, 0 of 60.
    So a waited gloo work is kept in a small queue of the last ones: gloo's
    reference is then never the last, and whichever thread drops the work
    later holds the GIL (a wait evicting it, or the interpreter's own
    teardown). The cost is the tensors of at most 8 finished works, which
    are nearly always buffers the engine keeps anyway.
    """

    __slots__ = ("_call", "_outlive", "_start", "_stats", "_then", "_works", "input_free")

    def __init__(
        self,
        work: dist.Work | list[dist.Work] | None,
        stats: OpStats | None,
        start: float,
        then: Callable[[], None] | None = None,
        *,
        outlive: bool = False,
        call: Call | None = None,
    ) -> None:
        self._works = work if isinstance(work, list) else [] if work is None else [work]
        self._stats, self._start, self._then = stats, start, then
        self._outlive = outlive  # a gloo work: keep it past the wait (see the Note)
        self._call = call  # worker/whereabouts.py [Note: naming a stall]
        # the collective holds no reference to its input any more (a shared exchange
        # wrote it out as it was issued): the caller may reuse it before the wait
        self.input_free = False

    def done(self) -> bool:
        """Whether every work has completed (or failed), without waiting: ``wait()``
        then returns or raises at once."""
        return all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        with _translated("waiting on a collective"), TRACKER.waiting(self._call):
            for work in self._works:
                work.wait()
        if self._outlive:
            _FINISHED.extend(self._works)
        self._works = []
        if self._then is not None:
            then, self._then = self._then, None
            with _translated("completing a collective"):  # a shared exchange's reads
                then()
        if self._stats is not None:
            self._stats.seconds += time.perf_counter() - self._start
            self._stats = None


_DONE = Handle(None, None, 0.0)
# free receive buffers a Collectives keeps ([Note: a reduce-scatter's receive buffer is reused])
_SCRATCH_KEPT = 2
# transient bucket-sized buffers are made in multiples of this many elements, so
# that after a membership change (each bucket padded to a multiple of the new
# world size) the same buffers still fit
BUFFER_GRAIN = 1 << 16


def smallest_fit(buffers: list[torch.Tensor], numel: int, like: torch.Tensor) -> int | None:
    """The index of the smallest of ``buffers`` that holds ``numel`` elements of ``like``'s
    dtype and device (None: none does), so that a larger one stays for a larger need
    (worker/reducers.py [Note: staging buffers by need])."""
    fits = [
        i
        for i, buf in enumerate(buffers)
        if buf.numel() >= numel and buf.dtype == like.dtype and buf.device == like.device
    ]
    return min(fits, key=lambda i: buffers[i].numel()) if fits else None


def grained(numel: int) -> int:
    """``numel`` rounded up to a multiple of :data:`BUFFER_GRAIN`."""
    return numel + (-numel % BUFFER_GRAIN)


@dataclass
class Collectives:
    """Collectives over one process group (``None`` = the default group).

    With no initialized process group, or a group of one, every op is local and
    nothing is counted: a single process moves no bytes.
    """

    group: dist.ProcessGroup | None = None
    stats: dict[str, OpStats] = field(default_factory=lambda: defaultdict(OpStats))
    # CPU seconds spent compressing payloads for these collectives ("encode", "decode")
    codec: dict[str, OpStats] = field(default_factory=lambda: defaultdict(OpStats))
    # receive buffers of gloo's reduce-scatter, free for the next one
    # ([Note: a reduce-scatter's receive buffer is reused])
    _scratch: list[torch.Tensor] = field(default_factory=list, repr=False)
    # this group's shared memory on one host (None: not every rank shares it)
    _host: SharedExchange | None = field(default=None, repr=False)
    _host_opened: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
            self.backend = str(dist.get_backend(self.group))
        else:
            self.rank, self.world_size, self.backend = 0, 1, "none"

    @classmethod
    def ahead(cls, rank: int, world_size: int, backend: str) -> Collectives:
        """Stand-in for the default group of a generation that has not formed yet:
        its rank and size, to build buffers for (worker/elastic/joining.py [Note: a newcomer
        builds ahead]). No collective may run on it; once the group has formed,
        :meth:`ShardState.rebind` swaps in the real one."""
        comm = cls()
        comm.rank, comm.world_size, comm.backend = rank, world_size, backend
        return comm

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def on_default_group(self) -> bool:
        """Whether this is the default process group (or a stand-in for one)."""
        return self.group is None or self.group is dist.group.WORLD

    @staticmethod
    def gloo_world() -> Collectives:
        """A new gloo group of every rank of the default group (a collective of them
        all): a peer lost while it forms raises :class:`CollectiveError`, as a
        collective does, so that the job re-forms rather than the rank exiting."""
        with _translated("new_group"):
            return Collectives(dist.new_group(backend="gloo"))

    @functools.cached_property
    def _tag(self) -> GroupTag:
        """This group as worker/whereabouts.py names it."""
        if self.group is None:
            return GroupTag.of(dist.group.WORLD, range(self.world_size))
        return GroupTag.of(self.group, dist.get_process_group_ranks(self.group))

    def _book(
        self, op: Op, nbytes: int, wire: int | None = None, *, kind: str | None = None
    ) -> tuple[OpStats, float]:
        """Count a collective under ``op`` (``kind``: what it is, where ``op`` books
        it as another) and number it for the coordinator ([Note: naming a stall])."""
        stats = self.stats[op]
        stats.calls += 1
        stats.bytes += nbytes
        stats.wire_bytes += nbytes if wire is None else wire
        TRACKER.issue(kind or op, self._tag)  # its Handle waits on TRACKER.last
        return stats, time.perf_counter()

    def _finish(
        self,
        work: dist.Work | list[dist.Work] | None,
        stats: OpStats,
        start: float,
        async_op: bool,
        then: Callable[[], None] | None = None,
    ) -> Handle:
        handle = Handle(work, stats, start, then, outlive=self.backend == "gloo", call=TRACKER.last)
        if not async_op:
            handle.wait()
        return handle

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: str = "sum",
        async_op: bool = False,
        control: bool = False,
    ) -> Handle:
        if not self.distributed:
            return _DONE
        stats, start = self._book(
            "control" if control else "all_reduce", _nbytes(tensor), kind="all_reduce"
        )
        work = _issue(
            dist.all_reduce, tensor, op=_REDUCE_OPS[op], group=self.group, async_op=async_op
        )
        return self._finish(work, stats, start, async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Handle:
        """Sum ``input`` (``world_size`` equal chunks) across ranks; chunk r lands on rank r."""
        if not self.distributed:
            output.copy_(input)
            return _DONE
        stats, start = self._book("reduce_scatter", _nbytes(input))
        if self.backend == "gloo":
            shared = self._shared("reduce_scatter", output, input)
            if shared is not None:  # [Note: exchanges through shared memory]
                self._scratch.clear()  # none needed (a fall-back to gloo makes them anew)
                work, finish = shared
                handle = self._finish(work, stats, start, async_op, finish)
                handle.input_free = True
                return handle
            # [Note: gloo's flat collectives] an all-to-all moves each chunk once
            chunks = self._take_scratch(input)
            work = _issue(dist.all_to_all_single, chunks, input, group=self.group, async_op=True)

            def add_up() -> None:
                sum_chunks(output, chunks.view(self.world_size, -1))
                self._give_scratch(chunks)

            return self._finish(work, stats, start, async_op, add_up)
        work = _issue(reduce_scatter_flat, output, input, group=self.group, async_op=async_op)
        return self._finish(work, stats, start, async_op)

    def _take_scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A buffer shaped as ``like`` to receive into: a free one large enough, or new.

        [Note: a reduce-scatter's receive buffer is reused]
        gloo's reduce-scatter receives every rank's chunk of the input into a
        buffer as large as the input (a bucket), then sums. Made anew at every
        call, a bucket above glibc's mmap threshold (32 MiB) came from the kernel
        each time and went back after the sum, so every step faulted in fresh
        pages for each such bucket. Measured here (3 ranks, 19M-parameter GPT,
        stage 2, 16M-element buckets, 30 steps, three runs of each alternated): a
        median step of 0.332-0.370 s made anew, 0.312-0.323 s reused. Under the
        threshold (the default 4M-element buckets) glibc's heap already reused
        the memory and nothing changed measurably. Waited-on buffers are kept
        for the next call: at most the two largest (two buckets reduce at a time,
        see worker/reducers.py StagingPool), a smaller one a view of the start of
        a larger one. Held between steps: up to two bucket-sized buffers, on
        gloo only.
        """
        n = like.numel()
        fit = smallest_fit(self._scratch, n, like)
        if fit is not None:
            return self._scratch.pop(fit)[:n].view(like.shape)
        # rounded up, so that a next generation's buckets fit too (inherit_scratch)
        made = torch.empty(grained(n), dtype=like.dtype, device=like.device)
        return made[:n].view(like.shape)

    def _give_scratch(self, *used: torch.Tensor) -> None:
        for t in used:
            self._scratch.append(t._base if t._base is not None else t)
        self._scratch.sort(key=lambda t: t.numel(), reverse=True)
        del self._scratch[_SCRATCH_KEPT:]

    def warm_scratch(self, numels: list[int], dtype: torch.dtype, device: torch.device) -> None:
        """Make the receive buffers of the two largest of reduce-scatters of ``numels``
        elements now, written once (on gloo; other backends receive in place)."""
        if self.backend != "gloo" or not self.distributed:
            return
        largest = sorted(numels, reverse=True)[:_SCRATCH_KEPT]
        self._give_scratch(*(torch.zeros(grained(n), dtype=dtype, device=device) for n in largest))

    def inherit_scratch(self, old: Collectives) -> None:
        """Take the free receive buffers of ``old``, the group this one replaces (a
        new generation's buckets are the old ones' size within a few elements)."""
        if old is not self:
            scratch, old._scratch = old._scratch, []
            self._give_scratch(*scratch)

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        async_op: bool = False,
        logical_bytes: int | None = None,
    ) -> Handle:
        """Concatenate every rank's ``input`` into ``output`` in rank order.

        ``logical_bytes``: for a compressed payload, the size of the tensor it
        stands for (``bytes`` counts that, ``wire_bytes`` the payload).
        """
        if not self.distributed:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _DONE
        wire = _nbytes(output)
        stats, start = self._book("all_gather", logical_bytes or wire, wire)
        if self.backend == "gloo":
            shared = self._shared("all_gather", output, input)
            if shared is not None:  # [Note: exchanges through shared memory]
                work, finish = shared
                return self._finish(work, stats, start, async_op, finish)
            # [Note: gloo's flat collectives] each rank broadcasts its own slot
            slots = output.view(self.world_size, -1)
            if slots[self.rank].data_ptr() != input.data_ptr():
                slots[self.rank].copy_(input.view(-1))
            works = [
                _issue(
                    dist.broadcast, slots[r], src=self._global(r), group=self.group, async_op=True
                )
                for r in range(self.world_size)
            ]
            return self._finish(works, stats, start, async_op)
        work = _issue(all_gather_flat, output, input, group=self.group, async_op=async_op)
        return self._finish(work, stats, start, async_op)

    def _shared(self, op: str, output: torch.Tensor, input: torch.Tensor) -> Started | None:
        """Start ``op`` ("all_gather" or "reduce_scatter", equal chunks)
        through this host's shared memory where every rank of the group can
        (worker/shared_exchange.py); None: over gloo's transport. Every rank decides
        alike from the shapes."""
        moved = _nbytes(input) * (self.world_size if op == "all_gather" else 1)  # the region
        expected = moved // self.world_size if op == "reduce_scatter" else moved
        if (
            output.device.type != "cpu"
            or input.device.type != "cpu"
            or not (output.is_contiguous() and input.is_contiguous())
            or _nbytes(output) != expected  # gloo says what is wrong
            or moved < MIN_SHARED_BYTES
        ):
            return None
        # issuing completes the one before: a wait ([Note: naming a stall])
        with _translated(op), TRACKER.waiting(TRACKER.last):
            if not self._host_opened:
                self._host_opened = True
                wanted = os.environ.get(SHM_DISABLE_ENV, "0") != "1"
                self._host = SharedExchange.open(
                    self.group, self.rank, self.world_size, wanted=wanted
                )
            if self._host is None:
                return None
            return getattr(self._host, op)(output, input)

    def split(self, size: int) -> Collectives:
        """Collectives over this rank's block of ``size`` consecutive ranks of this
        group: ranks ``[0, size)``, ``[size, 2·size)``, ... (hpZ's and qgZ's node
        groups, worker/stages.py [Note: hierarchical partitioning]).

        ``torch.distributed.new_group`` wants every rank of the default group to
        create every group, in the same order: each rank here creates every
        block's group, so every rank of this group must call it at the same point
        of its collectives, and this group must span the default group."""
        self._check_blocks(size)
        blocks = [list(range(start, start + size)) for start in range(0, self.world_size, size)]
        return self._form(blocks, self.rank % size, "its block")

    def across(self, size: int) -> Collectives:
        """Collectives over the ranks of this group that hold this rank's place in
        their block of ``size`` consecutive ranks (see :meth:`split`): ranks
        ``{j, j + size, j + 2·size, ...}`` for this rank's ``j = rank % size``,
        where this rank is rank ``rank // size`` (qgZ's cross-node groups,
        worker/compression.py [Note: hierarchical gradient reduce-scatter]).
        Formed as :meth:`split`'s groups are: every rank creates every such
        group, in the same order, at the same point of its collectives."""
        self._check_blocks(size)
        places = [list(range(j, self.world_size, size)) for j in range(size)]
        return self._form(places, self.rank // size, "the ranks of its place")

    def _check_blocks(self, size: int) -> None:
        if size < 1 or self.world_size % size:
            raise ValueError(f"{size} ranks per block do not divide {self.world_size} ranks")
        if self.group is not None and dist.get_world_size() != self.world_size:
            raise ValueError(
                "blocks of ranks are formed from the default process group only; this "
                f"group has {self.world_size} of its {dist.get_world_size()} ranks"
            )

    def _form(self, groups: list[list[int]], want: int, what: str) -> Collectives:
        """Create a group of each list of this group's ranks (every rank creates
        every group, in order) and return this rank's, where it is rank ``want``."""
        mine: dist.ProcessGroup | None = None
        with _translated("new_group"):
            for ranks in groups:
                group = dist.new_group([self._global(r) for r in ranks])
                if self.rank in ranks:
                    mine = group
        formed = Collectives(mine)
        if formed.rank != want:
            # new_group orders a group's ranks by their global rank
            raise ValueError(
                f"rank {self.rank} is rank {formed.rank} of {what}, not {want}: "
                "this group's ranks are not in the default group's order"
            )
        return formed

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0, async_op: bool = False) -> Handle:
        if not self.distributed:
            return _DONE
        stats, start = self._book("broadcast", _nbytes(tensor))
        work = _issue(
            dist.broadcast, tensor, src=self._global(src), group=self.group, async_op=async_op
        )
        return self._finish(work, stats, start, async_op)

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        async_op: bool = False,
        as_op: Op = "all_to_all",
        logical_bytes: int | None = None,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> Handle:
        """Chunks of ``input`` to every rank (equal, or as the split sizes say);
        ``as_op`` books it under the op it implements (a compressed reduce-scatter
        is an all-to-all of payloads)."""
        if not self.distributed:
            output.copy_(input)
            return _DONE
        wire = _nbytes(input)
        stats, start = self._book(as_op, logical_bytes or wire, wire, kind="all_to_all")
        work = _issue(
            dist.all_to_all_single,
            output,
            input,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=self.group,
            async_op=async_op,
        )
        return self._finish(work, stats, start, async_op)

    def send_recv(
        self,
        sends: list[torch.Tensor],
        dst: int,
        recvs: list[torch.Tensor],
        src: int,
        *,
        async_op: bool = False,
    ) -> Handle:
        """Send ``sends`` to rank ``dst`` and receive ``recvs`` from rank ``src``, in
        order, as one batch (NCCL needs the batch where every rank sends and
        receives at once). Bytes count what this rank sends."""
        if not self.distributed:
            for out, t in zip(recvs, sends, strict=True):
                out.copy_(t)
            return _DONE
        stats, start = self._book("send_recv", sum(_nbytes(t) for t in sends))
        ops = [dist.P2POp(dist.isend, t, self._global(dst), self.group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self._global(src), self.group) for t in recvs]
        works = _issue(dist.batch_isend_irecv, ops) if ops else []
        return self._finish(list(works or []), stats, start, async_op)

    def barrier(self) -> None:
        if self.distributed:
            TRACKER.issue("barrier", self._tag)
            _issue(dist.barrier, group=self.group, async_op=False)

    @contextmanager
    def codec_time(self, kind: Literal["encode", "decode"]) -> Iterator[None]:
        """Book the calling thread's CPU time inside the block as codec ``kind``."""
        start = time.thread_time()
        try:
            yield
        finally:
            stats = self.codec[kind]
            stats.calls += 1
            stats.seconds += time.thread_time() - start

    def codec_report(self) -> dict[str, dict[str, float]]:
        """Codec calls and CPU seconds by kind (encode, decode) since start."""
        return {
            kind: {"calls": self.codec[kind].calls, "seconds": self.codec[kind].seconds}
            for kind in ("encode", "decode")
        }

    def report(self) -> dict[str, dict[str, int | float]]:
        return {
            op: {
                "calls": s.calls,
                "bytes": s.bytes,
                "wire_bytes": s.wire_bytes,
                "seconds": s.seconds,
            }
            for op, s in sorted(self.stats.items())
        }


def _issue(fn: Callable[..., dist.Work | None], *args, **kwargs) -> dist.Work | None:
    with _translated(getattr(fn, "__name__", "collective")):
        if kwargs.get("async_op", True):
            return fn(*args, **kwargs)
        # a blocking call waits inside torch: it is the wait ([Note: naming a stall])
        with TRACKER.waiting(TRACKER.last):
            return fn(*args, **kwargs)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
