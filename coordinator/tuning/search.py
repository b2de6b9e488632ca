"""Hyperparameter search on Ray Tune: each trial a zeroplane job of N workers.

    from ray import tune
    from coordinator.tuning.search import HpoSpec, search

    result = search(HpoSpec(
        script="train.py", nproc=2, max_steps=200,
        space={"lr": tune.loguniform(1e-4, 1e-1), "warmup": tune.choice([0, 50])},
        num_samples=8,
    ))
    print(result.table()); result.best.params

``zeroplane hpo`` is this from the command line. How it fits together:

* **A trial is a zeroplane job.** Tune runs :func:`run_trial` for each point of
  the space; it starts the script on ``nproc`` Ray actors through the Ray
  launcher (:class:`~coordinator.launchers.ray_cluster.RayJob`: a placement group, the
  job's own coordinator in the trial's process), with the point in
  ``$ZEROPLANE_HPARAMS`` (the script reads it with ``worker.hpo.trial()``).
* **Metrics come from the engine.** Every rank's heartbeat already carries its
  step and last step's loss to the job's coordinator; the trial reads them
  (heartbeats every ``report_interval_s``) and reports ``loss`` (the mean over
  the ranks at the newest step) and ``step`` to Tune whenever the step moves.
  ASHA (``ASHAScheduler(time_attr="step")``) stops trials whose loss is behind
  at a rung: the trial's actor ends, and with it the job's actors (Ray
  fate-shares actors with their owner) and their worker processes.
* **Checkpoints are zeroplane's.** The script saves with
  ``engine.save_checkpoint(worker.hpo.trial().checkpoint_dir)``; each new
  one (the directory a rank's report names) goes to Tune with the next report.
  A trial Tune starts again (a failure with ``max_failures``, a paused trial,
  an experiment restored) gets it back in ``trial().resume_from``, and the
  script's ``engine.load_checkpoint`` continues at its step, at any world size.
* **The result** is every trial's parameters, last step and loss and whether it
  ran to the end or was stopped early; the best trial is the lowest last loss.

The checkpoint directory is on the trial's node: on a cluster of several nodes
give ``checkpoint_root`` on a filesystem every node mounts, as for any
zeroplane checkpoint. Ray is imported only when a search starts.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "CHECKPOINT_ENV",
    "HPARAMS_ENV",
    "RESUME_ENV",
    "HpoResult",
    "HpoSpec",
    "TrialOutcome",
    "parse_space",
    "run_trial",
    "search",
]

logger = logging.getLogger(__name__)

HPARAMS_ENV = "ZEROPLANE_HPARAMS"
CHECKPOINT_ENV = "ZEROPLANE_TRIAL_CHECKPOINT_DIR"
RESUME_ENV = "ZEROPLANE_TRIAL_RESUME_FROM"
# what a trial's own actor asks for: it only drives the job (Tune needs some resource)
_DRIVER_CPU = 0.01


@dataclass(frozen=True, kw_only=True)
class HpoSpec:
    """One search.

    script / args: the training script every worker runs (a path; it must exist at
        the same path on every node). nproc: workers per trial.
    space: Tune's param_space (``tune.loguniform(...)``, ``tune.grid_search([...])``,
        plain values); each trial's point reaches the script as JSON.
    num_samples: Tune's samples of the space (each grid point that many times).
    max_steps: the steps a trial runs to (ASHA's ``max_t``); grace_steps: no trial
        is stopped before this step; reduction_factor: ASHA's (2: half survive a rung).
    max_concurrent: trials at once. stage: every trial's ZeRO stage (None: the
        script's). address: a Ray cluster (None: a local one of ``num_cpus``).
    max_failures: how often Tune starts a failed trial again (from its checkpoint).
    report_interval_s: the workers' heartbeat interval in a trial (their lease is 5x
        that), so how often the loss and step reach Tune.
    storage_path / name: where Tune keeps results and checkpoints.
    checkpoint_root: where trials' zeroplane checkpoints are written.
    """

    script: str
    args: tuple[str, ...] = ()
    space: Mapping[str, Any] = field(default_factory=dict)
    nproc: int = 2
    num_samples: int = 1
    max_steps: int = 100
    grace_steps: int = 1
    reduction_factor: float = 2.0
    max_concurrent: int = 1
    stage: int | None = None
    address: str | None = None
    num_cpus: int | None = None
    max_failures: int = 0
    report_interval_s: float = 1.0
    storage_path: str | None = None
    name: str = "zeroplane-hpo"
    checkpoint_root: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.script:
            raise ValueError("HpoSpec.script must name the training script")
        object.__setattr__(self, "args", tuple(self.args))
        for name in ("nproc", "num_samples", "max_steps", "grace_steps", "max_concurrent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"HpoSpec.{name} must be an integer >= 1, got {value!r}")
        if self.grace_steps > self.max_steps:
            raise ValueError(
                f"HpoSpec.grace_steps ({self.grace_steps}) must be <= max_steps ({self.max_steps})"
            )
        if not (math.isfinite(self.reduction_factor) and self.reduction_factor > 1):
            raise ValueError(f"HpoSpec.reduction_factor must be > 1, got {self.reduction_factor!r}")
        if self.stage not in (None, 0, 1, 2, 3):
            raise ValueError(f"HpoSpec.stage must be None or 0-3, got {self.stage!r}")
        if not isinstance(self.space, Mapping):
            raise ValueError(f"HpoSpec.space must be a dict, got {type(self.space).__name__}")
        if self.max_failures < 0:
            raise ValueError(f"HpoSpec.max_failures must be >= 0, got {self.max_failures}")
        if not (math.isfinite(self.report_interval_s) and self.report_interval_s > 0):
            raise ValueError(
                f"HpoSpec.report_interval_s must be > 0, got {self.report_interval_s!r}"
            )


@dataclass(frozen=True, kw_only=True)
class TrialOutcome:
    """One trial as the search ended: its point, last step and loss, and how it ended."""

    trial_id: str
    params: Mapping[str, Any]
    step: int
    loss: float | None
    status: Literal["completed", "stopped early", "failed"]
    error: str = ""
    checkpoint: str | None = None


@dataclass(frozen=True, kw_only=True)
class HpoResult:
    trials: tuple[TrialOutcome, ...]
    best: TrialOutcome | None
    path: str

    @property
    def stopped_early(self) -> list[TrialOutcome]:
        return [t for t in self.trials if t.status == "stopped early"]

    def table(self) -> str:
        names = sorted({k for t in self.trials for k in t.params})
        header = ("trial", *names, "step", "loss", "status")
        rows = [header]
        for t in self.trials:
            mark = " *" if self.best is not None and t.trial_id == self.best.trial_id else ""
            rows.append(
                (
                    t.trial_id,
                    *(_show(t.params.get(n)) for n in names),
                    str(t.step),
                    ("-" if t.loss is None else f"{t.loss:.4f}") + mark,
                    t.status + (f": {t.error}" if t.error else ""),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
        lines = []
        for i, row in enumerate(rows):
            cells = [c.rjust(w) for c, w in zip(row[:-1], widths, strict=True)]
            lines.append("  ".join([*cells, row[-1]]))
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  ------")
        if self.best is not None:
            lines.append("")
            lines.append(
                f"best: {self.best.trial_id} loss {self.best.loss:.4f} at step "
                f"{self.best.step}: {json.dumps(dict(self.best.params), sort_keys=True)}"
            )
        return "\n".join(lines)


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def _read(reports: Iterable[Any]) -> tuple[int, float | None, str | None]:
    """From every worker's last report (those that finished and left included): the
    job's newest step, the mean loss over the ranks at it, and the newest checkpoint
    directory any rank reported."""
    reports = list(reports)
    if not reports:
        return 0, None, None
    step = max(r.step for r in reports)
    losses = [r.loss for r in reports if r.step == step and r.loss is not None]
    checkpoints = [r.checkpoint for r in reports if r.checkpoint]
    return (
        step,
        (sum(losses) / len(losses) if losses else None),
        (checkpoints[0] if checkpoints else None),
    )


def _stage_checkpoint(saved: str | None, root: Path, last: str | None) -> Path | None:
    """A directory holding the newest zeroplane checkpoint in ``saved`` (``latest`` and
    its step folder), if it is newer than ``last``: what Tune copies to its storage."""
    if not saved:
        return None
    try:
        newest = Path(saved, "latest").read_text().strip()
    except OSError:
        return None
    if not newest or f"report-{newest}" == last:
        return None
    staged = root / f"report-{newest}"
    shutil.rmtree(staged, ignore_errors=True)
    try:
        shutil.copytree(Path(saved, newest), staged / newest)
    except OSError as exc:  # replaced by a newer save while copying: the next report has it
        logger.debug("checkpoint %s not staged: %s", newest, exc)
        shutil.rmtree(staged, ignore_errors=True)
        return None
    (staged / "latest").write_text(newest)
    return staged


def run_trial(config: dict[str, Any], spec: HpoSpec) -> None:
    """Tune's trainable: one trial as a zeroplane job on Ray actors (see the module notes)."""
    from ray import tune

    from coordinator.launchers.ray_cluster import RayJob, RaySpec

    context = tune.get_context()
    trial_id = context.get_trial_id() or "trial"
    root = Path(spec.checkpoint_root or tempfile.gettempdir()) / f"zeroplane-hpo-{trial_id}"
    checkpoint_dir = root / "checkpoint"
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **spec.env,
        HPARAMS_ENV: json.dumps(config),
        CHECKPOINT_ENV: str(checkpoint_dir),
    }
    restored = tune.get_checkpoint()
    if restored is not None:
        resume = root / "resume"
        shutil.rmtree(resume, ignore_errors=True)
        restored.to_directory(str(resume))
        env[RESUME_ENV] = str(resume)
    job = RayJob(
        RaySpec(
            command=(sys.executable, spec.script, *spec.args),
            nproc=spec.nproc,
            stage=spec.stage,
            env=env,
            max_restarts=0,
            lease_timeout_s=5 * spec.report_interval_s,
            grace_s=5.0,
        )
    )
    try:
        result = _follow_job(job, root, spec)
    finally:
        if spec.checkpoint_root is None:  # a temporary place: Tune holds the copies
            shutil.rmtree(root, ignore_errors=True)
    if not result.ok:
        raise RuntimeError(f"the trial's zeroplane job failed: {result.message}")


def _follow_job(job: Any, root: Path, spec: HpoSpec) -> Any:
    """Run the trial's job to its end, reporting its loss and checkpoints to Tune."""
    from ray import tune

    last_step, last_checkpoint = 0, None
    with job:
        while True:
            try:
                result = job.wait(timeout=spec.report_interval_s / 2)
                done = True
            except TimeoutError:
                done = False
            step, loss, saved = _read(job.last_reports().values())
            if step > last_step and loss is not None:
                staged = _stage_checkpoint(saved, root, last_checkpoint)
                # "step" is ASHA's clock: it only moves forward (a resumed trial
                # reports from its checkpoint's step on)
                tune.report(
                    {"loss": loss, "step": step},
                    checkpoint=None if staged is None else tune.Checkpoint.from_directory(staged),
                )
                if staged is not None:
                    last_checkpoint = staged.name
                    shutil.rmtree(staged, ignore_errors=True)  # Tune has its copy now
                last_step = step
            if done:
                return result


def search(spec: HpoSpec) -> HpoResult:
    """Run the search on Ray Tune with ASHA; every trial's outcome and the best."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    script = str(Path(spec.script).resolve())
    if not Path(script).is_file():
        raise ValueError(f"HpoSpec.script: no such file {spec.script!r}")
    spec = _replace(spec, script=script)
    started_ray = False
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
        if spec.address:
            kwargs["address"] = spec.address
        else:
            kwargs["num_cpus"] = spec.num_cpus or max(
                spec.nproc * spec.max_concurrent + 1, os.cpu_count() or 1
            )
        ray.init(**kwargs)
        started_ray = True
    storage = spec.storage_path or tempfile.mkdtemp(prefix="zeroplane-hpo-")
    try:
        trainable = tune.with_parameters(run_trial, spec=spec)
        # the trial's actor only drives the job: its workers hold the CPUs (their own
        # placement group, made by the Ray launcher)
        trainable = tune.with_resources(trainable, {"cpu": _DRIVER_CPU})
        tuner = tune.Tuner(
            trainable,
            param_space=dict(spec.space),
            tune_config=tune.TuneConfig(
                metric="loss",
                mode="min",
                num_samples=spec.num_samples,
                max_concurrent_trials=spec.max_concurrent,
                scheduler=ASHAScheduler(
                    time_attr="step",
                    max_t=spec.max_steps,
                    grace_period=spec.grace_steps,
                    reduction_factor=spec.reduction_factor,
                ),
            ),
            run_config=tune.RunConfig(
                name=spec.name,
                storage_path=str(Path(storage).resolve()),
                failure_config=tune.FailureConfig(max_failures=spec.max_failures),
                verbose=0,
            ),
        )
        grid = tuner.fit()
        outcomes = tuple(_outcome(r, spec) for r in grid)
    finally:
        if started_ray:
            ray.shutdown()
    done = [t for t in outcomes if t.loss is not None and t.status != "failed"]
    best = min(done, key=lambda t: t.loss) if done else None  # type: ignore[arg-type,return-value]
    return HpoResult(trials=outcomes, best=best, path=str(Path(storage, spec.name)))


def _outcome(result: Any, spec: HpoSpec) -> TrialOutcome:
    metrics = result.metrics or {}
    step = int(metrics.get("step", 0))
    loss = metrics.get("loss")
    trial_id = str(metrics.get("trial_id") or Path(result.path).name)
    if result.error is not None:
        status, error = "failed", str(result.error).strip().splitlines()[-1][:200]
    elif step >= spec.max_steps:
        status, error = "completed", ""
    else:
        status, error = "stopped early", ""
    checkpoint = None if result.checkpoint is None else result.checkpoint.path
    return TrialOutcome(
        trial_id=trial_id,
        params=dict(result.config or {}),
        step=step,
        loss=None if loss is None else float(loss),
        status=status,  # type: ignore[arg-type]
        error=error,
        checkpoint=checkpoint,
    )


def _replace(spec: HpoSpec, **changes: Any) -> HpoSpec:
    from dataclasses import replace

    return replace(spec, **changes)


def parse_space(items: Sequence[str]) -> dict[str, Any]:
    """``zeroplane hpo --param NAME=KIND:ARGS`` into Tune domains: ``lr=loguniform:1e-4:1e-1``,
    ``wd=uniform:0:0.1``, ``warmup=choice:0,10,100``, ``lr=grid:1e-3,1e-2``, ``seed=3``."""
    from ray import tune

    space: dict[str, Any] = {}
    for item in items:
        name, sep, rest = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--param wants NAME=KIND:ARGS, got {item!r}")
        kind, _, args = rest.partition(":")
        try:
            if kind in ("loguniform", "uniform"):
                low, high = (float(v) for v in args.split(":"))
                space[name] = getattr(tune, kind)(low, high)
            elif kind in ("choice", "grid"):
                values = [_number(v) for v in args.split(",") if v]
                if not values:
                    raise ValueError("no values")
                space[name] = tune.choice(values) if kind == "choice" else tune.grid_search(values)
            elif kind == "randint":
                low, high = (int(v) for v in args.split(":"))
                space[name] = tune.randint(low, high)
            else:
                space[name] = _number(rest)
        except ValueError as exc:
            raise ValueError(f"--param {item!r}: {exc}") from None
    return space


def _number(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
