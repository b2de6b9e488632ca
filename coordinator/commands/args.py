"""Argument types for the subcommands' numeric flags.

Each is an argparse ``type=``: a bad value is refused while parsing, with a
message argparse prefixes with the flag's name (``argument --grace: ...``),
before any command starts anything. NaN and infinity are refused wherever a
time or a ratio means something finite.
"""

from __future__ import annotations

import argparse
import math

__all__ = ["counts", "fraction", "non_negative", "seconds", "wait_seconds"]


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
