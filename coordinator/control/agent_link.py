"""A worker's link to its host's heartbeat agent, and the framing both ends speak.

The agent (coordinator/control/host_agent.py [Note: the host agent]) and a worker's
client (coordinator/control/client.py) both use this module; neither imports the
other for it. The wire: each message (``AgentBeat`` one way, ``AgentReply`` the other)
framed by its length in 4 big-endian bytes. Nothing but the protobuf messages crosses it.
"""

from __future__ import annotations

import socket
import struct
import threading

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb

__all__ = ["MAX_FRAME_BYTES", "AgentLink", "recv_frame", "send_frame"]

_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 20  # a beat carries one report: far below this


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> bytes | None:
    """One framed message; None at the end of the stream."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes, over the limit of {MAX_FRAME_BYTES}")
    payload = _recv_exact(sock, size)
    if payload is None:
        raise ValueError("the stream ended inside a frame")
    return payload


class AgentLink:
    """A worker's connection to its host's agent ([Note: the host agent]): ``beat``
    sends one and returns the agent's reply, or raises OSError when the agent cannot
    be reached (the caller then heartbeats the coordinator itself)."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._seq = 0
        self._lock = threading.Lock()

    @property
    def seq(self) -> int:
        """The seq of the newest beat sent (0: none)."""
        return self._seq

    def beat(
        self, beat: pb.RankBeat, *, lease_s: float, interval_s: float, flush: bool = False
    ) -> pb.AgentReply:
        with self._lock:
            try:
                if self._sock is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.settimeout(self.timeout_s)
                    sock.connect(self.path)
                    self._sock = sock
                self._seq += 1
                msg = pb.AgentBeat(
                    beat=beat,
                    seq=self._seq,
                    lease_timeout_s=lease_s,
                    heartbeat_interval_s=interval_s,
                    flush=flush,
                )
                send_frame(self._sock, msg.SerializeToString())
                payload = recv_frame(self._sock)
                if payload is None:
                    raise ConnectionResetError("the host agent closed the connection")
                return pb.AgentReply.FromString(payload)
            except (OSError, ValueError) as exc:
                self._close()
                raise OSError(f"host agent at {self.path}: {exc}") from exc

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close()
