"""TLS for the control plane: what a client says when it and the coordinator disagree,
and the throwaway certificate of ``zeroplane run --tls``.

[Note: a TLS mismatch fails at once]
gRPC reports every failed handshake as an unreachable server and keeps
retrying: a plaintext worker against a TLS coordinator, a TLS worker against a
plaintext one, an untrusted certificate or a missing client certificate all
looked like "unreachable for 30s (DEADLINE_EXCEEDED)". So before its first call
that waits for the coordinator a client makes one handshake of its own with
Python's ``ssl`` (a TCP connect and a few packets; nothing if the port does not
answer yet, which is the coordinator still starting): a plaintext client that
finds a TLS server, a TLS client that finds a plaintext one, or a handshake
refused for a certificate raises :class:`TlsMismatch` naming what to set.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import socket
import ssl
from pathlib import Path

from coordinator.core.settings import write_private

__all__ = ["TlsMismatch", "probe", "self_signed"]

_PROBE_TIMEOUT_S = 2.0


class TlsMismatch(Exception):
    """The client's TLS settings cannot work with the coordinator's."""


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _connect(address: str) -> socket.socket | None:
    try:
        return socket.create_connection(_split(address), timeout=_PROBE_TIMEOUT_S)
    except OSError:
        return None  # not up yet, or not there: the call's own wait decides


def probe(
    address: str,
    *,
    tls: bool,
    root_cert_file: Path | None = None,
    server_name: str | None = None,
    client_cert_file: Path | None = None,
    client_key_file: Path | None = None,
) -> bool:
    """Raise :class:`TlsMismatch` if a client with these settings cannot talk to the
    coordinator at ``address`` for a reason of TLS ([Note: a TLS mismatch fails at
    once]); True when it can, False when nothing answers there yet."""
    sock = _connect(address)
    if sock is None:
        return False
    host = server_name or _split(address)[0]
    with sock:
        if not tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            ctx.set_alpn_protocols(["h2"])
            try:
                with ctx.wrap_socket(sock, server_hostname=host):
                    pass
            except (OSError, ssl.SSLError):
                return True  # no TLS there: as this client expects
            raise TlsMismatch(
                f"the coordinator at {address} speaks TLS and this client plaintext: set "
                "$ZEROPLANE_TLS_ROOT_CERT to the PEM file of the certificate authority "
                "that signed its certificate (or to 'system'), or pass --tls-ca"
            )
        ctx = ssl.create_default_context(
            cafile=None if root_cert_file is None else str(root_cert_file)
        )
        ctx.set_alpn_protocols(["h2"])
        if client_cert_file is not None:
            ctx.load_cert_chain(str(client_cert_file), str(client_key_file))
        try:
            with ctx.wrap_socket(sock, server_hostname=host) as tls_sock:
                # a gRPC server speaks first (its HTTP/2 settings); one that refuses the
                # client's certificate (or its absence) closes after the TLS 1.3 handshake
                tls_sock.settimeout(0.5)
                first = b"?"
                with contextlib.suppress(TimeoutError, ssl.SSLWantReadError, BlockingIOError):
                    first = tls_sock.recv(1)
        except ssl.SSLCertVerificationError as exc:
            roots = root_cert_file or "the system's roots"
            raise TlsMismatch(
                f"the coordinator at {address} presented a certificate this client does "
                f"not trust ({exc.verify_message}; trusted: {roots}); set "
                "$ZEROPLANE_TLS_ROOT_CERT to the authority that signed it, and "
                "$ZEROPLANE_TLS_SERVER_NAME if the certificate names another host"
            ) from None
        except ssl.SSLError as exc:
            reason = exc.reason or str(exc)
            if "CERTIFICATE_REQUIRED" in reason or "HANDSHAKE_FAILURE" in reason:
                raise TlsMismatch(
                    f"the coordinator at {address} requires a client certificate "
                    f"({reason}): set $ZEROPLANE_TLS_CLIENT_CERT and "
                    "$ZEROPLANE_TLS_CLIENT_KEY to one its client CA signed"
                ) from None
            if "BAD_CERTIFICATE" in reason or "UNKNOWN_CA" in reason:
                raise TlsMismatch(
                    f"the coordinator at {address} refused this client's certificate "
                    f"({reason}): {_refused_because(client_cert_file)}"
                ) from None
            raise TlsMismatch(
                f"the coordinator at {address} does not speak TLS ({reason}) and this "
                "client asked for it ($ZEROPLANE_TLS_ROOT_CERT is set): unset it, or "
                "start the coordinator with --tls-cert and --tls-key"
            ) from None
        except OSError:
            return False  # the connection dropped: the call's own wait decides
    if first:
        return True
    if client_cert_file is None:
        raise TlsMismatch(
            f"the coordinator at {address} requires a client certificate (it closed the "
            "connection after the handshake): set $ZEROPLANE_TLS_CLIENT_CERT and "
            "$ZEROPLANE_TLS_CLIENT_KEY to one its client CA signed"
        )
    raise TlsMismatch(
        f"the coordinator at {address} refused this client's certificate "
        f"{client_cert_file} (it closed the connection after the handshake): "
        f"{_refused_because(client_cert_file)}"
    )


def _refused_because(cert_file: str | Path | None) -> str:
    """Why a coordinator would refuse the client certificate in ``cert_file``, as far
    as the client can tell from the certificate itself (the server logs its own
    reason): outside its validity period, or not for client authentication; else
    the one reason left, an authority other than the coordinator's."""
    signed = "it must be signed by the authority of the coordinator's --tls-client-ca"
    if cert_file is None:
        return signed
    try:
        from cryptography import x509
        from cryptography.x509.oid import ExtendedKeyUsageOID

        cert = x509.load_pem_x509_certificate(Path(cert_file).read_bytes())
    except Exception:  # unreadable here: the server's reason is in its log
        return signed
    now = datetime.datetime.now(datetime.UTC)
    if now > cert.not_valid_after_utc:
        return f"it expired at {cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC; renew it"
    if now < cert.not_valid_before_utc:
        return (
            f"it is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M:%S} UTC "
            "(is this host's clock behind?)"
        )
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return signed
    if ExtendedKeyUsageOID.CLIENT_AUTH not in usages:
        names = ", ".join(getattr(u, "_name", u.dotted_string) for u in usages)
        return (
            f"its extended key usage ({names}) does not include client authentication; "
            "issue one for clientAuth"
        )
    return signed


def self_signed(directory: Path, hosts: list[str]) -> tuple[Path, Path]:
    """A certificate for ``hosts`` (names or IP addresses), signed by itself, valid
    for a day, and its private key, written into ``directory`` (the key readable by
    its owner only): ``zeroplane run --tls``'s, which its workers trust."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "coordinator.crt", directory / "coordinator.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_private(
        key_file,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    return cert_file, key_file


def http_context(cert_file: Path, key_file: Path, client_ca_file: Path | None) -> ssl.SSLContext:
    """The coordinator's HTTPS: its gRPC certificate, and where gRPC asks for client
    certificates (``client_ca_file``), HTTPS asks for them too (mutual TLS)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    if client_ca_file is not None:
        ctx.load_verify_locations(client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
