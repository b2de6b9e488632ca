"""The ``zeroplane`` command line.

Each subcommand lives in ``coordinator.commands.<name>`` and exposes
``add_parser(subparsers)``, which registers it and sets ``func`` to a callable
taking the parsed arguments and returning an exit code. Subcommands import
heavy dependencies (torch) lazily, inside ``func``, so the CLI starts fast and
the coordinator package stays torch-free.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

__all__ = ["main"]

COMMANDS = ("demo", "run", "plan", "tune", "hpo", "status", "coordinator", "submit", "checkpoint")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeroplane", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"coordinator.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"coordinator.commands.{name}":
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
