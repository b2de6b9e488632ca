"""How long training pauses when zeroplane changes its membership, beside a restart.

For a ≈20M-parameter GPT (bench/elastic_worker.py) on gloo, one run measures, per
``--stages`` stage:

* **zeroplane**: an in-process coordinator and worker processes. Scale-up 2→3
  (spawn a worker), graceful scale-down 3→2 (SIGTERM one: it hands its shards
  over and exits 0), scale-up 2→3 again, then crash 3→2 (SIGKILL one, two steps
  after a checkpoint: the benchmark tells the coordinator once the process has
  exited, as ``zeroplane run``'s launcher does, and the survivors roll back to the
  checkpoint, or with ``--replica-every K`` to their in-memory replicas).
* **restart** (torchrun-style): the same script without a coordinator, ranks from
  ``RANK``/``WORLD_SIZE``/``MASTER_*`` as torchrun sets them. For the same four
  changes every worker is stopped and the new number started fresh from the last
  checkpoint. Graceful changes stop with SIGTERM (all ranks agree on the step,
  save a checkpoint there and exit 0, so no step is lost); the crash SIGKILLs
  every worker two steps after a periodic checkpoint, which is a torchrun agent
  that notices the dead worker and stops the rest instantly.

The restart side is a lower bound on what torchrun costs: the harness respawns
the workers itself the moment the old ones are gone, with no agent rendezvous
and no monitor interval.

Definitions (printed with the table): the time a step completes is when its
optimizer step finished (before any membership work inside ``engine.step()``),
on the observer, the process that is rank 0 (zeroplane: the same process all
along; restart: rank 0 of each launch). For a change from a to b ranks:

* ``pause = t(first step computed at b ranks) - t(last step computed at a ranks
  before it) - median step time at b ranks``: the time training stood still
  beyond one ordinary step; a periodic checkpoint save that falls between the
  two is taken out (it happens with or without the change; a restart's save at
  the stop is part of the restart and stays in);
* ``lost = t(first step at b ranks numbered past the last step done at a ranks)
  - t(that last step) - median step at b``: the pause plus the replay of the
  steps rolled back to the checkpoint (equal to the pause when none were);
* ``median step``: of the gaps between consecutive steps at that world size in
  the same process with no checkpoint save, rollback or membership change in between.

Run ``python bench/elastic.py --help``; bench/README.md has the details.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run from a checkout without installing the package.
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    exit_on_sigterm,
    fmt_cell,
    free_port,
    rank_env,
    ratio,
    rel_iqr,
    stop_processes,
)
from coordinator.control.server import CoordinatorServer, create_server  # noqa: E402
from coordinator.core.settings import (  # noqa: E402
    CoordinatorConfig,
    MembershipConfig,
    PlanConfig,
    ServerConfig,
)

NAN = float("nan")
WORKER = Path(__file__).with_name("elastic_worker.py")
LOG_LINE = re.compile(r"^(\d+\.\d+) (\w+) (\S+): (.*)$")
DEFINITIONS = """\
step done    when a step's optimizer step finished (before any membership work
             inside engine.step()), on rank 0 (zeroplane: one process throughout;
             restart: rank 0 of each launch)
step a/b     median gap between consecutive steps at a / b ranks, same process,
             no checkpoint save, rollback or membership change in between
pause        t(first step computed at b ranks) - t(last step at a ranks before it)
             - step b - any periodic save in between: how long training stood
             still beyond one ordinary step
lost         t(first step at b ranks numbered past the last step done at a ranks)
             - t(that step) - step b: pause plus replaying the rolled-back steps
replayed     steps done before the change and done again after it
trigger->1st from the harness's action (spawn, SIGTERM, SIGKILL) to the first step at b
             ranks; for a scale-up it includes the newcomer's start-up, during which
             zeroplane keeps training at a ranks
x            zeroplane / restart"""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line still being written
    return out


def log_time(path: Path, pattern: str, after: float) -> float | None:
    """The timestamp of the first engine log line matching ``pattern`` after ``after``."""
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        m = LOG_LINE.match(line)
        if m and float(m.group(1)) > after and re.search(pattern, m.group(4)):
            return float(m.group(1))
    return None


@dataclass
class Worker:
    name: str
    proc: subprocess.Popen
    events: Path
    log: Path
    spawned: float
    exited: float | None = None

    def read(self) -> list[dict[str, Any]]:
        return [{**e, "src": self.name} for e in read_jsonl(self.events)]

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None and self.exited is None:
            self.exited = time.time()
        return code


@dataclass
class Change:
    label: str
    kind: str  # "up", "down" or "crash"
    a: int
    b: int
    trigger: float
    # names of the processes that matter: the newcomer; the old and new rank 0 of a restart
    new: str = ""
    old: str = ""
    # (what, unix time) milestones for the breakdown, filled in after the run
    marks: list[tuple[str, float | None]] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)


class Run:
    """Worker processes of one system at one stage, and what they logged."""

    SYSTEM = ""

    def __init__(self, stage: int, opts: argparse.Namespace, root: Path) -> None:
        self.system, self.stage, self.opts = self.SYSTEM, stage, opts
        self.dir = root / f"{self.system}-stage{stage}"
        self.dir.mkdir(parents=True)
        self.ckpt = self.dir / "ckpt"
        self.workers: dict[str, Worker] = {}
        self.observers: list[str] = []  # the rank-0 processes, in order
        self.changes: list[Change] = []

    def spawn(self, name: str, env: dict[str, str], *extra: str) -> Worker:
        cmd = [
            sys.executable,
            str(WORKER),
            "--events",
            str(self.dir / f"{name}.jsonl"),
            "--stage",
            str(self.stage),
            "--global-batch",
            str(self.opts.global_batch),
            "--seq",
            str(self.opts.seq),
            "--checkpoint",
            str(self.ckpt),
            "--save-every",
            str(self.opts.save_every),
            *extra,
        ]
        log = self.dir / f"{name}.log"
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
        with log.open("w") as f:
            proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=f, stderr=subprocess.STDOUT)
        w = Worker(name, proc, self.dir / f"{name}.jsonl", log, time.time())
        self.workers[name] = w
        return w

    def observed(self) -> list[dict[str, Any]]:
        events = [e for name in self.observers for e in self.workers[name].read()]
        return sorted(events, key=lambda e: e["t"])

    def steps(self, world: int | None = None, after: float = 0.0) -> list[dict[str, Any]]:
        return [
            e
            for e in self.observed()
            if e["ev"] == "step" and e["done"] > after and world in (None, e["world"])
        ]

    def wait_until(self, what: str, cond: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.opts.timeout
        while not cond():
            for w in self.workers.values():
                code = w.poll()
                if code not in (None, 0) and w.name in self.live_names_expected():
                    raise RuntimeError(f"{w.name} exited with {code}:\n{self.tail(w)}")
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}\n{self.tail(w)}" for n, w in self.workers.items())
                raise RuntimeError(f"{self.system}: timed out waiting for {what}\n{tails}")
            time.sleep(0.02)

    def live_names_expected(self) -> set[str]:
        return set()

    @staticmethod
    def tail(w: Worker) -> str:
        return w.log.read_text()[-1500:] if w.log.exists() else ""

    def wait_steps(self, world: int, n: int, after: float, past: int = -1) -> None:
        """Until the observer has done ``n`` steps at ``world`` ranks after ``after``
        (numbered above ``past``)."""
        self.wait_until(
            f"{n} steps at {world} ranks",
            lambda: sum(e["step"] > past for e in self.steps(world, after)) >= n,
        )

    def periodic_save(self, world: int, after: float) -> int:
        """Wait for a periodic checkpoint at ``world`` ranks begun after ``after``.

        Both systems crash two steps after a fresh one, so both replay the same steps.
        """
        found: list[int] = []

        def saved() -> bool:
            found[:] = [
                e["step"]
                for e in self.observed()
                if e["ev"] == "saved" and e["world"] == world and e["t0"] > after
            ]
            return bool(found)

        self.wait_until(f"a checkpoint at {world} ranks", saved)
        return found[0]

    def close(self) -> None:
        stuck = stop_processes((w.proc for w in self.workers.values()), timeout=30)
        for w in self.workers.values():
            if w.proc in stuck:
                print(f"warning: {w.name} (pid {w.proc.pid}) did not die", file=sys.stderr)


# ---------------------------------------------------------------------------- zeroplane


class ElasticRun(Run):
    SYSTEM = "zeroplane"

    def __init__(self, stage: int, opts: argparse.Namespace, root: Path) -> None:
        super().__init__(stage, opts, root)
        self.token = secrets.token_urlsafe(16)
        self.membership = MembershipConfig(
            min_workers=2,
            max_workers=4,
            join_window_s=opts.join_window,
            lease_timeout_s=opts.lease,
            heartbeat_interval_s=opts.heartbeat,
        )
        config = CoordinatorConfig(
            server=ServerConfig(token=self.token),
            membership=self.membership,
            plan=PlanConfig(stage=stage, precision="fp32", bucket_numel=opts.bucket_numel),
        )
        self.server: CoordinatorServer
        self.server, _ = create_server(config)
        self.server.start()
        self.expected: set[str] = set()
        self.coord_events: list[dict[str, Any]] = []

    def live_names_expected(self) -> set[str]:
        return self.expected

    def start(self, name: str) -> Worker:
        env = {
            "ZEROPLANE_COORDINATOR": self.server.address,
            "ZEROPLANE_TOKEN": self.token,
            "ZEROPLANE_WORKER_ID": name,
            "ZEROPLANE_COLLECTIVE_TIMEOUT_S": str(self.opts.collective_timeout),
        }
        self.expected.add(name)
        return self.spawn(
            name,
            env,
            "--bucket-numel",
            str(self.opts.bucket_numel),
            "--replica-every",
            str(self.opts.replica_every),
            *(["--no-gradient-log"] if self.opts.no_gradient_log else []),
        )

    def run(self) -> None:
        o = self.opts
        self.observers = ["w0"]
        t = time.time()
        self.start("w0")
        self.start("w1")
        self.wait_steps(2, o.warmup, t)

        self.grow("scale-up 2→3 #1", "w2")
        change = Change("scale-down 3→2", "down", 3, 2, time.time())
        self.changes.append(change)
        self.expected.discard("w2")
        self.workers["w2"].proc.send_signal(signal.SIGTERM)
        self.wait_steps(2, o.steady, change.trigger)
        self.wait_until("w2 to exit", lambda: self.workers["w2"].poll() is not None)
        self.grow("scale-up 2→3 #2", "w3")

        ckpt = self.periodic_save(3, time.time())
        self.wait_steps(3, 1, self.changes[-1].trigger, past=ckpt + 1)
        change = Change("crash 3→2", "crash", 3, 2, time.time())
        self.changes.append(change)
        self.expected.discard("w3")
        self.workers["w3"].proc.kill()
        # as `zeroplane run`'s launcher does: it sees the process exit (it polls its
        # workers every 50 ms) and tells its coordinator, which drops the worker
        self.workers["w3"].proc.wait(timeout=30)
        self.server.worker_exited("w3", "killed by SIGKILL")
        before = self.steps(3)[-1]["step"]
        self.wait_steps(2, o.steady, change.trigger, past=before)
        self.coord_events = [
            {"t": e.unix_s, "kind": e.kind, "worker": e.worker_id, "detail": e.detail}
            for e in self.server.status().events
        ]
        self.mark()

    def grow(self, label: str, newcomer: str) -> None:
        change = Change(label, "up", 2, 3, time.time(), new=newcomer)
        self.changes.append(change)
        self.start(newcomer)
        self.wait_steps(3, self.opts.steady, change.trigger)

    def coord(self, kind: str, worker: str = "", after: float = 0.0) -> float | None:
        return next(
            (
                e["t"]
                for e in self.coord_events
                if e["kind"] == kind and worker in ("", e["worker"]) and e["t"] > after
            ),
            None,
        )

    def mark(self) -> None:
        """Milestones of each change from the workers' and the coordinator's logs."""
        w0 = self.workers["w0"].log
        for c in self.changes:
            T = c.trigger
            if c.kind == "up":
                new = self.workers[c.new]
                first = next((e for e in new.read() if e["ev"] == "step"), None)
                reg = self.coord("registered", new.name, T)
                c.marks = [
                    ("newcomer imported torch+zeroplane", _ev_time(new, "imported")),
                    ("coordinator: newcomer registered", reg),
                    ("coordinator: new generation", self.coord("generation", "", T)),
                    ("rank 0: joining the new group", log_time(w0, r"joining generation", T)),
                    ("rank 0: grew (state moved)", log_time(w0, r"grew to", T)),
                ]
                if reg is not None:
                    c.extra["registered"] = reg
                if first is not None:
                    c.extra["newcomer_first_step"] = first["done"]
            elif c.kind == "down":
                leaver = self.workers["w2"].log
                c.marks = [
                    ("leaver: SIGTERM handled", log_time(leaver, r"^SIGTERM", T)),
                    ("leaver: handed over", log_time(leaver, r"handed over", T)),
                    ("coordinator: left", self.coord("left", "w2", T)),
                    ("rank 0: joining the new group", log_time(w0, r"joining generation", T)),
                    ("rank 0: state adopted", log_time(w0, r"left; now rank", T)),
                ]
            else:
                c.marks = [
                    ("rank 0: collective failed", log_time(w0, r"step abandoned", T)),
                    ("coordinator: dropped the dead worker", self.coord("expired", "w3", T)),
                    ("rank 0: joining the new group", log_time(w0, r"joining generation", T)),
                    ("rank 0: checkpoint loaded", log_time(w0, r"recovered as", T)),
                ]

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.server.stop()


def _ev_time(w: Worker, ev: str) -> float | None:
    return next((e["t"] for e in w.read() if e["ev"] == ev), None)


# ---------------------------------------------------------------------------- restart


class RestartRun(Run):
    SYSTEM = "restart"

    def __init__(self, stage: int, opts: argparse.Namespace, root: Path) -> None:
        super().__init__(stage, opts, root)
        self.launch = 0
        self.live: list[Worker] = []

    def live_names_expected(self) -> set[str]:
        return {w.name for w in self.live}

    def start(self, world: int, resume: bool) -> float:
        port = free_port()
        self.launch += 1
        self.live = []
        for rank in range(world):
            env = rank_env(rank, world, port)
            extra = ["--collective-timeout", str(self.opts.collective_timeout)]
            extra += ["--bucket-numel", str(self.opts.bucket_numel)]
            if resume:
                extra.append("--resume")
            self.live.append(self.spawn(f"l{self.launch}r{rank}", env, *extra))
        self.observers.append(self.live[0].name)
        return self.live[0].spawned

    def stop(self, sig: signal.Signals) -> float:
        old = self.live
        self.live = []  # exits are expected from here on
        for w in old:
            w.proc.send_signal(sig)
        self.wait_until("the old workers to exit", lambda: all(w.poll() is not None for w in old))
        bad = {w.name: w.proc.returncode for w in old if w.proc.returncode not in (0, -sig)}
        if bad:
            raise RuntimeError(f"restart: workers exited badly after {sig.name}: {bad}")
        return max(w.exited or 0.0 for w in old)

    def change(self, label: str, kind: str, a: int, b: int, sig: signal.Signals) -> Change:
        c = Change(label, kind, a, b, time.time(), old=self.live[0].name)
        self.changes.append(c)
        exited = self.stop(sig)
        spawned = self.start(b, resume=True)
        c.new = self.live[0].name
        c.marks = [("old workers exited", exited), ("new workers spawned", spawned)]
        return c

    def run(self) -> None:
        o = self.opts
        t = time.time()
        self.start(2, resume=False)
        self.wait_steps(2, o.warmup, t)
        for label, kind, a, b in (
            ("scale-up 2→3 #1", "up", 2, 3),
            ("scale-down 3→2", "down", 3, 2),
            ("scale-up 2→3 #2", "up", 2, 3),
        ):
            c = self.change(label, kind, a, b, signal.SIGTERM)
            self.wait_steps(b, o.steady, c.trigger)
        ckpt = self.periodic_save(3, time.time())
        self.wait_steps(3, 1, self.changes[-1].trigger, past=ckpt + 1)
        before = self.steps(3)[-1]["step"]
        c = self.change("crash 3→2", "crash", 3, 2, signal.SIGKILL)
        self.wait_steps(2, o.steady, c.trigger, past=before)
        self.mark()

    def mark(self) -> None:
        for c in self.changes:
            old, new = self.workers[c.old], self.workers[c.new]
            ev_old, ev_new = old.read(), new.read()
            # a graceful stop saves at its step unless a periodic save just did
            stop_save = next((e for e in ev_old if e["ev"] == "saved" and e["t"] > c.trigger), None)
            loaded = next((e for e in ev_new if e["ev"] == "loaded"), None)
            c.marks = [
                ("old rank 0: checkpoint saved", None if stop_save is None else stop_save["t"]),
                *c.marks,
                ("new rank 0: imported torch+zeroplane", _ev_time(new, "imported")),
                ("new rank 0: group formed, engine built", _ev_time(new, "initialized")),
                ("new rank 0: checkpoint loaded", None if loaded is None else loaded["t"]),
            ]


# ---------------------------------------------------------------------------- analysis


def step_times(run: Run) -> dict[int, list[float]]:
    """Ordinary step gaps by world size (see DEFINITIONS)."""
    out: dict[int, list[float]] = {}
    for name in run.observers:
        prev: dict[str, Any] | None = None
        for e in run.workers[name].read():
            if e["ev"] != "step":
                prev = None  # a save, rollback or load in between: not an ordinary gap
                continue
            # a step whose engine.step() also changed the membership ends no ordinary gap
            ok = e["world"] == e["after"]
            same_world = prev is not None and prev["world"] == e["world"]
            if ok and same_world and prev["step"] + 1 == e["step"]:
                out.setdefault(e["world"], []).append(e["done"] - prev["done"])
            prev = e if ok else None
    return out


def summarize(times: list[float]) -> dict[str, float]:
    if not times:
        return {"median": NAN, "iqr": NAN, "n": 0}
    return {"median": statistics.median(times), "iqr": rel_iqr(times), "n": len(times)}


def measure(run: Run) -> dict[str, Any]:
    steps = {w: summarize(ts) for w, ts in step_times(run).items()}
    all_steps = run.steps()
    changes = []
    for c in run.changes:
        step_b = steps.get(c.b, {}).get("median", NAN)
        first = next(e for e in all_steps if e["done"] > c.trigger and e["world"] == c.b)
        last = [e for e in all_steps if e["done"] < first["done"] and e["world"] == c.a][-1]
        caught = next(
            e
            for e in all_steps
            if e["done"] >= first["done"] and e["world"] == c.b and e["step"] > last["step"]
        )
        # a periodic save that fell inside the change is no part of it: the job saves
        # there with or without a change (a restart's save at the stop is)
        saving = sum(
            e["t"] - e["t0"]
            for e in run.observed()
            if e["ev"] == "saved"
            and e.get("why") == "periodic"
            and last["done"] < e["t0"] < first["done"]
        )
        row: dict[str, Any] = {
            "label": c.label,
            "kind": c.kind,
            "from": c.a,
            "to": c.b,
            "trigger": c.trigger,
            "last_step_before": last["step"],
            "last_step_before_t": last["done"],
            "first_step_after": first["step"],
            "first_step_after_t": first["done"],
            "gap_s": first["done"] - last["done"],
            "periodic_save_s": saving,
            "pause_s": first["done"] - last["done"] - step_b - saving,
            "lost_s": caught["done"] - last["done"] - step_b - saving,
            "replayed": last["step"] - (first["step"] - 1),
            "trigger_to_first_s": first["done"] - c.trigger,
            "marks": [
                {"what": what, "t": t, "since_trigger_s": None if t is None else t - c.trigger}
                for what, t in c.marks
            ],
        }
        if "registered" in c.extra:
            row["registered_to_first_s"] = first["done"] - c.extra["registered"]
        formed = next((t for what, t in c.marks if what == "coordinator: new generation"), None)
        if formed is not None and formed < last["done"]:
            # the members train on while the ranks prepare ([Note: meeting ahead]):
            # what the steps from the new generation to the switch took beyond
            # ordinary ones, on top of the pause, and not counting periodic saves
            between = [e for e in all_steps if formed < e["done"] <= last["done"]]
            saves = sum(
                e["t"] - e["t0"]
                for e in run.observed()
                if e["ev"] == "saved"
                and e.get("why") == "periodic"
                and formed < e["t0"] < last["done"]
            )
            step_a = steps.get(c.a, {}).get("median", NAN)
            row["preparing_excess_s"] = last["done"] - formed - len(between) * step_a - saves
        if "newcomer_first_step" in c.extra:
            row["newcomer_spawn_to_first_step_s"] = c.extra["newcomer_first_step"] - c.trigger
        changes.append(row)
    codes = {n: w.proc.returncode for n, w in run.workers.items()}
    return {
        "system": run.system,
        "stage": run.stage,
        "params": _params(run),
        "step_s": {str(k): v for k, v in sorted(steps.items())},
        "changes": changes,
        "exit_codes": codes,
        "dir": str(run.dir),
    }


def _params(run: Run) -> int:
    for w in run.workers.values():
        for e in w.read():
            if e["ev"] == "initialized":
                return int(e.get("params", 0))
    return 0


def no_nan(x: Any) -> Any:
    """NaN (a missing median or ratio) as null, so the JSON stays standard."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: no_nan(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [no_nan(v) for v in x]
    return x


def report(results: list[dict[str, Any]], opts: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for stage in opts.stages:
        zp, rs = (
            next((r for r in results if r["system"] == name and r["stage"] == stage), None)
            for name in ("zeroplane", "restart")
        )
        runs = [r for r in (zp, rs) if r is not None]
        print(f"\nstage {stage}: step time (median s, IQR/median, n)")
        for r in runs:
            cells = ", ".join(
                f"{w} ranks {s['median']:.3f} s ({s['iqr']:.0%}, n={s['n']})"
                for w, s in r["step_s"].items()
            )
            print(f"  {r['system']:<9} {cells}")
        head = (
            f"{'change':<17}{'zp pause':>9}{'rs pause':>9}{'x':>6}"
            f"{'zp lost':>9}{'rs lost':>9}{'x':>6}{'replayed':>10}"
            f"{'zp trig→1st':>13}{'rs trig→1st':>13}"
        )
        print(f"\nstage {stage}: seconds (zp = zeroplane, rs = torchrun-style restart)")
        print(head)
        print("-" * len(head))
        # with --systems naming one system, the other's columns show "-"
        labels = [c["label"] for c in runs[0]["changes"]]
        blank = {"pause_s": NAN, "lost_s": NAN, "replayed": "-", "trigger_to_first_s": NAN}
        for i, label in enumerate(labels):
            a = zp["changes"][i] if zp else {"label": label, **blank}
            b = rs["changes"][i] if rs else {"label": label, **blank}
            row = {
                "stage": stage,
                "change": a["label"],
                "zeroplane_pause_s": a["pause_s"],
                "restart_pause_s": b["pause_s"],
                "pause_ratio": ratio(a["pause_s"], b["pause_s"]),
                "zeroplane_lost_s": a["lost_s"],
                "restart_lost_s": b["lost_s"],
                "lost_ratio": ratio(a["lost_s"], b["lost_s"]),
                "zeroplane_replayed": a["replayed"],
                "restart_replayed": b["replayed"],
                "zeroplane_trigger_to_first_s": a["trigger_to_first_s"],
                "restart_trigger_to_first_s": b["trigger_to_first_s"],
            }
            rows.append(row)
            print(
                f"{a['label']:<17}{fmt_cell(a['pause_s']):>9}{fmt_cell(b['pause_s']):>9}"
                f"{fmt_cell(row['pause_ratio']):>6}{fmt_cell(a['lost_s']):>9}{fmt_cell(b['lost_s']):>9}"
                f"{fmt_cell(row['lost_ratio']):>6}{a['replayed']:>5}/{b['replayed']:<4}"
                f"{fmt_cell(a['trigger_to_first_s']):>13}{fmt_cell(b['trigger_to_first_s']):>13}"
            )
        for a in zp["changes"] if zp else []:
            if "registered_to_first_s" in a:
                print(
                    f"  zeroplane {a['label']}: newcomer registered → first 3-rank step "
                    f"{fmt_cell(a['registered_to_first_s'])} s; newcomer spawned → its first step "
                    f"{fmt_cell(a.get('newcomer_spawn_to_first_step_s'))} s; "
                    "steps while the ranks prepared took "
                    f"{fmt_cell(a.get('preparing_excess_s'))} s beyond ordinary ones"
                )
        print(f"\nstage {stage}: milestones, seconds after the trigger")
        for r in runs:
            for c in r["changes"]:
                marks = [
                    (m["since_trigger_s"], m["what"])
                    for m in c["marks"]
                    if m["since_trigger_s"] is not None
                ]
                marks += [
                    (c["last_step_before_t"] - c["trigger"], "last step at the old size"),
                    (c["trigger_to_first_s"], "first step at the new size"),
                ]
                print(f"  {r['system']} {c['label']}:")
                for dt, what in sorted(marks):
                    print(f"    {dt:+7.2f}  {what}")
        for c in zp["changes"] if zp else []:
            marks = {m["what"]: m["t"] for m in c["marks"]}
            expired = marks.get("coordinator: dropped the dead worker")
            joined = marks.get("rank 0: joining the new group")
            if c["kind"] == "crash" and expired and joined and joined - expired > 1.0:
                print(
                    f"  note: zeroplane formed its new group {joined - expired:.1f} s after the "
                    "coordinator dropped the dead worker (see bench/README.md, Noise)"
                )
        odd = {n: c for n, c in (zp or {}).get("exit_codes", {}).items() if c not in (0, -9)}
        if odd:
            print(f"  zeroplane: unexpected exit codes {odd}")
    print("\n" + DEFINITIONS)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--systems", nargs="+", default=["zeroplane", "restart"], choices=("zeroplane", "restart")
    )
    p.add_argument("--stages", type=int, nargs="+", default=[2], choices=(0, 1, 2, 3))
    p.add_argument("--global-batch", type=int, default=6, help="divisible by 2 and 3")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    p.add_argument("--save-every", type=int, default=10, help="periodic checkpoint, steps")
    p.add_argument("--warmup", type=int, default=6, help="steps before the first change")
    p.add_argument("--steady", type=int, default=6, help="steps at each size after a change")
    p.add_argument("--lease", type=float, default=3.0, help="coordinator lease timeout, s")
    p.add_argument("--heartbeat", type=float, default=0.5, help="heartbeat interval, s")
    p.add_argument("--join-window", type=float, default=0.5, help="coordinator join window, s")
    p.add_argument("--collective-timeout", type=float, default=15.0)
    p.add_argument(
        "--replica-every",
        type=int,
        default=0,
        help="zeroplane: in-memory replicas every this many steps (0: a crash rolls back "
        "to the checkpoint, as the restart does)",
    )
    p.add_argument(
        "--no-gradient-log",
        action="store_true",
        help="zeroplane: a crash rolls back to the replicas (default: the lost rank is "
        "brought forward from its replica and the gradient log)",
    )
    p.add_argument("--bucket-numel", type=int, default=PlanConfig().bucket_numel)
    p.add_argument("--timeout", type=float, default=180.0, help="per wait, s")
    p.add_argument("--workdir", type=Path, help="keep logs and checkpoints here")
    p.add_argument("--json", type=Path, help="write every measurement here")
    opts = p.parse_args()
    if opts.global_batch % 6:
        p.error("--global-batch must split over 2 and 3 ranks (a multiple of 6)")

    # SIGTERM (e.g. from a CI timeout) unwinds through the finally blocks below
    exit_on_sigterm()
    tmp = None
    if opts.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="zp-elastic-")
        root = Path(tmp.name)
    else:
        root = opts.workdir / time.strftime("elastic-%Y%m%d-%H%M%S")
        root.mkdir(parents=True)
    load_before = os.getloadavg()
    started = time.time()
    results = []
    try:
        for stage in opts.stages:
            for cls in (ElasticRun, RestartRun):
                if cls.SYSTEM not in opts.systems:
                    continue
                run = cls(stage, opts, root)
                print(f"stage {stage}: {run.system} ...", flush=True)
                try:
                    run.run()
                finally:
                    run.close()
                results.append(measure(run))
        load_after = os.getloadavg()
        print(
            f"\n{results[0]['params'] / 1e6:.2f}M-parameter GPT, AdamW, fp32, gloo, "
            f"global batch {opts.global_batch} x {opts.seq} tokens; lease {opts.lease:g} s, "
            f"heartbeat {opts.heartbeat:g} s, join window {opts.join_window:g} s, "
            f"checkpoint every {opts.save_every} steps; load average "
            f"{load_before[0]:.1f} → {load_after[0]:.1f} on {os.cpu_count()} CPUs; "
            f"{time.time() - started:.0f} s"
        )
        rows = report(results, opts)
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


if __name__ == "__main__":
    main()
