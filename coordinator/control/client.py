"""The client a worker uses to talk to the coordinator.

    client = CoordinatorClient(ClientConfig(address="coord:50051", token=load_token(path)))
    client.register(WorkerInfo(worker_id=..., host=..., device_kind="cuda",
                               device_memory_bytes=...), inventory)
    client.start()                          # heartbeat and watch threads
    gen = client.wait_for_generation()      # the first generation with this worker in it
    rank = gen.rank_of(client.worker_id)    # init_process_group at gen.rendezvous_endpoint
    ...
    client.set_report(WorkerReport(model_state_bytes={...}, step=step,
                                   applied_generation_id=gen.id))
    if client.generation.id != gen.id: ...  # at a step boundary: apply the new generation
    ...
    client.close(leave=True)

The background threads never raise into training. While the coordinator is
unreachable they log once, keep retrying (heartbeats at the heartbeat
interval, the watch stream with exponential backoff) and re-attach when it is
back: a coordinator restarted from its state file knows the worker and its
generation. A heartbeat fenced as stale fetches the newer generation first;
a lease the coordinator no longer holds is registered again.

[Note: client retries]
Unary calls are retried by gRPC itself, as the channel's service config
says (``_service_config``): Register, Leave and Status wait for the channel
to be ready (``wait_for_ready``: a coordinator not up yet, or restarting, is
waited for until the call's deadline) and retry UNAVAILABLE with exponential
backoff (``retryPolicy``: a coordinator draining or shutting down). A
Heartbeat neither waits nor retries: its thread is its retry, at the
heartbeat interval, and has to notice an outage. Two loops stay
hand-written: the watch stream's reconnect (a gRPC retry ends once a
response has arrived, and a stream that breaks after a generation must be
re-opened from the newest one received, a request gRPC cannot rewrite), and
the heartbeat thread's.

Rendezvous: every worker reports a few ports free on its host at register
time and again with each heartbeat; the coordinator hosts each generation's
rendezvous store on a reported port of that generation's rank 0, never the
previous generation's. ``Generation.rendezvous_endpoint`` is ``host:port``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.control.agent_link import AgentLink
from coordinator.control.tls import TlsMismatch, probe
from coordinator.core.conversions import (
    param_to_proto,
    rank_beat_to_proto,
    report_to_proto,
    status_from_proto,
    where_to_proto,
    worker_to_proto,
)
from coordinator.core.generation_codec import MissingPrevious, generation_from_proto
from coordinator.core.layout import ParamSpec
from coordinator.core.meshplan import MeshCoords
from coordinator.core.messages import (
    GENERATION_METADATA_KEY,
    Generation,
    RankBeat,
    StatusReport,
    Whereabouts,
    WorkerInfo,
    WorkerReport,
)
from coordinator.core.ports import free_ports
from coordinator.core.settings import (
    ADDRESS_ENV,
    HOST_AGENT_ENV,
    TLS_CLIENT_CERT_ENV,
    TLS_CLIENT_KEY_ENV,
    TLS_ROOT_CERT_ENV,
    TLS_SERVER_NAME_ENV,
    load_token,
)

__all__ = [
    "ClientConfig",
    "CoordinatorAuthError",
    "CoordinatorClient",
    "CoordinatorError",
    "CoordinatorTlsError",
    "CoordinatorUnavailableError",
    "FencedError",
    "HostBeatReply",
    "LeaseLostError",
    "Registration",
    "RequestRejectedError",
    "StaleGenerationError",
    "free_ports",
]

logger = logging.getLogger(__name__)


class CoordinatorError(Exception):
    """A coordinator RPC failed."""


class CoordinatorUnavailableError(CoordinatorError):
    """The coordinator could not be reached."""


class CoordinatorAuthError(CoordinatorError):
    """The coordinator rejected the bearer token."""


class CoordinatorTlsError(CoordinatorError):
    """This client's TLS settings and the coordinator's disagree (coordinator/control/tls.py)."""


class RequestRejectedError(CoordinatorError):
    """A malformed request, or an inventory that is not the job's."""


class StaleGenerationError(CoordinatorError):
    def __init__(self, message: str, current: int) -> None:
        super().__init__(message)
        self.current = current


class FencedError(CoordinatorError):
    """The coordinator dropped this worker in a stall (coordinator/control/stalls.py):
    it must exit, not register again."""


class LeaseLostError(CoordinatorError):
    """The coordinator holds no lease for this worker."""


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    # host:port of the coordinator.
    address: str
    token: str | None = field(default=None, repr=False)
    tls: bool = False
    # PEM roots to trust; None: the system's.
    tls_root_cert_file: Path | None = None
    # Expected name in the server's certificate, when it is not the address's host.
    tls_server_name: str | None = None
    # Mutual TLS: this client's certificate chain and private key (PEM), both or neither.
    tls_client_cert_file: Path | None = None
    tls_client_key_file: Path | None = None
    # How long register/status keep trying an unreachable coordinator.
    connect_timeout_s: float = 30.0
    rpc_timeout_s: float = 10.0
    # Reconnect backoff of the watch stream and of register.
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    max_message_bytes: int = 1 << 30
    # The Unix socket of this host's heartbeat agent: heartbeats go there
    # (coordinator/control/host_agent.py [Note: the host agent]); None: to the coordinator.
    host_agent: str | None = None

    @classmethod
    def from_env(cls, **overrides: object) -> ClientConfig:
        """Address from ``$ZEROPLANE_COORDINATOR``, token from ``$ZEROPLANE_TOKEN_FILE`` or
        ``$ZEROPLANE_TOKEN`` (what ``EmbeddedCoordinator`` exports to local workers),
        TLS from :meth:`tls_from_env`, the host agent from ``$ZEROPLANE_HOST_AGENT``."""
        address = os.environ.get(ADDRESS_ENV)
        if not address and "address" not in overrides:
            raise ValueError(f"${ADDRESS_ENV} is not set: where is the coordinator?")
        fields: dict[str, object] = {
            "address": address,
            "token": load_token(),
            "host_agent": os.environ.get(HOST_AGENT_ENV, "").strip() or None,
        }
        return cls(**{**fields, **cls.tls_from_env(), **overrides})

    @staticmethod
    def tls_from_env() -> dict[str, object]:
        """The TLS fields ``$ZEROPLANE_TLS_*`` ask for: ``$ZEROPLANE_TLS_ROOT_CERT`` (a PEM
        file of the roots to trust, or ``system``) turns TLS on;
        ``$ZEROPLANE_TLS_SERVER_NAME`` is the name the certificate must carry when it
        is not the address's host; ``$ZEROPLANE_TLS_CLIENT_CERT`` and
        ``$ZEROPLANE_TLS_CLIENT_KEY`` are this client's for mutual TLS."""
        out: dict[str, object] = {}
        root = os.environ.get(TLS_ROOT_CERT_ENV, "").strip()
        if root:
            out["tls"] = True
            out["tls_root_cert_file"] = None if root == "system" else Path(root)
        name = os.environ.get(TLS_SERVER_NAME_ENV, "").strip()
        if name:
            out["tls_server_name"] = name
        for env, key in (
            (TLS_CLIENT_CERT_ENV, "tls_client_cert_file"),
            (TLS_CLIENT_KEY_ENV, "tls_client_key_file"),
        ):
            value = os.environ.get(env, "").strip()
            if value:
                out[key] = Path(value)
        if ("tls_client_cert_file" in out or "tls_server_name" in out) and "tls" not in out:
            raise ValueError(
                f"${TLS_CLIENT_CERT_ENV} and ${TLS_SERVER_NAME_ENV} need ${TLS_ROOT_CERT_ENV} "
                "(a PEM file of the roots to trust, or 'system')"
            )
        return out

    def __post_init__(self) -> None:
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"ClientConfig.address must be host:port, got {self.address!r}")
        if self.token is not None and not self.token.strip():
            raise ValueError("ClientConfig.token must be None or non-empty")
        for name in ("tls_root_cert_file", "tls_client_cert_file", "tls_client_key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"ClientConfig.{name} {str(path)!r} is not a file")
        if (self.tls_client_cert_file is None) != (self.tls_client_key_file is None):
            raise ValueError(
                "ClientConfig.tls_client_cert_file and tls_client_key_file go together"
            )
        if not self.tls and (self.tls_client_cert_file or self.tls_root_cert_file):
            raise ValueError("ClientConfig: TLS files given with tls=False")
        for name in ("connect_timeout_s", "rpc_timeout_s", "backoff_initial_s", "backoff_max_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"ClientConfig.{name} must be finite and > 0, got {value}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(
                f"ClientConfig.backoff_max_s ({self.backoff_max_s}) must be >= "
                f"backoff_initial_s ({self.backoff_initial_s})"
            )


@dataclass(frozen=True)
class Registration:
    worker_id: str
    generation_id: int
    lease_timeout_s: float
    heartbeat_interval_s: float
    reattached: bool
    epoch: str


_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_SERVICE = "zeroplane.coordinator.v1.Coordinator"
# gRPC caps maxAttempts at 5.
_ATTEMPTS = 5


def _duration(seconds: float) -> str:
    return f"{seconds:.6f}".rstrip("0").rstrip(".") + "s"


def _service_config(config: ClientConfig) -> str:
    """The channel's service config: gRPC's retry policy (see [Note: client retries])."""
    retry = {
        "maxAttempts": _ATTEMPTS,
        "initialBackoff": _duration(config.backoff_initial_s),
        "maxBackoff": _duration(config.backoff_max_s),
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    retried = [{"service": _SERVICE, "method": m} for m in ("Register", "Leave", "Status")]
    return json.dumps({"methodConfig": [{"name": retried, "retryPolicy": retry}]})


@dataclass(frozen=True)
class HostBeatReply:
    """The coordinator's answer to a host heartbeat (coordinator/control/membership.py
    [Note: host heartbeats])."""

    generation_id: int
    job_finished: bool
    # Per rank, in the request's order: (worker id, outcome, lease seconds left, detail);
    # outcome is "OK", "STALE_GENERATION", "UNKNOWN_WORKER" or "INVALID".
    ranks: tuple[tuple[str, str, float, str], ...]

    @classmethod
    def from_proto(cls, msg: pb.HostHeartbeatResponse) -> HostBeatReply:
        name = pb.RankBeatResult.Outcome.Name
        return cls(
            generation_id=msg.generation_id,
            job_finished=msg.job_finished,
            ranks=tuple(
                (r.worker_id, name(r.outcome), r.lease_remaining_s, r.detail) for r in msg.ranks
            ),
        )


class CoordinatorClient:
    """One worker's connection to the coordinator (see the module docstring)."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            # grpc's own reconnect backoff reaches minutes; a restarted coordinator
            # should be found within about a second.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500),
            # Notice a vanished coordinator host on the watch stream.
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.enable_retries", 1),
            ("grpc.service_config", _service_config(config)),
            # A request is retried only while gRPC still holds it: a large inventory too.
            ("grpc.per_rpc_retry_buffer_size", config.max_message_bytes),
        ]
        if config.tls:
            roots = None
            if config.tls_root_cert_file is not None:
                roots = Path(config.tls_root_cert_file).read_bytes()
            if config.tls_server_name:
                options.append(("grpc.ssl_target_name_override", config.tls_server_name))
            cert = key = None
            if config.tls_client_cert_file is not None:
                cert = Path(config.tls_client_cert_file).read_bytes()
                key = Path(config.tls_client_key_file).read_bytes()
            credentials = grpc.ssl_channel_credentials(
                root_certificates=roots, private_key=key, certificate_chain=cert
            )
            self._channel = grpc.secure_channel(config.address, credentials, options)
        else:
            self._channel = grpc.insecure_channel(config.address, options)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._metadata = (
            () if config.token is None else (("authorization", f"Bearer {config.token}"),)
        )
        self._probed = False  # the TLS settings were checked against the coordinator
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._stop_heartbeats = threading.Event()
        # set to send a heartbeat now (and by close(), to end the heartbeat thread)
        self._beat_now = threading.Event()
        self._leaving = False
        self._threads: list[threading.Thread] = []
        self._watch_call: grpc.Future | None = None
        self.on_generation: Callable[[Generation], None] | None = None
        self._incarnation = uuid.uuid4().hex
        self._worker: WorkerInfo | None = None
        self._inventory: tuple[ParamSpec, ...] = ()
        self._registration: Registration | None = None
        self._generation: Generation | None = None
        self._report: WorkerReport | None = None
        self.connected = False
        # set by a heartbeat once a member has ended training (Membership.finished)
        self.job_finished = False
        # where this worker is, sampled at each heartbeat; and what to do, once, when the
        # coordinator stops the job in a stall or drops this worker in one (why, in words)
        # (coordinator/control/stalls.py)
        self.where: Callable[[], Whereabouts] | None = None
        self.on_stall: Callable[[str], None] = lambda why: logger.error("%s", why)
        self.stalled = ""
        # heartbeats through this host's agent ([Note: the host agent]); the seq of the
        # last beat sent to it before this worker (re-)registered, and whether the agent
        # has carried this worker's leave announcement
        self._agent = (
            None
            if config.host_agent is None
            # generous: a connection dropped on a timeout reads as this rank's death
            else AgentLink(config.host_agent, timeout_s=max(config.rpc_timeout_s, 30.0))
        )
        self._agent_floor = 0
        self._agent_told_leaving = False
        self._agent_down_since: float | None = None

    # ---- properties -------------------------------------------------------------------

    @property
    def worker_id(self) -> str:
        if self._worker is None:
            raise RuntimeError("register() first")
        return self._worker.worker_id

    @property
    def registration(self) -> Registration | None:
        return self._registration

    @property
    def generation(self) -> Generation | None:
        """The newest generation this client has received (None before the first)."""
        with self._cond:
            return self._generation

    def _known_id(self) -> int:
        with self._cond:
            return 0 if self._generation is None else self._generation.id

    # ---- RPCs -------------------------------------------------------------------------

    def register(self, worker: WorkerInfo, inventory: Sequence[ParamSpec]) -> Registration:
        """Register (or re-attach) ``worker`` with the model's parameter ``inventory``.

        Keeps trying an unreachable coordinator for ``connect_timeout_s``, then
        raises CoordinatorUnavailableError. Missing ``free_ports`` and
        ``incarnation`` are filled in.
        """
        worker = dataclasses.replace(
            worker,
            free_ports=worker.free_ports or free_ports(),
            incarnation=worker.incarnation or self._incarnation,
        )
        request = pb.RegisterRequest(
            worker=worker_to_proto(worker), inventory=[param_to_proto(p) for p in inventory]
        )
        response = self._unary("Register", request, wait_s=self.config.connect_timeout_s)
        self._worker, self._inventory = worker, tuple(inventory)
        self._registration = Registration(
            worker_id=response.worker_id,
            generation_id=response.generation_id,
            lease_timeout_s=response.lease_timeout_s,
            heartbeat_interval_s=response.heartbeat_interval_s,
            reattached=response.reattached,
            epoch=response.epoch,
        )
        self.connected = True
        if self._agent is not None:
            self._agent_floor = self._agent.seq
        known = self.generation
        if known is not None and known.epoch != response.epoch:
            self._forget_generations(response.generation_id, "a new epoch")
        if response.generation_id != self._known_id():
            self._catch_up(response.generation_id)
        return self._registration

    def heartbeat(self, *, flush: bool = False) -> float:
        """One heartbeat now; returns the lease's remaining seconds. The thread calls this.
        Through the host's agent when there is one ([Note: the host agent]); ``flush``:
        the coordinator has it when this returns (a final report)."""
        worker = self._worker
        if worker is None:
            raise RuntimeError("register() first")
        generation = self.generation
        exclude = () if generation is None else (generation.rendezvous_port,)
        fields = {
            "worker_id": worker.worker_id,
            "generation_id": self._known_id(),
            "free_ports": free_ports(exclude=exclude),
            "leaving": self._leaving,
        }
        report, where = self._report, None if self.where is None else self.where()
        if report is not None or where is not None:
            fields["report"] = msg = report_to_proto(report or WorkerReport())
            if where is not None:
                msg.where.CopyFrom(where_to_proto(where))
        if self._agent is not None:
            remaining = self._beat_via_agent(pb.RankBeat(**fields), flush=flush)
            if remaining is not None:
                return remaining
        request = pb.HeartbeatRequest(**fields)
        # A heartbeat stuck for most of a lease is worth less than a fresh one.
        timeout = self.config.rpc_timeout_s
        if self._registration is not None:
            timeout = min(timeout, self._registration.lease_timeout_s / 3)
        response = self._unary("Heartbeat", request, timeout=timeout)
        if response.job_finished:
            self.job_finished = True
        self._check_stalled(response.stalled)
        return response.lease_remaining_s

    def _check_stalled(self, why: str, *, fenced: bool = False) -> None:
        if why and not self.stalled:
            self.stalled = why
            verdict = "dropped this worker" if fenced else "stopped the job"
            self.on_stall(f"the coordinator {verdict} in a stall: {why}")

    def _beat_via_agent(self, beat: pb.RankBeat, *, flush: bool) -> float | None:
        """A heartbeat through the host's agent: the lease's seconds left as of the newest
        beat it forwarded, or None when the agent cannot be reached (the caller then
        heartbeats the coordinator itself). Raises as a heartbeat would, on the
        coordinator's answer to a beat that still applies ([Note: the host agent])."""
        assert self._agent is not None and self._registration is not None
        lease = self._registration.lease_timeout_s
        flush = flush or (beat.leaving and not self._agent_told_leaving)
        try:
            reply = self._agent.beat(
                beat,
                lease_s=lease,
                interval_s=self._registration.heartbeat_interval_s,
                flush=flush,
            )
        except OSError as exc:
            if self._agent_down_since is None:
                self._agent_down_since = time.monotonic()
                logger.warning("%s; heartbeating the coordinator directly", exc)
            return None
        if self._agent_down_since is not None:
            logger.info("the host agent answers again")
            self._agent_down_since = None
        if reply.unavailable:
            raise CoordinatorUnavailableError(f"the host agent says: {reply.unavailable}")
        if reply.job_finished:
            self.job_finished = True
        self._check_stalled(reply.stalled)
        if not reply.HasField("result") or reply.forwarded_seq <= self._agent_floor:
            return lease  # nothing forwarded since this worker registered yet
        if beat.leaving and reply.forwarded_seq == self._agent.seq:
            self._agent_told_leaving = True
        result = reply.result
        if result.outcome == pb.RankBeatResult.STALE_GENERATION:
            if self._known_id() < reply.generation_id:
                raise StaleGenerationError(result.detail, reply.generation_id)
            return lease  # caught up since (the watch stream was faster)
        if result.outcome == pb.RankBeatResult.UNKNOWN_WORKER:
            raise LeaseLostError(result.detail)
        if result.outcome == pb.RankBeatResult.FENCED:
            raise FencedError(result.detail)
        if result.outcome == pb.RankBeatResult.INVALID:
            raise RequestRejectedError(f"Heartbeat (through the host agent): {result.detail}")
        return result.lease_remaining_s

    def host_beat_stream(self, requests: Iterator[pb.HostHeartbeatRequest]) -> Any:
        """The HostHeartbeats call as it is: the responses as they come, errors as
        grpc.RpcError (a host agent's, coordinator/control/host_agent.py)."""
        return self._stub.HostHeartbeats(requests, metadata=self._metadata)

    def describe(self, exc: grpc.RpcError, method: str) -> CoordinatorError:
        """The error a failed call of ``method`` means (what the client's own calls raise)."""
        return self._translate(exc, method)

    def host_heartbeat(self, host_id: str, beats: Sequence[RankBeat]) -> HostBeatReply:
        """One heartbeat for every rank of a host, as its agent (coordinator/control/
        membership.py [Note: host heartbeats]); needs no register() of its own."""
        request = pb.HostHeartbeatRequest(
            host_id=host_id, ranks=[rank_beat_to_proto(b) for b in beats]
        )
        return HostBeatReply.from_proto(self._unary("HostHeartbeat", request))

    def host_heartbeats(
        self, host_id: str, beats: Iterable[Sequence[RankBeat]]
    ) -> Iterator[HostBeatReply]:
        """Host heartbeats on one stream: a reply per item of ``beats``, as it is sent
        (an agent's loop feeds ``beats`` at its interval)."""
        requests = (
            pb.HostHeartbeatRequest(host_id=host_id, ranks=[rank_beat_to_proto(b) for b in item])
            for item in beats
        )
        call = self.host_beat_stream(requests)
        try:
            for msg in call:
                yield HostBeatReply.from_proto(msg)
        except grpc.RpcError as exc:
            raise self._translate(exc, "HostHeartbeats") from None
        finally:
            call.cancel()

    def fetch_generation(self, *, after: int = 0, timeout: float | None = None) -> Generation:
        """The first generation newer than ``after`` (waiting for it up to ``timeout``)."""
        worker_id = "" if self._worker is None else self._worker.worker_id
        try:
            call = self._stub.WatchGenerations(
                pb.WatchGenerationsRequest(worker_id=worker_id, after_generation_id=after),
                metadata=self._metadata,
                timeout=timeout or self.config.rpc_timeout_s,
            )
        except ValueError as exc:  # a closed channel
            raise CoordinatorError(f"WatchGenerations: {exc}") from None
        try:
            msg = next(call)
        except StopIteration:
            raise CoordinatorUnavailableError(
                f"coordinator at {self.config.address} closed the generation stream"
            ) from None
        except grpc.RpcError as exc:
            raise self._translate(exc, "WatchGenerations") from None
        finally:
            call.cancel()
        generation = generation_from_proto(msg)
        self._accept(generation)
        return generation

    def hold_position(self, coords: MeshCoords) -> None:
        """Record the mesh position this worker's engine holds (``WorkerInfo.held``):
        a registration again (after a coordinator restart or a lost lease) carries it,
        and the coordinator then places this worker only there."""
        worker = self._worker
        if worker is not None and worker.mesh is not None and worker.held != coords:
            self._worker = dataclasses.replace(worker, held=coords)

    def announce_leaving(self) -> None:
        """Say in a heartbeat sent now, and in every one after, that this worker was
        asked to leave and will (a launcher then stops counting it as a member).
        Safe in a signal handler: it only sets flags for the heartbeat thread."""
        self._leaving = True
        self._beat_now.set()

    def leave(self, reason: str = "") -> None:
        """Give up the lease (heartbeats stop first, so the worker is not re-registered)."""
        self._stop_heartbeats.set()
        self._beat_now.set()
        if self._worker is None:
            return
        request = pb.LeaveRequest(worker_id=self._worker.worker_id, reason=reason)
        self._unary("Leave", request, wait_s=self.config.rpc_timeout_s)

    def status(self) -> StatusReport:
        response = self._unary("Status", pb.StatusRequest(), wait_s=self.config.connect_timeout_s)
        return status_from_proto(response)

    def _unary(
        self, method: str, request: object, *, wait_s: float = 0.0, timeout: float | None = None
    ) -> Any:
        """Call ``method`` once; gRPC retries it (see [Note: client retries]). ``wait_s``:
        wait that long for an unreachable coordinator; 0: fail at once, in ``timeout``."""
        if self._closed.is_set():
            raise CoordinatorError("client closed")
        if wait_s > 0 and not self._probed:
            self._check_tls()
        try:
            return getattr(self._stub, method)(
                request,
                metadata=self._metadata,
                timeout=wait_s or timeout or self.config.rpc_timeout_s,
                wait_for_ready=wait_s > 0,
            )
        except grpc.RpcError as exc:
            if wait_s > 0 and exc.code() in _UNREACHABLE and not self._probed:
                self._check_tls()  # it may have come up meanwhile: say why it failed
            raise self._translate(exc, method, wait_s) from None
        except ValueError as exc:  # the channel was closed under the call
            raise CoordinatorError(f"{method}: {exc}") from None

    def _check_tls(self) -> None:
        """Fail at once on a TLS mismatch, not after the wait (coordinator/control/tls.py
        [Note: a TLS mismatch fails at once]); once the coordinator has answered."""
        c = self.config
        try:
            answered = probe(
                c.address,
                tls=c.tls,
                root_cert_file=c.tls_root_cert_file,
                server_name=c.tls_server_name,
                client_cert_file=c.tls_client_cert_file,
                client_key_file=c.tls_client_key_file,
            )
        except TlsMismatch as exc:
            raise CoordinatorTlsError(str(exc)) from None
        except (OSError, ValueError):
            return  # unreadable files, a name that does not resolve: the call says
        self._probed = answered

    def _translate(self, exc: grpc.RpcError, method: str, waited: float = 0.0) -> CoordinatorError:
        code, detail = exc.code(), exc.details()
        where = f"coordinator at {self.config.address}"
        if code in _UNREACHABLE:
            waited_s = f" for {waited:g}s" if waited else ""
            return CoordinatorUnavailableError(
                f"{where} is unreachable{waited_s} ({code.name}: {detail}); "
                "is it running, and is the address right?"
            )
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return CoordinatorAuthError(f"{where} rejected the credentials: {detail}")
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            trailing = dict(exc.trailing_metadata() or ())
            if GENERATION_METADATA_KEY in trailing:
                return StaleGenerationError(detail, int(trailing[GENERATION_METADATA_KEY]))
            return RequestRejectedError(f"{where} rejected {method}: {detail}")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return RequestRejectedError(f"{where} rejected {method}: {detail}")
        if code == grpc.StatusCode.NOT_FOUND:
            return LeaseLostError(detail)
        if code == grpc.StatusCode.ABORTED:
            return FencedError(detail)
        return CoordinatorError(f"{method} to {where} failed ({code.name}): {detail}")

    # ---- background threads -----------------------------------------------------------

    def set_report(self, report: WorkerReport) -> None:
        """What the next heartbeats carry (model-state bytes by kind, step, ...)."""
        self._report = report

    def start(self, *, on_generation: Callable[[Generation], None] | None = None) -> None:
        """Start the heartbeat and watch threads; ``on_generation`` runs on the watch thread."""
        if self._worker is None:
            raise RuntimeError("register() before start()")
        if self._threads:
            raise RuntimeError("start() was already called")
        self.on_generation = on_generation
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._watch_loop, "watch")):
            thread = threading.Thread(target=target, name=f"zeroplane-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def wait_for_generation(
        self, *, after: int = 0, member: bool = True, timeout: float | None = None
    ) -> Generation:
        """Block until a generation newer than ``after`` (with this worker in it, if ``member``)."""
        worker_id = self.worker_id

        def ready() -> bool:
            g = self._generation
            if self._closed.is_set() or g is None or g.id <= after:
                return self._closed.is_set()
            return not member or g.rank_of(worker_id) is not None

        with self._cond:
            if not ready() and not self._threads:
                raise RuntimeError("start() the client before waiting for a generation")
            if not self._cond.wait_for(ready, timeout):
                who = " with this worker as a member" if member else ""
                raise TimeoutError(f"no generation newer than {after}{who} within {timeout}s")
            if self._closed.is_set():
                raise CoordinatorError("client closed")
            assert self._generation is not None
            return self._generation

    def _accept(self, generation: Generation) -> None:
        with self._cond:
            if self._generation is not None and generation.id <= self._generation.id:
                return
            self._generation = generation
            self._cond.notify_all()
        logger.info(
            "generation %d: world size %d, stage %d, rank %s, rendezvous %s",
            generation.id,
            generation.world_size,
            generation.stage,
            generation.rank_of(self.worker_id),
            generation.rendezvous_endpoint,
        )
        if self.on_generation is not None:
            try:
                self.on_generation(generation)
            except Exception:
                logger.exception("on_generation callback failed")

    def _heartbeat_loop(self) -> None:
        assert self._registration is not None
        interval = self._registration.heartbeat_interval_s
        outage_since: float | None = None
        delay = interval
        while not (self._wait_beat(delay) or self._stop_heartbeats.is_set()):
            # Retrying at the heartbeat interval, not slower, keeps the lease alive across
            # a coordinator restart (it grants members one fresh lease when it comes back).
            delay = interval
            try:
                self.heartbeat()
            except StaleGenerationError as exc:
                logger.info("%s; fetching it", exc)
                delay = 0 if self._catch_up(exc.current) else interval
                continue
            except FencedError as exc:
                self._check_stalled(str(exc), fenced=True)
                break
            except LeaseLostError as exc:
                if self._stop_heartbeats.is_set():
                    break  # this heartbeat crossed our own Leave: nothing was lost
                logger.warning("%s; registering again", exc)
                self._register_again()
                continue
            except CoordinatorUnavailableError as exc:
                if outage_since is None:
                    outage_since = time.monotonic()
                    logger.warning("%s; training continues, retrying", exc)
                self.connected = False
                continue
            except CoordinatorError as exc:
                if self._closed.is_set():
                    break
                logger.error("heartbeat failed: %s", exc)
                self.connected = False
                continue
            self.connected = True
            if outage_since is not None:
                logger.info(
                    "re-attached to the coordinator after %.1fs", time.monotonic() - outage_since
                )
                outage_since = None

    def _catch_up(self, current: int) -> bool:
        """Get to the coordinator's ``current`` generation; True once there."""
        if self._known_id() > current:
            self._forget_generations(current, "generation ids going backwards")
        if self._known_id() < current:
            try:
                self.fetch_generation(after=self._known_id())
            except CoordinatorError as exc:
                logger.warning("cannot fetch generation %d: %s", current, exc)
                return False
        return self._known_id() == current

    def _forget_generations(self, current: int, sign: str) -> None:
        # Only a coordinator restarted without its state file does this: follow it.
        with self._cond:
            logger.error(
                "the coordinator lost its state (%s: its generation is %d, this worker's %d; "
                "no --state-file?): following it, this worker's state counts as lost",
                sign,
                current,
                self._generation.id if self._generation else 0,
            )
            self._generation = None
            if self._watch_call is not None:
                self._watch_call.cancel()  # the watch loop reconnects from generation 0

    def _register_again(self) -> None:
        assert self._worker is not None
        try:
            self.register(self._worker, self._inventory)
        except CoordinatorError as exc:
            logger.error("registering again failed: %s", exc)

    def _watch_loop(self) -> None:
        delay = self.config.backoff_initial_s
        while not self._closed.is_set():
            # Incremental (coordinator/core/reshard.py [Note: incremental schedule]): the
            # members as a delta from the generation this client holds, and only its own
            # moves; it completes them from the generation it holds.
            request = pb.WatchGenerationsRequest(
                worker_id=self.worker_id, after_generation_id=self._known_id(), incremental=True
            )
            try:
                with self._cond:
                    if self._closed.is_set():
                        return
                    call = self._stub.WatchGenerations(request, metadata=self._metadata)
                    self._watch_call = call
                for msg in call:
                    if msg.id <= self._known_id():
                        continue  # fetched meanwhile (a heartbeat's catch-up)
                    self._accept(generation_from_proto(msg, self.generation))
                    delay = self.config.backoff_initial_s
            except MissingPrevious as exc:
                # the generation it follows was forgotten meanwhile: ask again from here
                logger.debug("generation stream: %s", exc)
                call.cancel()
                continue
            except grpc.RpcError as exc:
                if self._closed.is_set():
                    return
                logger.debug("generation stream: %s", self._translate(exc, "WatchGenerations"))
            except ValueError as exc:
                logger.error("the coordinator sent an invalid generation: %s", exc)
            if self._closed.wait(delay):
                return
            delay = min(2 * delay, self.config.backoff_max_s)

    # ---- shutdown ---------------------------------------------------------------------

    def _wait_beat(self, delay: float) -> bool:
        """Until the next heartbeat is due (or wanted now); True once closed."""
        self._beat_now.wait(delay)
        self._beat_now.clear()
        return self._closed.is_set()

    def close(self, *, leave: bool = False, reason: str = "") -> None:
        """Stop the threads and the channel; ``leave`` gives up the lease first."""
        if self._closed.is_set():
            return
        if leave:
            try:
                self.leave(reason)
            except CoordinatorError as exc:
                logger.warning("leave failed: %s", exc)
        with self._cond:
            self._closed.set()
            self._beat_now.set()
            if self._watch_call is not None:
                self._watch_call.cancel()
            self._cond.notify_all()
        # Closing the channel ends every call in flight, one waiting for a coordinator too.
        self._channel.close()
        for thread in self._threads:
            thread.join()
        if self._agent is not None:
            self._agent.close()  # after the Leave: the agent then stops listing this rank

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
