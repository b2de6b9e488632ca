"""Local launcher: N worker processes on this machine, torchrun-style.

A :class:`LocalJob` spawns ``nproc`` copies of one command with the environment
torchrun gives its workers (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), prefixes each line the
workers print with their rank, and owns their whole lifetime:

* every worker runs in its own session and process group, so stopping the job
  signals everything a worker started, not only the worker itself;
* on Linux each worker also gets ``PR_SET_PDEATHSIG``, so even a launcher killed
  with SIGKILL leaves no worker behind;
* the first worker to fail fails the job with its exit code; the others get
  SIGTERM, then SIGKILL after a grace period;
* :func:`forward_signals` passes Ctrl-C/SIGTERM on to the workers (they are in
  their own sessions, so the terminal's SIGINT does not reach them directly).

Services (the embedded coordinator, later) plug in through :class:`JobService`:
the job starts them before the workers, adds the environment they return to
every worker, and stops them after the last worker is gone.

Usage from Python::

    spec = LaunchSpec(command=(sys.executable, "train.py"), nproc=2)
    job = LocalJob(spec)
    with forward_signals(job), job:
        result = job.wait()
    sys.exit(result.returncode)
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import IO, Protocol

from coordinator.core.ports import free_port
from coordinator.core.settings import WORKER_ID_ENV
from coordinator.launchers.spawner import ForkedProcess, ForkServer, forkable

__all__ = [
    "STAGE_CHOICES",
    "JobResult",
    "JobService",
    "LaunchSpec",
    "LineHandler",
    "LocalJob",
    "find_free_port",
    "forward_signals",
    "prefix_lines",
]

logger = logging.getLogger(__name__)

STAGE_CHOICES = ("0", "1", "2", "3", "auto")

# (rank, stream name "stdout" | "stderr", line without its newline)
LineHandler = Callable[[int, str, str], None]

# Runs in each child before the real command: ask the kernel to SIGKILL the
# worker when the launcher dies, then exec the command. A trampoline instead of
# preexec_fn because preexec_fn is unsafe once the launcher has threads.
_PDEATHSIG_TRAMPOLINE = """\
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    os._exit(1)  # the launcher died before prctl took effect
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as e:
    sys.stderr.write(f"zeroplane: cannot run {sys.argv[2]!r}: {e}\\n")
    os._exit(127)
"""


class JobService(Protocol):
    """Something a job runs beside its workers (e.g. an embedded coordinator).

    A service that also has ``worker_exited(worker_id: str, how: str)`` is told of
    every worker process that exits, as the launcher sees it (an embedded
    coordinator then drops a crashed worker at once); one with
    ``job_stopping(why: str)`` is told once when the launcher starts stopping the
    job (interrupted, failed or abandoned), before the workers exit."""

    def start(self) -> Mapping[str, str]:
        """Start; return environment variables every worker should see."""
        ...

    def stop(self) -> None:
        """Stop; called once, after every worker has exited."""
        ...


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """What to launch.

    command: the argv each worker runs, e.g. ``(sys.executable, "train.py")``.
    nproc: number of local workers (the world size on one machine).
    stage: exported as ``ZEROPLANE_STAGE`` when set: "0"-"3" or "auto".
    env: extra environment for every worker, applied over the launcher's own.
    master_addr / master_port: the torch.distributed rendezvous; port 0 picks a
        free port at start.
    grace_s: how long workers get between SIGTERM (or a forwarded signal) and
        SIGKILL.
    fork_server: fork the workers from one process that imported torch once
        (coordinator/launchers/spawner.py [Note: fork server]) when ``command`` is this
        interpreter running a script or ``-m module``; Linux only.
    """

    command: tuple[str, ...]
    nproc: int = 1
    stage: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    grace_s: float = 5.0
    fork_server: bool = False

    def __post_init__(self) -> None:
        command = tuple(self.command)
        if not command or not all(isinstance(a, str) for a in command):
            raise ValueError(f"LaunchSpec.command must be a non-empty argv of str, got {command!r}")
        object.__setattr__(self, "command", command)
        if not isinstance(self.nproc, int) or self.nproc < 1:
            raise ValueError(f"LaunchSpec.nproc must be an int >= 1, got {self.nproc!r}")
        if self.stage is not None:
            stage = str(self.stage)
            if stage not in STAGE_CHOICES:
                raise ValueError(
                    f"LaunchSpec.stage must be one of {', '.join(STAGE_CHOICES)}, "
                    f"got {self.stage!r}"
                )
            object.__setattr__(self, "stage", stage)
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"LaunchSpec.master_port must be in 0..65535, got {self.master_port}")
        if not (math.isfinite(self.grace_s) and self.grace_s >= 0):
            raise ValueError(f"LaunchSpec.grace_s must be finite and >= 0, got {self.grace_s}")
        env = dict(self.env)
        bad = {k: v for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)}
        if bad:
            raise ValueError(f"LaunchSpec.env must map str to str, got {bad!r}")
        object.__setattr__(self, "env", MappingProxyType(env))


@dataclass(frozen=True, kw_only=True)
class JobResult:
    """How a job ended.

    returncode: 0 on success; the failing worker's exit code (128 + signal
        number if it was killed by a signal); 128 + signal number when the job
        was interrupted or stopped.
    returncodes: each rank's raw ``Popen.returncode`` (negative: killed by that
        signal).
    failed_rank: the first rank that failed, if one did.
    signal: the signal that interrupted or stopped the job, if any.
    """

    returncode: int
    returncodes: tuple[int, ...]
    failed_rank: int | None = None
    signal: int | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (what torchrun does too; racy by nature)."""
    return free_port(host)


# a line that starts with a timestamp of its own (a logging format with asctime)
_STAMPED = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d")


def timestamp(unix_s: float | None = None) -> str:
    """``2026-11-30 23:59:59,123``: logging's ``asctime``, as the coordinator's lines have."""
    now = time.time() if unix_s is None else unix_s
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now % 1 * 1000):03d}"


def prefix_lines(stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> LineHandler:
    """A line handler that writes ``[rankN] line`` to stdout/stderr as the worker did.

    Lines on stderr (the workers' logs) are stamped with the time they arrived,
    like the coordinator's log lines, unless they carry a timestamp already;
    stdout is the script's output and stays as it printed it.
    """

    def handle(rank: int, stream: str, line: str) -> None:
        if stream == "stderr":
            stamp = "" if _STAMPED.match(line) else f"{timestamp()} "
            out = stderr or sys.stderr
        else:
            stamp, out = "", stdout or sys.stdout
        out.write(f"{stamp}[rank{rank}] {line}\n")
        out.flush()

    return handle


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _exit_code(returncode: int) -> int:
    # The shell's convention for a process killed by a signal.
    return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {_signal_name(-returncode)}"
    return f"failed with exit code {returncode}"


def _base_env(spec: LaunchSpec) -> dict[str, str]:
    """The environment every worker of ``spec`` shares (before its rank's variables)."""
    env = dict(os.environ)
    # Lines should reach the launcher as they are printed, not at exit.
    env.setdefault("PYTHONUNBUFFERED", "1")
    # torchrun's default: N processes each with all cores oversubscribe the machine.
    if spec.nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    env.update(spec.env)
    return env


def shared_fork_server(spec: LaunchSpec) -> ForkServer | None:
    """One fork server for several jobs of ``spec``'s command, one after another (pass
    it to each :class:`LocalJob`; the caller closes it): torch is imported once for
    all of them. None where ``spec`` forks no workers."""
    if not (spec.fork_server and forkable(spec.command) and sys.platform.startswith("linux")):
        return None
    return ForkServer(_base_env(spec), launch_prefix=LocalJob._trampoline())


class LocalJob:
    """``nproc`` local workers of one command, from start to cleanup.

    ``start()`` spawns them; ``poll()`` checks on them without blocking and
    drives failure handling; ``wait()`` blocks until the job is over;
    ``stop()`` ends it (SIGTERM, then SIGKILL after ``grace_s``);
    ``send_signal()`` forwards a signal, and a second one escalates to SIGKILL.
    Used as a context manager it starts on entry and always stops on exit.

    Call ``start()`` from a thread that outlives the job (normally the main
    thread): on Linux the kernel kills the workers when that thread exits.
    """

    def __init__(
        self,
        spec: LaunchSpec,
        *,
        on_line: LineHandler | None = None,
        services: Sequence[JobService] = (),
        restarts: int | None = None,
        training_over: Callable[[], bool] | None = None,
        halted: Callable[[], str] | None = None,
        started: Callable[[int], None] | None = None,
        fork_server: ForkServer | None = None,
    ) -> None:
        self.spec = spec
        # a fork server the caller keeps for several jobs (``zeroplane demo``'s stages):
        # used while alive, never closed here; None: the job starts its own (spec.fork_server)
        self._shared_fork_server = fork_server
        # told how many workers a replacement started (the coordinator then admits them
        # as soon as they register)
        self._started = started or (lambda count: None)
        # why failed workers must not be replaced ("": they may be), e.g. the
        # coordinator stopped the job in a stall (coordinator/control/stalls.py)
        self._halted = halted or str
        # elastic jobs: how many failed workers may be replaced (None: fail fast)
        self._restarts_left = restarts
        # whether training has ended (a coordinator's word): a worker's exit 0 is then
        # the end of training, otherwise a leave (None: an exit 0 always says so)
        self._training_over = training_over or (lambda: True)
        self._on_line = on_line or prefix_lines()
        self._services = list(services)
        self._started_services: list[JobService] = []
        self._procs: list[subprocess.Popen[bytes] | ForkedProcess] = []
        self._fork_server: ForkServer | None = None
        self._readers: list[threading.Thread] = []
        self._output_lock = threading.Lock()
        self._master_port: int | None = None
        self._failed_rank: int | None = None
        self._signal: int | None = None
        self._kill_deadline: float | None = None
        self._killed = False
        self._stopped = False
        self._result: JobResult | None = None
        self._extra_env: dict[str, str] = {}
        self._retiring: set[int] = set()
        self._killed_workers: set[int] = set()  # kill_worker already ended them
        # workers whose exit is not the job's: left when asked, or replaced
        self._settled: set[int] = set()
        # why the job was stopped as failed (abandon())
        self._abandoned: str | None = None
        # whether the services were told the job is stopping
        self._stopping_told = False
        # workers whose exit the services were told of
        self._exits_told: set[int] = set()

    # -- lifecycle -----------------------------------------------------------

    @property
    def master_port(self) -> int | None:
        return self._master_port

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def result(self) -> JobResult | None:
        return self._result

    def start(self) -> LocalJob:
        if self._procs or self._result is not None:
            raise RuntimeError("LocalJob.start() called twice")
        spec = self.spec
        self._master_port = spec.master_port or find_free_port(spec.master_addr)
        try:
            extra_env: dict[str, str] = {}
            for service in self._services:
                extra_env.update(service.start())
                self._started_services.append(service)
            self._extra_env = extra_env
            if self._shared_fork_server is not None and self._shared_fork_server.alive:
                self._fork_server = self._shared_fork_server
            elif spec.fork_server and forkable(spec.command) and sys.platform.startswith("linux"):
                self._fork_server = self._new_fork_server()
            for rank in range(spec.nproc):
                self._spawn(rank, self._worker_env(rank, extra_env))
        except BaseException:
            self._kill_all(signal.SIGKILL)
            self._reap()
            self._finish_cleanup()
            raise
        logger.debug(
            "started %d worker(s), pids %s, master %s:%d",
            spec.nproc,
            self.pids,
            spec.master_addr,
            self._master_port,
        )
        return self

    def poll(self) -> JobResult | None:
        """Check on the workers; the job's result once every worker is gone, else None."""
        if self._result is not None:
            return self._result
        if not self._procs:
            raise RuntimeError("LocalJob.poll() before start()")
        codes = [p.poll() for p in self._procs]
        self._tell_stopping()
        self._tell_exits(codes)
        if self._failed_rank is None and self._signal is None and self._abandoned is None:
            failed = [
                r for r, c in enumerate(codes) if c not in (None, 0) and r not in self._settled
            ]
            # a worker exited 0 outside a retirement: training ended (nothing to replace),
            # unless the coordinator says it goes on (a leave the caller has not yet
            # settled: a worker that handed over on a SIGTERM from outside)
            finished = any(
                c == 0 and i not in self._retiring and i not in self._settled
                for i, c in enumerate(codes)
            ) and (not failed or self._training_over())
            for r in failed:
                alive = any(c is None for i, c in enumerate(codes) if i != r)
                if not self._settle(r, codes[r] or 0, going=alive or not finished):
                    self._failed_rank = r
                    logger.debug("rank %d %s", r, _describe(codes[r] or 0))
                    self._tell_stopping()
                    self._begin_shutdown(signal.SIGTERM)
                    break
            codes += [p.poll() for p in self._procs[len(codes) :]]  # replacements started
        if all(c is not None for c in codes):
            return self._finish([c for c in codes if c is not None])
        if (
            self._kill_deadline is not None
            and not self._killed
            and time.monotonic() >= self._kill_deadline
        ):
            logger.warning(
                "workers still running %.1fs after the signal; sending SIGKILL", self.spec.grace_s
            )
            self._kill_all(signal.SIGKILL)
        return None

    def _tell_stopping(self) -> None:
        """Tell the services, once, that the job is being stopped (from poll(), not
        from the signal handler that may have started the stop)."""
        if not self.stopping or self._stopping_told:
            return
        self._stopping_told = True
        why = self._abandoned or (
            f"the launcher got {_signal_name(self._signal)}"
            if self._signal is not None
            else "a worker failed"
        )
        for service in self._started_services:
            told = getattr(service, "job_stopping", None)
            if told is not None:
                try:
                    told(why)
                except Exception as exc:  # the workers are stopped by signal anyway
                    logger.debug("could not tell that the job stops: %s", exc)

    def _tell_exits(self, codes: list[int | None]) -> None:
        """Tell the services of each worker process that exited since the last poll."""
        for index, code in enumerate(codes):
            if code is None or index in self._exits_told:
                continue
            self._exits_told.add(index)
            for service in self._started_services:
                told = getattr(service, "worker_exited", None)
                if told is None:
                    continue
                try:
                    how = _describe(code) if code < 0 else f"exited with code {code}"
                    told(self.worker_id(index), how)
                except Exception as exc:  # the coordinator finds out by itself anyway
                    logger.debug("could not tell of worker %d's exit: %s", index, exc)

    def _settle(self, index: int, code: int, *, going: bool) -> bool:
        """Whether worker ``index``'s failure leaves the job running: a worker asked
        to leave that died of that SIGTERM (before its handler was installed), or of
        anything else while others train, has left; in an elastic job that has not
        finished (``going``: others still train, or every worker failed before any
        finished, when the replacements
        start again from the script's checkpoint, as torchrun's restarts do), a
        failed worker is replaced while restarts last."""
        if index in self._retiring and code == -signal.SIGTERM:
            self._settled.add(index)
            logger.info("worker %d stopped before it could hand over: it has left", index)
            return True
        if index in self._retiring and going:
            # it was leaving anyway: the others recover without it, nobody replaces it
            self._settled.add(index)
            logger.warning("worker %d %s while it was retired: it has left", index, _describe(code))
            return True
        if not going:
            return False
        if why := self._halted():
            logger.error("worker %d %s; not replaced: %s", index, _describe(code), why)
            return False
        return self.replace(index, _describe(code))

    def replace(self, index: int, what: str) -> bool:
        """Start a worker in place of worker ``index``, which ``what`` (e.g. "was
        killed by SIGKILL"), if the job is elastic and has restarts left."""
        if not self._restarts_left:
            if self._restarts_left == 0:
                logger.error("worker %d %s; no restarts left", index, what)
            return False
        self._restarts_left -= 1
        self._settled.add(index)
        new = self.add_worker()
        self._started(1)
        logger.warning(
            "worker %d %s; started worker %d in its place (%d restart(s) left)",
            index,
            what,
            new,
            self._restarts_left,
        )
        return True

    @property
    def stopping(self) -> bool:
        """The job is being stopped: interrupted, failed or abandoned."""
        return self._signal is not None or self._failed_rank is not None or bool(self._abandoned)

    def left_unasked(self) -> list[int]:
        """Workers that exited 0 without being asked to leave (not retired), in the
        order they were started: they finished training, or left on a SIGTERM sent
        from outside the launcher."""
        return [
            i
            for i, p in enumerate(self._procs)
            if p.poll() == 0 and i not in self._retiring and i not in self._settled
        ]

    def settled(self, index: int) -> bool:
        """Whether worker ``index``'s exit is dealt with already (replaced, settled)."""
        return index in self._settled or index in self._retiring

    def settle(self, index: int) -> None:
        """Take worker ``index``'s exit as dealt with (see :meth:`left_unasked`)."""
        self._settled.add(index)

    def abandon(self, message: str) -> None:
        """Stop the job as failed, for ``message``: SIGTERM, then SIGKILL after grace."""
        if self._result is not None or self._abandoned is not None:
            return
        self._abandoned = message
        self._tell_stopping()
        self._begin_shutdown(signal.SIGTERM)

    def wait(self, timeout: float | None = None) -> JobResult:
        """Block until the job is over; TimeoutError if ``timeout`` passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (result := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job still running after {timeout}s")
            time.sleep(0.05)
        return result

    @property
    def running(self) -> list[int]:
        """Indices of the workers still running and not asked to leave."""
        return [
            i for i, p in enumerate(self._procs) if p.poll() is None and i not in self._retiring
        ]

    def worker_id(self, index: int) -> str:
        """Worker ``index``'s name at the coordinator: ``$ZEROPLANE_WORKER_ID`` when
        the job's environment sets it (one worker per pod), else HOST-INDEX."""
        return self.spec.env.get(WORKER_ID_ENV) or os.environ.get(
            WORKER_ID_ENV, f"{socket.gethostname()}-{index}"
        )

    def add_worker(self) -> int:
        """Start one more worker (an elastic scale-up); returns its index.

        It gets the same environment as the others, the coordinator's address
        included, registers, and joins at the coordinator's next generation.
        """
        if self._result is not None or not self._procs:
            raise RuntimeError("add_worker() needs a running job")
        index = len(self._procs)
        self._spawn(index, self._worker_env(index, self._extra_env))
        logger.info("started worker %d (pid %d)", index, self._procs[index].pid)
        return index

    def retire_worker(self, index: int | None = None) -> int:
        """Ask one worker (default: the newest running) to leave with SIGTERM.

        A zeroplane worker hands its shards to the others and exits 0; the job
        goes on. Returns the worker's index.
        """
        running = self.running
        if not running:
            raise RuntimeError("no running worker to retire")
        if index is None:
            index = running[-1]
        elif index not in running:
            raise ValueError(f"worker {index} is not running")
        self._retiring.add(index)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self._procs[index].pid, signal.SIGTERM)
        logger.info("asked worker %d (pid %d) to leave", index, self._procs[index].pid)
        return index

    def kill_worker(self, index: int, why: str) -> None:
        """End worker ``index`` and everything it started at once (SIGKILL: a stopped
        or hung process too), saying ``why``; its exit then counts as a failure."""
        if index not in self.running or index in self._killed_workers:
            return
        self._killed_workers.add(index)
        logger.warning("killing worker %d (pid %d): %s", index, self._procs[index].pid, why)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._procs[index].pid, signal.SIGKILL)

    def send_signal(self, signum: int) -> None:
        """Forward ``signum`` to every worker; a second call sends SIGKILL.

        Safe to call from a signal handler (no locks taken).
        """
        if self._result is not None:
            return
        if self._signal is not None or self._failed_rank is not None or self._abandoned:
            self._kill_all(signal.SIGKILL)
            return
        self._signal = signum
        self._begin_shutdown(signum)

    def stop(self) -> JobResult | None:
        """End the job (SIGTERM, then SIGKILL after grace) and clean up; idempotent."""
        if self._result is not None:
            return self._result
        if not self._procs:
            self._finish_cleanup()
            return None
        if self.poll() is None:
            self._stopped = self._signal is None and self._failed_rank is None
            self.send_signal(signal.SIGTERM)
        return self.wait()

    def __enter__(self) -> LocalJob:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals -----------------------------------------------------------

    def _worker_env(self, rank: int, extra: Mapping[str, str]) -> dict[str, str]:
        spec = self.spec
        env = _base_env(spec)
        env.update(extra)
        n = str(spec.nproc)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            ROLE_RANK=str(rank),
            WORLD_SIZE=n,
            LOCAL_WORLD_SIZE=n,
            ROLE_WORLD_SIZE=n,
            GROUP_WORLD_SIZE="1",
            MASTER_ADDR=spec.master_addr,
            MASTER_PORT=str(self._master_port),
        )
        if spec.stage is not None:
            env["ZEROPLANE_STAGE"] = spec.stage
        env[WORKER_ID_ENV] = self.worker_id(rank)
        return env

    @staticmethod
    def _trampoline() -> list[str]:
        """What a child runs under so it dies with the launcher (Linux)."""
        if not sys.platform.startswith("linux"):
            return []
        return [sys.executable, "-I", "-S", "-c", _PDEATHSIG_TRAMPOLINE, str(os.getpid())]

    def _new_fork_server(self) -> ForkServer:
        return ForkServer(self._worker_env(0, self._extra_env), launch_prefix=self._trampoline())

    def _spawn(self, rank: int, env: dict[str, str]) -> None:
        proc: subprocess.Popen[bytes] | ForkedProcess | None = None
        server = self._fork_server
        if server is not None and not server.alive:
            # it died (its workers carry on, spawner.py [Note: workers outlive the fork
            # server]): the next workers come from a new one
            logger.warning("the fork server is gone; starting a new one for worker %d", rank)
            server.close()
            try:
                server = self._fork_server = self._new_fork_server()
            except OSError as e:
                logger.warning("no new fork server (%s): workers start as fresh processes", e)
                server = self._fork_server = None
        if server is not None and server.alive:
            try:
                proc = server.fork(self.spec.command, env)
            except OSError as e:
                logger.warning("%s; starting worker %d as a fresh process", e, rank)
        if proc is None:
            proc = subprocess.Popen(
                [*self._trampoline(), *self.spec.command],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        self._procs.append(proc)
        if self._signal is not None:
            # A signal arrived while the job was starting: this worker gets it too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, self._signal)
        for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            reader = threading.Thread(
                target=self._pump,
                args=(rank, name, pipe),
                name=f"zeroplane-rank{rank}-{name}",
                daemon=True,
            )
            reader.start()
            self._readers.append(reader)

    def _pump(self, rank: int, stream: str, pipe: IO[bytes] | None) -> None:
        if pipe is None:
            return
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                with self._output_lock:
                    try:
                        self._on_line(rank, stream, line)
                    except Exception:
                        logger.exception("output handler failed on a line from rank %d", rank)

    def _begin_shutdown(self, signum: int) -> None:
        self._kill_deadline = time.monotonic() + self.spec.grace_s
        self._kill_all(signum)

    def _kill_all(self, signum: int) -> None:
        if signum == signal.SIGKILL:
            self._killed = True
        for proc in self._procs:
            # The group outlives its leader while anything the worker started is alive.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signum)

    def _reap(self) -> None:
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(self.spec.grace_s, 1.0))

    def _finish(self, codes: list[int]) -> JobResult:
        failed = [i for i, c in enumerate(codes) if c != 0 and i not in self._settled]
        stopping = self._signal is not None or self._abandoned is not None
        if self._failed_rank is None and not stopping and failed:
            self._failed_rank = failed[0]  # failed as the job was finishing
        if self._abandoned is not None and self._failed_rank is None and self._signal is None:
            result = JobResult(returncode=1, returncodes=tuple(codes), message=self._abandoned)
        elif self._failed_rank is not None:
            rank = self._failed_rank
            code = codes[rank]
            others = len(codes) - 1
            message = f"rank {rank} {_describe(code)}"
            if others:
                message += f"; stopped the other {others} worker(s)"
            result = JobResult(
                returncode=_exit_code(code),
                returncodes=tuple(codes),
                failed_rank=rank,
                message=message,
            )
        elif self._signal is not None:
            result = JobResult(
                returncode=128 + self._signal,
                returncodes=tuple(codes),
                signal=self._signal,
                message=(
                    "stopped by the launcher"
                    if self._stopped
                    else f"interrupted by {_signal_name(self._signal)}"
                ),
            )
        else:
            result = JobResult(
                returncode=0, returncodes=tuple(codes), message="all workers exited 0"
            )
        self._result = result
        self._finish_cleanup()
        logger.debug("job finished: %s", result.message)
        return result

    def _finish_cleanup(self) -> None:
        # Leftovers a worker started and did not wait for die with the job.
        self._kill_all(signal.SIGKILL)
        if self._fork_server is not None and self._fork_server is not self._shared_fork_server:
            self._fork_server.close()
        self._fork_server = None
        for reader in self._readers:
            reader.join(timeout=1.0)
        while self._started_services:
            service = self._started_services.pop()
            try:
                service.stop()
            except Exception:
                logger.exception("stopping service %r failed", service)


@contextlib.contextmanager
def forward_signals(
    job: LocalJob,
    signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP),
) -> Iterator[LocalJob]:
    """Forward these signals to the job's workers while the block runs.

    Only the main thread can install signal handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield job
        return
    previous = {s: signal.getsignal(s) for s in signals}

    def handler(signum: int, frame: object) -> None:
        job.send_signal(signum)

    try:
        for s in signals:
            signal.signal(s, handler)
        yield job
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
