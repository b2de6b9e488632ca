"""``zeroplane hpo``: a hyperparameter search on Ray Tune, each trial a zeroplane job.

    zeroplane hpo --nproc 2 --max-steps 200 --samples 8 \\
        --param lr=loguniform:1e-4:1e-1 --param warmup=choice:0,50 \\
        examples/hpo_train.py --steps 200

coordinator/tuning/search.py has how it works; the script reads its point with
``worker.hpo.trial()``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["add_parser", "hpo"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "hpo",
        help="search hyperparameters on Ray Tune, each trial a zeroplane job of N workers",
        description=(
            "A hyperparameter search on Ray Tune (pip install 'zeroplane[hpo]'), each trial "
            "a zeroplane job of --nproc workers of SCRIPT; ASHA stops the poor trials early. "
            "The script reads its point with worker.hpo.trial()."
        ),
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=KIND:ARGS",
        help="a dimension of the space: lr=loguniform:1e-4:1e-1, wd=uniform:0:0.1, "
        "warmup=choice:0,10,100, lr=grid:1e-3,1e-2, randint:LOW:HIGH, or a plain value",
    )
    parser.add_argument(
        "--nproc", type=int, default=2, metavar="N", help="workers per trial (default 2)"
    )
    parser.add_argument(
        "--samples", type=int, default=1, metavar="N", help="Tune's num_samples (default 1)"
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        required=True,
        metavar="N",
        help="the steps a trial runs to (ASHA's max_t)",
    )
    parser.add_argument(
        "--grace-steps",
        type=int,
        default=1,
        metavar="N",
        help="no trial stops before this step (default 1)",
    )
    parser.add_argument(
        "--reduction-factor",
        type=float,
        default=2.0,
        metavar="F",
        help="ASHA keeps 1/F of the trials at each rung (default 2)",
    )
    parser.add_argument(
        "--concurrent", type=int, default=1, metavar="N", help="trials at once (default 1)"
    )
    parser.add_argument(
        "--stage",
        type=int,
        choices=(0, 1, 2, 3),
        default=None,
        help="ZeRO stage of every trial (default: the script's own)",
    )
    parser.add_argument(
        "--max-failures",
        type=int,
        default=0,
        metavar="N",
        help="retries of a failed trial (default 0)",
    )
    parser.add_argument(
        "--address", metavar="RAY_ADDRESS", help="the Ray cluster (default: start a local one)"
    )
    parser.add_argument("--storage", metavar="PATH", help="Tune's storage_path")
    parser.add_argument(
        "--name",
        default="zeroplane-hpo",
        help="the experiment's name (default zeroplane-hpo)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, metavar="FILE", help="write the best point here as JSON"
    )
    parser.add_argument("script", metavar="SCRIPT", help="the training script of every trial")
    parser.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="the script's own arguments: everything after SCRIPT, passed unchanged",
    )
    parser.set_defaults(func=hpo)
    return parser


def hpo(args: argparse.Namespace) -> int:
    try:
        import ray  # noqa: F401
        from ray import tune  # noqa: F401
    except ImportError:
        print("zeroplane hpo needs Ray Tune: pip install 'zeroplane[hpo]'", file=sys.stderr)
        return 2
    from coordinator.tuning.search import HpoSpec, parse_space, search

    try:
        spec = HpoSpec(
            script=args.script,
            args=tuple(args.script_args),
            space=parse_space(args.param),
            nproc=args.nproc,
            num_samples=args.samples,
            max_steps=args.max_steps,
            grace_steps=args.grace_steps,
            reduction_factor=args.reduction_factor,
            max_concurrent=args.concurrent,
            stage=args.stage,
            max_failures=args.max_failures,
            address=args.address,
            storage_path=args.storage,
            name=args.name,
        )
        result = search(spec)
    except ValueError as exc:
        print(f"zeroplane hpo: {exc}", file=sys.stderr)
        return 2
    print(result.table())
    print(f"results: {result.path}")
    if result.best is None:
        print("zeroplane hpo: no trial reported a loss", file=sys.stderr)
        return 1
    if args.out is not None:
        args.out.write_text(json.dumps(dict(result.best.params), indent=1))
        print(f"best point: {args.out}")
    return 0
