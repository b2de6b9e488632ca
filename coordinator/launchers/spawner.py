"""The launcher's side of the fork server: workers forked from a process that already
imported torch.

[Note: fork server]
A worker of ``zeroplane run`` is a Python process that spends 1.5-2 s of CPU
importing torch before it runs a line of the user's script, and N workers
starting at once on a few cores do it N times over. A job pays it at start,
and again for every replacement and every worker added; a replacement's import
also slows the survivors' steps on the node it shares with them.

So the launcher starts one server process (``python -m worker.forkserver``)
that imports torch and zeroplane's ``worker`` package once, and asks it for
each worker: the server forks, and the child becomes the worker as
``python script.py ...`` would (its own session, the worker's environment,
``sys.argv``, ``sys.path[0]``, stdout and stderr on the launcher's pipes, the
script run as ``__main__``). A fork costs milliseconds; the child shares the
imported modules' pages with the server until it writes them.

What makes it safe:
- the server runs no user code and no torch operation: it imports, then
  waits; it never initializes CUDA, so each child picks its own devices from
  its environment (``CUDA_VISIBLE_DEVICES`` is read at CUDA's first use);
- only commands the launcher builds itself are forked: the launcher's own
  interpreter with a script or ``-m module``. Anything else (another
  interpreter, ``-c``, a non-Python program) starts as a fresh process as
  before;
- environment variables read when an interpreter starts (``PYTHONPATH``,
  ``PYTHONHASHSEED``, ``PYTHONUNBUFFERED``, ...) are the server's, which the
  launcher starts with the environment every worker shares; a worker's own
  variables (``RANK``, ``WORKER_ID``, ...) are set in the child before the
  script runs;
- the server dies with the launcher (``PR_SET_PDEATHSIG``), and every child
  dies with the launcher too, but not with the server ([Note: workers
  outlive the fork server]); the server reports each child's exit status,
  which only the parent can collect, until it is gone.

[Note: workers outlive the fork server]
The server is an optimisation of starting, not a part of the job. Its
children used to die with it (``PR_SET_PDEATHSIG``), so a SIGTERM to the
wrong pid, or the OOM killer's choice, took every worker of the host and its
state with it. Now the launcher makes itself a child subreaper
(``PR_SET_CHILD_SUBREAPER``): when the server dies, its children become the
launcher's, which waits for them itself (:func:`_adopt`) and so still learns
each exit status. A child watches its parent instead of a death signal: while
it is the server or the launcher it runs, and once it is anything else (the
launcher died, the child went to init) it kills itself, as the death signal
did. A SIGTERM or SIGINT to the server ends only the server; the launcher
starts the next workers from a new one.

:class:`ForkServer` starts the server and forks; :class:`ForkedProcess` is the
``subprocess.Popen`` subset :class:`coordinator.launchers.local.LocalJob` uses (``pid``,
``poll``, ``wait``, ``returncode``, ``stdout``, ``stderr``), with ``send_signal``,
``terminate`` and ``kill``. The wire format is one JSON object per ``SOCK_SEQPACKET``
message over a socketpair; a fork request carries the child's stdout and stderr
pipes (or one open file for both) as file descriptors. The test suite forks its
elastic jobs' workers from one such server (tests/conftest.py ``fork_server``,
``subreaper=False``: pytest reaps no one else's orphans).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from coordinator.core.wire import recv, send

logger = logging.getLogger(__name__)

__all__ = ["SERVER_MODULE", "ForkServer", "ForkedProcess", "forkable"]

SERVER_MODULE = "worker.forkserver"
# a child's return code when the server died before it could report one
LOST_WITH_SERVER = -int(signal.SIGKILL)
_PR_SET_CHILD_SUBREAPER = 36


def forkable(command: Sequence[str]) -> bool:
    """Whether the fork server can run ``command``: this interpreter with a script or
    ``-m module`` and no other interpreter option."""
    if len(command) < 2 or command[0] != sys.executable:
        return False
    if command[1] == "-m":
        return len(command) >= 3 and bool(command[2]) and not command[2].startswith("-")
    return not command[1].startswith("-")


class ForkedProcess:
    """A worker forked by the server: what LocalJob uses of ``subprocess.Popen``."""

    def __init__(self, pid: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.pid = pid
        self.stdout: IO[bytes] | None = stdout
        self.stderr: IO[bytes] | None = stderr
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _set_exit(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
            self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Signal the worker (not its process group), unless it has exited."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One server process that forks workers (see [Note: fork server]).

    ``env``: the server's environment, the one every worker shares (each worker's
    own variables come with its fork request). ``launch_prefix``: what to run the
    server under (the launcher's parent-death trampoline). Start it early: the
    server imports torch while the launcher goes on; the first :meth:`fork` waits
    for it (up to ``ready_timeout_s``).
    """

    def __init__(
        self,
        env: Mapping[str, str],
        *,
        launch_prefix: Sequence[str] = (),
        ready_timeout_s: float = 300.0,
        subreaper: bool = True,
    ) -> None:
        # its children become this process's if it dies ([Note: workers outlive the
        # fork server]); ``subreaper=False`` for a process that waits for no one else's
        # orphans (they would stay zombies), its forked children reported lost instead
        if subreaper:
            become_subreaper()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._ready_timeout_s = ready_timeout_s
        self._lock = threading.Lock()  # one request in flight at a time
        self._reply: dict[str, Any] | None = None
        self._replied = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._gone = False
        self._closing = False
        argv = [*launch_prefix, sys.executable, "-m", SERVER_MODULE, str(theirs.fileno())]
        try:
            self._proc = subprocess.Popen(
                argv,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._reader = threading.Thread(
            target=self._read, name="zeroplane-forkserver-reader", daemon=True
        )
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return not self._gone

    def fork(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        cwd: str | os.PathLike[str] | None = None,
        *,
        output: IO[Any] | None = None,
    ) -> ForkedProcess:
        """Fork a worker running ``command`` (see :func:`forkable`) with ``env``; its
        stdout and stderr on pipes (the process's ``stdout`` and ``stderr``), or both
        written to the open file ``output`` (then those are None)."""
        if not forkable(command):
            raise ValueError(f"the fork server cannot run {list(command)!r}")
        if output is None:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
        else:  # duplicates, closed below as the pipes' ends are
            out_r = err_r = -1
            out_w, err_w = os.dup(output.fileno()), os.dup(output.fileno())
        request = {"argv": list(command[1:]), "env": dict(env), "cwd": str(cwd or os.getcwd())}
        try:
            with self._lock:
                with self._replied:
                    self._reply = None
                if self._gone:
                    raise OSError("the fork server has exited")
                send(self._sock, request, [out_w, err_w])
                reply = self._await_reply()
                if "pid" not in reply:
                    raise OSError(f"the fork server could not fork: {reply.get('error')}")
                pid = int(reply["pid"])
                child = ForkedProcess(
                    pid,
                    None if out_r < 0 else os.fdopen(out_r, "rb"),
                    None if err_r < 0 else os.fdopen(err_r, "rb"),
                )
                out_r = err_r = -1
                with self._replied:
                    self._children[pid] = child
                    early = self._early_exits.pop(pid, None)
                if early is not None:
                    child._set_exit(early)
                return child
        finally:
            for fd in (out_w, err_w, out_r, err_r):
                if fd >= 0:
                    os.close(fd)

    def close(self) -> None:
        """Stop the server and kill what it forked that still runs."""
        self._closing = True
        with self._replied:
            running = [c for c in self._children.values() if c.returncode is None]
        for child in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self._proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._reader.join(timeout=5.0)
        self._sock.close()

    # -- internals -----------------------------------------------------------

    def _await_reply(self) -> dict[str, Any]:
        deadline = time.monotonic() + self._ready_timeout_s
        with self._replied:
            while self._reply is None:
                if self._gone:
                    raise OSError("the fork server exited before it answered")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OSError(
                        f"the fork server did not answer within {self._ready_timeout_s:.0f}s"
                    )
                self._replied.wait(min(left, 1.0))
            return self._reply

    def _read(self) -> None:
        try:
            while True:
                try:
                    message, _ = recv(self._sock)
                except OSError:
                    message = None
                if message is None:
                    break
                with self._replied:
                    if "exited" in message:
                        pid, code = int(message["exited"]), int(message["returncode"])
                        child = self._children.pop(pid, None)
                        if child is None:
                            self._early_exits[pid] = code  # before fork() saw its pid
                        else:
                            child._set_exit(code)
                    else:
                        self._reply = message
                        self._replied.notify_all()
        finally:
            with self._replied:
                self._gone = True
                orphans, self._children = list(self._children.values()), {}
                self._replied.notify_all()
            if orphans and not self._closing:
                logger.warning(
                    "the fork server (pid %d) exited; its %d worker(s) carry on, adopted "
                    "by the launcher",
                    self._proc.pid,
                    len(orphans),
                )
            for child in orphans:
                threading.Thread(
                    target=_adopt, args=(child,), name="zeroplane-adopted", daemon=True
                ).start()


def become_subreaper() -> bool:
    """Make this process the parent of its orphaned descendants (Linux): a fork
    server's children when it dies ([Note: workers outlive the fork server])."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1) == 0
    except (OSError, AttributeError):
        return False


def _adopt(child: ForkedProcess) -> None:
    """A child whose server is gone: once it is this process's (a subreaper's), wait
    for it and report its exit status; one that never becomes it (no subreaper) is
    reported lost when it has gone."""
    while True:
        try:
            pid, status = os.waitpid(child.pid, 0)
        except ChildProcessError:
            try:
                os.kill(child.pid, 0)
            except ProcessLookupError:
                child._set_exit(LOST_WITH_SERVER)  # gone before it was ours
                return
            except PermissionError:
                pass
            time.sleep(0.02)  # not reparented yet
            continue
        if pid == child.pid:
            child._set_exit(os.waitstatus_to_exitcode(status))
            return
