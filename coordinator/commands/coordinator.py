"""``zeroplane coordinator``: serve the control plane until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from coordinator.commands.args import (
    PRECISIONS,
    activation_shape,
    add_alias,
    add_shape_args,
    add_stall_flags,
    fraction,
    seconds,
    stall_settings,
    wait_seconds,
)
from coordinator.core.planner import parse_count
from coordinator.core.settings import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    CoordinatorConfig,
    HttpConfig,
    MembershipConfig,
    PlanConfig,
    ServerConfig,
    load_token,
)

__all__ = ["DEFAULT_PORT", "add_parser", "coordinator", "serving_host"]

_LOOPBACK = ("127.0.0.1", "::1", "localhost")

DEFAULT_PORT = 50051


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "coordinator",
        help="serve the coordinator (control plane)",
        description=(
            "Serve the zeroplane coordinator: admits workers, forms generations, plans "
            "stage, layout and reshard schedules, and watches leases. Prints "
            "'zeroplane coordinator listening on HOST:PORT' once serving."
        ),
    )
    net = parser.add_argument_group("serving")
    net.add_argument(
        "--host",
        default=None,
        help="address to bind (default: 0.0.0.0 with a token, else 127.0.0.1: a coordinator "
        "without a token serves this host only unless --insecure)",
    )
    net.add_argument(
        "--insecure",
        action="store_true",
        help="serve beyond loopback without a token: anyone who reaches the port can join, "
        "leave or stop the job (docs/guides/security.md)",
    )
    net.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"gRPC port; 0 picks a free one (default {DEFAULT_PORT})",
    )
    net.add_argument(
        "--token-file",
        metavar="FILE",
        help="bearer token file, e.g. a mounted Secret "
        f"(default: ${TOKEN_FILE_ENV}, else ${TOKEN_ENV}; neither: no auth)",
    )
    net.add_argument("--tls-cert", metavar="FILE", type=Path, help="PEM certificate chain")
    net.add_argument("--tls-key", metavar="FILE", type=Path, help="PEM private key")
    net.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        type=Path,
        help="mutual TLS: admit only clients whose certificate this PEM authority signed "
        "(workers set $ZEROPLANE_TLS_CLIENT_CERT and $ZEROPLANE_TLS_CLIENT_KEY)",
    )
    net.add_argument(
        "--state-file",
        metavar="FILE",
        type=Path,
        help="persist the current generation here, so a restart keeps the job",
    )
    net.add_argument(
        "--grace",
        type=seconds,
        default=5.0,
        metavar="SECONDS",
        help="on SIGTERM, time the calls in flight get to finish (default 5)",
    )
    net.add_argument(
        "--http-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve /metrics, Prometheus service discovery (/sd) and a status page (/) on "
        "this port (0: a free one; default: no HTTP)",
    )
    net.add_argument(
        "--http-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address for HTTP (default 127.0.0.1; 0.0.0.0 for a Prometheus on another host, "
        "as the Kubernetes manifests pass; see --http-auth and --http-tls)",
    )
    net.add_argument(
        "--http-auth",
        action="store_true",
        help="ask every HTTP client but /healthz for the job's token (--token-file): "
        "'Authorization: Bearer TOKEN', or basic auth with the token as the password",
    )
    net.add_argument(
        "--http-tls",
        action="store_true",
        help="serve HTTP over TLS with --tls-cert/--tls-key (and, with --tls-client-ca, "
        "ask HTTP clients for a certificate too)",
    )
    net.add_argument(
        "--job-name",
        default="zeroplane",
        metavar="NAME",
        help="the job label /sd gives the workers' series (default zeroplane)",
    )

    members = parser.add_argument_group("membership")
    members.add_argument(
        "--min-workers",
        type=int,
        default=1,
        metavar="N",
        help="the job runs with at least N workers (default 1)",
    )
    members.add_argument(
        "--max-workers",
        type=int,
        default=4096,
        metavar="N",
        help="admit at most N workers (default 4096)",
    )
    members.add_argument(
        "--join-window",
        type=seconds,
        default=2.0,
        metavar="SECONDS",
        help="batch joins this long before forming a generation (default 2)",
    )
    members.add_argument(
        "--lease-timeout",
        type=wait_seconds,
        default=10.0,
        metavar="SECONDS",
        help="drop a worker silent this long (default 10)",
    )
    members.add_argument(
        "--heartbeat-interval",
        type=wait_seconds,
        metavar="SECONDS",
        help="how often workers heartbeat (default lease timeout / 5)",
    )
    add_stall_flags(members)

    plan = parser.add_argument_group("planning")
    plan.add_argument(
        "--stage",
        choices=("auto", "0", "1", "2", "3"),
        default="auto",
        help="ZeRO stage; auto picks the lowest that fits the smallest worker (default)",
    )
    precision = plan.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="bf16",
        help="training precision the planner counts bytes for, as ZeroConfig(dtype=...) "
        "(default bf16)",
    )
    add_alias(plan, "--dtype", to=precision)
    plan.add_argument(
        "--optimizer-states",
        type=int,
        default=2,
        metavar="K",
        help="fp32 states per parameter the optimizer keeps (Adam 2, momentum SGD 1; default 2)",
    )
    plan.add_argument(
        "--headroom",
        type=fraction,
        default=0.1,
        metavar="FRACTION",
        help="fraction of device memory kept free (default 0.1)",
    )
    plan.add_argument(
        "--bucket-numel",
        default=str(PlanConfig().bucket_numel),
        metavar="N",
        help="elements per bucket (default 2**24)",
    )
    plan.add_argument(
        "--align",
        type=int,
        default=1,
        metavar="N",
        help="shard lengths a multiple of N elements (buckets padded to world size x N; default 1)",
    )
    add_shape_args(
        parser.add_argument_group(
            "activations",
            "the model's shape, from which --stage auto and a mesh left to the coordinator "
            "(zeroplane run --mesh auto) count activations per rank (default: none counted)",
        )
    )
    parser.set_defaults(func=coordinator)
    return parser


def serving_host(host: str | None, *, token: str | None, insecure: bool) -> str:
    """Where the coordinator listens: ``host``, or by default every interface when a
    token guards the RPCs and loopback when none does. A host beyond loopback
    without a token is refused unless ``insecure``: closed by default."""
    if host is None:
        return "0.0.0.0" if token is not None or insecure else "127.0.0.1"
    if token is None and not insecure and host not in _LOOPBACK:
        raise ValueError(
            f"--host {host} without a token would let anyone who reaches the port join, "
            "leave or stop the job: give --token-file (or $ZEROPLANE_TOKEN_FILE, "
            "$ZEROPLANE_TOKEN), or --insecure to serve it open"
        )
    return host


def coordinator(args: argparse.Namespace) -> int:
    from coordinator.control.server import serve

    if args.state_file is not None and not args.state_file.parent.is_dir():
        print(
            f"zeroplane coordinator: --state-file {str(args.state_file)!r}: directory "
            f"{str(args.state_file.parent)!r} does not exist",
            file=sys.stderr,
        )
        return 2
    try:
        token = load_token(args.token_file)
        interval = args.heartbeat_interval or args.lease_timeout / 5
        config = CoordinatorConfig(
            server=ServerConfig(
                host=args.host or "127.0.0.1",
                port=args.port,
                token=token,
                tls_cert_file=args.tls_cert,
                tls_key_file=args.tls_key,
                tls_client_ca_file=args.tls_client_ca,
                state_file=args.state_file,
                grace_s=args.grace,
            ),
            membership=MembershipConfig(
                min_workers=args.min_workers,
                max_workers=args.max_workers,
                join_window_s=args.join_window,
                lease_timeout_s=args.lease_timeout,
                heartbeat_interval_s=interval,
                **stall_settings(args),
            ),
            plan=PlanConfig(
                stage=None if args.stage == "auto" else int(args.stage),
                precision=args.precision,
                optimizer_states=args.optimizer_states,
                headroom=args.headroom,
                bucket_numel=parse_count(args.bucket_numel),
                align=args.align,
                activations=activation_shape(args),
            ),
            http=HttpConfig(
                port=args.http_port,
                host=args.http_host,
                job_name=args.job_name,
                auth=args.http_auth,
                tls=args.http_tls,
            ),
        )
        # after every other flag is checked: closed by default
        host = serving_host(args.host, token=token, insecure=args.insecure)
        config = dataclasses.replace(config, server=dataclasses.replace(config.server, host=host))
    except ValueError as exc:
        print(f"zeroplane coordinator: {exc}", file=sys.stderr)
        return 2

    def ready(port: int) -> None:
        print(f"zeroplane coordinator listening on {host}:{port}", flush=True)

    try:
        serve(config, on_ready=ready)
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"zeroplane coordinator: {exc}", file=sys.stderr)
        return 1
    return 0
