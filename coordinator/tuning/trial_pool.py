"""The tuner's side of the measured runs: a pool of local worker processes.

:class:`TrialPool` starts ``nproc`` workers of ``python -m worker.trials``
(worker/trials.py has the protocol) through :class:`~coordinator.launchers.local.LocalJob`
once, and measures a candidate by writing its request and waiting for rank 0's
result. A trial that fails ends the pool (its process group may be broken);
the next trial starts a fresh one. Torch-free.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from coordinator.launchers.local import LaunchSpec, LocalJob
from coordinator.tuning.autotune import Candidate, Measurement

__all__ = ["TrialPool", "TrialSettings"]


class TrialSettings:
    """What every trial shares: the model arguments of ``worker.trials``, the steps
    run, the ZeroConfig fields the search does not vary, and the time a trial may take."""

    def __init__(
        self,
        *,
        model_args: Sequence[str],
        base_config: Mapping[str, Any] | None = None,
        warmup: int = 1,
        steps: int = 3,
        timeout_s: float = 300.0,
    ) -> None:
        if warmup < 0 or steps < 1:
            raise ValueError(f"trials need warmup >= 0 and steps >= 1, got {warmup}, {steps}")
        self.model_args = tuple(model_args)
        self.base_config = dict(base_config or {})
        self.warmup = warmup
        self.steps = steps
        self.timeout_s = timeout_s


class TrialPool:
    """``nproc`` local workers that run the trials one after another (a context manager)."""

    def __init__(
        self,
        nproc: int,
        settings: TrialSettings,
        *,
        directory: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.nproc = nproc
        self.settings = settings
        self._tmp = None if directory else tempfile.TemporaryDirectory(prefix="zeroplane-tune-")
        self.dir = Path(directory or self._tmp.name)  # type: ignore[union-attr]
        self._env = dict(env or {})
        self._job: LocalJob | None = None
        self._next = 0
        self.output: collections.deque[str] = collections.deque(maxlen=40)
        self.last: dict[str, Any] = {}

    def __enter__(self) -> TrialPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _keep(self, rank: int, stream: str, line: str) -> None:
        self.output.append(f"[rank{rank}] {line}")

    def _ensure(self) -> LocalJob:
        if self._job is not None and self._job.poll() is None:
            return self._job
        (self.dir / "next").write_text(str(self._next))
        (self.dir / "stop").unlink(missing_ok=True)
        command = (
            sys.executable,
            "-m",
            "worker.trials",
            "--dir",
            str(self.dir),
            *self.settings.model_args,
        )
        spec = LaunchSpec(command=command, nproc=self.nproc, env=self._env, grace_s=2.0)
        self._job = LocalJob(spec, on_line=self._keep).start()
        return self._job

    def request(self, config: Mapping[str, Any], micro_batch: int) -> dict[str, Any]:
        """Run one trial; its result (``{"error": ...}`` if it failed)."""
        job = self._ensure()
        k = self._next
        self._next += 1
        ask = {
            "config": dict(config),
            "micro_batch": micro_batch,
            "warmup": self.settings.warmup,
            "steps": self.settings.steps,
        }
        tmp = self.dir / f"trial-{k}.json.tmp"
        tmp.write_text(json.dumps(ask))
        os.replace(tmp, self.dir / f"trial-{k}.json")
        result_path = self.dir / f"result-{k}.json"
        deadline = time.monotonic() + self.settings.timeout_s
        while not result_path.exists():
            ended = job.poll()
            if ended is not None:
                errors = sorted(self.dir.glob(f"error-{k}-rank*.txt"))
                why = errors[0].read_text() if errors else ended.message
                return {"error": why}
            if time.monotonic() > deadline:
                job.stop()
                return {"error": f"no result within {self.settings.timeout_s:g}s"}
            time.sleep(0.02)
        self.last = json.loads(result_path.read_text())
        return self.last

    def measure(self, candidate: Candidate) -> Measurement:
        """The tuner's measurement: one trial of ``candidate``."""
        result = self.request(
            candidate.zero_config(self.settings.base_config), candidate.micro_batch
        )
        if "error" in result:
            return Measurement(error=str(result["error"]).strip().splitlines()[-1][:200])
        memory = result.get("peak_bytes") or result.get("memory_bytes")
        return Measurement(
            samples_per_s=float(result["samples_per_s"]),
            memory_bytes=None if memory is None else float(memory),
            extra=result,
        )

    def close(self) -> None:
        if self._job is not None:
            (self.dir / "stop").write_text("")
            with contextlib.suppress(TimeoutError):
                self._job.wait(timeout=10)
            self._job.stop()
            self._job = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
