"""Free TCP ports: the one helper the launcher, the coordinator, the workers and
the benchmarks share.

A port found free may be taken before it is bound again (torchrun has the same
race): a rendezvous is always offered more than one candidate (a worker
reports two with every heartbeat) and a generation formed on a taken port
fails at its rendezvous and is formed again.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

__all__ = ["free_port", "free_ports"]


def free_ports(count: int = 2, *, host: str = "", exclude: Sequence[int] = ()) -> tuple[int, ...]:
    """``count`` distinct ports free on ``host`` (all interfaces by default) right
    now, none of them in ``exclude``."""
    ports: set[int] = set()
    while len(ports) < count:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in exclude:
            ports.add(port)
    return tuple(sorted(ports))


def free_port(host: str = "") -> int:
    """One port free on ``host`` right now."""
    return free_ports(1, host=host)[0]
