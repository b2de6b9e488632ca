"""zeroplane's compressed gradient exchange: bytes on the wire and step time, in one run.

On loopback the network is never the bottleneck, so besides loopback the
benchmark (run as root) puts the two ranks in network namespaces of their own,
joined by one veth pair whose both ends are rate-limited with ``tc tbf``
(default 1 Gbit/s and 100 Mbit/s). For each network, ZeRO stage and method it
reports the median step time, the logical and the wire bytes per step (from
``engine.comm_report()``), their ratio, the bytes the veth actually sent, the
time spent encoding and decoding, and the step time against uncompressed on
the same network and stage.

Namespaces are named ``zpbench-<pid>-{a,b}`` with a /30 that exists only inside
them; they are deleted at the end (also on Ctrl-C and SIGTERM), and ones left by
a crashed run (owner pid gone) are removed at start. Without root or iproute2
the benchmark says so and reports loopback only.

Run ``python bench/compression.py --help``; bench/README.md says what each
column means.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# Run from a checkout without installing the package.
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import worker  # noqa: E402
from bench.common import (  # noqa: E402
    exit_on_sigterm,
    fmt_ratio,
    free_port,
    gloo_group,
    median_ms,
    quiet_gloo_warnings,
    ratio,
    rel_iqr,
    stop_processes,
    timed_step,
)
from worker.models import GPT, GPTConfig  # noqa: E402

NS_PREFIX = "zpbench-"
# Private addresses that only ever exist inside this run's two namespaces.
ADDR_A, ADDR_B, PREFIX_LEN = "10.231.0.1", "10.231.0.2", 30
RDV_PORT = 29531
WORLD = 2
STAGES = (0, 1, 2, 3)
# "qwz": uncompressed gradients, int8 parameter all-gathers (ZeRO++'s qwZ; stages 1-3).
# "int8-gather": int8 gradients plus int8 parameter all-gathers (stages 1-3).
METHODS = ("none", "bf16", "fp16", "int8", "onebit", "qwz", "int8-gather")
DEFAULT_METHODS = ("none", "bf16", "int8", "onebit", "qwz", "int8-gather")
GATHER_METHODS = ("qwz", "int8-gather")
DEFAULT_RATES = ("1gbit", "100mbit")
SEED = 0

log = logging.getLogger("bench.compression")


# --------------------------------------------------------------------------- results


@dataclass
class Result:
    """One (network, stage, method) cell, as measured by rank 0 (times: slowest rank)."""

    network: str
    stage: int
    method: str
    step_s: list[float]
    cpu_s: list[float]  # process CPU time per step (larger rank): steadier than wall on a busy box
    logical_bytes: float  # per step, all data-plane ops ("control" excluded)
    wire_bytes: float  # per step, what comm_report says was sent
    nic_tx_bytes: float | None  # per step and rank, from the veth's counters
    codec_s: float  # per step, encode + decode CPU time (larger rank)
    loss: float
    ops: dict[str, dict[str, float]]  # per step, by op

    @property
    def median_ms(self) -> float:
        return median_ms(self.step_s)

    @property
    def cpu_ms(self) -> float:
        return median_ms(self.cpu_s)

    @property
    def iqr(self) -> float:
        return rel_iqr(self.step_s)

    @property
    def ratio(self) -> float:
        return self.logical_bytes / self.wire_bytes if self.wire_bytes else 1.0


# --------------------------------------------------------------------------- rank side


def _nic_tx(iface: str | None) -> int | None:
    if iface is None:
        return None
    # `ip netns exec` mounts this namespace's own /sys, so these are the veth's counters.
    return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())


def _engine_config(stage: int, method: str) -> worker.ZeroConfig:
    gather = method in GATHER_METHODS
    return worker.ZeroConfig(
        stage=stage,
        compression={"qwz": "none", "int8-gather": "int8"}.get(method, method),
        compression_block=256,
        stage3_gather_compression="int8" if gather else "none",
    )


def _data_bytes(report: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {op: dict(v) for op, v in report.items() if op != "control"}


def _codec_seconds(engine: worker.ZeroEngine) -> float:
    """CPU time the engine's collectives spent in encode + decode so far (error
    feedback's decode per encode included): CPU, not wall, time, so other
    processes on the cores do not inflate it."""
    return sum(v["seconds"] for v in engine.comm.codec_report().values())


def _train_step(engine: worker.ZeroEngine, idx: torch.Tensor, targets: torch.Tensor) -> float:
    loss = engine(idx, targets)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _measure(
    stage: int, method: str, gpt: GPTConfig, args: argparse.Namespace, iface: str | None
) -> dict[str, Any]:
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(SEED * 1000 + rank)
    n = args.warmup + args.steps
    idx = torch.randint(gpt.vocab_size, (n, args.micro_batch, gpt.block_size), generator=gen)
    targets = torch.randint(gpt.vocab_size, (n, args.micro_batch, gpt.block_size), generator=gen)
    torch.manual_seed(SEED)
    model = GPT(gpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = worker.initialize(model, opt, config=_engine_config(stage, method))

    for i in range(args.warmup):
        _train_step(engine, idx[i], targets[i])
    dist.barrier()
    before, tx0, codec0 = _data_bytes(engine.comm_report()), _nic_tx(iface), _codec_seconds(engine)
    times, cpu, loss = [], [], 0.0
    for i in range(args.warmup, n):
        loss, wall, c = timed_step(partial(_train_step, engine, idx[i], targets[i]))
        times.append(wall)
        cpu.append(c)
    codec_s = (_codec_seconds(engine) - codec0) / args.steps
    tx1 = _nic_tx(iface)
    after = _data_bytes(engine.comm_report())
    ops = {
        op: {
            k: (v[k] - before.get(op, {}).get(k, 0)) / args.steps
            for k in ("calls", "bytes", "wire_bytes", "seconds")
        }
        for op, v in after.items()
        if v["calls"] > before.get(op, {}).get("calls", 0)  # e.g. the start-up broadcast
    }
    # Slowest rank per step and for the codec; NIC bytes and loss averaged over ranks.
    # (After tx1 was read, so these collectives are not counted.)
    peak = torch.tensor([*times, *cpu, codec_s], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tx = float(tx1 - tx0) / args.steps if tx0 is not None and tx1 is not None else -1.0
    mean = torch.tensor([tx, loss], dtype=torch.float64)
    dist.all_reduce(mean)
    mean /= WORLD
    return {
        "step_s": peak[: args.steps].tolist(),
        "cpu_s": peak[args.steps : 2 * args.steps].tolist(),
        "codec_s": float(peak[-1]),
        "logical_bytes": sum(v["bytes"] for v in ops.values()),
        "wire_bytes": sum(v["wire_bytes"] for v in ops.values()),
        "nic_tx_bytes": float(mean[0]) if iface is not None else None,
        "loss": float(mean[1]),
        "ops": ops,
    }


def rank_main(args: argparse.Namespace) -> int:
    """One rank: every (stage, method) of the grid, ``--rounds`` times, interleaved."""
    torch.set_num_threads(1)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    logging.getLogger("worker").setLevel(logging.ERROR)  # e.g. "stage > 0 on one rank"
    quiet_gloo_warnings()
    gpt = GPTConfig(
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=4,
        vocab_size=args.vocab,
        block_size=args.seq,
    )
    timeout = timedelta(seconds=args.gloo_timeout)
    with gloo_group(args.addr, args.port, args.rank, WORLD, timeout):
        cells: dict[tuple[int, str], dict[str, Any]] = {}
        for r in range(args.rounds):
            for stage, method in _grid(args.stages, args.methods):
                t0 = time.perf_counter()
                m = _measure(stage, method, gpt, args, args.iface)
                gc.collect()  # the cell's engine, before the next one is built
                if (stage, method) in cells:
                    for key in ("step_s", "cpu_s"):  # bytes: last round's
                        m[key] = cells[stage, method][key] + m[key]
                cells[stage, method] = m
                if args.rank == 0:
                    print(
                        f"  [{args.network}] round {r + 1}/{args.rounds} stage {stage} "
                        f"{method:<11} median {median_ms(m['step_s']):8.1f} ms "
                        f"({time.perf_counter() - t0:.1f} s with build and warm-up)",
                        file=sys.stderr,
                        flush=True,
                    )
        if args.rank == 0:
            out = [
                asdict(Result(network=args.network, stage=s, method=meth, **m))
                for (s, meth), m in cells.items()
            ]
            Path(args.out).write_text(json.dumps(out))
    return 0


def _grid(stages: list[int], methods: list[str]) -> Iterator[tuple[int, str]]:
    for stage in stages:
        for method in methods:
            if method in GATHER_METHODS and stage == 0:
                continue  # stage 0 gathers no parameters
            yield stage, method


# --------------------------------------------------------------------------- namespaces


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(ns: str) -> None:
    """Stop what still runs inside ``ns`` (our own rank processes), then delete it;
    the veth end inside goes with it, and its peer with that."""
    with contextlib.suppress(RuntimeError):
        for pid in _run("ip", "netns", "pids", ns).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(RuntimeError):
        _run("ip", "netns", "del", ns)


def cleanup_stale() -> list[str]:
    """Delete namespaces left by a crashed run of this script (owner pid gone)."""
    removed = []
    with contextlib.suppress(RuntimeError):
        for line in _run("ip", "netns", "list").splitlines():
            name = line.split()[0] if line.split() else ""
            if not name.startswith(NS_PREFIX):
                continue
            owner = name[len(NS_PREFIX) :].split("-")[0]
            if owner.isdigit() and not _pid_alive(int(owner)):
                _delete_namespace(name)
                removed.append(name)
    return removed


@dataclass
class Netns:
    """Two namespaces joined by a veth pair, with a /30 inside them."""

    ns_a: str
    ns_b: str
    if_a: str
    if_b: str
    created: bool = False

    @classmethod
    def for_this_process(cls) -> Netns:
        pid = os.getpid()
        # Interface names are limited to 15 characters.
        return cls(f"{NS_PREFIX}{pid}-a", f"{NS_PREFIX}{pid}-b", f"zpb{pid}a", f"zpb{pid}b")

    def create(self) -> None:
        self.created = True  # from the first command on, so a partial setup is undone too
        _run("ip", "netns", "add", self.ns_a)
        _run("ip", "netns", "add", self.ns_b)
        # Both ends are created directly inside their namespaces: nothing appears in ours.
        _run(
            "ip", "link", "add", self.if_a, "netns", self.ns_a, "type", "veth",
            "peer", "name", self.if_b, "netns", self.ns_b,
        )  # fmt: skip
        for ns, iface, addr in ((self.ns_a, self.if_a, ADDR_A), (self.ns_b, self.if_b, ADDR_B)):
            _run("ip", "-n", ns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", iface)
            _run("ip", "-n", ns, "link", "set", iface, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def set_rate(self, rate: str, burst: str, latency: str) -> None:
        """Rate-limit both directions (each end's egress); ``replace`` also adds."""
        for ns, iface in ((self.ns_a, self.if_a), (self.ns_b, self.if_b)):
            _run(
                "tc", "-n", ns, "qdisc", "replace", "dev", iface, "root",
                "tbf", "rate", rate, "burst", burst, "latency", latency,
            )  # fmt: skip

    def delete(self) -> None:
        if self.created:
            for ns in (self.ns_a, self.ns_b):
                _delete_namespace(ns)
            self.created = False


def namespaces_unavailable() -> str | None:
    """Why namespaces cannot be used here, or ``None``."""
    if os.geteuid() != 0:
        return "not running as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (install iproute2)"
    return None


# --------------------------------------------------------------------------- driver


@dataclass
class Network:
    name: str  # "loopback" or a tc rate such as "100mbit"
    rate: str | None = None
    link_mbps: float | None = None  # measured with a plain TCP stream


_PROBE = """
import socket, sys, time
mode, addr, port, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if mode == "sink":
    srv = socket.create_server((addr, port))
    conn, _ = srv.accept()
    conn.recv(1, socket.MSG_PEEK)  # start the clock at the first byte, not at accept
    got, t0 = 0, time.perf_counter()
    while got < nbytes:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        got += len(chunk)
    print(got / (time.perf_counter() - t0))
else:
    for _ in range(100):
        try:
            s = socket.create_connection((addr, port))
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
    buf = bytes(1 << 20)
    for _ in range(nbytes >> 20):
        s.sendall(buf)
    s.close()
"""


def probe_link(net: Netns, rate_mbit: float) -> float:
    """One TCP stream from A to B for ~1 s: the rate the ranks can actually get (Mbit/s)."""
    nbytes = max(4, int(rate_mbit * 1e6 / 8 / (1 << 20))) << 20
    port = str(RDV_PORT + 1)
    sink = subprocess.Popen(
        ["ip", "netns", "exec", net.ns_b, sys.executable, "-c", _PROBE, "sink", ADDR_B, port,
         str(nbytes)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        subprocess.run(
            ["ip", "netns", "exec", net.ns_a, sys.executable, "-c", _PROBE, "source", ADDR_B,
             port, str(nbytes)],
            check=True, timeout=60,
        )  # fmt: skip
        out, _ = sink.communicate(timeout=60)
    finally:
        stop_processes([sink])
    return float(out) * 8 / 1e6


def _rate_mbit(rate: str) -> float:
    units = {"gbit": 1e3, "mbit": 1.0, "kbit": 1e-3}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: use a tc rate such as 1gbit or 100mbit")


def run_network(
    network: Network, net: Netns | None, args: argparse.Namespace, tmp: Path
) -> list[Result]:
    """Spawn both ranks for one network and collect rank 0's results."""
    out = tmp / f"{network.name}.json"
    common = [
        sys.executable, str(Path(__file__).resolve()),
        "--network", network.name, "--out", str(out),
        "--stages", *map(str, args.stages), "--methods", *args.methods,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds),
        "--micro-batch", str(args.micro_batch), "--n-layer", str(args.n_layer),
        "--n-embd", str(args.n_embd), "--vocab", str(args.vocab), "--seq", str(args.seq),
        "--gloo-timeout", str(args.gloo_timeout),
    ]  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    port = free_port() if net is None else RDV_PORT
    try:
        for rank in range(WORLD):
            # TORCH_CPP_LOG_LEVEL: c10d warns that a namespace has no hostname to resolve.
            env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")
            if net is None:
                cmd = [*common, "--addr", "127.0.0.1"]
            else:
                ns, iface = (net.ns_a, net.if_a) if rank == 0 else (net.ns_b, net.if_b)
                # gloo must use the veth, not lo, inside the namespace.
                env["GLOO_SOCKET_IFNAME"] = iface
                cmd = ["ip", "netns", "exec", ns, *common, "--addr", ADDR_A, "--iface", iface]
            cmd += ["--port", str(port), "--rank", str(rank)]
            log_file = (tmp / f"{network.name}-rank{rank}.log").open("w")
            logs.append(log_file)
            # Rank 0's progress lines go to our stderr; the rest to a log shown on failure.
            stderr = None if rank == 0 else log_file
            procs.append(subprocess.Popen(cmd, env=env, stdout=log_file, stderr=stderr))
        deadline = time.monotonic() + args.network_timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print(f"{network.name}: ranks still running after {args.network_timeout} s; stopped")
    finally:
        stop_processes(procs)
        for f in logs:
            f.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed or not out.exists():
        for r in failed or range(WORLD):
            text = (tmp / f"{network.name}-rank{r}.log").read_text()
            print(f"--- {network.name} rank {r} exited {procs[r].returncode}; log tail:")
            print("\n".join(text.splitlines()[-30:]))
        return []
    return [Result(**d) for d in json.loads(out.read_text())]


# --------------------------------------------------------------------------- report


def _mb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:.2f}"


def _gather_share(r: Result) -> str:
    """The parameter all-gather's wire over logical bytes (stages 1-3; qwZ shrinks it)."""
    gather = r.ops.get("all_gather")
    if not gather or not gather["bytes"] or r.stage == 0:
        return "-"  # stage 0's compressed all-reduce books a gradient all-gather
    return f"{gather['wire_bytes'] / gather['bytes']:.3f}"


def print_table(network: Network, results: list[Result], args: argparse.Namespace) -> None:
    title = (
        "loopback (127.0.0.1)"
        if network.rate is None
        else f"{network.rate} veth between namespaces (tbf burst {args.burst}, "
        f"latency {args.latency})"
    )
    if network.link_mbps is not None:
        title += f"; one TCP stream measured {network.link_mbps:.0f} Mbit/s"
    print(f"\n## {title}\n")
    head = (
        f"{'stage':>5} {'method':<11} {'step ms':>9} {'IQR':>5} {'x none':>7} {'cpu ms':>7} "
        f"{'logical MB':>10} {'wire MB':>8} {'ratio':>6} {'NIC tx MB':>9} {'NIC x none':>10} "
        f"{'link ms':>7} {'codec ms':>8} {'AG wire':>7} {'loss':>7}"
    )
    print(head)
    print("-" * len(head))
    base = {r.stage: r for r in results if r.method == "none"}
    for r in results:
        # The least time the step's bytes need on the link (each direction has its own).
        link = (
            f"{r.nic_tx_bytes * 8 / (network.link_mbps * 1e3):.0f}"
            if r.nic_tx_bytes is not None and network.link_mbps
            else "-"
        )
        b = base.get(r.stage)
        rel = fmt_ratio(ratio(r.median_ms, b.median_ms)) if b else "-"
        nic_rel = fmt_ratio(ratio(r.nic_tx_bytes, b.nic_tx_bytes)) if b else "-"
        print(
            f"{r.stage:>5} {r.method:<11} {r.median_ms:>9.1f} {100 * r.iqr:>4.0f}% {rel:>7} "
            f"{r.cpu_ms:>7.0f} "
            f"{_mb(r.logical_bytes):>10} {_mb(r.wire_bytes):>8} {r.ratio:>5.1f}x "
            f"{_mb(r.nic_tx_bytes):>9} {nic_rel:>10} {link:>7} "
            f"{1e3 * r.codec_s:>8.1f} {_gather_share(r):>7} {r.loss:>7.4f}"
        )
    print("\nMB = 1e6 bytes per step; logical and wire MB from comm_report() (per rank);")
    print("NIC tx MB = bytes the rank's veth sent per step (TCP/IP headers included);")
    print("link ms = NIC tx MB at the measured link rate; cpu ms = process CPU time per step;")
    print("codec ms = CPU time in encode + decode per step; AG wire = the parameter")
    print("all-gather's wire bytes over its logical bytes. See bench/README.md.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--stages", type=int, nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(DEFAULT_METHODS),
        choices=METHODS,
        help="gradient compression methods; 'qwz' = int8 parameter all-gathers only,\n"
        "'int8-gather' = int8 gradients and int8 parameter all-gathers (both stages\n"
        "1-3 only). 'none' is always run as the\n"
        "baseline of the 'x none' column. Default: %(default)s",
    )
    p.add_argument(
        "--rates",
        nargs="*",
        default=list(DEFAULT_RATES),
        help="tc tbf rates for the veth runs (default: %(default)s); none = loopback only",
    )
    p.add_argument("--burst", default="32kbit", help="tc tbf burst (default: %(default)s)")
    p.add_argument("--latency", default="50ms", help="tc tbf latency (default: %(default)s)")
    p.add_argument("--no-loopback", action="store_true", help="skip the loopback run")
    p.add_argument("--steps", type=int, default=5, help="timed steps per cell")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per cell")
    p.add_argument("--rounds", type=int, default=1, help="run the grid this many times")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=64, help="context length")
    p.add_argument("--json", type=Path, help="write every result here")
    p.add_argument("--gloo-timeout", type=int, default=300, help="seconds per collective")
    p.add_argument(
        "--network-timeout", type=int, default=1200, help="seconds for one network's grid"
    )
    # Internal: how the driver starts a rank.
    for flag in ("--rank", "--port"):
        p.add_argument(flag, type=int, help=argparse.SUPPRESS)
    for flag in ("--network", "--out", "--addr", "--iface"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank is None and "none" not in args.methods:
        args.methods = ["none", *args.methods]
    args.methods = list(dict.fromkeys(args.methods))
    args.stages = sorted(set(args.stages))
    for rate in args.rates:
        try:
            _rate_mbit(rate)
        except ValueError as e:
            p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank is not None:
        return rank_main(args)
    exit_on_sigterm()
    # Ctrl-C must clean up even where SIGINT was inherited ignored (a background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.perf_counter()
    networks = [] if args.no_loopback else [Network("loopback")]
    net: Netns | None = None
    ns_status = "not requested (no --rates)"
    all_results: list[Result] = []
    ok = True
    try:
        if args.rates:
            reason = namespaces_unavailable()
            if reason is None:
                for stale in cleanup_stale():
                    print(f"removed stale namespace {stale} (its run is gone)")
                net = Netns.for_this_process()
                try:
                    net.create()
                    ns_status = f"created {net.ns_a} and {net.ns_b} (veth {net.if_a}/{net.if_b})"
                except RuntimeError as e:
                    net.delete()
                    net, reason = None, str(e)
            if reason is not None:
                ns_status = f"UNAVAILABLE: {reason}"
                print(f"network namespaces cannot be created ({reason}): reporting loopback only")
                networks = [Network("loopback")]
            else:
                networks += [Network(rate, rate) for rate in args.rates]
        with tempfile.TemporaryDirectory(prefix="zpbench-") as tmp:
            for network in networks:
                if network.rate is not None:
                    assert net is not None
                    net.set_rate(network.rate, args.burst, args.latency)
                    network.link_mbps = probe_link(net, _rate_mbit(network.rate))
                print(f"{network.name}: running {len(list(_grid(args.stages, args.methods)))}"
                      f" cells x {args.rounds} round(s)", file=sys.stderr, flush=True)  # fmt: skip
                link = net if network.rate is not None else None
                results = run_network(network, link, args, Path(tmp))
                ok = ok and bool(results)
                all_results += results
                if results:
                    print_table(network, results, args)
    finally:
        # Always, also on Ctrl-C and SIGTERM: the namespaces, their veth and its qdiscs.
        if net is not None:
            net.delete()
    model = GPT(GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4,
                          vocab_size=args.vocab, block_size=args.seq))  # fmt: skip
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"\nmodel: GPT {args.n_layer} layers, d={args.n_embd}, vocab {args.vocab}, "
        f"context {args.seq}, {n_params / 1e6:.2f}M parameters ({4 * n_params / 1e6:.1f} MB "
        f"fp32); micro-batch {args.micro_batch} per rank; 2 ranks on gloo, 1 thread each; "
        f"{args.warmup} warm-up + {args.steps} timed steps x {args.rounds} round(s)"
    )
    print(f"namespaces: {ns_status}; total {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "model": {"n_layer": args.n_layer, "n_embd": args.n_embd, "vocab": args.vocab,
                      "seq": args.seq, "params": n_params, "micro_batch": args.micro_batch},
            "namespaces": ns_status,
            "tbf": {"burst": args.burst, "latency": args.latency},
            "networks": [asdict(n) for n in networks],
            "results": [asdict(r) | {"median_ms": r.median_ms, "cpu_ms": r.cpu_ms,
                                     "ratio": r.ratio}
                        for r in all_results],
        }  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; namespaces removed", file=sys.stderr)
        sys.exit(130)
