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

from coordinator.core.planner import Precision

__all__ = [
    "PRECISIONS",
    "add_alias",
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
