"""``zeroplane status``: the job as the coordinator sees it.

Members with their ranks, the generation, the stage and why, and per-rank
memory by kind as the workers report it in their heartbeats.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from coordinator.client import ClientConfig, CoordinatorClient, CoordinatorError
from coordinator.config import ADDRESS_ENV, TOKEN_ENV, load_token
from coordinator.messages import StatusReport
from coordinator.planner import format_bytes

__all__ = ["DEFAULT_ADDRESS", "add_parser", "format_status", "status"]

DEFAULT_ADDRESS = "127.0.0.1:50051"
KIND_ORDER = ("params", "grads", "master", "optimizer")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "status",
        help="members, generation, stage and per-rank memory of a running job",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--coordinator",
        default=os.environ.get(ADDRESS_ENV, DEFAULT_ADDRESS),
        metavar="HOST:PORT",
        help=f"coordinator address (default ${ADDRESS_ENV} or {DEFAULT_ADDRESS})",
    )
    parser.add_argument(
        "--token-file", metavar="FILE", help=f"bearer token file (default: ${TOKEN_ENV})"
    )
    parser.add_argument("--tls", action="store_true", help="connect with TLS")
    parser.add_argument("--tls-ca", metavar="FILE", help="PEM roots to trust (implies --tls)")
    parser.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="default 5")
    parser.add_argument("--events", type=int, default=10, metavar="N", help="recent events shown")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=status)
    return parser


def status(args: argparse.Namespace) -> int:
    try:
        config = ClientConfig(
            address=args.coordinator,
            token=load_token(args.token_file),
            tls=args.tls or args.tls_ca is not None,
            tls_root_cert_file=args.tls_ca,
            connect_timeout_s=args.timeout,
            rpc_timeout_s=args.timeout,
        )
    except ValueError as exc:
        print(f"zeroplane status: {exc}", file=sys.stderr)
        return 2
    client = CoordinatorClient(config)
    try:
        report = client.status()
    except CoordinatorError as exc:
        print(f"zeroplane status: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2, default=str))
    else:
        print(format_status(report, address=args.coordinator, events=args.events))
    return 0


def _bytes(n: float | None) -> str:
    return "-" if n is None else format_bytes(n)


def format_status(report: StatusReport, *, address: str = "", events: int = 10) -> str:
    lines = [f"coordinator {address} (zeroplane {report.server_version})".replace("  ", " ")]
    lines.append(
        f"phase: {report.phase}   generation {report.generation_id}   "
        f"world size {report.world_size}   stage {report.stage}"
    )
    if report.stage_reason:
        lines.append(f"stage reason: {report.stage_reason}")
    if report.waiting_reason:
        lines.append(f"waiting: {report.waiting_reason}")
    if report.rendezvous_endpoint:
        lines.append(f"rendezvous: {report.rendezvous_endpoint}")
    s = report.settings
    lines.append(
        f"membership: {s.min_workers}-{s.max_workers} workers, join window {s.join_window_s:g}s, "
        f"lease {s.lease_timeout_s:g}s (heartbeat every {s.heartbeat_interval_s:g}s)"
    )
    if report.inventory_digest:
        lines.append(
            f"model: {report.trainable_numel:,} trainable parameters, "
            f"inventory {report.inventory_digest[:12]}"
        )

    kinds = {k for w in report.workers if w.report for k in w.report.model_state_bytes}
    kinds_sorted = [k for k in KIND_ORDER if k in kinds] + sorted(kinds - set(KIND_ORDER))
    header = ["rank", "worker", "state", "host", "device", "device mem", "lease", "step"]
    header += [*kinds_sorted, "model states", "allocated"]
    rows = []
    for w in report.workers:
        r = w.report
        states = None if r is None else r.model_state_bytes
        rows.append(
            [
                "-" if w.rank is None else str(w.rank),
                w.info.worker_id,
                w.state,
                w.info.host,
                w.info.device_kind,
                _bytes(w.info.device_memory_bytes or None),
                f"{w.lease_remaining_s:.1f}s" if w.state != "lost" else "gone",
                "-" if r is None else str(r.step),
                *(_bytes(None if states is None else states.get(k)) for k in kinds_sorted),
                _bytes(None if states is None else sum(states.values())),
                _bytes(None if r is None else r.device_allocated_bytes),
            ]
        )
    lines.append("")
    if rows:
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
        lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
        for row in rows:
            lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    else:
        lines.append("no workers")
    if events and report.events:
        lines.append("")
        lines.append("recent events:")
        for e in report.events[-events:]:
            when = time.strftime("%H:%M:%S", time.localtime(e.unix_s))
            who = f" {e.worker_id}" if e.worker_id else ""
            detail = f": {e.detail}" if e.detail else ""
            lines.append(f"  {when} gen {e.generation_id} {e.kind}{who}{detail}")
    return "\n".join(lines)
