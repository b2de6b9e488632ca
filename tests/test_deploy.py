"""deploy/prometheus and deploy/grafana: promtool checks and rule unit tests, the
dashboard against Grafana's published schema, and every queried metric exported."""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from coordinator.control import telemetry as coordinator_metrics
from worker import metrics as worker_metrics

ROOT = Path(__file__).resolve().parents[1]
PROM = ROOT / "deploy" / "prometheus"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "zeroplane.json"

# Families a dashboard panel need not show, and why.
NOT_ON_DASHBOARD = {
    # same facts as the coordinator's gauges, which the dashboard shows once per job
    "zeroplane_stage",
    "zeroplane_world_size",
    "zeroplane_rank",
    "zeroplane_generation",
    "zeroplane_trainable_parameters",
    "zeroplane_coordinator_trainable_parameters",
    # used by the host-memory alert
    "zeroplane_host_memory_total_bytes",
    "zeroplane_host_memory_available_bytes",
    "zeroplane_collective_wire_bytes_total",  # per-op detail of the compression panels
    "zeroplane_collective_calls_total",
    "zeroplane_coordinator_registrations_total",
    "zeroplane_coordinator_info",
}


def tool(name: str, install: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing in CI (scripts/install-test-deps.sh installs it)")
        pytest.skip(f"{name} not installed: {install}")
    return path


def promtool() -> str:
    return tool("promtool", "apt-get install --no-install-recommends prometheus")


def run(*argv: str, cwd: Path = ROOT, timeout: float = 60) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(argv)}:\n{proc.stdout}\n{proc.stderr}"
    return proc


# ---------------------------------------------------------------- prometheus


@pytest.mark.timeout(60)
def test_promtool_accepts_the_config_and_rules() -> None:
    run(promtool(), "check", "config", "prometheus.yml", cwd=PROM)
    run(promtool(), "check", "rules", *sorted(str(p) for p in (PROM / "rules").glob("*.yml")))


@pytest.mark.timeout(60)
def test_promtool_rule_unit_tests() -> None:
    proc = run(promtool(), "test", "rules", "tests/rules_test.yml", cwd=PROM)
    assert "SUCCESS" in proc.stdout


# ---------------------------------------------------------------- grafana


def test_dashboard_json_is_generated_from_make_dashboard() -> None:
    module = runpy.run_path(str(GRAFANA / "make_dashboard.py"))
    assert DASHBOARD.read_text() == module["render"](), (
        "deploy/grafana/zeroplane.json is stale: run python deploy/grafana/make_dashboard.py"
    )


@pytest.mark.timeout(240)
def test_dashboard_type_checks_against_grafana_schema() -> None:
    npm = tool("npm", "install Node.js and npm (apt-get install nodejs npm)")
    node = tool("node", "install Node.js")
    validate = GRAFANA / "validate"
    if not (validate / "node_modules" / "@grafana" / "schema").is_dir():
        # The lockfile pins @grafana/schema and typescript.
        run(npm, "ci", "--no-audit", "--no-fund", cwd=validate, timeout=200)
    proc = run(node, "check.mjs", cwd=validate, timeout=120)
    assert "match @grafana/schema" in proc.stdout


# ---------------------------------------------------------------- metric names

_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
    "and", "or", "unless", "inf", "nan",
}  # fmt: skip


def promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (not functions, labels or keywords)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery windows
    expr = re.sub(r"\boffset\s+-?[0-9a-z]+", "", expr)
    # Grafana's label_values(selector, label): the label is not a metric
    expr = re.sub(r"\blabel_values\((.*),\s*\w+\s*\)", r"\1", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        name, rest = m.group(), expr[m.end() :].lstrip()
        if rest.startswith("(") or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    d = json.loads(DASHBOARD.read_text())
    out = [(f"annotation {a['name']}", a["target"]["expr"]) for a in d["annotations"]["list"]
           if "target" in a]  # fmt: skip
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            out.append((f"variable {v['name']}", v["query"]["query"]))
    for p in d["panels"]:
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r}", t["expr"]))
    return out


def rule_exprs() -> tuple[list[tuple[str, str]], set[str]]:
    exprs, recorded = [], set()
    for path in sorted((PROM / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                name = rule.get("record") or rule["alert"]
                exprs.append((f"rule {name}", rule["expr"]))
                if "record" in rule:
                    recorded.add(rule["record"])
    return exprs, recorded


def exported_series() -> set[str]:
    names = set(worker_metrics.METRIC_NAMES) | set(coordinator_metrics.METRIC_NAMES)
    histograms = {
        "zeroplane_step_duration_seconds",
        "zeroplane_coordinator_generation_formation_seconds",
        "zeroplane_coordinator_rpc_duration_seconds",
    }
    for h in histograms:
        assert h in names
        names |= {f"{h}_bucket", f"{h}_sum", f"{h}_count"}
    return names


def test_promql_metric_extraction() -> None:
    got = promql_metrics(
        'histogram_quantile(0.9, sum by (le, rank) (rate(a_bucket{job=~"x|y", op!="b"}[5m])))'
        " / ignoring(kind) (b_total offset 5m > 0) and on(rank) rec:c:sum"
    )
    assert got == {"a_bucket", "b_total", "rec:c:sum"}
    assert promql_metrics('label_values(zeroplane_worker_info{job=~"$job"}, stage)') == {
        "zeroplane_worker_info"
    }


def test_every_queried_metric_is_exported() -> None:
    exported = exported_series()
    rules, recorded = rule_exprs()
    unknown = [
        f"{where}: {name}"
        for where, expr in dashboard_queries() + rules
        for name in sorted(promql_metrics(expr))
        if name not in exported | recorded
    ]
    assert not unknown, "queries read metrics nobody exports:\n" + "\n".join(unknown)


def test_every_exported_family_is_on_the_dashboard() -> None:
    shown = set().union(*(promql_metrics(expr) for _, expr in dashboard_queries()))
    families = set(worker_metrics.METRIC_NAMES) | set(coordinator_metrics.METRIC_NAMES)
    missing = sorted(
        f
        for f in families - NOT_ON_DASHBOARD
        if f not in shown and not any(s.startswith(f"{f}_") for s in shown)
    )
    assert not missing, f"no panel shows {missing}"
