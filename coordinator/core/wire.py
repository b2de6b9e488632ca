"""The fork server's wire format, shared by its two ends (coordinator/launchers/spawner.py,
the launcher's; worker/forkserver.py, the server's): one JSON object per
``SOCK_SEQPACKET`` message over a socketpair, file descriptors beside it."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MAX_MESSAGE", "recv", "send"]

# the largest message: a fork request carries a whole environment
MAX_MESSAGE = 1 << 20


def send(sock: socket.socket, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"fork server message of {len(data)} bytes (at most {MAX_MESSAGE})")
    socket.send_fds(sock, [data], list(fds))


def recv(sock: socket.socket, maxfds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the descriptors it carried; (None, []) once the peer is gone."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, maxfds)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds
