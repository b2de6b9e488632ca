"""The fork server: imports torch once, then forks one worker per request.

Run by the launcher as ``python -m worker.forkserver FD`` (coordinator/launchers/spawner.py
[Note: fork server] says why and what is kept safe). The server imports, then
only waits, forks and reaps: it runs no user code and no torch operation.
A forked child leaves :func:`serve` with its request and becomes the worker in
:func:`become`; an exception the script raises propagates as it would out of
``python script.py``, so the exit status and traceback are the interpreter's own.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from coordinator.core.wire import recv, send

# what the workers import before anything else; one that fails to import is skipped
# (a job whose scripts do not use torch still runs)
PRELOAD = ("torch", "worker")
_REAP_EVERY_S = 0.02
# how often a worker looks whether its launcher is still there (coordinator/launchers/
# spawner.py [Note: workers outlive the fork server])
_WATCH_EVERY_S = 0.25


@dataclass(frozen=True)
class Request:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    stdout: int
    stderr: int


def preload(modules: tuple[str, ...] = PRELOAD) -> None:
    for name in modules:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def serve(sock: socket.socket) -> Request | None:
    """Fork a child per request until the launcher hangs up. Returns in each child
    (with its request) and, in the server, None once the launcher is gone."""
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock], [], [], _REAP_EVERY_S)
        _reap(sock, children)
        if not ready:
            continue
        try:
            message, fds = recv(sock, maxfds=2)
        except OSError:
            message, fds = None, []
        if message is None:
            return None
        request = _request(message, fds)
        if request is None:
            send(sock, {"error": f"malformed fork request {sorted(message)!r}"})
            continue
        try:
            pid = os.fork()
        except OSError as e:
            _close(request)
            send(sock, {"error": str(e)})
            continue
        if pid == 0:
            return request
        _close(request)
        children.add(pid)
        send(sock, {"pid": pid})


def become(request: Request, server_pid: int, launcher_pid: int) -> None:
    """In the child: be the worker ``python ARGV...`` would have started. It lives on if
    the server dies (the launcher, a subreaper, adopts it) and dies with the launcher."""
    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGINT):  # the server's own, not a worker's
        signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)
    parents = {server_pid, launcher_pid}
    if os.getppid() not in parents:
        os._exit(1)  # the launcher died before this child could watch it
    threading.Thread(
        target=_die_with_the_launcher, args=(parents,), name="zeroplane-launcher", daemon=True
    ).start()
    os.dup2(request.stdout, 1)
    os.dup2(request.stderr, 2)
    _close(request)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    argv = request.argv
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's path first
        sys.path[0] = os.getcwd()
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))


def run(request: Request) -> None:
    """Run the worker's script as ``__main__``; a script that cannot be opened or a
    module that cannot be found ends as the interpreter ends it (same message, same
    exit code: 2 and 1)."""
    argv = request.argv
    if argv[0] == "-m":
        try:
            found = importlib.util.find_spec(argv[1]) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            sys.stderr.write(f"{sys.executable}: No module named {argv[1]}\n")
            raise SystemExit(1)
        # a module the server preloaded (``-m worker.x``) runs afresh as __main__, as
        # under ``python -m``, not beside its imported copy (runpy warns of that)
        sys.modules.pop(argv[1], None)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    path = os.path.abspath(argv[0])
    if not os.path.isdir(path):  # a directory runs its __main__.py, as python does
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            sys.stderr.write(
                f"{sys.executable}: can't open file {path!r}: [Errno {e.errno}] {e.strerror}\n"
            )
            raise SystemExit(2) from None
    runpy.run_path(argv[0], run_name="__main__")


def _die_with_the_launcher(parents: set[int]) -> None:
    """What ``PR_SET_PDEATHSIG`` did when it tied a worker to the server: a parent other
    than the server or the launcher means the launcher is gone (the worker was
    handed to init or an outer subreaper), and the worker goes with it."""
    while os.getppid() in parents:
        time.sleep(_WATCH_EVERY_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _request(message: dict[str, Any], fds: list[int]) -> Request | None:
    argv, env, cwd = message.get("argv"), message.get("env"), message.get("cwd")
    ok = (
        len(fds) == 2
        and isinstance(argv, list)
        and argv
        and all(isinstance(a, str) for a in argv)
        and (argv[0] != "-m" or len(argv) >= 2)
        and isinstance(env, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        and isinstance(cwd, str)
    )
    if not ok:
        for fd in fds:
            os.close(fd)
        return None
    return Request(argv, env, cwd, fds[0], fds[1])


def _close(request: Request) -> None:
    for fd in (request.stdout, request.stderr):
        with contextlib.suppress(OSError):
            os.close(fd)


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)
        with contextlib.suppress(OSError):
            send(sock, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[1]))
    launcher_pid = os.getppid()  # the trampoline exec'd this interpreter
    # a SIGTERM or SIGINT to the server stops new starts, never a running worker
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    preload()
    server_pid = os.getpid()
    try:
        request = serve(sock)
    except SystemExit:
        return  # asked to stop: the launcher adopts the workers
    if request is None:
        return  # the launcher hung up
    sock.close()
    become(request, server_pid, launcher_pid)
    run(request)


if __name__ == "__main__":
    main(sys.argv)
