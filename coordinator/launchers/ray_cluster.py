"""Ray launcher: workers as Ray actors in a placement group, the coordinator beside the driver.

    spec = RaySpec(command=(sys.executable, "train.py"), nproc=4, gpus_per_worker=1)
    with RayJob(spec) as job:          # ray.init, coordinator, placement group, actors
        result = job.wait()

``zeroplane run --launcher ray [--address ADDR] --nproc N SCRIPT ARGS`` is this.

* One placement-group bundle per worker (``{"CPU": 1, "GPU": g}``), PACKed, so
  the job either gets all its resources or waits for them, and a worker's
  resources stay reserved while it restarts.
* Each actor runs one worker process of the command through
  :class:`coordinator.launchers.local.LocalJob` (nproc 1), so the process dies with its
  actor (PR_SET_PDEATHSIG) and its output reaches the driver through Ray's log
  forwarding, prefixed with the worker's name.
* The coordinator runs in the driver's process (an
  :class:`~coordinator.control.embedded.EmbeddedCoordinator` listening on all interfaces
  and advertised at the driver node's address); workers register with it as
  under ``zeroplane run`` and take their rank from its generations. Crash
  recovery is the same as with local processes: a worker process that fails is
  started again on its actor (up to ``max_restarts`` times; a dead actor is
  restarted by Ray first), registers as a new process, and the coordinator
  forms the next generation; survivors keep training or roll back as the
  worker runtime decides. ``scale_to`` adds workers (each in a placement
  group of its own) or stops the newest ones with SIGTERM, so they hand their
  shards over, within the job's [min_workers, max_workers]. A worker that
  leaves on a SIGTERM from outside (it hands over and exits 0 before training
  ended) is let go while at least ``min_workers`` members remain, and started
  again otherwise (a restart), as under ``zeroplane run``.
* Everything is torn down on exit or failure: actors killed, placement groups
  removed, the coordinator stopped, and a Ray instance this job started shut down.

Neither ray nor torch is imported until a job starts, so the CLI stays light.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from coordinator.core.settings import (
    ADDRESS_ENV,
    WORKER_ID_ENV,
    CoordinatorConfig,
    MembershipConfig,
    PlanConfig,
    ServerConfig,
)

__all__ = ["RayJob", "RayJobResult", "RaySpec"]

logger = logging.getLogger(__name__)

HOST_ENV = "ZEROPLANE_HOST"


@dataclass(frozen=True, kw_only=True)
class RaySpec:
    """What to launch on Ray.

    command: the argv each worker runs, e.g. ``(sys.executable, "train.py")``; it must
        exist at the same path on every node (as with torchrun).
    nproc: workers at start. min_workers / max_workers: the coordinator's bounds
        (default: exactly ``nproc``).
    address: a running Ray cluster (``ray.init(address=...)``); None starts a local one.
    gpus_per_worker / cpus_per_worker: each worker's bundle.
    stage: 0-3, ``"auto"`` (the planner's choice) or None (each worker's ZeroConfig).
    max_restarts: how often one worker may be started again after failing.
    grace_s: SIGTERM to SIGKILL, for workers that are stopped.
    env: extra environment for every worker.
    """

    command: tuple[str, ...]
    nproc: int = 1
    min_workers: int | None = None
    max_workers: int | None = None
    address: str | None = None
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0
    stage: int | Literal["auto"] | None = None
    max_restarts: int = 3
    lease_timeout_s: float = 10.0
    grace_s: float = 30.0
    ready_timeout_s: float = 300.0
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        command = tuple(self.command)
        if not command or not all(isinstance(a, str) for a in command):
            raise ValueError(f"RaySpec.command must be a non-empty argv of str, got {command!r}")
        object.__setattr__(self, "command", command)
        if not isinstance(self.nproc, int) or self.nproc < 1:
            raise ValueError(f"RaySpec.nproc must be an int >= 1, got {self.nproc!r}")
        lo = self.nproc if self.min_workers is None else self.min_workers
        hi = self.nproc if self.max_workers is None else self.max_workers
        if not 1 <= lo <= self.nproc <= hi:
            raise ValueError(
                f"RaySpec needs 1 <= min_workers ({lo}) <= nproc ({self.nproc}) <= "
                f"max_workers ({hi})"
            )
        object.__setattr__(self, "min_workers", lo)
        object.__setattr__(self, "max_workers", hi)
        if self.gpus_per_worker < 0:
            raise ValueError(f"RaySpec.gpus_per_worker must be >= 0, got {self.gpus_per_worker}")
        if self.cpus_per_worker <= 0:
            raise ValueError(f"RaySpec.cpus_per_worker must be > 0, got {self.cpus_per_worker}")
        if self.stage not in (None, "auto", 0, 1, 2, 3):
            raise ValueError(f"RaySpec.stage must be None, 'auto' or 0-3, got {self.stage!r}")
        for name in ("max_restarts", "lease_timeout_s", "grace_s", "ready_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"RaySpec.{name} must be >= 0, got {getattr(self, name)}")
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))


@dataclass(frozen=True, kw_only=True)
class RayJobResult:
    """returncode: 0 when every worker finished; else the failing worker's code (128 +
    signal when interrupted). restarts: how often each worker was started again."""

    returncode: int
    restarts: Mapping[str, int]
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class _WorkerActor:
    """One worker process on a Ray node (made a Ray actor class in ``RayJob``)."""

    def __init__(self, name: str, grace_s: float) -> None:
        self.name = name
        self.grace_s = grace_s
        self.job: Any = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def run(self, command: tuple[str, ...], env: Mapping[str, str], cwd: str) -> int:
        """Run the worker to its end; its exit code (128 + signal when killed)."""
        import sys

        from coordinator.launchers.local import LaunchSpec, LocalJob

        def line(_rank: int, stream: str, text: str) -> None:
            # The actor's own stdout/stderr: Ray forwards them to the driver.
            out = sys.stderr if stream == "stderr" else sys.stdout
            out.write(f"[{self.name}] {text}\n")
            out.flush()

        os.chdir(cwd)
        spec = LaunchSpec(command=command, nproc=1, env=dict(env), grace_s=self.grace_s)
        self.job = LocalJob(spec, on_line=line)
        self.job.start()
        return self.job.wait().returncode

    def pid(self) -> int | None:
        """The worker process's pid (for tests that crash it)."""
        return None if self.job is None or not self.job.pids else self.job.pids[0]

    def terminate(self) -> None:
        """SIGTERM the worker (it hands its shards over and leaves), SIGKILL after grace."""
        if self.job is not None:
            self.job.send_signal(signal.SIGTERM)


@dataclass
class _Worker:
    actor: Any
    placement_group: Any
    future: Any = None  # the running run() call; None once it has returned
    restarts: int = 0
    stopping: bool = False  # asked to leave: its exit is not a failure
    failed: bool = False  # to be started again once the coordinator has let it go


class RayJob:
    """A zeroplane job on Ray, from start to teardown (see the module docstring).

    A monitor thread watches the workers from ``start`` on: it starts failed ones
    again and settles the job's result, which ``wait`` returns.
    """

    def __init__(self, spec: RaySpec) -> None:
        self.spec = spec
        self._ray: Any = None
        self._started_ray = False
        self._coordinator: Any = None
        self._env: dict[str, str] = {}
        self._actor_cls: Any = None
        self._workers: dict[str, _Worker] = {}
        self._lock = threading.RLock()
        self._next = 0
        self._stop_signal: int | None = None
        self._result: RayJobResult | None = None
        self._done = threading.Event()
        self._monitor: threading.Thread | None = None

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> RayJob:
        import ray

        from coordinator.control.embedded import EmbeddedCoordinator

        self._ray = ray
        spec = self.spec
        try:
            if ray.is_initialized():
                logger.info("using the Ray instance this process already joined")
            else:
                kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
                if spec.address is None:
                    # Room for every worker's bundle on a local instance.
                    need = math.ceil(spec.max_workers * spec.cpus_per_worker)  # type: ignore[operator]
                    kwargs["num_cpus"] = max(need, os.cpu_count() or 1)
                else:
                    kwargs["address"] = spec.address
                ray.init(**kwargs)
                self._started_ray = True
            host = ray.util.get_node_ip_address()
            config = CoordinatorConfig(
                # All interfaces: actors on other nodes reach the driver's node address.
                server=ServerConfig(host="0.0.0.0", token=secrets.token_urlsafe(24)),
                membership=MembershipConfig(
                    min_workers=spec.min_workers,  # type: ignore[arg-type]
                    max_workers=spec.max_workers,  # type: ignore[arg-type]
                    join_window_s=0.0 if spec.min_workers == spec.max_workers else 2.0,
                    lease_timeout_s=spec.lease_timeout_s,
                    heartbeat_interval_s=spec.lease_timeout_s / 5,
                ),
                plan=PlanConfig(
                    stage=None if spec.stage in (None, "auto") else spec.stage,  # type: ignore[arg-type]
                    stage_from_workers=spec.stage is None,
                ),
            )
            self._coordinator = EmbeddedCoordinator(config)
            env = self._coordinator.start()
            port = self._coordinator.server.port
            env[ADDRESS_ENV] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            self._env = {**spec.env, **env}
            # Threaded (max_concurrency): terminate() and pid() answer while run() blocks.
            self._actor_cls = ray.remote(max_restarts=spec.max_restarts, max_concurrency=4)(
                _WorkerActor
            )
            self._add(spec.nproc)
            self._monitor = threading.Thread(
                target=self._watch, name="zeroplane-ray-monitor", daemon=True
            )
            self._monitor.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> RayJob:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Tear everything down; safe to call more than once."""
        self._done.set()
        if self._monitor is not None:
            self._monitor.join()
            self._monitor = None
        ray = self._ray
        if ray is not None and ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            with self._lock:
                workers = list(self._workers.values())
                self._workers.clear()
            for w in workers:
                with contextlib.suppress(Exception):
                    ray.kill(w.actor, no_restart=True)
            for pg in {id(w.placement_group): w.placement_group for w in workers}.values():
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)
        if self._coordinator is not None:
            self._coordinator.stop()
            self._coordinator = None
        if self._started_ray and ray is not None:
            ray.shutdown()
            self._started_ray = False

    # ---- workers ------------------------------------------------------------------------

    @property
    def workers(self) -> list[str]:
        with self._lock:
            return list(self._workers)

    @property
    def size(self) -> int:
        """Workers in the job: started and not asked to leave."""
        with self._lock:
            return sum(not w.stopping for w in self._workers.values())

    def _add(self, count: int) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = self.spec
        bundle = {"CPU": spec.cpus_per_worker}
        if spec.gpus_per_worker:
            bundle["GPU"] = spec.gpus_per_worker
        pg = placement_group([dict(bundle) for _ in range(count)], strategy="PACK")
        ready, _ = self._ray.wait([pg.ready()], timeout=spec.ready_timeout_s)
        if not ready:
            raise TimeoutError(
                f"Ray could not place {count} worker(s) of {bundle} within "
                f"{spec.ready_timeout_s:g}s: is the cluster big enough?"
            )
        for i in range(count):
            with self._lock:
                name = f"ray-{self._next}"
                self._next += 1
                actor = self._actor_cls.options(
                    num_cpus=spec.cpus_per_worker,
                    num_gpus=spec.gpus_per_worker,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=i
                    ),
                ).remote(name, spec.grace_s)
                self._workers[name] = _Worker(actor=actor, placement_group=pg)
                self._launch(name)

    def _launch(self, name: str) -> None:
        w = self._workers[name]
        host = self._ray.get(w.actor.node_ip.remote())
        env = {
            **self._env,
            WORKER_ID_ENV: name,
            HOST_ENV: host,
            # Ray gives a GPU actor its devices in CUDA_VISIBLE_DEVICES: device 0 is its own.
            "LOCAL_RANK": "0",
        }
        w.future = w.actor.run.remote(self.spec.command, env, os.getcwd())

    def scale_to(self, n: int) -> None:
        """Start workers, or stop the newest ones with SIGTERM, until ``n`` run."""
        lo, hi = self.spec.min_workers, self.spec.max_workers
        if not lo <= n <= hi:  # type: ignore[operator]
            raise ValueError(f"scale_to({n}): the job runs between {lo} and {hi} workers")
        with self._lock:
            running = [name for name, w in self._workers.items() if not w.stopping]
            if n > len(running):
                self._add(n - len(running))
            leaving = [self._workers[name] for name in reversed(running[n:])]
            for w in leaving:
                w.stopping = True
        for w in leaving:
            self._ray.get(w.actor.terminate.remote())

    def worker_pid(self, name: str) -> int | None:
        """The pid of worker ``name``'s process (None between restarts)."""
        with self._lock:
            actor = self._workers[name].actor
        return self._ray.get(actor.pid.remote())

    def status(self) -> Any:
        """The coordinator's view of the job (in process, no RPC)."""
        return self._coordinator.server.status()

    def last_reports(self) -> dict[str, Any]:
        """Every worker's last report, those that left included (in process, no RPC)."""
        return self._coordinator.server.last_reports()

    # ---- monitoring ---------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> RayJobResult:
        """Until every worker has finished, or one failed more than ``max_restarts`` times."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"Ray job still running after {timeout}s")
        if self._result is None:
            raise RuntimeError("the job was stopped before it finished")
        return self._result

    def send_signal(self, signum: int) -> None:
        """Stop the job (from a signal handler): ``wait`` returns 128 + signum."""
        self._stop_signal = signum

    def _watch(self) -> None:
        try:
            while not self._done.is_set():
                result = self._poll()
                if result is not None:
                    self._result = result
                    self._done.set()
        except Exception as exc:
            logger.exception("the Ray job's monitor failed")
            self._result = RayJobResult(returncode=1, restarts={}, message=f"monitor: {exc}")
            self._done.set()

    def _poll(self) -> RayJobResult | None:
        from ray.exceptions import RayActorError

        ray = self._ray
        with self._lock:
            pending = {w.future: n for n, w in self._workers.items() if w.future is not None}
            failed = [n for n, w in self._workers.items() if w.failed]
        if not pending and not failed:
            return self._settle(0, "all workers finished")
        if self._stop_signal is not None:
            return self._interrupted()
        if failed:
            self._restart(failed)
        if not pending:
            time.sleep(0.2)
            return None
        done, _ = ray.wait(list(pending), num_returns=1, timeout=0.2)
        for future in done:
            name = pending[future]
            with self._lock:
                w = self._workers[name]
                w.future = None
            try:
                code = ray.get(future)
                why = f"exited with {code}"
            except RayActorError as exc:
                code, why = 1, f"lost its actor ({type(exc).__name__})"
            if w.stopping:
                continue
            if code == 0:
                status = self.status()
                if status.over() or name not in status.departed():
                    continue  # it finished training (or never joined: a plain script)
                # it left on a SIGTERM from outside (a node drain, say): the others
                # go on while the members are enough, else it is replaced
                members = self._members(status)
                if members >= self.spec.min_workers:  # type: ignore[operator]
                    w.stopping = True
                    logger.info("worker %s left the job; %d member(s) go on", name, members)
                    continue
                code, why = (
                    1,
                    (
                        f"left the job without being asked (a SIGTERM from outside?) and "
                        f"{members} worker(s) remain, fewer than the {self.spec.min_workers} "
                        "the job needs"
                    ),
                )
            if w.restarts >= self.spec.max_restarts:
                return self._settle(
                    code, f"worker {name} {why}; no restarts left ({self.spec.max_restarts})"
                )
            w.restarts += 1
            w.failed = True
            logger.warning(
                "worker %s %s; it starts again (%d of %d) once the coordinator lets it go",
                name,
                why,
                w.restarts,
                self.spec.max_restarts,
            )
        return None

    def _members(self, status: Any) -> int:
        """Workers running, not asked to leave, and not gone from the coordinator."""
        with self._lock:
            running = {n for n, w in self._workers.items() if w.future is not None}
            running -= {n for n, w in self._workers.items() if w.stopping}
        return len(running - status.departed())

    def _restart(self, names: list[str]) -> None:
        # A failed worker starts again only when the coordinator no longer counts it as
        # a member (its lease ran out): survivors first recover among themselves, and
        # the new process then joins as any new worker does, as with local processes.
        members = {w.info.worker_id for w in self.status().workers if w.state == "member"}
        for name in names:
            if name not in members:
                with self._lock:
                    self._workers[name].failed = False
                    self._launch(name)

    def _interrupted(self) -> RayJobResult:
        with self._lock:
            workers = list(self._workers.values())
        for w in workers:
            w.stopping = True
            with contextlib.suppress(Exception):
                w.actor.terminate.remote()
        futures = [w.future for w in workers if w.future is not None]
        self._ray.wait(futures, num_returns=len(futures), timeout=self.spec.grace_s + 5)
        signum = self._stop_signal or signal.SIGTERM
        return self._settle(128 + signum, f"interrupted by {signal.Signals(signum).name}")

    def _settle(self, code: int, message: str) -> RayJobResult:
        with self._lock:
            restarts = {n: w.restarts for n, w in self._workers.items()}
        return RayJobResult(returncode=code, restarts=restarts, message=message)
