"""``zeroplane status``: the job as the coordinator sees it.

Members with their ranks, the generation, the stage and why, and per-rank
memory by kind as the workers report it in their heartbeats. Then, from the
workers' metrics endpoints, the figures the Grafana dashboard and the
coordinator's status page show: model state against the stage-0 baseline,
collective bandwidth by op, compression ratio, step time and throughput (see
coordinator/control/observe.py). ``--http HOST:PORT`` reads them from the
coordinator's HTTP port instead (what ``zeroplane run`` prints), which needs
no token.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from coordinator.commands.args import seconds, wait_seconds
from coordinator.control.client import ClientConfig, CoordinatorClient, CoordinatorError
from coordinator.control.observe import Sampler, expert_balance
from coordinator.control.stalls import where_short
from coordinator.control.web import api_status
from coordinator.core.messages import StatusReport, Whereabouts
from coordinator.core.planner import format_bytes
from coordinator.core.settings import ADDRESS_ENV, TOKEN_ENV, TOKEN_FILE_ENV, load_token

__all__ = ["DEFAULT_ADDRESS", "add_parser", "format_figures", "format_status", "status"]

DEFAULT_ADDRESS = "127.0.0.1:50051"
KIND_ORDER = ("params", "grads", "master", "optimizer")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "status",
        help="members, generation, stage and per-rank memory of a running job",
        description=(
            "The job as the coordinator sees it: members with their ranks, the generation, "
            "the stage and why, per-rank memory by kind, and from the workers' metrics "
            "endpoints model state, collective bandwidth, compression, step time and "
            "throughput. --http reads the same from the coordinator's HTTP port, with no token."
        ),
    )
    parser.add_argument(
        "--coordinator",
        default=os.environ.get(ADDRESS_ENV, DEFAULT_ADDRESS),
        metavar="HOST:PORT",
        help=f"coordinator address (default ${ADDRESS_ENV} or {DEFAULT_ADDRESS})",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help=f"bearer token file (default: ${TOKEN_FILE_ENV}, else ${TOKEN_ENV})",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="connect with TLS, trusting the system's roots (default: as $ZEROPLANE_TLS_ROOT_CERT "
        "says; $ZEROPLANE_TLS_CLIENT_CERT/KEY for mutual TLS)",
    )
    parser.add_argument("--tls-ca", metavar="FILE", help="PEM roots to trust (implies --tls)")
    parser.add_argument(
        "--timeout",
        type=wait_seconds,
        default=5.0,
        metavar="SECONDS",
        help="how long to wait for the coordinator (default 5)",
    )
    parser.add_argument(
        "--events", type=int, default=10, metavar="N", help="recent events shown (default 10)"
    )
    parser.add_argument(
        "--window",
        type=seconds,
        default=1.0,
        metavar="SECONDS",
        help="sample the workers' metrics twice this far apart for bandwidth, step time and "
        "throughput (default 1; 0: one sample, averages since each worker started)",
    )
    parser.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="read the job from the coordinator's HTTP port (its status page) instead of gRPC",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=status)
    return parser


def status(args: argparse.Namespace) -> int:
    if args.http:
        return _status_over_http(args)
    try:
        tls = ClientConfig.tls_from_env()  # $ZEROPLANE_TLS_*, as the workers read them
        if args.tls or args.tls_ca is not None:
            tls.update(tls=True, tls_root_cert_file=args.tls_ca)
        config = ClientConfig(
            address=args.coordinator,
            token=load_token(args.token_file),
            connect_timeout_s=args.timeout,
            rpc_timeout_s=args.timeout,
            **tls,
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
    ranks = _figures(report, args.window)
    if args.json:
        out = dataclasses.asdict(report)
        out["ranks"] = ranks
        print(json.dumps(out, indent=2, default=str))
    else:
        print(format_status(report, address=args.coordinator, events=args.events))
        if ranks:
            print()
            print(format_figures(ranks))
    return 0


def _figures(report: StatusReport, window: float) -> list[dict[str, Any]]:
    """Per-rank figures from the members' metrics endpoints (two samples ``window`` apart)."""
    if not any(w.info.metrics_endpoint for w in report.members):
        return []
    sampler = Sampler(min_interval_s=0.0, window_s=max(window, 1.0) * 10)
    try:
        ranks = api_status(report, "", sampler)["ranks"]
        if window > 0:
            time.sleep(window)
            ranks = api_status(report, "", sampler)["ranks"]
    finally:
        sampler.close()
    return ranks


def _status_over_http(args: argparse.Namespace) -> int:
    address = args.http if "://" in args.http else f"http://{args.http}"

    def fetch() -> dict[str, Any]:
        with urllib.request.urlopen(f"{address}/api/status", timeout=args.timeout) as r:
            return json.load(r)

    try:
        api = fetch()
        # The coordinator keeps recent samples; a first look has one, so look twice.
        if args.window > 0 and any(not r.get("window_s") for r in api["ranks"]):
            time.sleep(max(args.window, 1.0))
            api = fetch()
    except (OSError, ValueError, urllib.error.URLError) as exc:
        print(f"zeroplane status: cannot read {address}/api/status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(api, indent=2))
        return 0
    lines = [
        f"job {api['job']} at {args.http} (zeroplane {api['version']})",
        f"phase: {api['phase']}   generation {api['generation']}   "
        f"world size {api['world_size']}   stage {api['stage']}",
    ]
    if api.get("stage_reason"):
        lines.append(f"stage reason: {api['stage_reason']}")
    if api.get("mesh"):
        m = api["mesh"]
        lines.append(f"mesh: pp={m['pp']} x dp={m['dp']} x tp={m['tp']} ({api['mesh_reason']})")
    if api.get("waiting_reason"):
        lines.append(f"waiting: {api['waiting_reason']}")
    if api.get("stall"):
        lines.append(f"stall ({api['stall_kind']}): {api['stall']}")
    mesh = bool(api.get("mesh"))
    rows = [
        [
            "-" if w["rank"] is None else str(w["rank"]),
            *([_at(w.get("mesh"))] if mesh else []),
            w["worker_id"],
            w["state"],
            w["host"],
            w["device_kind"],
            "-" if w["step"] is None else str(w["step"]),
            where_short(Whereabouts(**w["where"]) if w.get("where") else None),
            w["metrics_endpoint"] or "-",
        ]
        for w in api["workers"]
    ]
    header = ["rank", *(["pp/dp/tp"] if mesh else []), "worker", "state", "host", "device"]
    lines += ["", *_table([*header, "step", "where", "metrics"], rows)]
    if api["ranks"]:
        lines += ["", format_figures(api["ranks"])]
    print("\n".join(lines))
    return 0


def _at(coords: Mapping[str, int] | None) -> str:
    return "-" if not coords else f"{coords['pp']}/{coords['dp']}/{coords['tp']}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    if not rows:
        return []
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    return [
        "  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip()
        for line in (header, *rows)
    ]


FIGURE_OPS = ("all_reduce", "reduce_scatter", "all_gather")


def format_figures(ranks: Sequence[Mapping[str, Any]]) -> str:
    """The per-rank figures table (rows as ``/api/status`` returns them under ``ranks``)."""

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    def rate(value: float | None) -> str:
        return "-" if value is None else f"{format_bytes(value)}/s"

    header = ["rank", "held", "stage-0 baseline", "saves", "step time", "samples/s"]
    header += [f"{op} bw" for op in FIGURE_OPS] + ["compression", "loss"]
    experts = any(r.get("expert_tokens") for r in ranks)
    if experts:  # expert parallelism: the busiest expert over the mean, the worst layer
        header += ["expert load", "dropped"]
    rows, errors, window = [], [], 0.0
    for r in ranks:
        if r.get("error"):
            errors.append(f"rank {r.get('rank')}: {r['error']}")
        if "model_state" not in r:
            continue
        window = max(window, r.get("window_s") or 0.0)
        kept = r.get("kept")
        step = r.get("step_seconds")
        bandwidth = r.get("bandwidth") or {}
        rows.append(
            [
                str(r.get("rank")),
                _bytes(r.get("state_total")),
                _bytes(r.get("baseline_total")),
                "-" if kept is None else f"{100 * (1 - kept):.1f}%",
                "-" if step is None else f"{1000 * step:.1f} ms",
                num(r.get("samples_per_second"), ".1f"),
                *(rate(bandwidth.get(op)) for op in FIGURE_OPS),
                num(r.get("compression_ratio"), ".2f"),
                num(r.get("loss"), ".4f"),
            ]
        )
        if experts:
            share = r.get("expert_dropped_share")
            rows[-1] += [
                num(r.get("expert_load"), ".2f"),
                "-" if share is None else f"{100 * share:.1f}%",
            ]
    over = f"over {window:.1f}s" if window else "averaged since each worker started"
    lines = [f"per-rank figures ({over}; bandwidth = collective bytes per collective second):"]
    lines += _table(header, rows) or ["no worker metrics"]
    if experts:
        load, layer = expert_balance(r.get("expert_tokens") or {} for r in ranks)
        lines.append(
            "expert load (token rows of the busiest expert over the mean, the worst layer; "
            f"1.00 is even): every rank's experts {num(load, '.2f')} ({layer or '-'})"
        )
    return "\n".join(lines + errors)


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
    if report.mesh is not None:
        m = report.mesh
        lines.append(f"mesh: pp={m.pp} x dp={m.dp} x tp={m.tp} ({report.mesh_reason})")
    if report.waiting_reason:
        lines.append(f"waiting: {report.waiting_reason}")
    if report.stall:
        lines.append(f"stall ({report.stall_kind}): {report.stall}")
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
    mesh = report.mesh is not None
    header = ["rank", *(["pp/dp/tp"] if mesh else []), "worker", "state", "host", "device"]
    header += ["device mem", "lease", "step", "where"]
    header += [*kinds_sorted, "model states", "allocated"]
    rows = []
    for w in report.workers:
        r = w.report
        states = None if r is None else r.model_state_bytes
        coords = report.coords(w.rank)
        at = "-" if coords is None else f"{coords.pp}/{coords.dp}/{coords.tp}"
        rows.append(
            [
                "-" if w.rank is None else str(w.rank),
                *([at] if mesh else []),
                w.info.worker_id,
                f"{w.state} (leaving)" if w.leaving else w.state,
                w.info.host,
                w.info.device_kind,
                _bytes(w.info.device_memory_bytes or None),
                f"{w.lease_remaining_s:.1f}s" if w.state not in ("lost", "left") else "gone",
                "-" if r is None else str(r.step),
                where_short(None if r is None else r.where),
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
