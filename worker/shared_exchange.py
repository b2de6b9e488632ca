"""All-gathers and reduce-scatters among the ranks of one host through shared memory.

[Note: exchanges through shared memory]
On gloo, every byte a collective moves between two ranks of one host crosses
loopback TCP: copied into the kernel by the sender and out of it by the
receiver, on the cores the ranks compute on, and each collective is handed to
gloo's thread, which takes the core from the training thread. Stage 3
gathers Ψ once or twice a step and reduce-scatters it once, unit by unit
(gloo's reduce-scatter is an all-to-all and a sum: [Note: gloo's flat
collectives]), and on the held-out peer shape that movement was most of
stage 3's excess over DDP (bench/README.md, "Smaller units").

When every rank of a group can open the same file in ``/dev/shm`` and see
the others' processes (checked when the group's first large exchange runs:
rank 0 makes the file and writes a random nonce into it, every rank opens it
by name and reads the nonce back, and the group agrees on the answer), an
exchange instead writes this rank's contribution into its slot of a region
of that file (``pwrite``: an all-gather's shard, an all-to-all's whole
input), rings every other rank's doorbell (a named pipe per rank, one
24-byte record: who, which exchange, how many bytes), waits for the other
ranks' rings and reads what it receives from their slots (``preadv``: their
shards, or the chunk each sent it). Each byte is copied once into shared
memory and once out of it; nothing goes through gloo's thread. Measured on 2
ranks of this machine (2 cores, another job running): a ring and its wait
take 8-55 µs and ~4 µs of CPU, a gloo all-reduce of 32 bytes 0.9 ms and
~0.45 ms of CPU; a 3.2 MB gather's bytes 1.2-1.3 ms against 2.8-3.0 ms by
gloo's broadcasts.

The file is read and written by system calls, never mapped, so its pages
count in the host's shared memory once, not in any rank's resident set (a
mapped region read by N ranks would count N times). The file and the pipes
are unlinked as soon as every rank has opened them: a crash leaves nothing in
``/dev/shm``.

Where an exchange's region lies is decided the same way on every rank, from
the sizes alone (every rank exchanges the same sizes in the same order). The
file holds a ring three times the largest region: a region is placed right
after the previous one, or at the start when it does not fit before the end.
Its bytes are free to overwrite once every rank has read them, which no rank
has to be told: before a rank issues exchange ``u`` it completes exchange
``u - 1`` (waits for its rings and reads it). So a rank that has every ring
of ``u - 1`` knows every rank has issued ``u - 1``, hence has read ``u - 2``:
only ``u - 1``'s bytes can still be unread, and the placement never overlaps
them (with the ring at three times the largest region, a region that does
not fit after ``u - 1`` fits before it). The order costs little: stage 3
prefetches one unit, and ``u - 1`` was issued a unit's compute before ``u``.
When a larger region comes, every rank completes all it has issued before
the group agrees on the larger ring (an all-reduce), which then starts empty.

A ring carries the exchange's number and size, so ranks that disagree on one
fail with :class:`~worker.collectives.CollectiveError` rather than read each
other's bytes for another tensor. A wait is a collective's wait for the
coordinator's stall naming, and it ends in a
:class:`~worker.collectives.CollectiveError` as a gloo wait does: when a peer
process is gone (checked every 100 ms) without having rung for it (a peer that
rang for its last exchange and exited is heard: its rings are in the pipe
before it ends, and the doorbell is drained before a loss is judged), when a
peer left the group (a rank aborting a broken group rings its peers a last
time, as it closes its gloo connections: [Note: a survivor that learns late]
in worker/compat.py), when this rank releases a wait on ranks the coordinator
dropped, or at the group's collective timeout. When the file cannot grow to
hold a larger region (``/dev/shm`` full: ``posix_fallocate`` fails on some
rank), the group agrees to use gloo's collectives from then on. Regions over
64 MiB (an all-gather's is the world size times its input) go over gloo, so
that the ring stays under 200 MiB of host memory a group; a reduce-scatter's
goes in pieces instead (:meth:`SharedExchange.reduce_scatter`, which reads and
adds one chunk at a time, so that it needs no receive buffer as large as its
input).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import select
import struct
import threading
import time
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from worker.compat import group_timeout, on_closing_connections

__all__ = [
    "MIN_SHARED_BYTES",
    "SHM_DISABLE_ENV",
    "SharedExchange",
    "SharedExchangeError",
    "Started",
    "hang_up",
    "sum_chunks",
]

logger = logging.getLogger(__name__)

# "1" turns it off: every collective goes over gloo's transport (as NCCL_SHM_DISABLE=1)
SHM_DISABLE_ENV = "ZEROPLANE_SHM_DISABLE"
# smaller exchanges stay on gloo
MIN_SHARED_BYTES = 1 << 16
# so do exchanges of larger regions (an all-to-all's is world x its input): the ring,
# three of them, is host memory (charged to the job's memory limit in a container)
MAX_REGION_BYTES = 64 << 20
_DIR = "/dev/shm"
_HEADER = 4096  # the nonce; the ring starts after it
_ALIGN = 64
_GRAIN = 1 << 20  # the file grows in whole MiB
_RING = struct.Struct("<qqq")  # rank, exchange number (-1: left the group), bytes
_POLL_MS = 100
# issuing exchange u completes exchange u - BEHIND (see the Note)
BEHIND = 1
_LEFT = -1

# the shared exchanges of this process, to hang up when a group breaks (from any thread)
_OPEN: weakref.WeakSet[SharedExchange] = weakref.WeakSet()
_OPEN_LOCK = threading.Lock()

# what to wait on (one exchange, or the pieces of one) and what completes it once done
Started = tuple["_Rings | list[_Rings]", Callable[[], None]]


def _buffer(t: torch.Tensor, start: int = 0, stop: int | None = None) -> memoryview:
    """A writable view of bytes ``[start, stop)`` of contiguous CPU tensor ``t``."""
    stop = _nbytes(t) if stop is None else stop
    raw = (ctypes.c_char * (stop - start)).from_address(t.data_ptr() + start)
    return memoryview(raw).cast("B")


def _write(fd: int, data: memoryview, offset: int) -> None:
    while data:
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def _read(fd: int, into: memoryview, offset: int) -> None:
    while into:
        done = os.preadv(fd, [into], offset)
        if done == 0:
            raise OSError(f"the shared exchange file ended at byte {offset}")
        into, offset = into[done:], offset + done


def sum_chunks(output: torch.Tensor, chunks: Iterable[torch.Tensor]) -> None:
    """``output`` = the sum of ``chunks`` (each as ``output``, taken as it comes: an
    iterator may refill one buffer), added one after another in their order, in fp32
    for 16-bit dtypes: the same sum through shared memory and over gloo."""
    acc: torch.Tensor | None = None
    wide = output.dtype in (torch.bfloat16, torch.float16)
    for chunk in chunks:
        chunk = chunk.view(output.shape)
        if acc is None:
            acc = chunk.float() if wide else output.copy_(chunk)
        else:
            acc.add_(chunk)
    if acc is not None and acc is not output:
        output.copy_(acc)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _round_up(n: int, multiple: int) -> int:
    return n + (-n % multiple)


class SharedExchange:
    """The shared file and doorbells of one process group whose ranks all run on this
    host. Made by :meth:`open` (a collective of the group); :meth:`start` issues one
    all-gather or reduce-scatter through it. One thread issues and waits on a group's
    collectives, as
    torch.distributed requires; :func:`hang_up` may come from another.
    """

    def __init__(
        self,
        fd: int,
        bell: int,
        peers: dict[int, tuple[int, int]],
        group: dist.ProcessGroup | None,
        rank: int,
        world: int,
    ) -> None:
        self.fd, self.bell, self.group, self.rank, self.world = fd, bell, group, rank, world
        self.peers = peers  # group rank -> (doorbell fd, pid)
        self.global_ranks = {r: _global(group, r) for r in range(world)}
        self.timeout_s = group_timeout(group).total_seconds()
        self.capacity = 0  # bytes of ring, after the header
        self.largest = 0
        self.seq = 0
        # the regions other ranks may not have read yet, [start, end), oldest first
        self.live: deque[tuple[int, int]] = deque(maxlen=2 * BEHIND - 1)
        # what completes each exchange not yet completed, by number (oldest first)
        self.pending: dict[int, Callable[[], None]] = {}
        self.heard: dict[int, dict[int, int]] = defaultdict(dict)  # seq -> {rank: bytes}
        self.broken: str | None = None  # why no wait can succeed any more
        # peers found ended (why), each failing the exchanges it did not ring for
        self.ended: dict[int, str] = {}
        self.fallen_back = False  # the group agreed to use gloo's collectives
        self._chunk: torch.Tensor | None = None  # a reduce-scatter's (see reduce_scatter)
        fds = [fd, bell, *(w for w, _ in peers.values())]
        weakref.finalize(self, _close_all, fds)
        with _OPEN_LOCK:
            _OPEN.add(self)

    @classmethod
    def open(
        cls, group: dist.ProcessGroup | None, rank: int, world: int, *, wanted: bool = True
    ) -> SharedExchange | None:
        """The group's shared file and doorbells, or None where some rank cannot use
        them (another host, another ``/dev/shm`` or process namespace, none at all) or
        does not want them (``wanted``: ``ZEROPLANE_SHM_DISABLE`` on that rank). A
        collective of ``group``, whatever this rank wants, so that ranks that disagree
        agree on gloo."""
        fd, bell, path, token = -1, -1, "", secrets.token_hex(8)
        nonce = secrets.token_bytes(16)
        peers: dict[int, tuple[int, int]] = {}
        bells: list[str] = []
        agreed = torch.tensor([0], dtype=torch.int32)
        try:
            if rank == 0 and wanted:
                with contextlib.suppress(OSError):
                    fd, path = _make_file(nonce)
            box = [path, nonce, token]
            dist.broadcast_object_list(box, src=_global(group, 0), group=group)
            path, nonce, token = box
            bells = [os.path.join(_DIR, f"zeroplane-bell-{token}-{r}") for r in range(world)]
            ok = bool(path) and wanted
            try:
                if rank != 0 and ok:
                    fd = os.open(path, os.O_RDWR)
                ok = ok and os.pread(fd, len(nonce), 0) == nonce
                if ok:
                    os.mkfifo(bells[rank], 0o600)
                    bell = os.open(bells[rank], os.O_RDWR | os.O_NONBLOCK)
            except OSError:
                ok = False
            pids: list[object] = [None] * world
            dist.all_gather_object(pids, os.getpid() if ok else None, group=group)
            if all(pid is not None for pid in pids):
                try:
                    for r, pid in enumerate(pids):
                        if r != rank:
                            if not _alive(int(pid)):  # its process is visible from this one
                                raise ProcessLookupError(pid)
                            writer = os.open(bells[r], os.O_WRONLY | os.O_NONBLOCK)
                            peers[r] = (writer, int(pid))
                except OSError:
                    ok = False
            agreed[0] = 1 if ok else 0
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        finally:
            # every rank that could open them has (or the group failed as they did);
            # this rank's pipe may exist unopened
            for mine in bells[rank : rank + 1] + ([path] if rank == 0 and path else []):
                with contextlib.suppress(OSError):
                    os.unlink(mine)
            if not agreed.item():
                _close_all([fd, bell, *(w for w, _ in peers.values())])
        if not agreed.item():
            logger.info("this group's collectives go over gloo: not every rank shares %s", _DIR)
            return None
        return cls(fd, bell, peers, group, rank, world)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Started | None:
        """Issue the all-gather of ``input`` into ``output`` (contiguous, on the CPU):
        what to wait on and what completes it once done. None: the group uses gloo's
        collectives, from now or before."""
        total = _nbytes(output)
        slot = total // self.world
        own = input.reshape(-1)
        out_slots = output.view(self.world, -1)
        spans = [(0, self.rank * slot), ((self.rank + 1) * slot, total)]  # the peers' slots
        reads = [(output, a, b, a) for a, b in spans if b > a]
        started = self._start("all-gather", total, own, reads)
        if started is not None and out_slots[self.rank].data_ptr() != own.data_ptr():
            out_slots[self.rank].copy_(own)
        return started

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Started | None:
        """Issue the reduce-scatter (a sum) of ``input``'s equal chunks into ``output``
        (contiguous, on the CPU): chunk r of every rank, summed in rank order
        (:func:`sum_chunks`), lands in rank r's ``output``. Each rank writes its whole
        input (an all-to-all's), but each chunk is read out of the region into one
        chunk-sized buffer and added as it comes: no receive buffer as large as the
        input (what gloo's all-to-all and a sum need: [Note: gloo's flat
        collectives] in worker/collectives.py). This rank's own chunk is read back
        from its slot too, so ``input`` is free to reuse once this returns.

        An input whose region (world x its bytes) is over ``MAX_REGION_BYTES`` goes
        in pieces, each the same columns of every chunk, one exchange each: issuing
        a piece completes the one before (see the Note), so all but the last are
        waited for here."""
        world, numel = self.world, output.numel()
        columns = max(1, MAX_REGION_BYTES // (world * world * input.element_size()))
        rows = input.view(world, numel)
        started = []
        for lo in range(0, numel, columns):
            hi = min(numel, lo + columns)
            piece = self._reduce_piece(output[lo:hi], rows[:, lo:hi])
            if piece is None:  # only the first can be (later ones are no larger)
                return None
            started.append(piece)
        if len(started) == 1:
            return started[0]

        def finish() -> None:
            for _, done in started:
                done()

        return [rings for rings, _ in started], finish

    def _reduce_piece(self, output: torch.Tensor, rows: torch.Tensor) -> Started | None:
        """One exchange of :meth:`reduce_scatter`: ``rows`` (world x the piece's
        columns) written as one slot, chunk ``rank`` of every slot summed into
        ``output``."""
        chunk = output.numel() * rows.element_size()
        slot = self.world * chunk

        def reduce(read: Callable[[torch.Tensor, int], None]) -> None:
            buffer = self._chunk_buffer(output.numel(), rows.dtype)

            def chunks() -> Iterator[torch.Tensor]:
                for p in range(self.world):
                    read(buffer, p * slot + self.rank * chunk)
                    yield buffer

            sum_chunks(output, chunks())

        own = list(rows) if not rows.is_contiguous() else [rows.reshape(-1)]
        return self._start("reduce-scatter", self.world * slot, own, [], reduce)

    def _chunk_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The buffer a reduce-scatter reads each chunk into: kept, as large as the
        largest chunk yet (a bucket's share: 1/world of gloo's receive buffer)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self._chunk is None or self._chunk.numel() < nbytes:
            self._chunk = torch.empty(nbytes, dtype=torch.uint8)
        return self._chunk[:nbytes].view(dtype)

    def _start(
        self,
        op: str,
        total: int,
        own: torch.Tensor | list[torch.Tensor],
        reads: list[tuple[torch.Tensor, int, int, int]],
        then: Callable[[Callable[[torch.Tensor, int], None]], None] | None = None,
    ) -> Started | None:
        """Issue one exchange through a region of ``total`` bytes: this rank writes
        ``own`` (one tensor, or several one after another) into its slot (``total /
        world`` bytes); once every rank has, each
        ``(tensor, start, stop, at)`` of ``reads`` gets bytes ``[start, stop)`` of
        ``tensor`` from the region's bytes from ``at`` on, then ``then`` runs with a
        reader (``read(tensor, at)`` fills ``tensor`` from the region's byte ``at``)."""
        self._complete(self.seq + 1 - BEHIND)  # [Note: exchanges through shared memory]
        if self.fallen_back or total > MAX_REGION_BYTES:
            return None
        if self.broken is not None:  # no ring after a hang-up: peers would read it
            raise _error(f"exchange #{self.seq + 1} through shared memory failed: {self.broken}")
        if total > self.largest and not self._grow(total):
            return None
        at = self._place(total)
        self.seq += 1
        seq = self.seq
        try:
            offset = _HEADER + at + self.rank * (total // self.world)
            for part in own if isinstance(own, list) else [own]:
                _write(self.fd, _buffer(part), offset)
                offset += _nbytes(part)
        except OSError as exc:
            raise _error(f"exchange #{seq} through shared memory failed: {exc}") from exc
        self._ring(_RING.pack(self.rank, seq, total), self.peers)
        rings, done = _Rings(self, seq, total, op), False

        def finish() -> None:
            nonlocal done
            if done:
                return
            done = True
            self.pending.pop(seq, None)
            try:
                for tensor, start, stop, offset in reads:
                    _read(self.fd, _buffer(tensor, start, stop), _HEADER + at + offset)
                if then is not None:
                    then(lambda into, offset: _read(self.fd, _buffer(into), _HEADER + at + offset))
            except OSError as exc:
                self.broken = self.broken or f"reading exchange #{seq} failed: {exc}"
                raise _error(f"exchange #{seq} through shared memory failed: {exc}") from exc

        def complete() -> None:
            rings.wait()
            finish()

        self.pending[seq] = complete
        return rings, finish

    def _complete(self, upto: int) -> None:
        """Complete every exchange this rank issued up to number ``upto``."""
        while self.pending:
            seq = next(iter(self.pending))
            if seq > upto:
                return
            self.pending.pop(seq)()

    def _place(self, total: int) -> int:
        end = self.live[-1][1] if self.live else 0
        at = _round_up(end, _ALIGN)
        if at + total > self.capacity:
            at = 0
        if any(at < b and at + total > a for a, b in self.live):
            raise AssertionError("a shared region overlaps an unread one")  # see the Note
        self.live.append((at, at + total))
        return at

    def _grow(self, total: int) -> bool:
        """Make the ring ``2·BEHIND + 1`` times ``total`` (the new largest region) on every
        rank, or agree to fall back to gloo's collectives where some rank cannot. Every
        rank completes all it issued first, so that past the agreement every region has
        been read everywhere and the ring starts empty."""
        self._complete(self.seq)
        capacity = _round_up((2 * BEHIND + 1) * (total + _ALIGN), _GRAIN)
        ok = 1
        try:
            os.posix_fallocate(self.fd, 0, _HEADER + capacity)
        except OSError as exc:
            logger.warning("no room for %d bytes in %s (%s): gloo's collectives", total, _DIR, exc)
            ok = 0
        agreed = torch.tensor([ok], dtype=torch.int32)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        if not agreed.item():
            self.fallen_back = True
            return False
        self.capacity, self.largest = capacity, total
        self.live.clear()
        return True

    def _ring(self, record: bytes, peers: Iterable[int]) -> None:
        for r in peers:
            try:
                os.write(self.peers[r][0], record)
            except OSError as exc:  # its reader is gone: the process died
                self.ended.setdefault(r, f"rank {self.global_ranks[r]} is gone ({exc})")

    def _drain(self) -> None:
        """Take every ring waiting in this rank's doorbell."""
        while True:
            try:
                data = os.read(self.bell, _RING.size * 64)
            except BlockingIOError:
                return
            for r, s, nbytes in _RING.iter_unpack(data):
                if s != _LEFT:
                    self.heard[s][r] = nbytes
                elif r != self.rank:  # its rings came before: the pipe keeps their order
                    self.ended.setdefault(r, f"rank {self.global_ranks[r]} left the group")
            if len(data) < _RING.size * 64:
                return

    def _hear(self, seq: int, deadline: float) -> dict[int, int]:
        """Block until every peer rang for exchange ``seq``; their byte counts. A peer
        found ended fails the exchange only if its ring is still missing once the
        doorbell has been drained after the finding: a process's rings are in the pipe
        before it ends, so a peer that rang and then exited (its last exchange done,
        others still to read it) is heard, not lost."""
        heard = self.heard[seq]
        poller = None  # made only if the rings are not all there yet
        # (a peer found ended has no pipe left to watch)
        writers = {w: r for r, (w, _) in self.peers.items() if r not in self.ended}
        checked = time.monotonic()
        while True:
            if self.broken is not None:  # (this rank hung up, or an exchange failed)
                raise _error(f"exchange #{seq} through shared memory failed: {self.broken}")
            self._drain()  # every peer in self.ended was found so before this drain
            if len(heard) == self.world - 1:
                return self.heard.pop(seq)
            lost = sorted(r for r in self.ended if r not in heard)
            if lost:
                self.broken = self.ended[lost[0]]
                continue
            known = len(self.ended)
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(self.global_ranks[r] for r in self.peers if r not in heard)
                self.broken = f"exchange #{seq} timed out"
                raise _error(
                    f"exchange #{seq} through shared memory timed out after "
                    f"{self.timeout_s:g}s waiting on rank(s) {missing}"
                )
            if now - checked >= _POLL_MS / 1000:
                checked = now
                self._check_alive()
            if poller is None:
                poller = select.poll()
                poller.register(self.bell, select.POLLIN)
                for w in writers:  # a peer's pipe with no reader left: its process ended
                    poller.register(w, select.POLLERR)
            for fd, events in poller.poll(0 if len(self.ended) > known else _POLL_MS):
                if fd in writers and events & select.POLLERR:
                    poller.unregister(fd)
                    r = writers.pop(fd)
                    gone = self.global_ranks[r]
                    self.ended.setdefault(r, f"rank {gone} left its doorbell: it ended")

    def _check_alive(self) -> None:
        for r, (_, pid) in self.peers.items():
            if r not in self.ended and not _alive(pid):
                self.ended[r] = f"rank {self.global_ranks[r]} (pid {pid}) exited"

    def hang_up(self, global_ranks: Iterable[int], why: str) -> None:
        """Fail this rank's waits on the group, and theirs on this rank (see the Note)."""
        self.broken = self.broken or why
        gone = set(global_ranks)
        peers = [r for r in self.peers if self.global_ranks[r] in gone]
        self._ring(_RING.pack(self.rank, _LEFT, 0), peers)
        with contextlib.suppress(OSError):  # wakes this rank's own wait, if one polls
            os.write(self.bell, _RING.pack(self.rank, _LEFT, 0))


class _Rings:
    """What a shared exchange's :class:`~worker.collectives.Handle` waits on: the other
    ranks' rings for it (in the place of a gloo work)."""

    __slots__ = ("_deadline", "_done", "_host", "_op", "_seq", "_total")

    def __init__(self, host: SharedExchange, seq: int, total: int, op: str) -> None:
        self._host, self._seq, self._total, self._op, self._done = host, seq, total, op, False
        self._deadline = time.monotonic() + host.timeout_s

    def is_completed(self) -> bool:
        return self._done

    def wait(self) -> None:
        if self._done:
            return
        host = self._host
        sizes = host._hear(self._seq, self._deadline)
        self._done = True
        wrong = {host.global_ranks[r]: n for r, n in sizes.items() if n != self._total}
        if wrong:
            host.broken = f"the ranks disagreed on exchange #{self._seq}"
            raise _error(
                f"the ranks disagree on exchange #{self._seq} of this group: this rank "
                f"issues an {self._op} of {self._total} bytes, rank(s) {wrong} other sizes "
                "(ranks issuing "
                "different collectives: data-dependent module execution?)"
            )


@on_closing_connections
def hang_up(global_ranks: Iterable[int], group: object | None) -> None:
    """A rank leaves ``group`` or gives up on ``global_ranks`` in it: every shared exchange
    of the group here, waiting or to come, fails, and so do those ranks' waits on this
    one ([Note: exchanges through shared memory]). Called where gloo's connections to
    them are closed (worker/compat.py)."""
    ranks = set(global_ranks)
    world = dist.group.WORLD
    with _OPEN_LOCK:
        hosts = list(_OPEN)
    for host in hosts:
        same = host.group is group or {host.group, group} <= {None, world}
        if same:
            host.hang_up(ranks, f"this rank gave up on rank(s) {sorted(ranks)}")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: a zombie, one that exited and that its parent
    has not reaped yet, does not (``kill(pid, 0)`` still reaches it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return _signalled(pid)
    return state not in (b"Z", b"X")


def _signalled(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _make_file(nonce: bytes) -> tuple[int, str]:
    path = os.path.join(_DIR, f"zeroplane-exchange-{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.pwrite(fd, nonce, 0)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    return fd, path


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class SharedExchangeError(RuntimeError):
    """An exchange through shared memory failed; :class:`~worker.collectives.Collectives`
    raises it as a :class:`~worker.collectives.CollectiveError`, as any collective's."""


def _error(message: str) -> Exception:
    return SharedExchangeError(message)
