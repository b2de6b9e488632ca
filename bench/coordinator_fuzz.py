"""The coordinator against ten thousand random malformed, unauthenticated and absurd
requests, and against large inventories; the figures issue #15 asks for.

A ``zeroplane coordinator`` process of its own (real CLI, token auth, stage 2,
leases of 2 s) gets:

1. **fuzz**: ``--per-kind`` requests of each RPC from tests/coordinator_fuzzing.py
   (seeded; absurd, garbage, tokenless, compressed and valid ones), 8 in flight,
   while a probe checks health every 20 ms; then a legitimate worker registers
   and must be given a generation. Printed: requests by RPC and family, status
   codes, health latency p50/p99/max, the process's RSS (and peak) before and after;
2. **bombs**: tokenless gzip-compressed requests that decompress to 120 MiB, and
   the peak RSS they cost;
3. **inventory**: for each ``--inventory`` size, a fresh coordinator; three workers
   register that inventory one after another (each forms a generation), at
   stage 2 and at stage 3 (a gather unit per 8 parameters). Printed: the
   coordinator's CPU seconds per registration (from /proc), wall seconds, and
   the slowest health answer meanwhile.

    python bench/coordinator_fuzz.py
    python bench/coordinator_fuzz.py --per-kind 200 --inventory 10000 --seed 7

Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import stop_processes  # noqa: E402
from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb  # noqa: E402
from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2_grpc as pb_grpc  # noqa: E402
from coordinator.core.conversions import param_from_proto, param_to_proto  # noqa: E402
from coordinator.core.layout import ParamSpec  # noqa: E402
from tests.coordinator_fuzzing import KINDS, fuzz  # noqa: E402
from tests.coordinator_util import TOKEN, HealthProbe, client, inventory, worker  # noqa: E402

AUTH = (("authorization", f"Bearer {TOKEN}"),)
CLK_TCK = os.sysconf("SC_CLK_TCK")


class Coordinator:
    """A ``zeroplane coordinator`` process; its port, memory and CPU time."""

    def __init__(self, *args: str, log: Path) -> None:
        env = {**os.environ, "ZEROPLANE_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "coordinator", "--host", "127.0.0.1",
             "--port", "0", "--join-window", "0", *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
        )  # fmt: skip
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"the coordinator did not start: {line!r} (see {log})")
        self.port = int(line.rsplit(":", 1)[1])

    def memory_mib(self) -> tuple[float, float]:
        """(resident, peak resident) MiB."""
        fields = dict(
            line.split(":", 1)
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
        )
        return (int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024)

    def cpu_s(self) -> float:
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(stat[11]) + int(stat[12])) / CLK_TCK

    def close(self) -> None:
        stop_processes([self.proc], grace=5)


@contextlib.contextmanager
def coordinator(*args: str, log: Path) -> Iterator[Coordinator]:
    c = Coordinator(*args, log=log)
    try:
        yield c
    finally:
        c.close()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def run_fuzz(args: argparse.Namespace, out: Path) -> dict:
    log = out / "fuzz-coordinator.log"
    with coordinator("--max-workers", "8", "--lease-timeout", "2", "--stage", "2", log=log) as c:
        before = c.memory_mib()
        started = time.perf_counter()
        with HealthProbe(c.port) as probe:
            result = fuzz(c.port, seed=args.seed, per_kind=args.per_kind)
        took = time.perf_counter() - started
        after = c.memory_mib()
        job = [param_from_proto(p) for p in result.job_inventory or ()] or inventory()
        with client(c.port) as legit:
            legit.register(worker("legit"), job)
            legit.start()
            generation = legit.wait_for_generation(timeout=30)
        legit_ok = generation.rank_of("legit") is not None
    text = log.read_text(errors="replace")
    return {
        "seed": args.seed,
        "seconds": round(took, 1),
        "sent": dict(result.sent),
        "families": dict(result.families),
        "codes": dict(result.codes),
        "unexpected": result.unexpected[:20],
        "health": {
            "checks": len(probe.latencies),
            "failures": len(probe.failures),
            "p50_s": probe.percentile(0.5),
            "p99_s": probe.percentile(0.99),
            "max_s": probe.worst,
        },
        "rss_mib": {"before": before[0], "after": after[0], "peak_after": after[1]},
        "legit_worker_admitted": legit_ok,
        "log_tracebacks": text.count("Traceback"),
        "log_internal_errors": text.count("internal error"),
    }


def run_bombs(args: argparse.Namespace, out: Path) -> dict:
    with coordinator(log=out / "bomb-coordinator.log") as c:
        channel = grpc.insecure_channel(
            f"127.0.0.1:{c.port}",
            options=[("grpc.max_send_message_length", -1)],
            compression=grpc.Compression.Gzip,
        )
        with channel:
            stub = pb_grpc.CoordinatorStub(channel)
            stub.Status(pb.StatusRequest(), metadata=AUTH, timeout=10)
            before = c.memory_mib()
            bomb = pb.LeaveRequest(worker_id="a", reason="A" * (120 << 20))
            codes = []
            for _ in range(args.bombs):
                try:
                    stub.Leave(bomb, timeout=60)
                    codes.append("OK")
                except grpc.RpcError as exc:
                    codes.append(exc.code().name)
            after = c.memory_mib()
    return {
        "bombs": args.bombs,
        "decompressed_mib": 120,
        "codes": codes,
        "rss_mib": {"before": before[0], "peak_before": before[1], "peak_after": after[1]},
    }


def run_inventory(n: int, stage: int, out: Path) -> dict:
    specs = [
        ParamSpec(name=f"layers.{i}.mlp.weight", shape=(64, 64), dtype="bfloat16", unit=i // 8)
        for i in range(n)
    ]
    params = [param_to_proto(p) for p in specs]
    requests = [
        pb.RegisterRequest(
            worker=pb.WorkerInfo(worker_id=w, host="127.0.0.1", free_ports=[40000 + i]),
            inventory=params,
        )
        for i, w in enumerate(("a", "b", "c"))
    ]
    rows = []
    with (
        tempfile.TemporaryDirectory() as state_dir,
        coordinator(
            "--max-workers", "3", "--stage", str(stage), "--lease-timeout", "300",
            "--state-file", str(Path(state_dir) / "state.json"),
            log=out / f"inventory-{n}-stage{stage}.log",
        ) as c,
        grpc.insecure_channel(f"127.0.0.1:{c.port}") as channel,
    ):  # fmt: skip
        stub = pb_grpc.CoordinatorStub(channel)
        with HealthProbe(c.port) as probe:
            for request in requests:
                cpu, wall, seen = c.cpu_s(), time.perf_counter(), len(probe.latencies)
                response = stub.Register(request, metadata=AUTH, timeout=300)
                rows.append(
                    {
                        "worker": request.worker.worker_id,
                        "generation": response.generation_id,
                        "coordinator_cpu_s": round(c.cpu_s() - cpu, 3),
                        "wall_s": round(time.perf_counter() - wall, 3),
                        "health_max_s": max(probe.latencies[seen:], default=0.0),
                    }
                )
        state_bytes = sum(p.stat().st_size for p in Path(state_dir).iterdir())
        state_file = (Path(state_dir) / "state.json").stat().st_size
    return {
        "params": n,
        "stage": stage,
        "registrations": rows,
        "state_file_bytes": state_file,
        "state_dir_bytes": state_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--per-kind", type=int, default=2000, help="requests per RPC")
    parser.add_argument("--bombs", type=int, default=3, help="tokenless gzip bombs")
    parser.add_argument(
        "--inventory", type=int, nargs="*", default=[100_000], help="inventory sizes"
    )
    parser.add_argument("--out", type=Path, default=None, help="logs and JSON here")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="zeroplane-fuzz-"))
    out.mkdir(parents=True, exist_ok=True)

    fuzzed = run_fuzz(args, out)
    print(f"fuzz: seed {fuzzed['seed']}, {sum(fuzzed['sent'].values())} requests in "
          f"{fuzzed['seconds']} s")  # fmt: skip
    print("  sent by RPC:    " + ", ".join(f"{k} {fuzzed['sent'].get(k, 0)}" for k in KINDS))
    print(
        "  by family:      " + ", ".join(f"{k} {v}" for k, v in sorted(fuzzed["families"].items()))
    )
    print("  status codes:   " + ", ".join(f"{k} {v}" for k, v in sorted(fuzzed["codes"].items())))
    print(f"  unexpected:     {len(fuzzed['unexpected'])} {fuzzed['unexpected'][:3]}")
    h = fuzzed["health"]
    print(f"  health:         {h['checks']} checks, {h['failures']} failed; p50 {_ms(h['p50_s'])}, "
          f"p99 {_ms(h['p99_s'])}, max {_ms(h['max_s'])}")  # fmt: skip
    m = fuzzed["rss_mib"]
    print(f"  RSS:            {m['before']:.0f} MiB before, {m['after']:.0f} MiB after "
          f"(peak {m['peak_after']:.0f} MiB)")  # fmt: skip
    print(f"  legit worker admitted afterwards: {fuzzed['legit_worker_admitted']}; "
          f"log: {fuzzed['log_tracebacks']} tracebacks, "
          f"{fuzzed['log_internal_errors']} internal errors")  # fmt: skip

    bombs = run_bombs(args, out) if args.bombs else None
    if bombs:
        m = bombs["rss_mib"]
        print(f"bombs: {bombs['bombs']} tokenless gzip requests of 120 MiB decompressed -> "
              f"{', '.join(sorted(set(bombs['codes'])))}; peak RSS {m['peak_before']:.0f} -> "
              f"{m['peak_after']:.0f} MiB")  # fmt: skip

    inventories = []
    for n in args.inventory:
        for stage in (2, 3):
            result = run_inventory(n, stage, out)
            inventories.append(result)
            print(f"inventory: {n} parameters, stage {stage}; state file "
                  f"{result['state_file_bytes']} B (+ inventory once: "
                  f"{result['state_dir_bytes'] - result['state_file_bytes']} B)")  # fmt: skip
            for row in result["registrations"]:
                print(f"  register {row['worker']} -> generation {row['generation']}: coordinator "
                      f"CPU {row['coordinator_cpu_s']:.2f} s, wall {row['wall_s']:.2f} s, "
                      f"health max {_ms(row['health_max_s'])}")  # fmt: skip
    (out / "coordinator_fuzz.json").write_text(
        json.dumps({"fuzz": fuzzed, "bombs": bombs, "inventory": inventories}, indent=1)
    )
    print(f"(logs and JSON in {out})")
    ok = not fuzzed["unexpected"] and fuzzed["legit_worker_admitted"] and not h["failures"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
