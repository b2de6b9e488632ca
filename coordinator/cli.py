"""The ``zeroplane`` command line.

Each subcommand lives in ``coordinator.commands.<name>`` and exposes
``add_parser(subparsers)``, which registers it and sets ``func`` to a callable
taking the parsed arguments and returning an exit code. Subcommands import
heavy dependencies (torch) lazily, inside ``func``, so the CLI starts fast and
the coordinator package stays torch-free: ``submit``, ``status``, ``plan`` and
``coordinator`` run from an install without the ``train`` extra. A command that
does need torch says so with ``set_defaults(needs="torch")``, and :func:`main`
refuses it with the install line when torch is missing.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import logging
import sys
from collections.abc import Sequence

__all__ = ["main"]

COMMANDS = ("demo", "run", "plan", "tune", "hpo", "status", "coordinator", "submit", "checkpoint")
TRAIN_EXTRA = "pip install 'zeroplane[train]'"


def version() -> str:
    try:
        return importlib.metadata.version("zeroplane")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeroplane",
        description="ZeRO-sharded PyTorch training run as a small distributed system.",
        epilog="zeroplane COMMAND --help: that command's options.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {version()}", help="print the version"
    )
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
    needs = getattr(args, "needs", None)
    if needs is not None and importlib.util.find_spec(needs) is None:
        print(
            f"zeroplane {args.command}: needs {needs}, which is not installed: {TRAIN_EXTRA} "
            f"(or install {needs} first, then zeroplane)",
            file=sys.stderr,
        )
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
