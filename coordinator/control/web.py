"""The coordinator's HTTP side: metrics, Prometheus service discovery, a status page.

============  ===============================================================
``/metrics``  the coordinator's Prometheus metrics (coordinator/control/telemetry.py)
``/sd``       the live workers' metrics endpoints in Prometheus' ``http_sd``
              format, so a plain Prometheus follows an elastic job
``/api/status``  JSON: the job, its workers, per-rank figures (coordinator/control/observe.py)
``/``         a self-contained status page over ``/api/status`` (no external
              assets: it works offline)
``/healthz``  ``ok``
============  ===============================================================

Everything here is read-only and carries no secret (no token, no tensor); it
serves on its own port (``HttpConfig.port``), next to the gRPC one, bound to
127.0.0.1 unless told otherwise. ``HttpConfig.auth`` asks every request but
``/healthz``'s (a kubelet's probe) for the control plane's token, as a bearer
token or as basic auth's password (a browser asks for it; Prometheus sends
either: ``authorization`` or ``basic_auth`` in its scrape config);
``HttpConfig.tls`` serves HTTPS with the gRPC server's certificate, and with
its client authority where it has one.

[Note: service discovery labels]
Each ``/sd`` target group sets ``job`` to the job's name (a target label
wins over the scrape config's ``job_name``), and describes the worker in
``__meta_zeroplane_*`` labels: ``rank``, ``stage``, ``generation``,
``worker_id``, ``host``, ``state``. They are meta labels, not target labels,
because the workers' own series already carry ``rank`` and ``stage``: a
target label of the same name would rename the worker's to ``exported_rank``.
Relabel them in if you want them (deploy/prometheus/prometheus.yml keeps
``worker_id``).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hmac
import json
import logging
import ssl
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import urlparse

from prometheus_client.exposition import choose_encoder

from coordinator.control.observe import Sampler
from coordinator.control.telemetry import CoordinatorMetrics
from coordinator.core.meshplan import MeshCoords
from coordinator.core.messages import StatusReport, WorkerReport, WorkerStatus

__all__ = ["CoordinatorHttp", "api_status", "sd_targets"]

logger = logging.getLogger(__name__)

EVENTS_SHOWN = 20


def sd_targets(report: StatusReport, job_name: str) -> list[dict[str, Any]]:
    """The ``http_sd`` target groups of the live workers (see [Note: service discovery labels])."""
    groups = []
    for w in report.workers:
        if w.state in ("lost", "left") or not w.info.metrics_endpoint:
            continue
        labels = {
            "job": job_name,
            "__meta_zeroplane_worker_id": w.info.worker_id,
            "__meta_zeroplane_host": w.info.host,
            "__meta_zeroplane_state": w.state,
            "__meta_zeroplane_generation": str(report.generation_id),
        }
        if w.rank is not None:
            labels["__meta_zeroplane_rank"] = str(w.rank)
            labels["__meta_zeroplane_stage"] = str(report.stage)
            coords = report.coords(w.rank)
            if coords is not None:
                labels |= {f"__meta_zeroplane_{k}": v for k, v in coords.labels().items()}
        groups.append({"targets": [w.info.metrics_endpoint], "labels": labels})
    return groups


def _coords(coords: MeshCoords | None) -> dict[str, int] | None:
    return None if coords is None else {"pp": coords.pp, "dp": coords.dp, "tp": coords.tp}


def api_status(
    report: StatusReport, job_name: str, sampler: Sampler | None, *, at_peers: bool = False
) -> dict[str, Any]:
    """The JSON behind the status page: the job, its workers and per-rank figures.

    ``at_peers``: read each worker's metrics at ``WorkerStatus.metrics_url`` (the
    address it connects to the coordinator from) and nowhere else: what the
    coordinator does, so that no registered name makes it reach another host.
    """
    members = sorted((w for w in report.workers if w.state == "member"), key=lambda w: w.rank or 0)

    def target(w: WorkerStatus) -> str:
        return w.metrics_url if at_peers else w.info.metrics_endpoint

    endpoints = [target(w) for w in members if target(w)]
    figures = sampler.sample(endpoints) if sampler is not None else {}
    ranks = []
    for w in members:
        f = figures.get(target(w))
        row: dict[str, Any] = {"rank": w.rank, "worker_id": w.info.worker_id}
        if f is not None:
            row.update(f.as_dict())
            row["rank"] = w.rank  # the coordinator's view wins over a stale scrape
        elif not w.info.metrics_endpoint:
            row["error"] = "no metrics endpoint reported"
        elif not target(w):
            row["error"] = "metrics endpoint not confirmed yet (no call from this worker since)"
        ranks.append(row)
    return {
        "job": job_name,
        "version": report.server_version,
        "phase": report.phase,
        "waiting_reason": report.waiting_reason,
        "generation": report.generation_id,
        "world_size": report.world_size,
        "stage": report.stage,
        "stage_reason": report.stage_reason,
        "mesh": None
        if report.mesh is None
        else {"pp": report.mesh.pp, "dp": report.mesh.dp, "tp": report.mesh.tp},
        "mesh_reason": report.mesh_reason,
        "stall": report.stall,
        "stall_kind": report.stall_kind,
        "newcomers": report.newcomers,
        "trainable_parameters": report.trainable_numel,
        "workers": [
            {
                "worker_id": w.info.worker_id,
                "state": w.state,
                "rank": w.rank,
                "mesh": _coords(report.coords(w.rank)),
                "host": w.info.host,
                "device_kind": w.info.device_kind,
                "metrics_endpoint": w.info.metrics_endpoint,
                "lease_remaining_s": round(w.lease_remaining_s, 2),
                "step": None if w.report is None else w.report.step,
                "where": _where(w.report),
            }
            for w in report.workers
        ],
        "ranks": ranks,
        "events": [
            {
                "unix_s": e.unix_s,
                "kind": e.kind,
                "worker_id": e.worker_id,
                "generation": e.generation_id,
                "detail": e.detail,
            }
            for e in list(report.events)[-EVENTS_SHOWN:]
        ],
    }


def _where(report: WorkerReport | None) -> dict[str, Any] | None:
    """Where a worker said it was (coordinator/control/stalls.py), or None."""
    where = None if report is None else report.where
    return None if where is None else dataclasses.asdict(where)


def _page() -> bytes:
    return resources.files("coordinator").joinpath("static/status.html").read_bytes()


class CoordinatorHttp:
    """The HTTP endpoints above, served from a thread; ``close()`` stops them.

    ``status`` returns the job's current ``StatusReport`` (the server reads it on
    its event loop); it is called from the HTTP threads.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        metrics: CoordinatorMetrics,
        status: Callable[[], StatusReport],
        job_name: str,
        sampler: Sampler | None = None,
        token: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.metrics = metrics
        self.status = status
        self.job_name = job_name
        self.sampler = sampler if sampler is not None else Sampler()
        self.token = token
        self._page = _page()
        handler = _handler_for(self)
        self._server = ThreadingHTTPServer((host, port), handler)
        if tls is not None:  # (each connection's handshake runs in its own thread)
            self._server.socket = tls.wrap_socket(
                self._server.socket, server_side=True, do_handshake_on_connect=False
            )
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="zeroplane-coordinator-http", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        self.sampler.close()

    def authorized(self, path: str, authorization: str | None) -> bool:
        """Whether a request for ``path`` with this ``Authorization`` header may be
        served: always without a token, and for ``/healthz``; else with the token as
        a bearer token or as basic auth's password (any user name)."""
        if self.token is None or urlparse(path).path.rstrip("/") == "/healthz":
            return True
        scheme, _, value = (authorization or "").strip().partition(" ")
        given = value.strip()
        if scheme.lower() == "basic":
            try:
                given = base64.b64decode(given, validate=True).decode().partition(":")[2]
            except (binascii.Error, UnicodeDecodeError):
                return False
        elif scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(given.encode(), self.token.encode())

    def respond(self, path: str, accept: str) -> tuple[int, str, bytes]:
        """(status, content type, body) for a GET of ``path``."""
        route = urlparse(path).path.rstrip("/") or "/"
        if route == "/metrics":
            encoder, content_type = choose_encoder(accept)
            return 200, content_type, encoder(self.metrics.registry)
        if route == "/healthz":
            return 200, "text/plain; charset=utf-8", b"ok\n"
        if route == "/":
            return 200, "text/html; charset=utf-8", self._page
        if route == "/sd":
            body = sd_targets(self.status(), self.job_name)
        elif route == "/api/status":
            body = api_status(self.status(), self.job_name, self.sampler, at_peers=True)
        else:
            return 404, "text/plain; charset=utf-8", b"not found\n"
        return 200, "application/json", json.dumps(body).encode()


def _handler_for(app: CoordinatorHttp) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "zeroplane-coordinator"

        def setup(self) -> None:
            if isinstance(self.request, ssl.SSLSocket):
                self.request.settimeout(10)  # a client that never finishes its hello
                self.request.do_handshake()
                self.request.settimeout(None)
            super().setup()

        def do_GET(self) -> None:
            if not app.authorized(self.path, self.headers.get("Authorization")):
                body = b"this coordinator's HTTP asks for the job's token\n"
                self.send_response(HTTPStatus.UNAUTHORIZED)
                self.send_header("WWW-Authenticate", 'Basic realm="zeroplane", charset="UTF-8"')
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            try:
                code, content_type, body = app.respond(self.path, self.headers.get("Accept", ""))
            except Exception:
                logger.exception("HTTP %s failed", self.path)
                code, content_type = HTTPStatus.INTERNAL_SERVER_ERROR, "text/plain"
                body = b"internal error\n"
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("http: " + format, *args)

    return Handler
