"""ZeRO++ at stage 3 across two emulated nodes: bytes crossing the link and step time.

Four gloo ranks, two per "node". Run as root with iproute2, the two nodes are two
network namespaces (ranks 0-1 in one, 2-3 in the other, loopback inside each) joined
by one veth pair rate-limited with ``tc tbf`` (default 1 Gbit/s), the setup of
bench/compression.py with two ranks per namespace; without root, loopback only.
For stage 3 plain, +qwZ (int8 parameter gathers), +hpZ (``hpz_partition_size=2``),
qwZ+hpZ, +qgZ (``compression="int8"``, ``hierarchical_reduce=2``: int8 gradient
reduce-scatters across nodes, full precision within) and all three it reports per
step: the median step time (slowest rank), the bytes the two veth ends sent (the
link's real traffic, headers included), the cross-node bytes the engine's counters
imply (``comm_report(by_group=True)``: a world collective's wire bytes times
(N - k)/N per rank, which is what crosses nodes in gloo's all-gather as broadcasts
and reduce-scatter as all-to-all, plus qgZ's cross-node group's wire bytes times
(m - 1)/m for its m = N/k ranks; the node group's never cross), the same against
plain, and the loss after the last step (every method trains the same model on the
same batches).

    python bench/zeropp.py                  # loopback and a 1 Gbit/s link
    python bench/zeropp.py --rates none     # loopback only

bench/README.md has the last run's table.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import worker  # noqa: E402
from bench.common import (  # noqa: E402
    exit_on_sigterm,
    free_port,
    gloo_group,
    median_ms,
    quiet_gloo_warnings,
    stop_processes,
    timed_step,
)
from bench.compression import (  # noqa: E402
    ADDR_A,
    Netns,
    _nic_tx,
    _rate_mbit,
    cleanup_stale,
    namespaces_unavailable,
    probe_link,
)
from worker.models import GPT, GPTConfig  # noqa: E402

WORLD, PER_NODE = 4, 2
RDV_PORT = 29541
SEED = 0
# method -> ZeroConfig fields at stage 3
METHODS: dict[str, dict[str, Any]] = {
    "plain": {},
    "qwZ": {"stage3_gather_compression": "int8"},
    "hpZ": {"hpz_partition_size": PER_NODE},
    "qwZ+hpZ": {"stage3_gather_compression": "int8", "hpz_partition_size": PER_NODE},
    "qgZ": {"compression": "int8", "hierarchical_reduce": PER_NODE},
    "qwZ+hpZ+qgZ": {
        "stage3_gather_compression": "int8",
        "hpz_partition_size": PER_NODE,
        "compression": "int8",
        "hierarchical_reduce": PER_NODE,
    },
}
NODES = WORLD // PER_NODE


@dataclass
class Result:
    network: str
    method: str
    step_s: list[float]
    link_bytes: float | None  # per step, both veth ends' tx counters
    cross_bytes: float  # per step, all ranks: world x (N - k) / N + cross x (m - 1) / m
    world_wire: float  # per step and rank
    node_wire: float  # per step and rank
    cross_wire: float  # per step and rank: qgZ's cross-node group
    loss: float


def _step(engine: worker.ZeroEngine, idx: torch.Tensor, targets: torch.Tensor) -> float:
    loss = engine(idx, targets)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _wire(report: dict[str, dict[str, dict[str, float]]], scope: str) -> float:
    return sum(v["wire_bytes"] for op, v in report.get(scope, {}).items() if op != "control")


def _measure(method: str, gpt: GPTConfig, args: argparse.Namespace) -> dict[str, Any]:
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(SEED * 1000 + rank)
    n = args.warmup + args.steps
    idx = torch.randint(gpt.vocab_size, (n, args.micro_batch, gpt.block_size), generator=gen)
    targets = torch.randint(gpt.vocab_size, (n, args.micro_batch, gpt.block_size), generator=gen)
    torch.manual_seed(SEED)
    model = GPT(gpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = worker.ZeroConfig(stage=3, compression_block=256, **METHODS[method])
    engine = worker.initialize(model, opt, config=config)
    for i in range(args.warmup):
        _step(engine, idx[i], targets[i])
    dist.barrier()
    before, tx0 = engine.comm_report(by_group=True), _nic_tx(args.iface)
    times, loss = [], 0.0
    for i in range(args.warmup, n):
        loss, wall, _ = timed_step(partial(_step, engine, idx[i], targets[i]))
        times.append(wall)
    tx1 = _nic_tx(args.iface)
    after = engine.comm_report(by_group=True)
    world = (_wire(after, "world") - _wire(before, "world")) / args.steps
    node = (_wire(after, "node") - _wire(before, "node")) / args.steps
    cross = (_wire(after, "cross") - _wire(before, "cross")) / args.steps
    # one rank per namespace reads its veth's counters (both ranks there share it)
    tx = float(tx1 - tx0) / args.steps if tx0 is not None and rank % PER_NODE == 0 else 0.0
    peak = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    sums = torch.tensor([tx, world, node, cross, loss], dtype=torch.float64)
    dist.all_reduce(sums)
    return {
        "step_s": peak.tolist(),
        "link_bytes": float(sums[0]) if args.iface is not None else None,
        "cross_bytes": float(sums[1]) * (WORLD - PER_NODE) / WORLD
        + float(sums[3]) * (NODES - 1) / NODES,
        "world_wire": float(sums[1]) / WORLD,
        "node_wire": float(sums[2]) / WORLD,
        "cross_wire": float(sums[3]) / WORLD,
        "loss": float(sums[4]) / WORLD,
    }


def rank_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    logging.getLogger("worker").setLevel(logging.ERROR)
    quiet_gloo_warnings()
    gpt = GPTConfig(
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=4,
        vocab_size=args.vocab,
        block_size=args.seq,
    )
    with gloo_group(args.addr, args.port, args.rank, WORLD, timedelta(seconds=300)):
        cells: dict[str, dict[str, Any]] = {}
        for r in range(args.rounds):
            for method in args.methods:
                t0 = time.perf_counter()
                m = _measure(method, gpt, args)
                gc.collect()
                if method in cells:
                    m["step_s"] = cells[method]["step_s"] + m["step_s"]
                cells[method] = m
                if args.rank == 0:
                    print(
                        f"  [{args.network}] round {r + 1}/{args.rounds} {method:<8} median "
                        f"{median_ms(m['step_s']):8.1f} ms ({time.perf_counter() - t0:.1f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
        if args.rank == 0:
            out = [asdict(Result(network=args.network, method=k, **m)) for k, m in cells.items()]
            Path(args.out).write_text(json.dumps(out))
    return 0


def run_network(name: str, net: Netns | None, args: argparse.Namespace, tmp: Path) -> list[Result]:
    out = tmp / f"{name}.json"
    common = [
        sys.executable, str(Path(__file__).resolve()), "--network", name, "--out", str(out),
        "--methods", *args.methods, "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--rounds", str(args.rounds), "--micro-batch", str(args.micro_batch),
        "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
        "--vocab", str(args.vocab), "--seq", str(args.seq),
    ]  # fmt: skip
    port = free_port() if net is None else RDV_PORT
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for rank in range(WORLD):
            env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")
            if net is None:
                cmd = [*common, "--addr", "127.0.0.1"]
            else:
                ns, iface = (net.ns_a, net.if_a) if rank < PER_NODE else (net.ns_b, net.if_b)
                env["GLOO_SOCKET_IFNAME"] = iface
                cmd = ["ip", "netns", "exec", ns, *common, "--addr", ADDR_A, "--iface", iface]
            cmd += ["--port", str(port), "--rank", str(rank)]
            log_file = (tmp / f"{name}-rank{rank}.log").open("w")
            logs.append(log_file)
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=log_file, stderr=None if rank == 0 else log_file
                )
            )
        deadline = time.monotonic() + args.network_timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print(f"{name}: ranks still running after {args.network_timeout} s; stopped")
    finally:
        stop_processes(procs)
        for f in logs:
            f.close()
    if any(p.returncode != 0 for p in procs) or not out.exists():
        for r in range(WORLD):
            text = (tmp / f"{name}-rank{r}.log").read_text()
            print(f"--- {name} rank {r} exited {procs[r].returncode}; log tail:")
            print("\n".join(text.splitlines()[-20:]))
        return []
    return [Result(**d) for d in json.loads(out.read_text())]


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def print_table(name: str, link: str, results: list[Result]) -> None:
    base = next((r for r in results if r.method == "plain"), None)
    print(f"\n{name}: {link}")
    print(
        "| stage 3 | step ms | vs plain | link MB/step | vs plain | cross-node MB/step "
        "(counters) | vs plain | world / node / cross wire MB per rank | loss | vs plain |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        step = median_ms(r.step_s)
        t = f"{step / median_ms(base.step_s):.2f}x" if base else "-"
        lb = (
            f"{r.link_bytes / base.link_bytes:.2f}x"
            if base and r.link_bytes is not None and base.link_bytes
            else "-"
        )
        cb = f"{r.cross_bytes / base.cross_bytes:.2f}x" if base and base.cross_bytes else "-"
        dl = f"{(r.loss - base.loss) / base.loss:+.2%}" if base else "-"
        print(
            f"| {r.method} | {step:.0f} | {t} | {_mb(r.link_bytes)} | {lb} | "
            f"{_mb(r.cross_bytes)} | {cb} | {_mb(r.world_wire)} / {_mb(r.node_wire)} / "
            f"{_mb(r.cross_wire)} | {r.loss:.4f} | {dl} |"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--rates", nargs="+", default=["1gbit"], help="tc rates; none: loopback only")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--network-timeout", type=float, default=900)
    # rank side
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--network", default="loopback", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--addr", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--iface", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank is not None:
        return rank_main(args)
    exit_on_sigterm()
    torch.manual_seed(SEED)
    numel = sum(
        p.numel()
        for p in GPT(
            GPTConfig(
                n_layer=args.n_layer,
                n_embd=args.n_embd,
                n_head=4,
                vocab_size=args.vocab,
                block_size=args.seq,
            )
        ).parameters()
    )
    print(
        f"ZeRO++ at stage 3: {WORLD} gloo ranks, {PER_NODE} per node; GPT {numel / 1e6:.2f}M "
        f"parameters (fp32), micro-batch {args.micro_batch} x {args.seq} tokens per rank; "
        f"{args.steps} steps after {args.warmup} warm-up, {args.rounds} round(s)"
    )
    rates = [] if args.rates == ["none"] else args.rates
    why = namespaces_unavailable() if rates else None
    if why:
        print(f"namespaces unavailable ({why}): loopback only")
        rates = []
    with tempfile.TemporaryDirectory(prefix="zeropp-") as tmp:
        results = run_network("loopback", None, args, Path(tmp))
        print_table("loopback", "every rank on 127.0.0.1 (nothing is rate-limited)", results)
        if rates:
            cleanup_stale()
            net = Netns.for_this_process()
            try:
                net.create()
                for rate in rates:
                    net.set_rate(rate, "256kb", "50ms")
                    mbps = probe_link(net, _rate_mbit(rate))
                    res = run_network(rate, net, args, Path(tmp))
                    print_table(
                        rate,
                        f"ranks 0-1 and 2-3 in two namespaces, one veth between them at "
                        f"{rate} (tbf; a TCP stream measured {mbps:.0f} Mbit/s)",
                        res,
                    )
            finally:
                net.delete()
    print(
        "\nstep ms: median over steps of the slowest rank; link MB: both veth ends' tx "
        "counters per step (TCP/IP headers included); cross-node MB: world collectives' "
        "wire bytes x (N-k)/N plus qgZ's cross-node group's x (m-1)/m, summed over ranks "
        "(node-group collectives never cross); "
        "loss: mean over ranks after the last step."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
