"""One heartbeat per host: the agent a launcher runs for its local workers, and the
link a worker's client uses to reach it.

[Note: the host agent]
The coordinator's load is one heartbeat per rank per interval, until a host's
agent sends one for all of its ranks (coordinator/control/membership.py [Note:
host heartbeats]). ``zeroplane run`` starts a ``HostAgent`` beside its workers: it
listens on a Unix socket in a directory only its user may enter and exports the
path as ``$ZEROPLANE_HOST_AGENT``. A worker's client then sends its heartbeat
(the same ``RankBeat`` a HostHeartbeat carries) to the agent rather than to the
coordinator, and reads back the coordinator's answer to its newest beat the agent
forwarded. The agent sends one HostHeartbeat per interval with the newest beat of
every rank connected to it.

Liveness stays per rank, within the same bound as a rank's own heartbeats:

* a rank whose connection closed (its process died, or it left) is left out of
  the next heartbeat, which the agent sends at once; the coordinator drops a rank
  its agent listed before and leaves out now (a rank that left is gone already);
* a rank still connected but silent (a hung process) is left out once its newest
  beat is older than its lease less one agent interval, so the coordinator drops it
  no later than its own lease would have lapsed; until then each beat the agent
  lists carries its age (``RankBeat.age_s``), and the coordinator dates the rank's
  lease from when the rank sent it, so a stall's diagnosis sees the rank silent
  (coordinator/control/stalls.py) as it would without an agent;
* a silent agent (the launcher gone) stops renewing every lease on the host, and
  they lapse together; a worker that cannot reach its agent heartbeats the
  coordinator itself.

The answer a worker reads is one interval old: a STALE_GENERATION answer counts
only while the worker still holds an older generation than the one it names, and
an UNKNOWN_WORKER one only for a beat sent after the worker last registered
(``AgentLink``'s caller, the client, checks both). A beat that must reach the
coordinator before the worker goes on (its final report, a leave it announces)
asks for ``flush``: the agent forwards it at once and answers after the
coordinator did.

The wire, and the worker's end of it (``AgentLink``), are
coordinator/control/agent_link.py: each message (``AgentBeat`` one way, ``AgentReply``
the other) framed by its length in 4 big-endian bytes.

[Note: who may beat through the agent]
The socket's directory is 0700, so only the user's processes reach it; that is not
enough, since any of them could forge ranks (a flood over the coordinator's limit
of ranks per host beat would have every real lease lapse; a forged leave would
drop a live worker). So a connection is served only when the peer (its
``SO_PEERCRED``, on Linux) is a process of this user descended from the agent's
process (the launcher, whose workers it starts), and only while the agent serves
fewer connections than the ranks its launcher may start (``max_ranks``). A
malformed frame or message ends that connection only, never the agent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator.control.agent_link import recv_frame, send_frame
from coordinator.control.client import ClientConfig, CoordinatorClient, CoordinatorError
from coordinator.core.settings import HOST_AGENT_ENV

__all__ = ["HostAgent", "agent_host_id"]

logger = logging.getLogger(__name__)

# The agent's interval until a worker has told it the coordinator's.
_DEFAULT_INTERVAL_S = 1.0


class _Rank:
    """One worker connection's newest beat and the answer to the newest forwarded."""

    __slots__ = (
        "beat",
        "forwarded_seq",
        "interval_s",
        "lease_s",
        "received_at",
        "result",
        "seq",
    )

    def __init__(self) -> None:
        self.beat: pb.RankBeat | None = None
        self.seq = 0
        self.received_at = 0.0
        self.lease_s = 0.0
        self.interval_s = 0.0
        self.result: pb.RankBeatResult | None = None
        self.forwarded_seq = 0


class HostAgent:
    """The heartbeat agent of one host's workers ([Note: the host agent]); a
    ``coordinator.launchers.local.JobService``.

    ``forward`` sends one HostHeartbeatRequest and returns the coordinator's
    response (raising ``CoordinatorError`` when it cannot); ``host_id`` names this
    agent at the coordinator, unique among the job's agents.
    """

    def __init__(
        self,
        forward: Callable[[pb.HostHeartbeatRequest], pb.HostHeartbeatResponse],
        host_id: str,
        *,
        max_ranks: int | None = None,
    ) -> None:
        self._forward = forward
        self.host_id = host_id
        # [Note: who may beat through the agent]: the ranks the launcher may start, and
        # the process whose descendants may beat (the launcher's: this one)
        self.max_ranks = max_ranks
        self.launcher_pid = os.getpid()
        self.refused = 0  # connections refused (a stranger, or one rank too many)
        self._lock = threading.Condition()
        self._ranks: dict[socket.socket, _Rank] = {}
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._dir: Path | None = None
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._listed = False  # the last heartbeat listed a rank
        self._generation_id = 0
        self._job_finished = False
        self._stalled = ""
        self._unavailable = ""
        self.beats_sent = 0
        self._on_stop: Callable[[], object] = lambda: None

    @classmethod
    def for_coordinator(
        cls,
        config: Callable[[], ClientConfig],
        host_id: str | None = None,
        *,
        max_ranks: int | None = None,
    ) -> HostAgent:
        """An agent that reaches the coordinator on a HostHeartbeats stream of its own,
        its client made from ``config()`` at the first heartbeat (after the services
        before it started: an embedded coordinator has its address then)."""
        stream = _HostStream(config)
        agent = cls(stream, host_id or agent_host_id(), max_ranks=max_ranks)
        agent._on_stop = stream.close
        return agent

    @property
    def path(self) -> str:
        if self._dir is None:
            raise RuntimeError("start() the agent first")
        return str(self._dir / "agent.sock")

    def start(self) -> dict[str, str]:
        # mkdtemp makes the directory 0700: only this user's processes reach the socket,
        # and the agent speaks to the coordinator with the job's token
        self._dir = Path(tempfile.mkdtemp(prefix="zeroplane-agent-"))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(64)
        self._listener = listener
        for target, name in ((self._accept_loop, "accept"), (self._beat_loop, "beat")):
            thread = threading.Thread(target=target, name=f"zeroplane-agent-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return {HOST_AGENT_ENV: self.path}

    def stop(self) -> None:
        self._closed.set()
        self._wake.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            for conn in list(self._ranks):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            self._lock.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._on_stop()

    # ---- the workers' side --------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            refusal = self._refusal(conn)
            if refusal is not None:
                self.refused += 1
                logger.warning("host agent: refused a connection: %s", refusal)
                conn.close()
                continue
            thread = threading.Thread(
                target=self._serve, args=(conn,), name="zeroplane-agent-rank", daemon=True
            )
            thread.start()

    def _refusal(self, conn: socket.socket) -> str | None:
        """Why ``conn`` may not beat through this agent, or None ([Note: who may beat
        through the agent])."""
        with self._lock:
            served = len(self._ranks)
        if self.max_ranks is not None and served >= self.max_ranks:
            return f"it already serves the {self.max_ranks} rank(s) its launcher may start"
        peer = _peer(conn)
        if peer is None:
            return None  # no SO_PEERCRED here: the directory's 0700 is the check
        pid, uid = peer
        if uid != os.getuid():
            return f"process {pid} is another user's (uid {uid})"
        if not _descends_from(pid, self.launcher_pid):
            return f"process {pid} was not started by this launcher"
        return None

    def _serve(self, conn: socket.socket) -> None:
        rank = _Rank()
        with self._lock:
            self._ranks[conn] = rank
        try:
            while not self._closed.is_set():
                payload = recv_frame(conn)
                if payload is None:
                    return
                msg = pb.AgentBeat.FromString(payload)
                with self._lock:
                    rank.beat, rank.seq = msg.beat, msg.seq
                    rank.received_at = time.monotonic()
                    rank.lease_s = msg.lease_timeout_s
                    rank.interval_s = msg.heartbeat_interval_s
                if msg.flush:
                    self._wake.set()
                    seq = msg.seq
                    with self._lock:
                        self._lock.wait_for(
                            lambda: (
                                rank.forwarded_seq >= seq  # noqa: B023 (waited on here)
                                or bool(self._unavailable)
                                or self._closed.is_set()
                            ),
                            timeout=min(max(rank.lease_s / 2, _DEFAULT_INTERVAL_S), 10.0),
                        )
                send_frame(conn, self._reply(rank).SerializeToString())
        except (OSError, ValueError, DecodeError) as exc:  # a malformed frame or message
            logger.debug("host agent: a worker connection ended: %s", exc)
        finally:
            with self._lock:
                del self._ranks[conn]
            conn.close()
            # a rank gone: tell the coordinator now, not at the next interval
            self._wake.set()

    def _reply(self, rank: _Rank) -> pb.AgentReply:
        with self._lock:
            reply = pb.AgentReply(
                forwarded_seq=rank.forwarded_seq,
                generation_id=self._generation_id,
                job_finished=self._job_finished,
                unavailable=self._unavailable,
                stalled=self._stalled,
            )
            if rank.result is not None:
                reply.result.CopyFrom(rank.result)
        return reply

    # ---- the coordinator's side ---------------------------------------------------

    def _interval(self) -> float:
        with self._lock:
            known = [r.interval_s for r in self._ranks.values() if r.interval_s > 0]
        return min(known, default=_DEFAULT_INTERVAL_S)

    def _due(self, interval: float) -> list[tuple[_Rank, pb.RankBeat, int]]:
        """The ranks to list now: connected, and heard from within their lease less one
        interval (a silent one must be lost no later than its own lease would lapse)."""
        now = time.monotonic()
        out = []
        with self._lock:
            for rank in self._ranks.values():
                if rank.beat is None:
                    continue
                age = now - rank.received_at
                if age > max(rank.lease_s - interval, interval):
                    continue
                rank.beat.age_s = age  # the coordinator dates the lease from the rank's beat
                out.append((rank, rank.beat, rank.seq))
        return out

    def _beat_loop(self) -> None:
        while not self._closed.is_set():
            interval = self._interval()
            self._wake.wait(interval)
            self._wake.clear()
            if self._closed.is_set():
                return
            due = self._due(interval)
            if not due and not self._listed:
                continue
            request = pb.HostHeartbeatRequest(host_id=self.host_id, ranks=[b for _, b, _ in due])
            try:
                response = self._forward(request)
            except Exception as exc:  # CoordinatorError, a closed channel at stop
                with self._lock:
                    if not self._unavailable:
                        logger.warning("host agent: heartbeat not delivered: %s", exc)
                    self._unavailable = str(exc) or type(exc).__name__
                    self._lock.notify_all()
                continue
            self.beats_sent += 1
            self._listed = bool(due)
            with self._lock:
                self._unavailable = ""
                self._generation_id = response.generation_id
                self._job_finished = response.job_finished
                self._stalled = response.stalled
                for (rank, _, seq), result in zip(due, response.ranks, strict=False):
                    rank.result, rank.forwarded_seq = result, seq
                self._lock.notify_all()


class _HostStream:
    """Host heartbeats on one HostHeartbeats stream (auth and call set-up once, not
    per beat: bench/README.md), opened at the first and again after any error; a
    reply that does not come within the client's RPC timeout cancels the stream."""

    def __init__(self, config: Callable[[], ClientConfig]) -> None:
        self._config = config
        self._client: CoordinatorClient | None = None
        self._call: Any = None
        self._replies: Iterator[pb.HostHeartbeatResponse] | None = None
        self._requests: queue.SimpleQueue[pb.HostHeartbeatRequest | None] | None = None

    def __call__(self, request: pb.HostHeartbeatRequest) -> pb.HostHeartbeatResponse:
        if self._client is None:
            self._client = CoordinatorClient(self._config())
        if self._call is None:
            requests: queue.SimpleQueue[pb.HostHeartbeatRequest | None] = queue.SimpleQueue()
            self._requests = requests
            self._call = self._client.host_beat_stream(iter(requests.get, None))
            self._replies = iter(self._call)
        assert self._requests is not None and self._replies is not None
        self._requests.put(request)
        timer = threading.Timer(self._client.config.rpc_timeout_s, self._call.cancel)
        timer.start()
        try:
            return next(self._replies)
        except grpc.RpcError as exc:
            self._reset()
            raise self._client.describe(exc, "HostHeartbeats") from None
        except StopIteration:
            self._reset()
            raise CoordinatorError("HostHeartbeats: the coordinator ended the stream") from None
        finally:
            timer.cancel()

    def _reset(self) -> None:
        if self._requests is not None:
            self._requests.put(None)
        if self._call is not None:
            self._call.cancel()
        self._call = self._replies = self._requests = None

    def close(self) -> None:
        self._reset()
        if self._client is not None:
            self._client.close()


def _peer(conn: socket.socket) -> tuple[int, int] | None:
    """The connecting process's (pid, uid), where the platform says (Linux)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    import struct

    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, _ = struct.unpack("3i", raw)
    return pid, uid


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is ``ancestor`` or one of its descendants (by the
    parents /proc names; False where it cannot tell)."""
    seen = set()
    while pid > 1 and pid not in seen:
        if pid == ancestor:
            return True
        seen.add(pid)
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False
        parent = next(
            (line.split()[1] for line in status.splitlines() if line.startswith("PPid:")), "0"
        )
        pid = int(parent)
    return pid == ancestor


def agent_host_id() -> str:
    """This agent's name at the coordinator: the host's name and the launcher's pid
    (two launchers of one job on a host must not list each other's ranks away)."""
    return f"{socket.gethostname()[:200]}-{os.getpid()}"
