"""``zeroplane run``: launch N local workers of a Python script, torchrun-style."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from coordinator.commands.args import (
    activation_shape,
    add_alias,
    add_shape_args,
    add_stall_flags,
    non_negative,
    seconds,
    stall_settings,
)
from coordinator.commands.keeping import (
    departed,
    expect_more,
    group_size,
    kill_dropped,
    member_groups,
    over,
    placeable,
    stopped_in_stall,
    stopped_unfinished,
    wait_scaling,
)
from coordinator.core.meshplan import (
    CP_ENV,
    CP_KIND_ENV,
    EP_ENV,
    MESH_ENV,
    PP_ENV,
    TP_ENV,
    MeshChangeRefused,
    MeshShape,
    check_resize,
)
from coordinator.core.messages import StatusReport, WorkerReport
from coordinator.core.settings import (
    ADDRESS_ENV,
    HEALTH_PORT_ENV,
    METRICS_HOST_ENV,
    METRICS_PORT_ENV,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    load_token,
)
from coordinator.launchers.health import serve_health
from coordinator.launchers.local import (
    STAGE_CHOICES,
    LaunchSpec,
    LocalJob,
    forward_signals,
)
from coordinator.launchers.progress import ProgressDisplay, ProgressTracker, follow
from coordinator.launchers.summary import JobSummary

__all__ = ["add_parser", "run"]

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "run",
        help="run a training script on N local workers",
        description=(
            "Spawn N local workers of `python SCRIPT ARGS` beside an embedded coordinator "
            "(ZEROPLANE_COORDINATOR, ZEROPLANE_TOKEN: worker.initialize registers and is "
            "given its rank), with torchrun's environment too (RANK, WORLD_SIZE, LOCAL_RANK, "
            "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) for scripts that form their own group. "
            "Each output line is prefixed with its rank. If a worker fails, the others "
            "are stopped and the job exits with that worker's code. Options before SCRIPT "
            "are zeroplane's; everything after SCRIPT goes to the script unchanged, so in "
            "`zeroplane run --stage 2 train.py --stage 3` zeroplane's stage is 2 and the "
            "script is given --stage 3."
        ),
    )
    parser.add_argument(
        "--nproc", type=int, default=1, metavar="N", help="number of local workers (default 1)"
    )
    parser.add_argument(
        "--stage",
        choices=STAGE_CHOICES,
        default=None,
        help="ZeRO stage for every worker, over the script's own ZeroConfig(stage=...) "
        "(a worker whose script asks for another says so); auto: the coordinator's "
        "planner picks the lowest that fits. Default: the script's own stage. Only "
        "before SCRIPT: a --stage after it is the script's own argument",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="T",
        help="tensor-parallel degree: $ZEROPLANE_TP for worker.mesh.ParallelConfig.from_env "
        "(default 1); --nproc must be a multiple of T*PP. A mesh job is elastic by whole "
        "groups of T*PP workers (--min-workers/--max-workers)",
    )
    parser.add_argument(
        "--pp",
        type=int,
        default=1,
        metavar="P",
        help="pipeline stages: $ZEROPLANE_PP (default 1)",
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        metavar="E",
        help="expert-parallel degree: $ZEROPLANE_EP for ParallelConfig.from_env (default 1): "
        "each mixture-of-experts layer's experts split over E ranks, tokens exchanged by "
        "all-to-all (docs/guides/moe.md); --nproc, --min-workers and --max-workers must be "
        "multiples of E: an elastic job grows and shrinks by whole ep groups of E workers; "
        "with --tp T and --pp P, whole P x T x E blocks at --nproc only",
    )
    parser.add_argument(
        "--cp",
        type=int,
        default=1,
        metavar="C",
        help="context-parallel degree: $ZEROPLANE_CP for ParallelConfig.from_env (default 1): "
        "each sequence split over C ranks, which share one batch (docs/guides/"
        "long-sequences.md); --nproc, --min-workers and --max-workers must be multiples "
        "of C: an elastic job grows and shrinks by whole cp groups of C workers",
    )
    parser.add_argument(
        "--cp-kind",
        choices=("ulysses", "ring"),
        default="ulysses",
        help="with --cp: 'ulysses' (all-to-all, heads divisible by C) or 'ring' (key/value "
        "blocks round the ring, any heads): $ZEROPLANE_CP_KIND (default ulysses)",
    )
    parser.add_argument(
        "--mesh",
        choices=("auto",),
        help="auto: the coordinator chooses tp and pp (and, with --stage auto or none "
        "asked, the stage) from the model and the workers' device memory, and every "
        "worker builds that mesh ($ZEROPLANE_MESH); not with --tp/--pp",
    )
    add_shape_args(
        parser.add_argument_group(
            "activations",
            "the model's shape, from which --stage auto and --mesh auto count activations "
            "per rank (the embedded coordinator's plan; default: none counted)",
        )
    )
    add_stall_flags(
        parser.add_argument_group(
            "stalls", "when the embedded coordinator names a stall, and when it acts on one"
        )
    )
    parser.add_argument(
        "--grace",
        type=seconds,
        default=5.0,
        metavar="SECONDS",
        help="time workers get to exit after SIGTERM before SIGKILL (default 5)",
    )
    min_workers = parser.add_argument(
        "--min-workers",
        type=int,
        default=None,
        metavar="A",
        help="elastic: the job keeps running with at least A workers (default: --nproc)",
    )
    add_alias(parser, "--min-nproc", to=min_workers)
    max_workers = parser.add_argument(
        "--max-workers",
        type=int,
        default=None,
        metavar="B",
        help="elastic: at most B workers (default: --nproc). While the job runs, "
        "`kill -USR1 PID` starts one more local worker and `kill -USR2 PID` asks the "
        "newest to hand over its shards and leave (PID: this launcher, printed at start); "
        "with --tp T/--pp PP, T*PP workers at a time (a whole group)",
    )
    add_alias(parser, "--max-nproc", to=max_workers)
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="N",
        help="elastic (--min-workers < --max-workers): a worker that dies is a membership "
        "event, the others carry on, and a replacement is started, up to N times in "
        "all; then the job fails with the worker's exit code (default 3). A job that "
        "is not elastic fails as soon as a worker fails. --launcher ray: how often each "
        "worker is started again on its actor, elastic or not",
    )
    parser.add_argument(
        "--no-fork-server",
        action="store_true",
        help="start every worker as a fresh Python process. By default the workers "
        "of a Python script are forked from one process that imported torch once, so "
        "starting, replacing or adding a worker does not import torch again",
    )
    parser.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        default=None,
        help="join this coordinator instead of starting an embedded one "
        "(its token from --token-file, $ZEROPLANE_TOKEN_FILE or $ZEROPLANE_TOKEN)",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="with --coordinator: the bearer token the workers present (default: "
        f"${TOKEN_FILE_ENV}, else ${TOKEN_ENV}); the embedded coordinator makes its own",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="the embedded coordinator serves TLS with a certificate made for this run "
        "(self-signed, for 127.0.0.1), which its workers trust; with --coordinator, the "
        "workers read $ZEROPLANE_TLS_ROOT_CERT as always",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=0,
        metavar="PORT",
        help="the embedded coordinator's status page, /metrics and Prometheus service "
        "discovery (/sd) port; the workers then serve /metrics too (default 0: a free port)",
    )
    parser.add_argument(
        "--no-http",
        action="store_true",
        help="no status page and no metrics endpoints (coordinator and workers)",
    )
    parser.add_argument(
        "--no-host-agent",
        action="store_true",
        help="each worker heartbeats the coordinator itself, instead of this launcher "
        "sending one heartbeat for all of its workers",
    )
    parser.add_argument(
        "--job-name",
        default="zeroplane",
        metavar="NAME",
        help="the job label Prometheus gives the workers' series (default zeroplane)",
    )
    parser.add_argument(
        "--launcher",
        choices=("local", "ray"),
        default="local",
        help="local processes (default), or Ray actors in a placement group "
        "(pip install 'zeroplane[ray]')",
    )
    parser.add_argument(
        "--address",
        metavar="RAY_ADDRESS",
        help="with --launcher ray: the Ray cluster to join (default: start a local one)",
    )
    parser.add_argument(
        "--gpus-per-worker",
        type=non_negative,
        default=0.0,
        metavar="G",
        help="with --launcher ray: GPUs in each worker's placement-group bundle (default 0)",
    )
    parser.add_argument(
        "--progress",
        choices=("auto", "live", "plain", "off"),
        default="auto",
        help="the job's progress line (step/total, loss, tokens/s, step time, ETA, world "
        "size, generation): live on a terminal, a plain line every --progress-interval "
        "seconds otherwise (auto, the default), or off",
    )
    parser.add_argument(
        "--progress-interval",
        type=seconds,
        default=10.0,
        metavar="SECONDS",
        help="seconds between plain progress lines (default 10)",
    )
    parser.add_argument(
        "--hold",
        action="store_true",
        help="once every worker has exited 0, stay up until SIGTERM (a Kubernetes "
        "StatefulSet restarts a container that exits, even with 0)",
    )
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="SCRIPT is a module name, run as `python -m SCRIPT`",
    )
    parser.add_argument("script", metavar="SCRIPT", help="the training script each worker runs")
    parser.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="the script's own arguments: everything after SCRIPT, passed unchanged",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    command = (sys.executable, *(("-m",) if args.module else ()), args.script, *args.script_args)
    try:
        spec = LaunchSpec(
            command=command,
            nproc=args.nproc,
            stage=args.stage,
            grace_s=args.grace,
            env=_mesh_env(args),
            fork_server=not args.no_fork_server,
        )
    except ValueError as exc:
        print(f"zeroplane run: {exc}", file=sys.stderr)
        return 2
    if args.token_file is not None:
        if not args.coordinator:
            print(
                "zeroplane run: --token-file is the token for --coordinator; the embedded "
                "coordinator makes its own",
                file=sys.stderr,
            )
            return 2
        try:
            load_token(args.token_file)  # readable and not empty, before any worker starts
        except ValueError as exc:
            print(f"zeroplane run: {exc}", file=sys.stderr)
            return 2
    if args.launcher == "ray":
        return _run_on_ray(args, command)
    if args.coordinator and args.tls:
        print(
            "zeroplane run: --tls makes the embedded coordinator's certificate; for "
            "--coordinator, set $ZEROPLANE_TLS_ROOT_CERT to the roots that sign its own",
            file=sys.stderr,
        )
        return 2
    if args.coordinator and args.seq is not None:
        print(
            "zeroplane run: --seq and the model's shape are the embedded coordinator's plan; "
            "for --coordinator, give them to zeroplane coordinator",
            file=sys.stderr,
        )
        return 2
    if args.coordinator:
        env = {**spec.env, ADDRESS_ENV: args.coordinator}
        if args.token_file is not None:
            # the workers read the file themselves (load_token): the token stays out of env
            env[TOKEN_FILE_ENV] = os.path.abspath(args.token_file)
        # the coordinator lists each worker's /metrics endpoint for Prometheus; a port
        # the environment names already wins (a Kubernetes pod's named metrics port).
        # Bound to what must reach it: loopback beside a coordinator on loopback
        if not args.no_http and METRICS_PORT_ENV not in os.environ:
            host = "127.0.0.1" if _on_loopback(args.coordinator) else "0.0.0.0"
            env |= {METRICS_PORT_ENV: "0", METRICS_HOST_ENV: host}
        spec = dataclasses.replace(spec, env=env)
        services = ()
    else:
        # imported here: the gRPC server is only needed when this process hosts it
        from coordinator.control.embedded import EmbeddedCoordinator

        try:
            embedded = EmbeddedCoordinator.for_local_job(
                args.nproc,
                args.stage if args.stage in (None, "auto") else int(args.stage),
                min_workers=args.min_workers,
                max_workers=args.max_workers,
                http_port=None if args.no_http else args.http_port,
                job_name=args.job_name,
                tls=args.tls,
                activations=activation_shape(args),
                stalls=stall_settings(args),
            )
        except ValueError as exc:
            print(f"zeroplane run: {exc}", file=sys.stderr)
            return 2
        services = (embedded,)
    if args.max_restarts < 0:
        print("zeroplane run: --max-restarts must be >= 0", file=sys.stderr)
        return 2
    low = args.nproc if args.min_workers is None else args.min_workers
    high = args.nproc if args.max_workers is None else args.max_workers
    agents = ()
    if not args.no_host_agent:
        from coordinator.control.client import ClientConfig
        from coordinator.control.host_agent import HostAgent

        if args.coordinator:
            token_file = spec.env.get(TOKEN_FILE_ENV)
            agents = (
                HostAgent.for_coordinator(
                    lambda: ClientConfig.from_env(
                        address=args.coordinator, token=load_token(token_file)
                    ),
                    max_ranks=high,
                ),
            )
        else:
            agents = (HostAgent.for_coordinator(embedded.client_config, max_ranks=high),)
    job = LocalJob(
        spec,
        services=(*services, *agents),
        restarts=args.max_restarts if low < high else None,
        training_over=lambda: over(services),
        halted=lambda: stopped_in_stall(services),
        started=lambda count: expect_more(services, count),
    )
    started = time.monotonic()
    page = None
    health = serve_health(os.environ.get(HEALTH_PORT_ENV))
    with health as alive, forward_signals(job), job:
        for service in services:
            http = service.server.http_address if service.server else None
            if http:
                page = f"http://{http}/"
                print(
                    f"zeroplane run: status page {page} (metrics /metrics, Prometheus http_sd /sd)",
                    file=sys.stderr,
                    flush=True,
                )
        with _progress(args) as display, _follow(display, lambda: _live_status(services)) as tick:
            result = wait_scaling(
                job,
                args,
                lambda: departed(services),
                over=lambda: over(services),
                placeable=lambda workers: placeable(services, workers),
                groups=lambda: member_groups(services, group_size(args)),
                tick=lambda: (kill_dropped(job, services), tick(), alive.beat()),
                expect=lambda count: expect_more(services, count),
            )
        # read before the embedded coordinator stops with the job
        status, reports = _final_status(services)
    if result.ok and status is not None and stopped_unfinished(status):
        result = dataclasses.replace(
            result,
            returncode=1,
            message="every worker left before training finished (asked to leave from "
            "outside the launcher, with nobody to hand the job's state to)",
        )
    if not result.ok:
        print(f"zeroplane run: {result.message}", file=sys.stderr)
    summary = JobSummary(
        ok=result.ok,
        outcome=result.message,
        wall_s=time.monotonic() - started,
        status=status,
        reports=reports,
        status_page=page,
    )
    print(summary, file=sys.stderr, flush=True)
    if result.ok and args.hold:
        _hold()
    return result.returncode


def _progress(args: argparse.Namespace) -> ProgressDisplay | contextlib.nullcontext[None]:
    if args.progress == "off":
        return contextlib.nullcontext()
    interactive = {"live": True, "plain": False}.get(args.progress)
    return ProgressDisplay(interactive=interactive, interval_s=args.progress_interval)


@contextlib.contextmanager
def _follow(
    display: ProgressDisplay | None,
    read: Callable[[], tuple[StatusReport | None, dict[str, WorkerReport] | None]],
) -> Iterator[Callable[[], None]]:
    """A tick for the wait loop that shows the job's progress (a no-op without a display)."""
    if display is None:
        yield lambda: None
        return
    # membership events reach the terminal as the coordinator's log lines already
    events = not logging.getLogger("coordinator.control.membership").isEnabledFor(logging.INFO)
    with follow(display, ProgressTracker("job"), read, events=events) as tick:
        yield tick


def _live_status(
    services: Sequence[object],
) -> tuple[StatusReport | None, dict[str, WorkerReport] | None]:
    """The embedded coordinator's view now (in process, no RPC); nothing otherwise."""
    for service in services:
        final = getattr(service, "final", None)  # the job is over: its last view
        if final is not None:
            return final
        server = getattr(service, "server", None)
        if server is not None:
            return server.status(), server.last_reports()
    return None, None


def _mesh_env(args: argparse.Namespace) -> dict[str, str]:
    """``$ZEROPLANE_TP``/``$ZEROPLANE_PP`` for a mesh job, checked against the worker
    counts: every count the job may run at must be whole model-parallel groups; and
    ``$ZEROPLANE_EP`` for an expert-parallel one, ``$ZEROPLANE_CP`` (and its kind) for a
    context-parallel one, whose groups are blocks within data parallelism."""
    ep, cp = getattr(args, "ep", 1), getattr(args, "cp", 1)
    if ep == 1 and cp == 1:
        return _tp_pp_env(args)
    for flag, n in (("--ep", ep), ("--cp", cp)):
        if n < 1:
            raise ValueError(f"{flag} must be >= 1, got {n}")
    # the job's block: an ep and a cp group are consecutive ranks both, so with both
    # the block is their least common multiple (worker/elastic/blocks.py)
    asked = [(d, n) for d, n in (("ep", ep), ("cp", cp)) if n > 1]
    kind = " and ".join(f"--{d}" for d, _ in asked)
    size = math.lcm(ep, cp)
    what = " x ".join(d for d, _ in asked)
    named = " and ".join(f"--{d} {n}" for d, n in asked)
    with_mesh = args.tp > 1 or args.pp > 1
    if (cp > 1 and args.pp != 1) or getattr(args, "mesh", None) == "auto":
        others = "--pp/--mesh" if cp > 1 else "--mesh"
        raise ValueError(f"{kind} runs with --tp/--pp only for now: not with {others}")
    if with_mesh:
        # an ep or cp group is that many consecutive dp indices at one tp and pp
        # position (worker/factory.py _split_dp): the job runs whole blocks of
        # pp x tp x ep (cp) ranks, at one size for now
        dims = [(d, n) for d, n in (("pp", args.pp), ("tp", args.tp)) if n > 1]
        size *= args.tp * args.pp
        what = " x ".join([d for d, _ in dims] + [what])
        named = " x ".join([f"--{d} {n}" for d, n in dims] + [named])
        for count in ("min_workers", "max_workers"):
            n = getattr(args, count)
            if n is not None and n != args.nproc:
                raise ValueError(
                    f"--{count.replace('_', '-')} {n}: a job with {kind} and "
                    f"--tp/--pp runs at --nproc {args.nproc} only for now (not elastic)"
                )
    for count in ("nproc", "min_workers", "max_workers"):
        n = getattr(args, count)
        if n is not None and (n < size or n % size):
            # an elastic one grows and shrinks by whole groups
            raise ValueError(
                f"--{count.replace('_', '-')} {n} is not a multiple of {size} ({named}): the "
                f"job runs whole {what} groups"
            )
    env = {EP_ENV: str(ep)} if ep > 1 else {}
    if cp > 1:
        env |= {CP_ENV: str(cp), CP_KIND_ENV: getattr(args, "cp_kind", "ulysses")}
    if with_mesh:
        env |= _tp_pp_env(args)
    return env


def _tp_pp_env(args: argparse.Namespace) -> dict[str, str]:
    if getattr(args, "mesh", None) == "auto":
        if args.tp != 1 or args.pp != 1:
            raise ValueError("--mesh auto chooses tp and pp: give it without --tp/--pp")
        low = args.nproc if args.min_workers is None else args.min_workers
        high = args.nproc if args.max_workers is None else args.max_workers
        if low != high:
            raise ValueError(
                "--mesh auto with --min-workers != --max-workers: an elastic mesh job is "
                "not supported yet"
            )
        return {MESH_ENV: "auto"}
    if args.tp == 1 and args.pp == 1:
        return {}
    shape = MeshShape.for_world(args.nproc, tp=args.tp, pp=args.pp)
    for flag in ("min_workers", "max_workers"):
        n = getattr(args, flag)
        if n is not None:
            try:
                check_resize(shape, n)
            except MeshChangeRefused as exc:
                raise ValueError(f"--{flag.replace('_', '-')} {n}: {exc}") from None
    return {TP_ENV: str(args.tp), PP_ENV: str(args.pp)}


def _final_status(
    services: Sequence[object],
) -> tuple[StatusReport | None, dict[str, WorkerReport]]:
    """The embedded coordinator's last view of the job and every worker's last
    report (nothing without an embedded coordinator)."""
    for service in services:
        final = getattr(service, "final", None)  # an EmbeddedCoordinator, as it stopped
        if final is not None:
            return final
        server = getattr(service, "server", None)
        if server is not None:
            try:
                return server.status(), server.last_reports()
            except Exception as exc:  # a summary must never fail a finished job
                logger.debug("no final status: %s", exc)
    return None, {}


def _on_loopback(address: str) -> bool:
    """Whether a coordinator at ``address`` (host:port) is on this host's loopback."""
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _run_on_ray(args: argparse.Namespace, command: tuple[str, ...]) -> int:
    # imported here: ray is an optional extra, and heavy
    from coordinator.launchers.ray_cluster import RayJob, RaySpec

    try:
        import ray  # noqa: F401
    except ImportError:
        print(
            "zeroplane run: --launcher ray needs Ray: pip install 'zeroplane[ray]'", file=sys.stderr
        )
        return 2
    try:
        spec = RaySpec(
            command=command,
            nproc=args.nproc,
            address=args.address,
            gpus_per_worker=args.gpus_per_worker,
            stage=args.stage if args.stage in (None, "auto") else int(args.stage),
            grace_s=args.grace,
            min_workers=args.min_workers,
            max_workers=args.max_workers,
            max_restarts=args.max_restarts,
        )
    except ValueError as exc:
        print(f"zeroplane run: {exc}", file=sys.stderr)
        return 2
    job = RayJob(spec)
    signals = (signal.SIGINT, signal.SIGTERM)
    # as with local workers: SIGUSR1 adds a worker, SIGUSR2 retires the newest
    requests: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _: job.send_signal(signum)) for s in signals}
    previous |= {
        s: signal.signal(s, lambda signum, _: requests.append(signum))
        for s in (signal.SIGUSR1, signal.SIGUSR2)
    }
    try:
        read = lambda: (job.status(), job.last_reports())  # noqa: E731
        with job, _progress(args) as display, _follow(display, read) as tick:
            while True:
                try:
                    result = job.wait(timeout=0.1)
                    break
                except TimeoutError:
                    pass
                tick()
                while requests:
                    step = 1 if requests.pop(0) == signal.SIGUSR1 else -1
                    try:
                        job.scale_to(job.size + step)
                    except ValueError as exc:
                        print(f"zeroplane run: {exc}", file=sys.stderr)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if not result.ok:
        print(f"zeroplane run: {result.message}", file=sys.stderr)
    return result.returncode


def _hold() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print("zeroplane run: all workers finished; holding until SIGTERM", file=sys.stderr, flush=True)
    stop.wait()
