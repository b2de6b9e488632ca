"""Shared pieces of the coordinator tests: a small inventory, a live server, a polling wait,
a health probe, a launcher's worker processes."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.control.client import ClientConfig, CoordinatorClient
from coordinator.control.membership import Membership
from coordinator.control.server import CoordinatorServer, create_server
from coordinator.core.conversions import param_to_proto
from coordinator.core.layout import ParamSpec
from coordinator.core.messages import WorkerInfo
from coordinator.core.settings import CoordinatorConfig, MembershipConfig, PlanConfig, ServerConfig
from coordinator.launchers.spawner import SERVER_MODULE

T = TypeVar("T")

TOKEN = "test-token-0123456789"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def inventory(hidden: int = 8) -> list[ParamSpec]:
    return [
        ParamSpec(name="embed.weight", shape=(32, hidden), dtype="float32"),
        ParamSpec(name="block.0.weight", shape=(hidden, hidden), dtype="float32", unit=1),
        ParamSpec(name="block.0.bias", shape=(hidden,), dtype="float32", unit=1),
        ParamSpec(name="norm.weight", shape=(hidden,), dtype="float32", requires_grad=False),
        ParamSpec(name="head.weight", shape=(7, hidden), dtype="float32", unit=2, group=1),
    ]


def config(
    *,
    token: str | None = TOKEN,
    state_file: Path | None = None,
    port: int = 0,
    min_workers: int = 1,
    max_workers: int = 8,
    join_window_s: float = 0.0,
    lease_timeout_s: float = 3.0,
    stage: int | None = 2,
    **server: object,
) -> CoordinatorConfig:
    return CoordinatorConfig(
        server=ServerConfig(
            host="127.0.0.1", port=port, token=token, state_file=state_file, grace_s=0.5, **server
        ),
        membership=MembershipConfig(
            min_workers=min_workers,
            max_workers=max_workers,
            join_window_s=join_window_s,
            lease_timeout_s=lease_timeout_s,
            heartbeat_interval_s=0.1,
        ),
        plan=PlanConfig(stage=stage, bucket_numel=100, align=2),
    )


@contextmanager
def running(cfg: CoordinatorConfig) -> Iterator[CoordinatorServer]:
    server, _ = create_server(cfg)
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=0.2)


def client(server_or_port: CoordinatorServer | int, *, token: str | None = TOKEN, **kw: object):
    port = server_or_port if isinstance(server_or_port, int) else server_or_port.port
    defaults = dict(connect_timeout_s=5.0, rpc_timeout_s=2.0, backoff_max_s=0.3)
    return CoordinatorClient(
        ClientConfig(address=f"127.0.0.1:{port}", token=token, **{**defaults, **kw})
    )


def raw_stub(port: int) -> tuple[grpc.Channel, pb_grpc.CoordinatorStub]:
    """A channel and a bare stub: requests as built, no client logic in between."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel, pb_grpc.CoordinatorStub(channel)


def register_request(worker_id: str, specs: list[ParamSpec] | None = None) -> pb.RegisterRequest:
    return pb.RegisterRequest(
        worker=pb.WorkerInfo(worker_id=worker_id, host="127.0.0.1", free_ports=[40000]),
        inventory=[param_to_proto(p) for p in specs or inventory()],
    )


def worker(worker_id: str, **kw: object) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, host="127.0.0.1", **kw)


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


class HealthProbe:
    """Health checks in a loop on a thread of its own; their latencies, and any failure."""

    def __init__(self, port: int, interval_s: float = 0.02) -> None:
        self._channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self._stub = health_pb2_grpc.HealthStub(self._channel)
        self._interval = interval_s
        self._stop = threading.Event()
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True, name="health-probe")

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                response = self._stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                if response.status != health_pb2.HealthCheckResponse.SERVING:
                    self.failures.append(f"status {response.status}")
            except grpc.RpcError as exc:
                self.failures.append(f"{exc.code().name}: {exc.details()}")
            self.latencies.append(time.perf_counter() - start)
            self._stop.wait(self._interval)

    def __enter__(self) -> HealthProbe:
        self._stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._channel.close()

    @property
    def worst(self) -> float:
        return max(self.latencies, default=0.0)

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class Clock:
    """A clock the test moves by hand (``clock.now += 5``): Membership's ``clock`` and
    ``wall_clock``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ranks by host, for the host heartbeat tests (three hosts, uneven)
HOSTS = {"h0": ["h0-0", "h0-1", "h0-2"], "h1": ["h1-0", "h1-1", "h1-2"], "h2": ["h2-0", "h2-1"]}


def formed_on_hosts(clock: Clock | None = None) -> Membership:
    """A membership at stage 2 whose first generation holds :data:`HOSTS`' ranks."""
    clock = clock or Clock()
    m = Membership(
        MembershipConfig(
            min_workers=1,
            max_workers=64,
            join_window_s=0.0,
            lease_timeout_s=3.0,
            heartbeat_interval_s=1.0,
        ),
        PlanConfig(stage=2, bucket_numel=100, align=2),
        clock=clock,
        wall_clock=clock,
    )
    for host, ranks in HOSTS.items():
        for wid in ranks:
            m.register(WorkerInfo(worker_id=wid, host=host, free_ports=(3000,)), inventory())
    assert m.maybe_form() is not None
    return m


def launched_workers(launcher_pid: int) -> list[int]:
    """A ``zeroplane run`` launcher's worker processes, oldest first: its children, and
    the children of its fork server in its place (coordinator/launchers/spawner.py)."""

    def children(pid: int) -> list[int]:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            listed = Path(f"/proc/{pid}/task/{pid}/children").read_text()
            return [int(c) for c in listed.split()]
        return []

    def is_fork_server(pid: int) -> bool:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            return SERVER_MODULE.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
        return False

    found = []
    for pid in children(launcher_pid):
        found += children(pid) if is_fork_server(pid) else [pid]
    return sorted(found)
