"""``/healthz`` of a launcher, for a liveness probe of the pod it runs in.

    with serve_health(os.environ.get(HEALTH_PORT_ENV)) as health:
        while running:
            ...
            health.beat()          # the loop over the workers turned

It answers 200 while the launcher's loop has turned within ``stale_s`` and 503
after, so that a wedged launcher gets its pod restarted (not a slow step: a
hung collective is the coordinator's to find and name, in
coordinator/control/stalls.py). No port: nothing is served and ``beat`` costs nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["Health", "serve_health"]

logger = logging.getLogger(__name__)


class Health:
    """The last time the launcher's loop turned."""

    def __init__(self, stale_s: float) -> None:
        self.stale_s = stale_s
        self._at = time.monotonic()

    def beat(self) -> None:
        self._at = time.monotonic()

    def healthy(self) -> bool:
        return time.monotonic() - self._at < self.stale_s


def _handler(health: Health) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.rstrip("/") != "/healthz":
                status, body = 404, b"not found\n"
            elif health.healthy():
                status, body = 200, b"ok\n"
            else:
                status, body = 503, b"the launcher's loop has not turned\n"
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # a probe every few seconds is not news

    return Handler


@contextlib.contextmanager
def serve_health(port: str | int | None, *, stale_s: float = 30.0) -> Iterator[Health]:
    """Serve ``/healthz`` on ``port`` (all interfaces: the kubelet probes the pod's
    address) for the block's duration; ``port`` None or empty: serve nothing."""
    health = Health(stale_s)
    if port is None or str(port).strip() == "":
        yield health
        return
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"the health port must be a port number, got {port!r}") from None
    server = ThreadingHTTPServer(("0.0.0.0", number), _handler(health))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="zeroplane-health", daemon=True)
    thread.start()
    logger.info("/healthz on port %d", server.server_port)
    try:
        yield health
    finally:
        server.shutdown()
        server.server_close()
