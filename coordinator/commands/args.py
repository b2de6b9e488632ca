"""What the subcommands' arguments share: types, the precision names, old spellings.

The types are argparse ``type=``s: a bad value is refused while parsing, with a
message argparse prefixes with the flag's name (``argument --grace: ...``),
before any command starts anything. NaN and infinity are refused wherever a
time or a ratio means something finite.

One name per idea across commands: an option that was renamed keeps its old
spelling as a hidden alias (:func:`add_alias`), so existing scripts still parse.
"""

from __future__ import annotations

import argparse
import math
from typing import get_args

from coordinator.core.planner import ActivationShape, Precision

__all__ = [
    "PRECISIONS",
    "activation_shape",
    "add_alias",
    "add_shape_args",
    "counts",
    "fraction",
    "non_negative",
    "seconds",
    "wait_seconds",
]

# ZeroConfig's dtype values, the one vocabulary of every --precision
PRECISIONS: tuple[str, ...] = get_args(Precision)


def add_alias(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *old: str,
    to: argparse.Action,
) -> None:
    """Parse the retired option strings ``old`` as ``to``'s option: same dest, type and
    choices, but left out of ``--help`` and the usage line. The default stays ``to``'s."""
    parser.add_argument(
        *old,
        dest=to.dest,
        type=to.type,
        choices=to.choices,
        metavar=to.metavar,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _checked(text: str, ok: bool, want: str) -> None:
    if not ok:
        raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")


def seconds(text: str) -> float:
    """A duration that may be zero: a grace period, a join window."""
    value = _number(text)
    _checked(text, value >= 0, ">= 0 seconds")
    return value


def wait_seconds(text: str) -> float:
    """A duration that must be positive: a timeout, a lease, an interval."""
    value = _number(text)
    _checked(text, value > 0, "> 0 seconds")
    return value


def non_negative(text: str) -> float:
    """A finite amount >= 0 (GPUs per worker)."""
    value = _number(text)
    _checked(text, value >= 0, ">= 0")
    return value


def fraction(text: str) -> float:
    """A ratio in [0, 1) (a headroom)."""
    value = _number(text)
    _checked(text, 0 <= value < 1, "in [0, 1)")
    return value


def counts(text: str) -> list[int]:
    """A comma-separated list of positive integers (``1,2,4,8``); no empty item."""
    items = text.split(",")
    values = []
    for item in items:
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise argparse.ArgumentTypeError(
                f"must be positive integers separated by commas, got {text!r}"
            )
        values.append(int(item))
    return values


def add_shape_args(group: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--seq``, ``--micro-batch``, ``--layers``, ``--hidden``, ``--heads``: a
    transformer's shape, from which the planner counts activations per rank
    (coordinator/core/planner.py ``ActivationShape``; ``zeroplane plan``,
    ``zeroplane coordinator`` and ``zeroplane run`` alike)."""
    group.add_argument("--seq", type=int, metavar="TOKENS", help="sequence length")
    group.add_argument(
        "--micro-batch",
        type=int,
        default=1,
        metavar="N",
        help="micro-batch size: sequences per rank per forward (default 1)",
    )
    group.add_argument("--layers", type=int, metavar="N", help="transformer layers")
    group.add_argument("--hidden", type=int, metavar="H", help="hidden size")
    group.add_argument("--heads", type=int, metavar="A", help="attention heads (default H/64)")


def activation_shape(
    args: argparse.Namespace, defaults: dict[str, int] | None = None
) -> ActivationShape | None:
    """The shape :func:`add_shape_args` parsed (None without ``--seq``); ``defaults``:
    layers, hidden and heads where the flags leave them out (a model's config)."""
    defaults = defaults or {}
    if args.seq is None:
        given = [f"--{n}" for n in ("layers", "hidden", "heads") if getattr(args, n) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need --seq (the sequence length)")
        return None
    layers = args.layers if args.layers is not None else defaults.get("layers")
    hidden = args.hidden if args.hidden is not None else defaults.get("hidden")
    missing = [n for n, v in (("--layers", layers), ("--hidden", hidden)) if v is None]
    if missing:
        raise ValueError(
            f"--seq needs {' and '.join(missing)} (or a --model whose config has them)"
        )
    return ActivationShape(
        layers=layers,
        hidden=hidden,
        seq=args.seq,
        micro_batch=args.micro_batch,
        heads=args.heads if args.heads is not None else defaults.get("heads"),
    )


def add_stall_flags(group: argparse._ArgumentGroup) -> None:
    """``--stall-after`` and ``--stall-timeout`` (coordinator/control/stalls.py), for the
    commands that run a coordinator."""
    group.add_argument(
        "--stall-after",
        type=wait_seconds,
        metavar="SECONDS",
        help="name a stall (on status, the status page, the metrics and the log) once a "
        "rank has waited this long in one collective (default 5, or "
        "$ZEROPLANE_STALL_AFTER_S)",
    )
    group.add_argument(
        "--stall-timeout",
        type=wait_seconds,
        metavar="SECONDS",
        help="act on a stall this long: drop a stopped or stuck rank (the job re-forms "
        "without it) or stop a job whose ranks' collectives diverged (default 30, or "
        "$ZEROPLANE_STALL_TIMEOUT_S)",
    )


def stall_settings(args: argparse.Namespace) -> dict[str, float]:
    """The MembershipConfig fields ``add_stall_flags``' flags set (the rest default)."""
    given = {"stall_after_s": args.stall_after, "stall_timeout_s": args.stall_timeout}
    return {k: v for k, v in given.items() if v is not None}
