"""TLS from end to end: workers and CLI clients reach a TLS coordinator (and a mutual-TLS
one) from $ZEROPLANE_TLS_*; a client whose TLS does not fit the server's is refused at
once, saying why; `zeroplane run --tls` makes its own certificate."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from coordinator.control.client import ClientConfig, CoordinatorClient, CoordinatorTlsError
from coordinator.control.server import create_server
from coordinator.core.settings import CoordinatorConfig, ServerConfig
from tests.test_run_e2e import EXAMPLE, reference

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "tls-test-token"


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, cert, key) -> tuple[Path, Path]:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file = path.with_suffix(".key")
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_file.chmod(0o600)
    return path.with_suffix(".crt"), key_file


def _cert(
    name: str,
    key,
    issuer=None,
    issuer_key=None,
    *,
    ca: bool = False,
    server: bool = True,
    hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
    age: datetime.timedelta = datetime.timedelta(0),
):
    now = datetime.datetime.now(datetime.UTC) - age
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.subject if issuer is not None else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if server:
            sans: list[x509.GeneralName] = []
            for host in hosts:
                try:
                    sans.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    sans.append(x509.DNSName(host))
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key if issuer_key is not None else key, hashes.SHA256())


def tls_secret(name: str, hosts: tuple[str, ...]) -> tuple[dict, bytes]:
    """A ``kubernetes.io/tls`` Secret as cert-manager writes one (``tls.crt``, ``tls.key``,
    ``ca.crt``) for ``hosts``, and its authority's PEM certificate."""
    ca_key, key = _key(), _key()
    ca = _cert("test CA", ca_key, ca=True)
    cert = _cert(hosts[0], key, ca, ca_key, hosts=hosts)
    pem = serialization.Encoding.PEM
    private = key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    data = {
        "tls.crt": cert.public_bytes(pem),
        "tls.key": private,
        "ca.crt": ca.public_bytes(pem),
    }
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name},
        "type": "kubernetes.io/tls",
        "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
    }
    return secret, data["ca.crt"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A certificate authority, the coordinator's certificate and a worker's client
    certificate signed by it, and an unrelated authority."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, other_key = _key(), _key()
    ca = _cert("zeroplane test CA", ca_key, ca=True)
    other = _cert("someone else's CA", other_key, ca=True)
    server_key, client_key = _key(), _key()
    out: dict[str, Path] = {}
    out["ca"], _ = _write(d / "ca", ca, ca_key)
    out["other_ca"], _ = _write(d / "other", other, other_key)
    out["server_cert"], out["server_key"] = _write(
        d / "server", _cert("127.0.0.1", server_key, ca, ca_key), server_key
    )
    out["client_cert"], out["client_key"] = _write(
        d / "client", _cert("worker", client_key, ca, ca_key, server=False), client_key
    )
    # signed by the right authority, refused for another reason the client can tell
    old = _cert("worker", client_key, ca, ca_key, server=False, age=datetime.timedelta(days=1))
    out["expired_cert"], _ = _write(d / "expired", old, client_key)
    out["server_only_cert"], _ = _write(
        d / "server_only", _cert("worker", client_key, ca, ca_key), client_key
    )
    return out


def _server(pki: dict[str, Path], *, mutual: bool = False, tls: bool = True):
    server = ServerConfig(
        token=TOKEN,
        tls_cert_file=pki["server_cert"] if tls else None,
        tls_key_file=pki["server_key"] if tls else None,
        tls_client_ca_file=pki["ca"] if mutual else None,
    )
    srv, port = create_server(CoordinatorConfig(server=server))
    srv.start()
    return srv, f"127.0.0.1:{port}"


def _status(address: str, **tls) -> None:
    config = ClientConfig(address=address, token=TOKEN, connect_timeout_s=20, **tls)
    with CoordinatorClient(config) as c:
        c.status()


def test_clients_that_do_not_fit_the_servers_tls_are_refused_at_once(pki) -> None:
    tls_server, tls_address = _server(pki)
    mutual_server, mutual_address = _server(pki, mutual=True)
    plain_server, plain_address = _server(pki, tls=False)
    trusted = {"tls": True, "tls_root_cert_file": pki["ca"]}
    cases = [
        (tls_address, {}, "speaks TLS and this client plaintext"),
        (plain_address, trusted, "does not speak TLS"),
        (tls_address, {"tls": True, "tls_root_cert_file": pki["other_ca"]}, "does not trust"),
        (mutual_address, trusted, "requires a client certificate"),
    ]
    try:
        for address, tls, said in cases:
            started = time.monotonic()
            with pytest.raises(CoordinatorTlsError, match=said):
                _status(address, **tls)
            # at once: not after the 20 s an unreachable coordinator is waited for
            assert time.monotonic() - started < 10, (said, time.monotonic() - started)
        _status(tls_address, **trusted)
        _status(plain_address)
        _status(
            mutual_address,
            **trusted,
            tls_client_cert_file=pki["client_cert"],
            tls_client_key_file=pki["client_key"],
        )
    finally:
        for srv in (tls_server, mutual_server, plain_server):
            srv.stop(0)


def test_the_tls_variables_configure_every_client(monkeypatch, pki) -> None:
    monkeypatch.setenv("ZEROPLANE_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("ZEROPLANE_TLS_ROOT_CERT", str(pki["ca"]))
    monkeypatch.setenv("ZEROPLANE_TLS_SERVER_NAME", "coordinator.example")
    monkeypatch.setenv("ZEROPLANE_TLS_CLIENT_CERT", str(pki["client_cert"]))
    monkeypatch.setenv("ZEROPLANE_TLS_CLIENT_KEY", str(pki["client_key"]))
    config = ClientConfig.from_env()
    assert config.tls and config.tls_root_cert_file == pki["ca"]
    assert config.tls_server_name == "coordinator.example"
    assert config.tls_client_key_file == pki["client_key"]
    monkeypatch.setenv("ZEROPLANE_TLS_ROOT_CERT", "system")
    assert ClientConfig.from_env().tls_root_cert_file is None
    monkeypatch.delenv("ZEROPLANE_TLS_ROOT_CERT")
    with pytest.raises(ValueError, match=r"need \$ZEROPLANE_TLS_ROOT_CERT"):
        ClientConfig.from_env()


def _coordinator(pki: dict[str, Path], tmp: Path, *, mutual: bool) -> tuple[subprocess.Popen, str]:
    token = tmp / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    cmd = [
        sys.executable, "-m", "coordinator.cli", "coordinator", "--host", "127.0.0.1",
        "--port", "0", "--token-file", str(token), "--min-workers", "2", "--max-workers", "2",
        "--stage", "2", "--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"]),
    ]  # fmt: skip
    if mutual:
        cmd += ["--tls-client-ca", str(pki["ca"])]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    proc = subprocess.Popen(cmd, cwd=ROOT, **pipes)
    line = proc.stdout.readline()
    assert line.startswith("zeroplane coordinator listening on 127.0.0.1:"), line
    return proc, line.split()[-1]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_a_job_trains_against_a_tls_coordinator(pki, tmp_path: Path, mutual: bool) -> None:
    coordinator, address = _coordinator(pki, tmp_path, mutual=mutual)
    env = {
        **os.environ,
        "ZEROPLANE_TOKEN_FILE": str(tmp_path / "token"),
        "ZEROPLANE_TLS_ROOT_CERT": str(pki["ca"]),
    }
    if mutual:
        env["ZEROPLANE_TLS_CLIENT_CERT"] = str(pki["client_cert"])
        env["ZEROPLANE_TLS_CLIENT_KEY"] = str(pki["client_key"])
    out = tmp_path / "final.pt"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "run", "--nproc", "2", "--no-http",
             "--coordinator", address, str(EXAMPLE), "--steps", "4", "--out", str(out)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=200,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        status = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "status", "--coordinator", address, "--json",
             "--window", "0"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr[-2000:]
    finally:
        coordinator.terminate()
        coordinator.wait(timeout=30)
    got, want = torch.load(out, weights_only=True), reference(4, 12)
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-5


@pytest.mark.timeout(240)
def test_zeroplane_run_tls_makes_and_trusts_its_own_certificate(tmp_path: Path) -> None:
    out = tmp_path / "final.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "-v", "run", "--nproc", "2", "--tls",
         "--no-http", str(EXAMPLE), "--steps", "3", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "serving on 127.0.0.1" in proc.stderr and "(TLS)" in proc.stderr, proc.stderr[-3000:]
    got, want = torch.load(out, weights_only=True), reference(3, 12)
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-5


def test_secrets_are_private_from_their_first_byte(tmp_path: Path, monkeypatch) -> None:
    """A token or key is never readable by others, not even between its write and a
    chmod: every byte is written to a file that is already 0600, a new one (under a
    permissive umask) or one that was there with a wider mode."""
    import stat

    from coordinator.control.tls import self_signed
    from coordinator.core.settings import write_private

    modes: list[int] = []
    real_write = os.write

    def watched(fd: int, data) -> int:
        modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return real_write(fd, data)

    old = os.umask(0)
    try:
        monkeypatch.setattr(os, "write", watched)
        fresh, shared = tmp_path / "token", tmp_path / "shared"
        shared.write_text("old secret, world-readable\n")
        shared.chmod(0o644)
        for path in (fresh, shared):
            write_private(path, b"s3cret\n")
            assert path.read_bytes() == b"s3cret\n"
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
        monkeypatch.setattr(os, "write", real_write)
        (tmp_path / "tls").mkdir()
        (tmp_path / "tls" / "coordinator.key").write_text("")  # left by an older run
        (tmp_path / "tls" / "coordinator.key").chmod(0o644)
        _, key = self_signed(tmp_path / "tls", ["127.0.0.1"])
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    finally:
        os.umask(old)
    assert modes and all(m == 0o600 for m in modes), modes


@pytest.mark.parametrize(
    ("cert", "said"),
    [("expired_cert", "it expired at"), ("server_only_cert", "does not include client auth")],
)
def test_a_refused_client_certificate_is_told_why(pki, cert: str, said: str) -> None:
    server, address = _server(pki, mutual=True)
    try:
        with pytest.raises(CoordinatorTlsError, match=said):
            _status(
                address, tls=True, tls_root_cert_file=pki["ca"],
                tls_client_cert_file=pki[cert], tls_client_key_file=pki["client_key"],
            )  # fmt: skip
    finally:
        server.stop(0)
