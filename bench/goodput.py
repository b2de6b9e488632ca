"""Goodput under failures: useful steps per second while a worker is SIGKILLed every N steps.

One job (the ≈20M-parameter GPT of bench/elastic_worker.py, or ``--model small``) on
``--nproc`` ranks (gloo, one torch thread each) trains ``--steps`` optimizer steps.
Per ``--every`` N, one worker is SIGKILLed about every N steps, and the job is run as:

* **zeroplane**, elastic as ``zeroplane run --nproc P --min-workers P-1 --max-workers P
  --max-restarts K`` runs it: :class:`coordinator.launchers.local.LocalJob` with an embedded
  coordinator. The survivors recover from the in-memory replicas (``--replica-every``)
  or the last checkpoint and train on; the launcher starts a replacement, which joins
  live;
* **restart** (torchrun-style, bench/elastic.py's ``RestartRun``): every worker is
  stopped at once (SIGKILL, as an agent that noticed the dead one at no delay) and
  ``P`` fresh ones resume from the last checkpoint. A lower bound on torchrun's cost:
  no agent, no rendezvous, no monitor interval.

Each system also runs once without failures (the baseline of its lost fraction).
Both systems checkpoint every ``--save-every`` steps, with and without failures.

Kill points: the k-th kill lands once a step numbered at least ``k·N + d_k`` is done at
full size (the previous replacement has joined), ``d_k`` drawn in ``[0, save_every)``
from ``--seed``: the same points for both systems, at a random phase of the checkpoint
period (a kill right after a checkpoint would cost a restart nothing to replay).

Definitions (printed with the table):

* ``wall``: from the first step done (step 1, any rank) to the last step done
  (step ``--steps``): start-up, the same for every run, is left out; every recovery
  is inside;
* ``goodput = (steps - 1) / wall``;
* ``lost = 1 - goodput / goodput of the same system without failures``;
* ``zp/rs lost``: zeroplane's lost fraction over the restart's at the same N (target
  at most 1/3); the issue's other target is zeroplane's ``lost`` < 10% at N = 50.

Run ``python bench/goodput.py --help``; bench/README.md has the details.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

# Run from a checkout without installing the package.
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import exit_on_sigterm, fmt_cell, ratio  # noqa: E402
from bench.elastic import WORKER, RestartRun, no_nan, read_jsonl  # noqa: E402
from coordinator.control.embedded import EmbeddedCoordinator  # noqa: E402
from coordinator.core.settings import (  # noqa: E402
    CoordinatorConfig,
    MembershipConfig,
    PlanConfig,
    ServerConfig,
)
from coordinator.launchers.local import LaunchSpec, LocalJob  # noqa: E402

NAN = float("nan")
DEFINITIONS = """\
kills      SIGKILLs that landed (the k-th once a step >= k*N + d_k is done at full
           size after the previous one; d_k in [0, save_every) from --seed)
wall       first step done (step 1) -> last step done (step --steps), any rank;
           start-up is left out, every recovery is inside
goodput    useful steps per second: (steps - 1) / wall
x no-fail  goodput over the same system's run without failures
lost       1 - x no-fail: the share of the time the failures cost (target: zeroplane
           under 10% at N = 50)
s/kill     (wall - wall without failures) / kills: seconds one failure cost
x rs       zeroplane's goodput over the restart's at the same N
zp/rs      zeroplane's lost over the restart's at the same N (target <= 0.33)
/kill      zeroplane's s/kill over the restart's
replayed   steps done again after a rollback (rank 0's step events)
step s     median gap between consecutive steps on rank 0 (all sizes)"""


# replacements beyond the planned kills that a zeroplane job may make
SPARE_RESTARTS = 3
# what a run that failed has in place of its measurements
FAILED: dict[str, Any] = {"wall_s": None, "goodput": None, "replayed": None, "step_s": None}

# ---------------------------------------------------------------------------- plan


def kill_points(steps: int, every: int | None, save_every: int, seed: int) -> list[int]:
    """The step after which each kill lands: ``k·every + d_k`` below ``steps``,
    ``d_k`` uniform in ``[0, save_every)`` from ``seed``; none when ``every`` is None."""
    if every is None:
        return []
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    rng = random.Random(f"{seed}-{every}")
    points, k = [], 1
    while (point := k * every + rng.randrange(max(1, save_every))) < steps:
        points.append(point)
        k += 1
    return points


# ---------------------------------------------------------------------------- analysis


def read_events(directory: Path) -> list[dict[str, Any]]:
    """Every worker's events in ``directory`` (one ``*.jsonl`` per process), by time."""
    events = [
        {**e, "src": path.stem}
        for path in sorted(directory.glob("*.jsonl"))
        for e in read_jsonl(path)
    ]
    return sorted(events, key=lambda e: e["t"])


def summarize(events: Iterable[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Goodput of one run from its workers' events (see DEFINITIONS)."""
    step_events = [e for e in events if e["ev"] == "step"]
    first = [e["done"] for e in step_events if e["step"] == 1]
    last = [e["done"] for e in step_events if e["step"] == steps]
    if not first or not last:
        raise ValueError(f"the run has no step 1 or no step {steps}")
    # one rank 0 per step at any world size: its events count each computed step once
    ranked = sorted((e for e in step_events if e["rank"] == 0), key=lambda e: e["done"])
    replayed, high, gaps = 0, 0, []
    for prev, e in zip([None, *ranked], ranked, strict=False):
        replayed += e["step"] <= high
        high = max(high, e["step"])
        if prev is not None and e["step"] == prev["step"] + 1:
            gaps.append(e["done"] - prev["done"])
    wall = min(last) - min(first)
    return {
        "t_first_step": min(first),
        "t_last_step": min(last),
        "wall_s": wall,
        "goodput": (steps - 1) / wall if wall > 0 else NAN,
        "computed": len(ranked),
        "replayed": replayed,
        "step_s": statistics.median(gaps) if gaps else NAN,
    }


def table(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The report's rows: each run beside its own system's run without failures and,
    on zeroplane's rows, beside the restart at the same N (see DEFINITIONS)."""
    base = {r["system"]: r for r in results if r["every"] is None}
    rows = []
    for r in results:
        own = base.get(r["system"])
        x = ratio(r["goodput"], None if own is None else own["goodput"])
        kills = len(r["kills"])
        rows.append(
            {
                "system": r["system"],
                "every": r["every"],
                "kills": kills,
                "wall_s": r["wall_s"],
                "goodput": r["goodput"],
                "x_no_fail": x,
                "lost": None if x is None else 1.0 - x,
                "s_per_kill": None
                if own is None or not kills or r["wall_s"] is None or own["wall_s"] is None
                else (r["wall_s"] - own["wall_s"]) / kills,
                "replayed": r["replayed"],
                "step_s": r["step_s"],
                "error": r.get("error"),
                "late_error": r.get("late_error"),
            }
        )
    by = {(row["system"], row["every"]): row for row in rows}
    for row in rows:
        rs = by.get(("restart", row["every"])) if row["system"] == "zeroplane" else None
        row["x_restart"] = None if rs is None else ratio(row["goodput"], rs["goodput"])
        # a ratio of two losses is only asked for with failures
        failed = rs is not None and row["every"] is not None
        row["zp_over_rs_lost"] = ratio(row["lost"], rs["lost"]) if failed else None
        row["zp_over_rs_per_kill"] = ratio(row["s_per_kill"], rs["s_per_kill"]) if failed else None
        row["kills_differ"] = failed and row["kills"] != rs["kills"]
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        f"{'system':<10}{'fail every':>11}{'kills':>6}{'wall s':>8}{'goodput':>9}"
        f"{'x no-fail':>10}{'lost':>8}{'s/kill':>8}{'x rs':>7}{'zp/rs':>7}{'/kill':>7}"
        f"{'replayed':>9}{'step s':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lost = "-" if r["lost"] is None else f"{100 * r['lost']:.1f}%"
        every = "never" if r["every"] is None else f"{r['every']} steps"
        lines.append(
            f"{r['system']:<10}{every:>11}{r['kills']:>6}{fmt_cell(r['wall_s']):>8}"
            f"{fmt_cell(r['goodput']):>9}{fmt_cell(r['x_no_fail']):>10}{lost:>8}"
            f"{fmt_cell(r['s_per_kill']):>8}{fmt_cell(r['x_restart']):>7}"
            f"{fmt_cell(r['zp_over_rs_lost']):>7}{fmt_cell(r['zp_over_rs_per_kill']):>7}"
            f"{'-' if r['replayed'] is None else r['replayed']:>9}{fmt_cell(r['step_s']):>8}"
        )
    for r in rows:
        if r["error"]:
            every = "no failures" if r["every"] is None else f"a kill every {r['every']} steps"
            lines.append(f"FAILED: {r['system']}, {every}: {r['error'].splitlines()[0]}")
        elif r["late_error"]:
            every = "no failures" if r["every"] is None else f"a kill every {r['every']} steps"
            first = r["late_error"].splitlines()[0]
            lines.append(f"note: {r['system']}, {every}, after its last step: {first}")
    for r in rows:
        if r["kills_differ"]:
            lines.append(
                f"note: at N = {r['every']} the systems took different numbers of kills (a kill "
                "waits until the job is back at full size): compare /kill, not zp/rs"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- runs


class Killer:
    """When the next kill is due: once a step numbered at least the next point is
    done at full size after the previous kill."""

    def __init__(self, points: Sequence[int], nproc: int, seed: int) -> None:
        self.points, self.nproc = list(points), nproc
        self.rng = random.Random(seed)
        self.kills: list[dict[str, Any]] = []

    def due(self, events: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
        if len(self.kills) == len(self.points):
            return None
        point = self.points[len(self.kills)]
        after = self.kills[-1]["t"] if self.kills else 0.0
        return next(
            (
                e
                for e in events
                if e["ev"] == "step"
                and e["world"] == self.nproc
                and e["done"] > after
                and e["step"] >= point
            ),
            None,
        )

    def record(self, at: dict[str, Any], victim: str) -> None:
        self.kills.append(
            {
                "point": self.points[len(self.kills)],
                "step": at["step"],
                "t": time.time(),
                "victim": victim,
            }
        )


def worker_flags(opts: argparse.Namespace) -> list[str]:
    return ["--steps", str(opts.steps), "--model", opts.model]


class ZeroplaneRun:
    """The job as ``zeroplane run --min-workers P-1 --max-workers P --max-restarts K`` runs it."""

    SYSTEM = "zeroplane"

    def __init__(self, opts: argparse.Namespace, root: Path, every: int | None) -> None:
        self.opts, self.every = opts, every
        self.dir = root / f"zeroplane-every{every or 0}"
        self.dir.mkdir(parents=True)
        self.killer = Killer(
            kill_points(opts.steps, every, opts.save_every, opts.seed), opts.nproc, opts.seed
        )
        self._logs: dict[int, IO[str]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.unplanned_exits = 0
        self.job: LocalJob | None = None

    def _line(self, index: int, stream: str, line: str) -> None:
        with self._lock:
            if self._closed:  # a last line pumped after the job stopped
                return
            if index not in self._logs:
                self._logs[index] = (self.dir / f"worker{index}.log").open("w", buffering=1)
            self._logs[index].write(line + "\n")

    def run(self) -> None:
        o = self.opts
        membership = MembershipConfig(
            min_workers=o.nproc - 1,
            max_workers=o.nproc,
            join_window_s=o.join_window,
            lease_timeout_s=o.lease,
            heartbeat_interval_s=o.heartbeat,
        )
        coordinator = EmbeddedCoordinator(
            CoordinatorConfig(
                server=ServerConfig(token=secrets.token_urlsafe(16)),
                membership=membership,
                plan=PlanConfig(stage=o.stage, precision="fp32", bucket_numel=o.bucket_numel),
            )
        )
        command = (
            sys.executable,
            str(WORKER),
            "--events",
            str(self.dir / "w-{pid}.jsonl"),
            "--stage",
            str(o.stage),
            "--global-batch",
            str(o.global_batch),
            "--seq",
            str(o.seq),
            "--checkpoint",
            str(self.dir / "ckpt"),
            "--save-every",
            str(o.save_every),
            "--bucket-numel",
            str(o.bucket_numel),
            "--replica-every",
            str(o.replica_every),
            *(["--no-gradient-log"] if o.no_gradient_log else []),
            *worker_flags(o),
        )
        spec = LaunchSpec(
            command=command,
            nproc=o.nproc,
            env={"ZEROPLANE_COLLECTIVE_TIMEOUT_S": str(o.collective_timeout)},
            fork_server=not o.no_fork_server,
        )
        self.job = job = LocalJob(
            spec,
            on_line=self._line,
            services=(coordinator,),
            # spare restarts: a worker that dies unplanned (printed, and counted in the
            # JSON as unplanned_exits) must not make a planned kill fail the job
            restarts=len(self.killer.points) + SPARE_RESTARTS,
        )
        job.start()
        stalled = Stall(o.timeout)
        while (result := job.poll()) is None:
            events = read_events(self.dir)
            stalled.check(events, self.SYSTEM, self.tails)
            at = self.killer.due(events)
            if at is not None and job.running:
                index = self.killer.rng.choice(job.running)
                os.kill(job.pids[index], signal.SIGKILL)
                self.killer.record(at, f"worker{index}")
            time.sleep(0.05)
        self.unplanned_exits = sum(c != 0 for c in result.returncodes) - len(self.killer.kills)
        if not result.ok:
            raise RuntimeError(f"zeroplane: {result.message}\n{self.tails()}")

    def tails(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.dir.glob("*.log"))
        )

    def close(self) -> None:
        if self.job is not None:
            self.job.stop()
        with self._lock:
            self._closed = True
            for f in self._logs.values():
                f.close()


class RestartGoodputRun(RestartRun):
    """bench/elastic.py's torchrun-style restart, killed on the same schedule."""

    def __init__(self, opts: argparse.Namespace, root: Path, every: int | None) -> None:
        super().__init__(opts.stage, opts, root / f"restart-every{every or 0}")
        self.every = every
        self.killer = Killer(
            kill_points(opts.steps, every, opts.save_every, opts.seed), opts.nproc, opts.seed
        )

    def spawn(self, name: str, env: dict[str, str], *extra: str):  # type: ignore[override]
        return super().spawn(name, env, *extra, *worker_flags(self.opts))

    def run(self) -> None:
        o = self.opts
        self.start(o.nproc, resume=False)
        stalled = Stall(o.timeout)
        while True:
            codes = {w.name: w.poll() for w in self.live}
            bad = {name: c for name, c in codes.items() if c not in (None, 0)}
            if bad:
                raise RuntimeError(f"restart: workers failed {bad}\n{self.tails()}")
            if all(c == 0 for c in codes.values()):
                return
            events = read_events(self.dir)
            stalled.check(events, self.system, self.tails)
            at = self.killer.due(events)
            if at is not None:
                victim = self.killer.rng.choice(self.live)
                victim.proc.kill()
                self.killer.record(at, victim.name)
                # the agent stops everyone and starts them again from the last checkpoint
                self.stop(signal.SIGKILL)
                self.start(o.nproc, resume=(self.ckpt / "latest").exists())
            time.sleep(0.05)

    def tails(self) -> str:
        return "\n".join(f"--- {n}\n{self.tail(w)}" for n, w in self.workers.items())


class Stall:
    """Fail a run that has done no new step for ``timeout`` seconds."""

    def __init__(self, timeout: float) -> None:
        self.timeout, self.count, self.since = timeout, 0, time.monotonic()

    def check(self, events: Sequence[dict[str, Any]], system: str, tails: Any) -> None:
        n = sum(e["ev"] == "step" for e in events)
        if n != self.count:
            self.count, self.since = n, time.monotonic()
        elif time.monotonic() - self.since > self.timeout:
            raise RuntimeError(f"{system}: no step for {self.timeout:g} s\n{tails()}")


def measure(
    run: ZeroplaneRun | RestartGoodputRun,
    opts: argparse.Namespace,
    error: str | None = None,
    *,
    late: bool = False,
) -> dict[str, Any]:
    """One run's result; ``late``: ``error`` came after the last step was done."""
    out = {
        "system": run.SYSTEM,
        "every": run.every,
        "kills": run.killer.kills,
        "kill_points": run.killer.points,
        "unplanned_exits": getattr(run, "unplanned_exits", 0),
    }
    if error is not None and not late:
        return {**out, **FAILED, "error": error}
    return {**out, **summarize(read_events(run.dir), opts.steps), "late_error": error}


# ---------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--systems", nargs="+", default=["zeroplane", "restart"], choices=("zeroplane", "restart")
    )
    p.add_argument("--every", type=int, nargs="+", default=[20, 50], help="a kill every N steps")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    p.add_argument("--nproc", type=int, default=3, help="ranks (zeroplane: elastic down to P-1)")
    p.add_argument("--model", choices=("20m", "small"), default="20m")
    p.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    p.add_argument("--global-batch", type=int, default=6, help="divisible by P and P-1")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    p.add_argument("--save-every", type=int, default=10, help="periodic checkpoint, steps")
    p.add_argument(
        "--replica-every", type=int, default=10, help="zeroplane in-memory replicas, steps (0: off)"
    )
    p.add_argument(
        "--no-gradient-log",
        action="store_true",
        help="zeroplane: a crash rolls back to the replicas and trains the steps since again "
        "(default: the lost rank is brought forward from its replica and the gradient log)",
    )
    p.add_argument("--lease", type=float, default=3.0, help="coordinator lease timeout, s")
    p.add_argument("--heartbeat", type=float, default=0.5, help="heartbeat interval, s")
    p.add_argument(
        "--join-window",
        type=float,
        default=3.0,
        help="coordinator join window, s (as zeroplane run)",
    )
    p.add_argument("--collective-timeout", type=float, default=15.0)
    p.add_argument("--bucket-numel", type=int, default=PlanConfig().bucket_numel)
    p.add_argument("--seed", type=int, default=0, help="kill points and victims")
    p.add_argument(
        "--timeout", type=float, default=180.0, help="fail a run with no step for this, s"
    )
    p.add_argument(
        "--no-fork-server",
        action="store_true",
        help="zeroplane: start each worker as a fresh process, as `zeroplane run "
        "--no-fork-server` does (default: forked from one that imported torch once)",
    )
    p.add_argument("--workdir", type=Path, help="keep logs, events and checkpoints here")
    p.add_argument("--json", type=Path, help="write every measurement here")
    opts = p.parse_args(argv)
    if opts.nproc < 2:
        p.error(f"--nproc must be >= 2 (a kill leaves P-1 survivors), got {opts.nproc}")
    if opts.global_batch % opts.nproc or opts.global_batch % (opts.nproc - 1):
        p.error(
            f"--global-batch {opts.global_batch} must split over "
            f"{opts.nproc} and {opts.nproc - 1} ranks"
        )
    if any(n < 1 for n in opts.every):
        p.error(f"--every must be >= 1, got {opts.every}")
    if opts.save_every < 1 or opts.steps < 2:
        p.error("--save-every must be >= 1 and --steps >= 2")
    if opts.replica_every < 0:
        p.error(f"--replica-every must be >= 0, got {opts.replica_every}")
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    exit_on_sigterm()
    tmp = None
    if opts.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="zp-goodput-")
        root = Path(tmp.name)
    else:
        root = opts.workdir / time.strftime("goodput-%Y%m%d-%H%M%S")
        root.mkdir(parents=True)
    load_before = os.getloadavg()
    started = time.time()
    results = []
    try:
        for every in [None, *opts.every]:
            for cls in (ZeroplaneRun, RestartGoodputRun):
                if cls.SYSTEM not in opts.systems:
                    continue
                run = cls(opts, root, every)
                what = "no failures" if every is None else f"a kill every {every} steps"
                print(f"{run.SYSTEM}, {what} ...", flush=True)
                error = None
                try:
                    run.run()
                except RuntimeError as exc:
                    # a job that fails under failures is a result too: report it, go on
                    error = str(exc)
                    (run.dir / "error.txt").write_text(error)
                finally:
                    run.close()
                # a worker that dies once the last step is done cost no step: measured,
                # with the error beside it
                late = error is not None and any(
                    e["ev"] == "step" and e["step"] == opts.steps for e in read_events(run.dir)
                )
                if error is not None:
                    what = "after the last step" if late else "FAILED"
                    print(f"{what}: {error.splitlines()[0]} (details in the JSON)", flush=True)
                results.append(measure(run, opts, error, late=late))
        load_after = os.getloadavg()
        rows = table(results)
        print(
            f"\n{opts.model} GPT, stage {opts.stage}, {opts.nproc} ranks, AdamW, fp32, gloo, "
            f"{opts.steps} steps of {opts.global_batch} x {opts.seq} tokens; checkpoint every "
            f"{opts.save_every} steps; zeroplane replicas every {opts.replica_every} steps"
            f"{' without' if opts.no_gradient_log else ' with'} the gradient log, "
            f"lease {opts.lease:g} s, heartbeat {opts.heartbeat:g} s, join window "
            f"{opts.join_window:g} s; seed {opts.seed}; load average {load_before[0]:.1f} → "
            f"{load_after[0]:.1f} on {os.cpu_count()} CPUs; {time.time() - started:.0f} s\n"
        )
        print(format_table(rows))
        for r in results:
            if r["unplanned_exits"]:
                print(f"  {r['system']} every {r['every']}: {r['unplanned_exits']} unplanned exits")
            if r["kills"]:
                at = ", ".join(f"{k['step']}" for k in r["kills"])
                print(f"  {r['system']} every {r['every']}: killed after steps {at}")
        print("\n" + DEFINITIONS)
        if opts.json:
            opts.json.parent.mkdir(parents=True, exist_ok=True)
            out = {
                "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(opts).items()},
                "load_average": [load_before, load_after],
                "cpus": os.cpu_count(),
                "definitions": DEFINITIONS,
                "table": rows,
                "runs": results,
            }
            opts.json.write_text(json.dumps(no_nan(out), indent=1))
            print(f"wrote {opts.json}")
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 1 if any(r.get("error") or r.get("late_error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
