"""The security guide's table of what listens, on what, and what it asks for
(docs/guides/security.md), probed: real `zeroplane coordinator` processes (closed by
default, then with a token, TLS and HTTP's own token and TLS), a rendezvous store
served the way every generation's rank 0 serves it, and where a worker's /metrics
binds. Each probe checks the row of the table that states what it measured.

The host agent's socket (the peer check, the rank bound, malformed frames) is probed
by tests/test_host_agent.py; token files created private by tests/test_tls.py."""

from __future__ import annotations

import base64
import contextlib
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest

from coordinator.commands.run import _on_loopback
from coordinator.control.client import ClientConfig, CoordinatorAuthError, CoordinatorClient
from coordinator.launchers.local import find_free_port
from tests.test_tls import pki  # noqa: F401  (the fixture)

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "security.md"
TOKEN = "surface-probe-token"


def _rows() -> dict[str, tuple[str, str]]:
    """The table's rows: the surface's first words -> (listens on, asks for)."""
    rows = {}
    for line in GUIDE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and not set(cells[0]) <= {"-"} and cells[0] != "Surface":
            rows[cells[0].split(" (")[0].split(":")[0]] = (cells[1], cells[2])
    return rows


ROWS = _rows()


def _outside_address() -> str | None:
    """An address of this machine beyond loopback (None: it has none)."""
    for target in ("10.255.255.254", "192.0.2.1", "198.51.100.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((target, 9))  # (a route is looked up; no packet is sent)
            except OSError:
                continue
            address = s.getsockname()[0]
            if not address.startswith("127."):
                return address
    return None


def _reaches(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=3):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _coordinator(*flags: str):
    """A `zeroplane coordinator` with ``flags``: yields (gRPC port, HTTP port)."""
    port, http = find_free_port(), find_free_port()
    cmd = [sys.executable, "-m", "coordinator.cli", "coordinator", "--port", str(port),
           "--http-port", str(http), *flags]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert "zeroplane coordinator listening on" in line, line + proc.stderr.read()
        yield port, http
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_table_has_a_row_for_every_probed_surface() -> None:
    assert {"gRPC control plane", "HTTP", "a worker's `/metrics`"} <= set(ROWS), ROWS
    assert any(k.startswith("the rendezvous store") for k in ROWS), ROWS


@pytest.mark.timeout(120)
def test_a_coordinator_without_a_token_listens_on_loopback_alone() -> None:
    outside = _outside_address()
    with _coordinator() as (port, http):
        assert _reaches("127.0.0.1", port) and _reaches("127.0.0.1", http)
        if outside is not None:
            assert not _reaches(outside, port), "gRPC reached from beyond loopback"
            assert not _reaches(outside, http), "HTTP reached from beyond loopback"
        # and HTTP asks for nothing
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/api/status", timeout=10) as r:
            assert r.status == 200
    assert "`127.0.0.1` without a token" in ROWS["gRPC control plane"][0]
    assert ROWS["HTTP"][0].startswith("`127.0.0.1`") and ROWS["HTTP"][1].startswith("nothing")


def _get(url: str, context: ssl.SSLContext | None, auth: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": auth} if auth else {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        assert exc.code != 401 or exc.headers["WWW-Authenticate"].startswith("Basic")
        return exc.code


@pytest.mark.timeout(120)
def test_a_token_tls_and_http_auth_close_every_coordinator_port(pki, tmp_path: Path) -> None:  # noqa: F811
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    tls = ("--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"]))
    outside = _outside_address()
    flags = (
        "--token-file",
        str(token),
        *tls,
        "--http-auth",
        "--http-tls",
        "--http-host",
        "0.0.0.0",
    )
    with _coordinator(*flags) as (port, http):
        # with a token the control plane listens on every interface
        if outside is not None:
            assert _reaches(outside, port) and _reaches(outside, http)
        # and asks every call for it
        config = ClientConfig(
            address=f"127.0.0.1:{port}", token=None, connect_timeout_s=20,
            tls=True, tls_root_cert_file=pki["ca"],
        )  # fmt: skip
        with CoordinatorClient(config) as c, pytest.raises(CoordinatorAuthError) as refused:
            c.status()
        assert "missing bearer token" in str(refused.value)
        # HTTP: TLS only, and the token on everything but /healthz
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10)
        trusted = ssl.create_default_context(cafile=str(pki["ca"]))
        base = f"https://127.0.0.1:{http}"
        basic = "Basic " + base64.b64encode(f"prometheus:{TOKEN}".encode()).decode()
        assert _get(f"{base}/metrics", trusted) == 401
        assert _get(f"{base}/api/status", trusted, "Bearer wrong") == 401
        assert _get(f"{base}/metrics", trusted, f"Bearer {TOKEN}") == 200
        assert _get(f"{base}/api/status", trusted, basic) == 200
        assert _get(f"{base}/healthz", trusted) == 200
    grpc_row, http_row = ROWS["gRPC control plane"], ROWS["HTTP"]
    assert "every interface with one" in grpc_row[0] and "the job's token" in grpc_row[1]
    assert "the job's token with `--http-auth`" in http_row[1] and "`/healthz`" in http_row[1]


def test_a_flag_that_needs_what_is_missing_is_refused(capsys) -> None:
    from coordinator.cli import main

    assert main(["coordinator", "--port", "0", "--http-port", "0", "--http-auth"]) == 2
    assert "HttpConfig.auth asks for the server's token" in capsys.readouterr().err
    assert main(["coordinator", "--port", "0", "--http-port", "0", "--http-tls"]) == 2
    assert "HttpConfig.tls serves the server's certificate" in capsys.readouterr().err


def test_the_rendezvous_store_listens_on_the_registered_address_alone() -> None:
    from worker.compat import serving_store

    outside = _outside_address()
    port = find_free_port()
    store = serving_store("127.0.0.1", port, 1, timedelta(seconds=10))
    try:
        assert _reaches("127.0.0.1", port)
        if outside is not None:
            assert not _reaches(outside, port)
    finally:
        del store
    if outside is not None:  # registered at the outside address: loopback is not served
        port = find_free_port()
        store = serving_store(outside, port, 1, timedelta(seconds=10))
        try:
            assert _reaches(outside, port) and not _reaches("127.0.0.1", port)
        finally:
            del store
    row = next(v for k, v in ROWS.items() if k.startswith("the rendezvous store"))
    assert row[0].startswith("the address rank 0 registered with") and row[1].startswith("nothing")


def test_a_workers_metrics_bind_loopback_beside_a_coordinator_on_loopback() -> None:
    """`zeroplane run --coordinator ADDR` binds its workers' /metrics (for the coordinator's
    Prometheus) to loopback where the coordinator is on loopback, else every interface."""
    assert _on_loopback("127.0.0.1:5000") and _on_loopback("[::1]:5000")
    assert _on_loopback("localhost:5000")
    assert not _on_loopback("10.0.0.7:5000") and not _on_loopback("coordinator:5000")
    row = ROWS["a worker's `/metrics`"]
    assert row[0].startswith("`127.0.0.1` under `zeroplane run`") and row[1] == "nothing"
