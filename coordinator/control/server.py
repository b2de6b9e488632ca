"""The coordinator's gRPC server.

    server, port = create_server(CoordinatorConfig(...))
    server.start()
    ...
    server.stop(grace=5)

or ``serve(config)``, which blocks until SIGTERM/SIGINT and then stops
gracefully. The server runs on grpc.aio in an event loop of its own (one
thread): every watch stream is a coroutine, not a thread, so thousands of
workers can watch at once, and the membership state is only ever touched from
that loop, so it needs no locks. ``CoordinatorServer`` is a synchronous handle
on it, for launchers and tests.

The service itself, its handlers and the reconcile that forms generations, is
coordinator/control/servicer.py; its gRPC plumbing coordinator/control/rpc.py.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from coordinator.control.membership import Membership
from coordinator.control.rpc import GRPC_LOGGER, SERVICE_NAME, NoMetadataValues
from coordinator.control.servicer import VERSION, Servicer
from coordinator.control.statefile import load_snapshot
from coordinator.control.telemetry import CoordinatorMetrics, RpcMetricsInterceptor
from coordinator.control.tls import http_context
from coordinator.control.web import CoordinatorHttp
from coordinator.core.messages import StatusReport, WorkerReport
from coordinator.core.settings import CoordinatorConfig

__all__ = [
    "SERVICE_NAME",
    "CoordinatorServer",
    "create_server",
    "serve",
]

logger = logging.getLogger(__name__)


class CoordinatorServer:
    """A coordinator serving on its own event-loop thread; a synchronous handle.

    The port is bound at construction (``port``), serving begins at ``start``.
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="zeroplane-coordinator", daemon=True
        )
        self._terminated = threading.Event()
        self._started = False
        grpc_logger = logging.getLogger(GRPC_LOGGER)
        if not any(isinstance(f, NoMetadataValues) for f in grpc_logger.filters):
            grpc_logger.addFilter(NoMetadataValues())
        self._thread.start()
        # The collector reads the membership at scrape time, on the loop (see status()).
        self.metrics = CoordinatorMetrics(
            status=self._status_or_none, job_name=config.http.job_name
        )
        self.http: CoordinatorHttp | None = None
        try:
            self.port: int = self._call(self._bind())
            if config.http.port is not None:
                server = config.server
                tls = None
                if config.http.tls:
                    assert server.tls_cert_file is not None and server.tls_key_file is not None
                    tls = http_context(
                        server.tls_cert_file, server.tls_key_file, server.tls_client_ca_file
                    )
                self.http = CoordinatorHttp(
                    host=config.http.host or server.host,
                    port=config.http.port,
                    metrics=self.metrics,
                    status=lambda: self._call(self._read_status(), timeout=10),
                    job_name=config.http.job_name,
                    token=server.token if config.http.auth else None,
                    tls=tls,
                )
        except BaseException:
            self._close_loop()
            raise

    @property
    def address(self) -> str:
        return _local_address(self.config.server.host, self.port)

    @property
    def http_address(self) -> str | None:
        """host:port of /metrics, /sd and the status page; None when HTTP is off."""
        if self.http is None:
            return None
        return _local_address(self.config.http.host or self.config.server.host, self.http.port)

    def _call(self, coro: Awaitable[Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _bind(self) -> int:
        cfg = self.config
        membership = Membership(cfg.membership, cfg.plan)
        if cfg.server.state_file is not None:
            snapshot = load_snapshot(cfg.server.state_file)
            if snapshot is not None:
                membership.restore(snapshot)
                self.metrics.on_restore(membership.generation)
        self._servicer = Servicer(cfg, membership, self.metrics)
        limit = cfg.server.max_request_bytes
        self._server = grpc.aio.server(
            interceptors=[RpcMetricsInterceptor(self.metrics)],
            options=[
                # Above the application limit, so an oversized request reaches the handler
                # and gets INVALID_ARGUMENT rather than grpc's RESOURCE_EXHAUSTED.
                # (Beyond this transport limit grpc itself answers RESOURCE_EXHAUSTED.)
                ("grpc.max_receive_message_length", max(2 * limit, limit + (4 << 20))),
                ("grpc.max_send_message_length", cfg.server.max_send_bytes),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ],
        )
        self._server.add_generic_rpc_handlers((self._servicer.handler(),))
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        host = cfg.server.host
        address = f"[{host}]:{cfg.server.port}" if ":" in host else f"{host}:{cfg.server.port}"
        if cfg.server.tls:
            client_ca = cfg.server.tls_client_ca_file
            credentials = grpc.ssl_server_credentials(
                [(cfg.server.tls_key_file.read_bytes(), cfg.server.tls_cert_file.read_bytes())],
                root_certificates=None if client_ca is None else client_ca.read_bytes(),
                require_client_auth=client_ca is not None,
            )
            port = self._server.add_secure_port(address, credentials)
        else:
            port = self._server.add_insecure_port(address)
        if not port:
            raise OSError(f"coordinator cannot bind {address}")
        return port

    def start(self) -> None:
        self._call(self._start())
        self._started = True
        if self.http is not None:
            self.http.start()
            http = self.config.http
            bound = http.host or self.config.server.host
            where = ": every interface" if bound in ("0.0.0.0", "::") else ""
            logger.info(
                "coordinator status page and metrics on %s://%s/ (bound to %s%s, %s)",
                "https" if http.tls else "http",
                self.http_address,
                bound,
                where,
                "the job's token asked for" if http.auth else "no authentication",
            )
        if self.config.server.token is None:
            logger.warning("no bearer token configured: the coordinator accepts any client")
        logger.info(
            "coordinator serving on %s:%d (%s)",
            self.config.server.host,
            self.port,
            ("mutual TLS" if self.config.server.tls_client_ca_file else "TLS")
            if self.config.server.tls
            else "plaintext",
        )

    async def _start(self) -> None:
        await self._server.start()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._servicer.start()

    def stop(self, grace: float | None = None) -> None:
        """Stop serving; in-flight RPCs get ``grace`` seconds (default: the config's)."""
        if self._terminated.is_set():
            return
        grace = self.config.server.grace_s if grace is None else grace
        if self.http is not None:
            self.http.close()
        try:
            self._call(self._stop(grace))
        finally:
            self._close_loop()
        logger.info("coordinator on port %d stopped", self.port)

    async def _stop(self, grace: float) -> None:
        await self._health.enter_graceful_shutdown()
        await self._servicer.stop()
        await self._server.stop(grace)

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._terminated.set()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._terminated.wait(timeout)

    def worker_exited(self, worker_id: str, how: str) -> None:
        """The launcher saw ``worker_id``'s process exit: it is gone now (in process)."""
        if self._terminated.is_set() or not hasattr(self, "_servicer"):
            return  # stopped (or never served): nobody to drop
        self._call(self._worker_exited(worker_id, how), timeout=10)

    async def _worker_exited(self, worker_id: str, how: str) -> None:
        await self._servicer.process_exited(worker_id, how)

    def job_stopping(self, why: str) -> None:
        """The launcher stops the job (``why``): no generation forms any more (in
        process)."""
        if self._terminated.is_set() or not hasattr(self, "_servicer"):
            return
        self._call(self._servicer.stop_job(why), timeout=10)

    def expect_more(self, count: int) -> None:
        """The launcher started ``count`` more workers: the next generation forms once
        they have registered, without the rest of the join window (in process)."""
        if self._terminated.is_set() or not hasattr(self, "_servicer"):
            return
        self._call(self._servicer.expect_more(count), timeout=10)

    def status(self) -> StatusReport:
        """The job's status, read in process (no RPC, no token)."""
        return self._call(self._read_status())

    def placeable(self, workers: Collection[str]) -> int:
        """How many of ``workers`` a generation of them alone could hold (whole groups
        only, in a mesh job), read in process."""
        return self._call(self._placeable(tuple(workers)))

    async def _placeable(self, workers: tuple[str, ...]) -> int:
        return self._servicer.m.placeable(workers)

    async def _read_status(self) -> StatusReport:
        return self._servicer.m.status(VERSION)

    def last_reports(self) -> dict[str, WorkerReport]:
        """Each worker's last report, including those that left (read in process)."""
        return self._call(self._read_last_reports())

    async def _read_last_reports(self) -> dict[str, WorkerReport]:
        return self._servicer.m.last_reports()

    def _status_or_none(self) -> StatusReport | None:
        if self._terminated.is_set() or not hasattr(self, "_servicer"):
            return None
        return self._call(self._read_status(), timeout=10)

    def __enter__(self) -> CoordinatorServer:
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _local_address(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def create_server(config: CoordinatorConfig) -> tuple[CoordinatorServer, int]:
    """A coordinator bound to its port but not yet serving, and that port."""
    server = CoordinatorServer(config)
    return server, server.port


def serve(config: CoordinatorConfig, *, on_ready: Callable[[int], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully. Call from the main thread."""
    server, port = create_server(config)
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        server.start()
        if on_ready is not None:
            on_ready(port)
        stop.wait()
        logger.info("stopping, grace %.1fs", config.server.grace_s)
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
