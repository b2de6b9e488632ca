"""A coordinator run by a launcher beside its workers: ``zeroplane run``, ``demo``, the
Ray launcher. It makes the job's token (and for ``--tls`` its certificate) and hands
the workers the environment that ``ClientConfig.from_env`` reads."""

from __future__ import annotations

import logging
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from coordinator.control.client import ClientConfig
from coordinator.control.server import CoordinatorServer, create_server
from coordinator.control.tls import self_signed
from coordinator.core.messages import StatusReport, WorkerReport
from coordinator.core.planner import ActivationShape
from coordinator.core.settings import (
    ADDRESS_ENV,
    METRICS_HOST_ENV,
    METRICS_PORT_ENV,
    TLS_ROOT_CERT_ENV,
    TOKEN_ENV,
    CoordinatorConfig,
    HttpConfig,
    MembershipConfig,
    PlanConfig,
    ServerConfig,
)

__all__ = ["EmbeddedCoordinator"]

logger = logging.getLogger(__name__)


class EmbeddedCoordinator:
    """A coordinator run by a launcher beside its workers
    (``coordinator.launchers.local.JobService``).

    ``start`` returns the environment that ``ClientConfig.from_env`` reads in the workers.
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        # a certificate made for this coordinator alone (for_local_job(tls=True))
        self.cert_dir: Path | None = None
        self.server: CoordinatorServer | None = None
        # the job's status and every worker's last report, read as it stopped
        self.final: tuple[StatusReport, dict[str, WorkerReport]] | None = None

    @classmethod
    def for_local_job(
        cls,
        nproc: int,
        stage: int | Literal["auto"] | None,
        *,
        http_port: int | None = None,
        job_name: str = "zeroplane",
        min_workers: int | None = None,
        max_workers: int | None = None,
        tls: bool = False,
        activations: ActivationShape | None = None,
        stalls: Mapping[str, float] | None = None,
    ) -> EmbeddedCoordinator:
        """The coordinator of a one-machine job of ``nproc`` workers (elastic between
        ``min_workers`` and ``max_workers``, both ``nproc`` by default), a fresh
        random token, and ``stage``: 0-3, ``"auto"`` (the planner's choice) or
        None (the stage each worker's ZeroConfig asks for).
        ``http_port``: serve metrics, service discovery and the status page there
        (0: a free port), and have the workers serve their metrics too. ``tls``: serve
        TLS with a self-signed certificate for 127.0.0.1 made now, which the workers
        trust ($ZEROPLANE_TLS_ROOT_CERT); it is deleted when the coordinator stops.
        ``activations``: the model's shape, for the activations a plan counts.
        ``stalls``: ``stall_after_s`` and ``stall_timeout_s`` where given
        (coordinator/control/stalls.py)."""
        low = nproc if min_workers is None else min_workers
        high = nproc if max_workers is None else max_workers
        if not low <= nproc <= high:
            raise ValueError(
                f"the job's worker range [{low}, {high}] must include its {nproc} workers"
            )
        cert_dir = cert = key = None
        if tls:
            cert_dir = Path(tempfile.mkdtemp(prefix="zeroplane-tls-"))
            cert, key = self_signed(cert_dir, ["127.0.0.1", "localhost"])
        embedded = cls(
            CoordinatorConfig(
                server=ServerConfig(
                    token=secrets.token_urlsafe(24), tls_cert_file=cert, tls_key_file=key
                ),
                membership=MembershipConfig(
                    min_workers=low,
                    max_workers=high,
                    # an elastic job still starts with all nproc: give them time to register
                    # (the first generation forms once they all have)
                    join_window_s=0.0 if low == nproc else 3.0,
                    expected_workers=nproc,
                    **(stalls or {}),
                ),
                plan=PlanConfig(
                    stage=None if stage in (None, "auto") else int(stage),
                    stage_from_workers=stage is None,
                    activations=activations,
                ),
                http=HttpConfig(port=http_port, job_name=job_name),
            )
        )
        embedded.cert_dir = cert_dir
        return embedded

    def start(self) -> dict[str, str]:
        self.server, _ = create_server(self.config)
        self.server.start()
        env = {ADDRESS_ENV: self.server.address}
        if self.config.server.token is not None:
            env[TOKEN_ENV] = self.config.server.token
        if self.cert_dir is not None and self.config.server.tls_cert_file is not None:
            env[TLS_ROOT_CERT_ENV] = str(self.config.server.tls_cert_file)
        if self.server.http is not None:
            # each worker serves /metrics on a free local port and reports it
            env[METRICS_PORT_ENV] = "0"
            env[METRICS_HOST_ENV] = "127.0.0.1"
        return env

    def client_config(self) -> ClientConfig:
        """How a client in this process reaches the coordinator (a host agent's)."""
        if self.server is None:
            raise RuntimeError("start() the coordinator first")
        cert = self.config.server.tls_cert_file if self.cert_dir is not None else None
        return ClientConfig(
            address=self.server.address,
            token=self.config.server.token,
            tls=cert is not None,
            tls_root_cert_file=None if cert is None else Path(cert),
        )

    def worker_exited(self, worker_id: str, how: str) -> None:
        """A worker's process exited (the launcher saw it): a crash costs the
        survivors no wait for its connection to be noticed closed."""
        if self.server is not None:
            self.server.worker_exited(worker_id, how)

    def job_stopping(self, why: str) -> None:
        """The launcher is stopping the job: a member told to leave while it waits for
        a generation learns that none is coming and leaves at once."""
        if self.server is not None:
            self.server.job_stopping(why)

    def stop(self) -> None:
        if self.server is not None:
            try:
                self.final = (self.server.status(), self.server.last_reports())
            except Exception as exc:  # the job's summary must never fail its stop
                logger.debug("no final status: %s", exc)
            self.server.stop()
        if self.cert_dir is not None:
            shutil.rmtree(self.cert_dir, ignore_errors=True)
