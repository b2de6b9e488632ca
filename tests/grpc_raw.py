"""A gRPC call written as raw HTTP/2 frames, for requests a grpc client refuses to send
(metadata that is not valid UTF-8, a compressed-flag lie): just enough HTTP/2 for one
call on a fresh connection, no flow control beyond the defaults."""

from __future__ import annotations

import re
import socket
import struct

__all__ = ["raw_call"]

_DATA, _HEADERS, _SETTINGS = 0, 1, 4
_END_STREAM, _END_HEADERS = 1, 4


def _int(value: int, prefix_bits: int) -> bytes:
    # HPACK integer (RFC 7541, 5.1)
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([value])
    out = [limit]
    value -= limit
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def _header(name: bytes, value: bytes) -> bytes:
    # a literal header field without indexing, new name, no Huffman coding
    return b"\x00" + _int(len(name), 7) + name + _int(len(value), 7) + value


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def raw_call(
    port: int,
    method: str,
    body: bytes,
    *,
    metadata: tuple[tuple[bytes, bytes], ...] = (),
    compressed: bool = False,
    timeout: float = 5.0,
) -> int | None:
    """Call ``method`` (``/package.Service/Method``) on 127.0.0.1:``port`` with one message
    ``body`` (under 64 KiB: no flow control here); the grpc-status the server answers
    with, None if it answered none."""
    if len(body) > 65_000:
        raise ValueError("raw_call sends at most 65,000 bytes (HTTP/2's initial window)")
    block = b"".join(
        _header(k, v)
        for k, v in (
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", method.encode()),
            (b":authority", f"127.0.0.1:{port}".encode()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            *((b"grpc-encoding", b"gzip") if compressed else ()),
            *metadata,
        )
    )
    message = bytes([int(compressed)]) + struct.pack(">I", len(body)) + body
    out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(_SETTINGS, 0, 0, b"")
    out += _frame(_HEADERS, _END_HEADERS, 1, block)
    chunks = [message[i : i + 16384] for i in range(0, len(message), 16384)]
    for i, chunk in enumerate(chunks):
        out += _frame(_DATA, _END_STREAM if i == len(chunks) - 1 else 0, 1, chunk)
    # the server's trailers are HPACK too, but grpc-status goes out as a literal
    status = re.compile(rb"grpc-status.(\d+)")
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(out)
        try:
            while (match := status.search(received)) is None:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
        except OSError:
            pass
    return None if match is None else int(match.group(1))
