"""Configuration of the coordinator: one frozen dataclass per concern.

* ``ServerConfig``: where it listens, authentication, TLS, the state file, limits;
* ``MembershipConfig``: how many workers, the join window, leases;
* ``PlanConfig`` (from ``coordinator.core.planner``): stage choice and layout;
* ``HttpConfig``: the HTTP port for metrics, service discovery and the status page.

The bearer token is read from a file (a mounted Kubernetes Secret) or an
environment variable by ``load_token``; it never appears in a repr.
"""

from __future__ import annotations

import logging
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.core.planner import PlanConfig

__all__ = [
    "ADDRESS_ENV",
    "HEALTH_PORT_ENV",
    "METRICS_HOST_ENV",
    "METRICS_PORT_ENV",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "CoordinatorConfig",
    "HttpConfig",
    "MembershipConfig",
    "PlanConfig",
    "ServerConfig",
    "load_token",
    "write_private",
]

logger = logging.getLogger(__name__)

# What a launcher exports to its workers (and what ``zeroplane status`` reads).
ADDRESS_ENV = "ZEROPLANE_COORDINATOR"
TOKEN_ENV = "ZEROPLANE_TOKEN"
TOKEN_FILE_ENV = "ZEROPLANE_TOKEN_FILE"
# The worker's name at the coordinator (default: HOST-LOCAL_RANK, or HOST-PID).
WORKER_ID_ENV = "ZEROPLANE_WORKER_ID"
# Where workers serve /metrics: a port (0: a free one; FIRST-LAST: local rank i takes
# FIRST + i) and the address to bind.
METRICS_PORT_ENV = "ZEROPLANE_METRICS_PORT"
# Where ``zeroplane run`` serves /healthz for a liveness probe (unset: nowhere).
HEALTH_PORT_ENV = "ZEROPLANE_HEALTH_PORT"
METRICS_HOST_ENV = "ZEROPLANE_METRICS_HOST"
# How clients reach a TLS coordinator: the PEM roots they trust ("system": the
# system's), the name its certificate carries when it is not the address's host,
# and for mutual TLS the client's own certificate and key (PEM files).
TLS_ROOT_CERT_ENV = "ZEROPLANE_TLS_ROOT_CERT"
TLS_SERVER_NAME_ENV = "ZEROPLANE_TLS_SERVER_NAME"
TLS_CLIENT_CERT_ENV = "ZEROPLANE_TLS_CLIENT_CERT"
TLS_CLIENT_KEY_ENV = "ZEROPLANE_TLS_CLIENT_KEY"
# The Unix socket of the host's heartbeat agent (coordinator/control/host_agent.py):
# a worker's heartbeats go there instead of to the coordinator.
HOST_AGENT_ENV = "ZEROPLANE_HOST_AGENT"
# When the coordinator names a stall, and when it acts on one (coordinator/control/stalls.py);
# what --stall-after and --stall-timeout default to.
STALL_AFTER_ENV = "ZEROPLANE_STALL_AFTER_S"
STALL_TIMEOUT_ENV = "ZEROPLANE_STALL_TIMEOUT_S"
MiB = 1 << 20


def env_seconds(name: str, default: float) -> float:
    """``$name`` as a positive number of seconds (``default`` when unset)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"${name} must be a positive number of seconds, got {raw!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Where and how the coordinator serves."""

    host: str = "127.0.0.1"
    # 0 picks a free port (tests); create_server returns the bound one.
    port: int = 0
    # Bearer token every RPC but the health service must carry; None disables auth.
    token: str | None = field(default=None, repr=False)
    # PEM files; both or neither. Without them the server is plaintext.
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # Mutual TLS: only clients holding a certificate this PEM authority signed connect.
    tls_client_ca_file: Path | None = None
    # Where the current generation and its members survive a restart; None: in memory only.
    state_file: Path | None = None
    # Seconds in-flight RPCs get to finish on stop.
    grace_s: float = 5.0
    # Larger requests are rejected with INVALID_ARGUMENT.
    max_request_bytes: int = 64 * MiB
    # Largest message the server sends (a generation with a big reshard schedule).
    max_send_bytes: int = 1024 * MiB
    # Largest parameter inventory a worker may register.
    max_params: int = 1_000_000

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("ServerConfig.host must be non-empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ServerConfig.port must be in [0, 65535], got {self.port}")
        if self.token is not None and not self.token.strip():
            raise ValueError("ServerConfig.token must be None or non-empty")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("ServerConfig.tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError(
                "ServerConfig.tls_client_ca_file needs tls_cert_file and tls_key_file "
                "(mutual TLS is TLS)"
            )
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"ServerConfig.{name} {str(path)!r} is not a file")
        if not (math.isfinite(self.grace_s) and self.grace_s >= 0):
            raise ValueError(f"ServerConfig.grace_s must be finite and >= 0, got {self.grace_s}")
        if self.state_file is not None and not Path(self.state_file).parent.is_dir():
            raise ValueError(
                f"ServerConfig.state_file {str(self.state_file)!r}: its directory does not exist"
            )
        if self.max_request_bytes < 1024:
            raise ValueError(
                f"ServerConfig.max_request_bytes must be >= 1024, got {self.max_request_bytes}"
            )
        if self.max_send_bytes < MiB:
            raise ValueError(
                f"ServerConfig.max_send_bytes must be >= {MiB}, got {self.max_send_bytes}"
            )
        if self.max_params < 1:
            raise ValueError(f"ServerConfig.max_params must be >= 1, got {self.max_params}")

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None


@dataclass(frozen=True, kw_only=True)
class MembershipConfig:
    """Who is in a generation, and when a new one forms.

    The first generation forms once ``min_workers`` have registered and the
    join window (counted from the earliest waiting registration) has passed,
    or at once when ``max_workers`` have. Joins later are batched by the same
    window; a leave or an expired lease forms the next generation at once,
    since survivors are blocked on the lost peer. Workers beyond
    ``max_workers`` wait as standbys.
    """

    min_workers: int = 1
    max_workers: int = 4096
    join_window_s: float = 2.0
    # The workers a launcher starts at once (zeroplane run's --nproc): the first
    # generation forms as soon as they have registered, without the rest of the window.
    expected_workers: int | None = None
    # A worker silent for this long is dropped.
    lease_timeout_s: float = 10.0
    heartbeat_interval_s: float = 2.0
    # A worker whose connection closed (its generation stream ended) and did not
    # come back within this is dropped without waiting out its lease
    # (coordinator/control/membership.py [Note: disconnects]). None: one heartbeat
    # interval; lease_timeout_s: leases alone decide.
    disconnect_grace_s: float | None = None
    # Added to the first lease of members restored from the state file: time for
    # their clients to notice the restarted coordinator and reconnect.
    reattach_grace_s: float = 10.0
    # Membership events kept for status.
    event_history: int = 256
    # A collective waited on this long is a stall, named on status, the metrics and the
    # log; once its longest wait reaches stall_timeout_s the coordinator acts on it
    # (coordinator/control/stalls.py). From $ZEROPLANE_STALL_AFTER_S and
    # $ZEROPLANE_STALL_TIMEOUT_S where set.
    stall_after_s: float = field(default_factory=lambda: env_seconds(STALL_AFTER_ENV, 5.0))
    stall_timeout_s: float = field(default_factory=lambda: env_seconds(STALL_TIMEOUT_ENV, 30.0))

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ValueError(f"MembershipConfig.min_workers must be >= 1, got {self.min_workers}")
        expected = self.expected_workers
        if expected is not None and not self.min_workers <= expected <= self.max_workers:
            raise ValueError(
                f"MembershipConfig.expected_workers ({expected}) must be within "
                f"[min_workers, max_workers] = [{self.min_workers}, {self.max_workers}]"
            )
        if self.max_workers < self.min_workers:
            raise ValueError(
                f"MembershipConfig.max_workers ({self.max_workers}) must be >= "
                f"min_workers ({self.min_workers})"
            )
        for name in ("join_window_s", "lease_timeout_s", "heartbeat_interval_s"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"MembershipConfig.{name} must be finite, got {value}")
        if self.join_window_s < 0:
            raise ValueError(
                f"MembershipConfig.join_window_s must be >= 0, got {self.join_window_s}"
            )
        if self.lease_timeout_s <= 0:
            raise ValueError(
                f"MembershipConfig.lease_timeout_s must be > 0, got {self.lease_timeout_s}"
            )
        if not 0 < self.heartbeat_interval_s <= self.lease_timeout_s / 2:
            raise ValueError(
                f"MembershipConfig.heartbeat_interval_s must be in (0, lease_timeout_s / 2 = "
                f"{self.lease_timeout_s / 2}], got {self.heartbeat_interval_s}"
            )
        grace = self.disconnect_grace_s
        if grace is not None and not (math.isfinite(grace) and grace >= 0):
            raise ValueError(
                f"MembershipConfig.disconnect_grace_s must be finite and >= 0, got {grace}"
            )
        if not (math.isfinite(self.reattach_grace_s) and self.reattach_grace_s >= 0):
            raise ValueError(
                "MembershipConfig.reattach_grace_s must be finite and >= 0, "
                f"got {self.reattach_grace_s}"
            )
        if self.event_history < 1:
            raise ValueError(
                f"MembershipConfig.event_history must be >= 1, got {self.event_history}"
            )
        after, bound = self.stall_after_s, self.stall_timeout_s
        if not (math.isfinite(bound) and 0 < after <= bound):
            raise ValueError(
                f"MembershipConfig.stall_after_s (--stall-after, {after}) and stall_timeout_s "
                f"(--stall-timeout, {bound}) "
                "must satisfy 0 < stall_after_s <= stall_timeout_s"
            )


@dataclass(frozen=True, kw_only=True)
class HttpConfig:
    """The coordinator's HTTP side (coordinator/control/web.py): ``/metrics``, ``/sd``, ``/``.

    port: None serves no HTTP at all; 0 picks a free port.
    host: address to bind; None: the gRPC server's host.
    job_name: the ``job`` label service discovery gives the workers' series,
        and what the dashboard's job variable selects.
    auth: ask every client but ``/healthz``'s for the server's token.
    tls: serve HTTPS with the server's certificate (and client authority).
    """

    port: int | None = None
    host: str | None = None
    job_name: str = "zeroplane"
    # every endpoint but /healthz asks for the server's token (ServerConfig.token):
    # "Authorization: Bearer TOKEN", or basic auth with the token as the password
    auth: bool = False
    # served over TLS with the server's certificate (ServerConfig.tls_cert_file), and
    # its client authority where it has one (mutual TLS)
    tls: bool = False

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"HttpConfig.port must be None or in [0, 65535], got {self.port}")
        if self.host is not None and not self.host:
            raise ValueError("HttpConfig.host must be None or non-empty")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", self.job_name):
            raise ValueError(
                "HttpConfig.job_name must be 1-63 letters, digits, '_', '.' or '-', "
                f"got {self.job_name!r}"
            )


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    http: HttpConfig = field(default_factory=HttpConfig)

    def __post_init__(self) -> None:
        for name, kind in (
            ("server", ServerConfig),
            ("membership", MembershipConfig),
            ("plan", PlanConfig),
            ("http", HttpConfig),
        ):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"CoordinatorConfig.{name} must be a {kind.__name__}")
        if self.http.auth and self.server.token is None:
            raise ValueError("HttpConfig.auth asks for the server's token: set ServerConfig.token")
        if self.http.tls and self.server.tls_cert_file is None:
            raise ValueError(
                "HttpConfig.tls serves the server's certificate: set ServerConfig.tls_cert_file "
                "and tls_key_file"
            )


def load_token(
    token_file: str | os.PathLike[str] | None = None, *, env: str = TOKEN_ENV
) -> str | None:
    """The bearer token from ``token_file`` if given, else ``$ZEROPLANE_TOKEN_FILE``, else
    ``$env``; None if none is set.

    Surrounding whitespace is stripped (Secrets mounted from files often end in a newline).
    """
    if token_file is None:
        token_file = os.environ.get(TOKEN_FILE_ENV) or None
    if token_file is not None:
        path = Path(token_file)
        try:
            token = path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read token file {str(path)!r}: {exc.strerror}") from exc
        if not token:
            raise ValueError(f"token file {str(path)!r} is empty")
        _warn_if_shared(path)
        return token
    token = os.environ.get(env, "").strip()
    return token or None


def write_private(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` readable and writable by its owner only, from the
    first byte: the file is created 0600 (an existing one is made 0600 before it is
    truncated), never world-readable for a moment as a write then a chmod would
    leave it. For tokens and private keys."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a file that was there keeps its mode through O_CREAT
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _warn_if_shared(path: Path) -> None:
    """Warn when users other than the owner may read the token file (as ssh does for a key)."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return
    if mode & 0o077:
        logger.warning(
            "token file %s is readable by others (mode %04o): anyone who can read it can "
            "join or stop this job; chmod 600 it (a Kubernetes Secret: defaultMode 0400)",
            path,
            mode,
        )
