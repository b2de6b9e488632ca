"""Observability end to end: a real Prometheus, a real headless Chromium, real jobs.

One module fixture runs ``zeroplane run`` (2 workers, embedded coordinator, a
fixed HTTP port) at stage 0 and then at stage 2, with a Prometheus started on
127.0.0.1 from deploy/prometheus (the scrape config and rules, with the
coordinator's address filled in and 1 s intervals). The stage-2 job stays up
while the tests look at it through the Prometheus HTTP API, the coordinator's
status page in Chromium, and ``zeroplane status``.

Outside CI a missing ``prometheus``/``promtool`` or ``chromium`` skips the tests
that need it, saying how to install it; with ``CI`` set they fail instead.
"""

from __future__ import annotations

import json
import math
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from coordinator.core.memory import model_state_bytes
from coordinator.launchers.local import find_free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "paced_train.py"
JOB = "zeroplane"
NPROC = 2
KINDS = ("params", "grads", "master", "optimizer")

pytestmark = pytest.mark.slow


def need(tool: str, install: str) -> str | None:
    path = shutil.which(tool)
    if path is None and os.environ.get("CI"):
        pytest.fail(f"{tool} is missing in CI (scripts/install-test-deps.sh installs it)")
    return path


def skip_without(path: str | None, what: str, install: str) -> str:
    if path is None:
        pytest.skip(f"{what} not installed: {install}")
    return path


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def wait_for(what: str, check: Callable[[], Any], timeout: float, log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except (OSError, ValueError, KeyError, urllib.error.URLError) as exc:
            last = exc
        time.sleep(0.5)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out waiting for {what} (last error: {last})\n{tail}")


class Prometheus:
    """A Prometheus on 127.0.0.1 with the project's scrape config and rules."""

    def __init__(self, binary: str, tmp: Path, coordinator_http: str) -> None:
        src = ROOT / "deploy" / "prometheus"
        shutil.copytree(src / "rules", tmp / "rules")
        text = (src / "prometheus.yml").read_text()
        assert text.count("127.0.0.1:9400") == 2, "the config's placeholder address moved"
        # 1 s instead of 5 s, so a job of a few seconds gets scraped many times.
        text = text.replace("127.0.0.1:9400", coordinator_http)
        text = re.sub(
            r"(scrape_interval|evaluation_interval|refresh_interval): 5s", r"\1: 1s", text
        )
        (tmp / "prometheus.yml").write_text(text)
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "prometheus.log"
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for("Prometheus to be ready", lambda: get(f"{self.url}/-/ready"), 30, self.log)

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        body = json.loads(get(url))
        assert body["status"] == "success", body
        return body["data"]["result"]

    def values(self, expr: str, key: str = "rank") -> dict[str, float]:
        return {r["metric"].get(key, ""): float(r["value"][1]) for r in self.query(expr)}

    def stop(self) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    except ProcessLookupError:
        proc.wait(5)


@dataclass
class Job:
    proc: subprocess.Popen
    log: Path
    http: str

    def api(self) -> dict[str, Any]:
        return json.loads(get(f"http://{self.http}/api/status"))

    def training(self, min_steps: int) -> bool:
        ranks = self.api()["ranks"]
        return len(ranks) == NPROC and all(r.get("steps", 0) >= min_steps for r in ranks)


def start_job(
    tmp: Path, stage: int, http_port: int, seconds: float, stop_file: Path | None = None
) -> Job:
    log = tmp / f"stage{stage}.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "run",
            "--nproc",
            str(NPROC),
            "--stage",
            str(stage),
            "--http-port",
            str(http_port),
            "--job-name",
            JOB,
            str(SCRIPT),
            "--seconds",
            str(seconds),
            "--rate",
            "4",
            *(("--stop-file", str(stop_file)) if stop_file else ()),
        ],
        cwd=ROOT,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    job = Job(proc, log, f"127.0.0.1:{http_port}")
    wait_for(f"the stage-{stage} job to train", lambda: job.training(3), 90, log)
    return job


@dataclass
class Observed:
    job: Job
    prometheus: Prometheus | None
    stage0: dict[str, dict[str, float]] = field(default_factory=dict)
    tmp: Path = Path()


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("observability")
    http_port = find_free_port()
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)  # runs last, after the stops
        binary = need("prometheus", "apt-get install --no-install-recommends prometheus")
        prom = None
        if binary is not None:
            prom = Prometheus(binary, tmp / "prometheus", f"127.0.0.1:{http_port}")
            stack.callback(prom.stop)
            # Stage 0 first, to compare stages in Prometheus: scraped until it ends,
            # which it does once Prometheus has what the tests read of it.
            stop0 = tmp / "stop-stage0"
            job0 = start_job(tmp, 0, http_port, seconds=60, stop_file=stop0)
            stack.callback(stop_process, job0.proc)
            # what the tests read of stage 0: the recording rules over its samples
            wait_for(
                "Prometheus to record the stage-0 workers' rates",
                lambda: (
                    len(
                        prom.values(
                            "rank_op:zeroplane_collective_bandwidth_bytes_per_second:rate1m"
                            '{stage="0", op="all_reduce"}'
                            " > 0 and on (rank, stage) rank:zeroplane_model_state_saving:ratio"
                        )
                    )
                    == NPROC
                ),
                40,
                prom.log,
            )
            stop0.touch()
            assert job0.proc.wait(60) == 0, job0.log.read_text()[-3000:]
        job = start_job(tmp, 2, http_port, seconds=60)
        stack.callback(stop_process, job.proc)
        if prom is not None:
            wait_for(
                "Prometheus to scrape the stage-2 workers a few times",
                lambda: (
                    len(
                        prom.values(
                            'count_over_time(zeroplane_steps_total{stage="2"}[1m]) >= 4 and on '
                            '(rank, stage) rank:zeroplane_step_duration_seconds:mean1m{stage="2"}'
                        )
                    )
                    == NPROC
                ),
                40,
                prom.log,
            )
        yield Observed(job=job, prometheus=prom, tmp=tmp)


def held(prom: Prometheus, stage: int, over: str = "") -> dict[str, dict[str, float]]:
    """Model-state bytes by rank and kind at ``stage`` (``over``: a last_over_time window)."""
    selector = f'zeroplane_model_state_bytes{{job="{JOB}", stage="{stage}"}}'
    expr = f"last_over_time({selector}[{over}])" if over else selector
    out: dict[str, dict[str, float]] = {}
    for r in prom.query(expr):
        out.setdefault(r["metric"]["rank"], {})[r["metric"]["kind"]] = float(r["value"][1])
    return out


# ---------------------------------------------------------------- Prometheus


@pytest.mark.timeout(600)
def test_prometheus_follows_the_job_and_memory_follows_the_formulas(observed: Observed) -> None:
    prom = skip_without(observed.prometheus, "Prometheus", "apt-get install prometheus")
    assert isinstance(prom, Prometheus)
    # http_sd found both workers (worker_id kept by relabeling) and the coordinator
    # carries the same job label through the static config.
    targets = prom.values(f'up{{job="{JOB}"}} == 1', key="instance")
    assert len(targets) == NPROC + 1, targets
    workers = prom.values(f'up{{job="{JOB}", worker_id!=""}}', key="worker_id")
    assert len(workers) == NPROC
    assert prom.values(f'zeroplane_coordinator_world_size{{job="{JOB}"}}', key="job") == {JOB: 2}

    psi = prom.values(f'zeroplane_trainable_parameters{{job="{JOB}", stage="2"}}')
    assert len(set(psi.values())) == 1
    psi_n = int(next(iter(psi.values())))
    stage0, stage2 = held(prom, 0, over="10m"), held(prom, 2)
    assert sorted(stage0) == sorted(stage2) == [str(r) for r in range(NPROC)]
    for stage, by_rank in ((0, stage0), (2, stage2)):
        want = model_state_bytes(psi_n, stage=stage, world_size=NPROC, dtype="fp32").as_dict()
        for rank, kinds in by_rank.items():
            for kind in KINDS:
                # padding (< N elements per bucket) and Adam's step counters on top
                assert kinds[kind] == pytest.approx(want[kind], rel=2e-3, abs=64), (
                    f"stage {stage} rank {rank} {kind}: {kinds[kind]} vs {want[kind]}"
                )
            # fp32 Adam, N = 2: stage 2 holds (4 + 12/2) / 16 of stage 0
            if stage == 2:
                ratio = sum(kinds[k] for k in KINDS) / sum(stage0[rank][k] for k in KINDS)
                assert ratio == pytest.approx(10 / 16, rel=2e-3)

    # the recording rules: saving per rank, bandwidth by op, step time, throughput
    saving2 = prom.values(f'rank:zeroplane_model_state_saving:ratio{{job="{JOB}", stage="2"}}')
    assert len(saving2) == NPROC and all(
        v == pytest.approx(6 / 16, abs=2e-3) for v in saving2.values()
    )
    saving0 = prom.values(
        f'last_over_time(rank:zeroplane_model_state_saving:ratio{{job="{JOB}", stage="0"}}[10m])'
    )
    assert len(saving0) == NPROC and all(abs(v) < 1e-3 for v in saving0.values())
    bandwidth = "rank_op:zeroplane_collective_bandwidth_bytes_per_second:rate1m"
    for stage, ops in ((2, ("reduce_scatter", "all_gather")), (0, ("all_reduce",))):
        for op in ops:
            expr = f'{bandwidth}{{job="{JOB}", stage="{stage}", op="{op}"}}'
            got = prom.values(f"last_over_time({expr}[10m])")
            assert len(got) == NPROC and all(v > 0 for v in got.values()), (stage, op, got)
    steps = prom.values(f'rank:zeroplane_step_duration_seconds:mean1m{{job="{JOB}", stage="2"}}')
    assert len(steps) == NPROC and all(0 < v < 10 for v in steps.values())
    rate = prom.values(f'job:zeroplane_samples:rate1m{{job="{JOB}", stage="2"}}', key="stage")
    assert rate["2"] > 0


# panels of a feature the observed job does not run (a dense GPT, no experts): their
# series exist only under expert parallelism; tests/test_moe_ep.py checks the values
# behind them against the routing, and tests/test_deploy.py that they are exported
NOT_IN_THIS_JOB = {"Tokens per expert (load balance)", "Dropped tokens", "Token all-to-all traffic"}


def dashboard_exprs() -> list[tuple[str, list[str]]]:
    d = json.loads((ROOT / "deploy" / "grafana" / "zeroplane.json").read_text())
    return [
        (p["title"], [t["expr"] for t in p.get("targets", [])])
        for p in d["panels"]
        if p["type"] != "row" and p["title"] not in NOT_IN_THIS_JOB
    ]


@pytest.mark.timeout(300)
def test_every_dashboard_panel_returns_data(observed: Observed) -> None:
    prom = skip_without(observed.prometheus, "Prometheus", "apt-get install prometheus")
    assert isinstance(prom, Prometheus)
    variables = {"$job": JOB, "$stage": ".*", "$rank": ".*", "$__rate_interval": "15s"}
    empty = []
    for title, exprs in dashboard_exprs():
        series = 0
        for expr in exprs:
            for name, value in variables.items():
                expr = expr.replace(name, value)
            series += len(prom.query(expr))
        if not series:
            empty.append(title)
    assert not empty, f"panels with no data: {empty}"
    # the dashboard's stage variable offers both stages
    url = f"{prom.url}/api/v1/label/stage/values?" + urllib.parse.urlencode(
        {"match[]": f'zeroplane_worker_info{{job="{JOB}"}}'}
    )
    assert {"0", "2"} <= set(json.loads(get(url))["data"])


@pytest.mark.timeout(120)
def test_promtool_check_metrics_passes_on_every_endpoint(observed: Observed) -> None:
    promtool = skip_without(
        need("promtool", "apt-get install prometheus"), "promtool", "apt-get install prometheus"
    )
    groups = json.loads(get(f"http://{observed.job.http}/sd"))
    endpoints = [g["targets"][0] for g in groups] + [observed.job.http]
    assert len(endpoints) == NPROC + 1
    for endpoint in endpoints:
        text = get(f"http://{endpoint}/metrics")
        proc = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, timeout=30
        )
        assert proc.returncode == 0, (endpoint, proc.stdout, proc.stderr)


# ---------------------------------------------------------------- the built-in page


def chromium(binary: str, tmp: Path, url: str, *args: str) -> str:
    profile = tmp / "chromium-profile"
    proc = subprocess.Popen(
        [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=10000",
            *args,
            url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        stop_process(proc, grace=2)
        shutil.rmtree(profile, ignore_errors=True)
    assert proc.returncode == 0
    return out


@pytest.mark.timeout(300)
def test_status_page_in_headless_chromium(observed: Observed) -> None:
    binary = skip_without(
        need("chromium", "apt-get install --no-install-recommends chromium"),
        "Chromium",
        "apt-get install --no-install-recommends chromium",
    )
    url = f"http://{observed.job.http}/"
    dom = chromium(binary, observed.tmp, url, "--dump-dom")
    assert 'data-loaded="1"' in dom, dom[-2000:]
    assert re.search(r'id="stage">2<', dom) and re.search(r'id="world-size">2<', dom)
    api = observed.job.api()
    for rank in range(NPROC):
        row = re.search(
            rf'<div class="mem-row" data-rank="{rank}">(.*?)(?=<div class="mem-row"|<p class)',
            dom,
            re.S,
        )
        assert row, f"no memory row for rank {rank}"
        # stage 2, fp32 Adam, 2 ranks: 10 of 16 bytes per parameter kept
        saving = re.search(r"saves (\d+\.\d)%", row.group(1))
        assert saving and float(saving.group(1)) == pytest.approx(37.5, abs=0.2), row.group(1)
        for kind in ("params", "grads", "optimizer"):
            assert f'data-kind="{kind}"' in row.group(1)
        table_row = re.search(rf'<tr data-rank="{rank}">(.*?)</tr>', dom)
        assert table_row, f"no table row for rank {rank}"
        cells = table_row.group(1)
        for op in ("reduce_scatter", "all_gather"):
            bw = re.search(rf'data-op="{op}">([^<]*)<', cells)
            assert bw and re.fullmatch(r"[\d.]+ [KMG]?B/s", bw.group(1)), (op, cells)
        assert re.search(r'data-field="compression">1\.00×<', cells), cells
        assert any(r["rank"] == rank and r["steps"] > 0 for r in api["ranks"])
    assert dom.count('data-state="member"') == NPROC

    shot = observed.tmp / "status-page.png"
    chromium(binary, observed.tmp, url, f"--screenshot={shot}", "--window-size=1280,1350")
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one
    keep = os.environ.get("ZEROPLANE_SCREENSHOT_DIR")
    if keep:
        shutil.copy(shot, Path(keep) / shot.name)


# ---------------------------------------------------------------- zeroplane status


@pytest.mark.timeout(120)
def test_zeroplane_status_shows_the_dashboard_figures(observed: Observed) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "status", "--http", observed.job.http],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "per-rank figures" in out and "reduce_scatter bw" in out
    rows = {
        m.group(1): m.group(0)
        for m in re.finditer(r"^(\d+) +\S+ \S+ +\S+ \S+ +\d+\.\d%.*$", out, re.MULTILINE)
    }
    assert sorted(rows) == ["0", "1"], out
    api = observed.job.api()
    prom = observed.prometheus
    for rank, line in rows.items():
        r = next(x for x in api["ranks"] if str(x["rank"]) == rank)
        assert f"{100 * (1 - r['kept']):.1f}%" in line
        assert re.search(r"[\d.]+ [KMG]?B/s", line)
        if prom is not None:
            # the dashboard's numbers: bytes held and the stage-0 baseline, per rank
            selector = f'job="{JOB}", stage="2"'
            held_now = prom.values(
                f'sum by (rank) (zeroplane_model_state_bytes{{{selector}, kind!="compression"}})'
            )[rank]
            base = prom.values(
                f"sum by (rank) (zeroplane_model_state_baseline_bytes{{{selector}}})"
            )[rank]
            assert math.isclose(held_now, r["state_total"]) and math.isclose(
                base, r["baseline_total"]
            )
            from coordinator.core.planner import format_bytes

            assert format_bytes(held_now) in line and format_bytes(base) in line


@pytest.mark.timeout(300)
def test_dashboard_preview_draws_every_panel(observed: Observed) -> None:
    prom = skip_without(observed.prometheus, "Prometheus", "apt-get install prometheus")
    binary = skip_without(
        need("chromium", "apt-get install --no-install-recommends chromium"),
        "Chromium",
        "apt-get install --no-install-recommends chromium",
    )
    assert isinstance(prom, Prometheus)
    preview = runpy.run_path(str(ROOT / "deploy" / "grafana" / "preview.py"))
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "zeroplane.json").read_text())
    page, empty = preview["render"](preview["Prometheus"](prom.url), JOB, 2.0, dashboard)
    empty = [title for title in empty if title not in NOT_IN_THIS_JOB]
    assert not empty, f"panels with no data: {empty}"
    out = observed.tmp / "dashboard-preview.html"
    out.write_text(page)
    shot = observed.tmp / "dashboard-preview.png"
    chromium(binary, observed.tmp, out.as_uri(), f"--screenshot={shot}", "--window-size=1400,3300")
    assert shot.stat().st_size > 50_000
    keep = os.environ.get("ZEROPLANE_SCREENSHOT_DIR")
    if keep:
        shutil.copy(shot, Path(keep) / shot.name)
