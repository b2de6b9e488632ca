"""``zeroplane run``: launch N local workers of a Python script, torchrun-style."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from coordinator.config import ADDRESS_ENV
from coordinator.launch import STAGE_CHOICES, LaunchSpec, LocalJob, forward_signals

__all__ = ["add_parser", "run"]


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
            "are stopped and the job exits with that worker's code."
        ),
    )
    parser.add_argument(
        "--nproc", type=int, default=1, metavar="N", help="number of local workers (default 1)"
    )
    parser.add_argument(
        "--stage",
        choices=STAGE_CHOICES,
        default=None,
        help="ZeRO stage, exported to the workers as ZEROPLANE_STAGE",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="time workers get to exit after SIGTERM before SIGKILL (default 5)",
    )
    parser.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        default=None,
        help="join this coordinator instead of starting an embedded one "
        "(its token from $ZEROPLANE_TOKEN or $ZEROPLANE_TOKEN_FILE)",
    )
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="SCRIPT is a module name, run as `python -m SCRIPT`",
    )
    parser.add_argument("script", metavar="SCRIPT", help="the training script each worker runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    command = (sys.executable, *(("-m",) if args.module else ()), args.script, *args.script_args)
    try:
        spec = LaunchSpec(command=command, nproc=args.nproc, stage=args.stage, grace_s=args.grace)
    except ValueError as exc:
        print(f"zeroplane run: {exc}", file=sys.stderr)
        return 2
    if args.coordinator:
        spec = dataclasses.replace(spec, env={**spec.env, ADDRESS_ENV: args.coordinator})
        services = ()
    else:
        # imported here: the gRPC server is only needed when this process hosts it
        from coordinator.server import EmbeddedCoordinator

        stage = None if args.stage in (None, "auto") else int(args.stage)
        services = (EmbeddedCoordinator.for_local_job(args.nproc, stage),)
    job = LocalJob(spec, services=services)
    with forward_signals(job), job:
        result = job.wait()
    if not result.ok:
        print(f"zeroplane run: {result.message}", file=sys.stderr)
    return result.returncode
