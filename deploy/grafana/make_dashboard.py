"""Writes deploy/grafana/zeroplane.json, the Grafana dashboard of a zeroplane job.

    python deploy/grafana/make_dashboard.py          # rewrite the JSON
    python deploy/grafana/make_dashboard.py --check  # exit 1 if it is stale

The JSON is what users import; this script is how it is kept consistent (one
selector, one layout rule, ids in order). tests/test_deploy.py fails when the
two differ, type-checks the JSON against Grafana's published schema, and checks
that every metric a panel queries is one zeroplane exports.

Queries use raw metrics (not the recording rules), so the dashboard works on a
Prometheus that has not loaded deploy/prometheus/rules.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("zeroplane.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job", stage=~"$stage", rank=~"$rank"'
JOB = 'job=~"$job"'
RATE = "$__rate_interval"
BY_RANK = "job, rank, stage"


def target(expr: str, legend: str = "", *, ref: str = "A", instant: bool = False,
           table: bool = False) -> dict[str, Any]:  # fmt: skip
    t: dict[str, Any] = {
        "refId": ref,
        "datasource": DS,
        "expr": expr,
        "legendFormat": legend or "__auto",
        "range": not instant,
        "instant": instant,
    }
    if table:
        t["format"] = "table"
    return t


def _targets(queries: list[tuple[str, str]], instant: bool = False) -> list[dict[str, Any]]:
    return [
        target(expr, legend, ref=chr(ord("A") + i), instant=instant)
        for i, (expr, legend) in enumerate(queries)
    ]


def timeseries(title: str, description: str, queries: list[tuple[str, str]], unit: str, *,
               stack: bool = False, draw: str = "line", min_: float | None = None
               ) -> dict[str, Any]:  # fmt: skip
    custom: dict[str, Any] = {
        "drawStyle": draw,
        "lineWidth": 1,
        "fillOpacity": 30 if stack or draw == "bars" else 8,
        "showPoints": "never",
        "spanNulls": True,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        "axisPlacement": "auto",
    }
    defaults: dict[str, Any] = {"unit": unit, "custom": custom}
    if min_ is not None:
        defaults["min"] = min_
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": _targets(queries),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {
                "showLegend": True,
                "displayMode": "table",
                "placement": "right",
                "calcs": ["lastNotNull"],
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def bargauge(title: str, description: str, queries: list[tuple[str, str]], unit: str,
             ) -> dict[str, Any]:  # fmt: skip
    return {
        "type": "bargauge",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": _targets(queries, instant=True),
        "fieldConfig": {"defaults": {"unit": unit, "min": 0}, "overrides": []},
        "options": {
            "orientation": "horizontal",
            "displayMode": "gradient",
            "valueMode": "color",
            "namePlacement": "left",
            "showUnfilled": True,
            "sizing": "auto",
            "minVizWidth": 8,
            "minVizHeight": 16,
            "maxVizHeight": 300,
            "legend": {
                "showLegend": False,
                "displayMode": "list",
                "placement": "bottom",
                "calcs": [],
            },
            "reduceOptions": {"values": False, "calcs": ["lastNotNull"], "fields": ""},
        },
    }


def stat(title: str, description: str, queries: list[tuple[str, str]], unit: str = "none",
         ) -> dict[str, Any]:  # fmt: skip
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": _targets(queries, instant=True),
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {
            "reduceOptions": {"values": False, "calcs": ["lastNotNull"], "fields": ""},
            "orientation": "auto",
            "textMode": "value_and_name",
            "wideLayout": True,
            "colorMode": "none",
            "graphMode": "none",
            "justifyMode": "auto",
            "showPercentChange": False,
            "percentChangeColorMode": "standard",
        },
    }


def info_table(title: str, description: str, expr: str) -> dict[str, Any]:
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": [target(expr, ref="A", instant=True, table=True)],
        "fieldConfig": {
            "defaults": {
                "custom": {"align": "auto", "cellOptions": {"type": "auto"}, "inspect": False}
            },
            "overrides": [],
        },
        "options": {
            "showHeader": True,
            "cellHeight": "sm",
            "frameIndex": 0,
        },
        "transformations": [
            {
                "id": "organize",
                "options": {
                    "excludeByName": {"Time": True, "Value": True, "__name__": True},
                    "indexByName": {"rank": 0, "stage": 1, "version": 2, "backend": 3},
                },
            }
        ],
    }


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def panels() -> list[dict[str, Any]]:
    """Rows of panels, laid out by layout(): full-width rows, panels two or three across."""
    state = f'zeroplane_model_state_bytes{{{SEL}, kind!="compression"}}'
    baseline = f"zeroplane_model_state_baseline_bytes{{{SEL}}}"

    def rate(metric: str, extra: str = "") -> str:
        return f"rate({metric}{{{SEL}{extra}}}[{RATE}])"

    data_plane = ', op!="control"'
    coll_bytes = rate("zeroplane_collective_bytes_total", data_plane)
    coll_seconds = rate("zeroplane_collective_seconds_total", data_plane)

    return [
        row("Job"),
        stat(
            "Stage, world size, generation",
            "The coordinator's current generation: its ZeRO stage, ranks, and id.",
            [
                (f"max by (job) (zeroplane_coordinator_stage{{{JOB}}})", "stage"),
                (f"max by (job) (zeroplane_coordinator_world_size{{{JOB}}})", "world size"),
                (f"max by (job) (zeroplane_coordinator_generation{{{JOB}}})", "generation"),
            ],
        ),
        stat(
            "Throughput",
            "Samples and tokens per second over all ranks (engine.step(samples=, tokens=)).",
            [
                (f"sum by (job) ({rate('zeroplane_samples_total')})", "samples/s"),
                (f"sum by (job) ({rate('zeroplane_tokens_total')})", "tokens/s"),
            ],
            unit="short",
        ),
        info_table(
            "Workers",
            "One row per rank: zeroplane and torch versions, backend, device, precision.",
            f"zeroplane_worker_info{{{SEL}}}",
        ),
        row("Memory"),
        bargauge(
            "Model state by kind, per rank",
            "Bytes each rank holds, by kind (params, grads, fp32 master, optimizer state, "
            "buffers). Padding included.",
            [(f"zeroplane_model_state_bytes{{{SEL}}} > 0", "rank {{rank}} · {{kind}}")],
            "decbytes",
        ),
        bargauge(
            "Model state against the stage-0 baseline, per rank",
            "What each rank holds beside what it would hold at stage 0 for the same model, "
            "precision and optimizer (the ZeRO formulas).",
            [
                (f"sum by ({BY_RANK}) ({state})", "rank {{rank}} · stage {{stage}} held"),
                (f"sum by ({BY_RANK}) ({baseline})", "rank {{rank}} · stage-0 baseline"),
            ],
            "decbytes",
        ),
        bargauge(
            "Model state by location (device / host offload), per rank",
            "Where each rank's model state lives: on the device, or in host memory where "
            "offload_optimizer (fp32 master, optimizer state, host gradient copy) or "
            "offload_params (stage-3 parameter shards) put it. Zero in host memory without "
            "offload.",
            [
                (
                    f"sum by ({BY_RANK}) ({state}) - sum by ({BY_RANK}) "
                    f'(zeroplane_model_state_host_bytes{{{SEL}, kind!="compression"}})',
                    "rank {{rank}} · device",
                ),
                (
                    f"sum by ({BY_RANK}) "
                    f'(zeroplane_model_state_host_bytes{{{SEL}, kind!="compression"}})',
                    "rank {{rank}} · host",
                ),
                (
                    f"zeroplane_model_state_host_bytes{{{SEL}}} > 0",
                    "rank {{rank}} · host {{kind}}",
                ),
            ],
            "decbytes",
        ),
        timeseries(
            "Memory saved against stage 0, per rank",
            "1 - held / stage-0 baseline. Stage 2 on N ranks with Adam in fp32 saves "
            "(12 - 12/N)/16 of model state; stage 3 saves 1 - 1/N.",
            [
                (
                    f"1 - sum by ({BY_RANK}) ({state}) / sum by ({BY_RANK}) ({baseline})",
                    "rank {{rank}} · stage {{stage}}",
                )
            ],
            "percentunit",
            min_=0,
        ),
        timeseries(
            "Fraction of stage-0 bytes kept, by kind",
            "held / baseline per kind: 1 for what a stage replicates, 1/N for what it shards.",
            [
                (
                    f"zeroplane_model_state_bytes{{{SEL}}} / ({baseline} > 0)",
                    "rank {{rank}} · {{kind}}",
                )
            ],
            "percentunit",
            min_=0,
        ),
        timeseries(
            "Device and host memory, per rank",
            "CUDA: allocated, reserved, peak and the device's total. CPU: the worker "
            "process's resident memory. Activations: what autograd kept for backward in "
            "the last measured forward (activation checkpointing lowers it).",
            [
                (f"zeroplane_activation_saved_bytes{{{SEL}}}", "rank {{rank}} activations"),
                (f"zeroplane_device_memory_allocated_bytes{{{SEL}}}", "rank {{rank}} allocated"),
                (f"zeroplane_device_memory_reserved_bytes{{{SEL}}}", "rank {{rank}} reserved"),
                (f"zeroplane_device_memory_peak_bytes{{{SEL}}}", "rank {{rank}} peak"),
                (f"zeroplane_device_memory_total_bytes{{{SEL}}}", "rank {{rank}} device total"),
                (f"zeroplane_host_memory_resident_bytes{{{SEL}}}", "rank {{rank}} resident"),
            ],
            "decbytes",
            min_=0,
        ),
        row("Communication"),
        timeseries(
            "Collective bandwidth by op, per rank",
            "Bytes per second of collective time: rate(bytes) / rate(seconds). Bytes are the "
            "logical tensor of each call (see worker/collectives.py).",
            [
                (
                    f"sum by ({BY_RANK}, op) ({coll_bytes}) "
                    f"/ (sum by ({BY_RANK}, op) ({coll_seconds}) > 0)",
                    "rank {{rank}} · {{op}}",
                )
            ],
            "Bps",
            min_=0,
        ),
        timeseries(
            "Collective traffic by op, per rank",
            "Logical bytes per wall-clock second.",
            [(coll_bytes, "rank {{rank}} · {{op}}")],
            "Bps",
            stack=True,
            min_=0,
        ),
        timeseries(
            "Time in collectives, per rank",
            "Seconds of collective time per second (asynchronous collectives overlap with "
            "compute, so this can pass 100%).",
            [(rate("zeroplane_collective_seconds_total"), "rank {{rank}} · {{op}}")],
            "percentunit",
            stack=True,
            min_=0,
        ),
        timeseries(
            "Gradient compression",
            "Ratio of raw to on-the-wire bytes (1.0 when compression is off).",
            [(f"zeroplane_compression_ratio{{{SEL}}}", "rank {{rank}} ratio")],
            "none",
            min_=0,
        ),
        timeseries(
            "Raw and wire bytes per second",
            "Collective payload before and after compression.",
            [
                (rate("zeroplane_compression_raw_bytes_total"), "rank {{rank}} raw"),
                (rate("zeroplane_compression_wire_bytes_total"), "rank {{rank}} wire"),
            ],
            "Bps",
            min_=0,
        ),
        row("Training"),
        timeseries(
            "Step time, per rank",
            "Mean optimizer step duration (first forward/backward of the accumulation window "
            "to the end of step()).",
            [
                (
                    f"{rate('zeroplane_step_duration_seconds_sum')} "
                    f"/ {rate('zeroplane_step_duration_seconds_count')}",
                    "rank {{rank}} · stage {{stage}}",
                )
            ],
            "s",
            min_=0,
        ),
        timeseries(
            "Step time quantiles",
            "p50 and p90 over all ranks.",
            [
                (
                    f"histogram_quantile({q}, sum by (job, stage, le) "
                    f"({rate('zeroplane_step_duration_seconds_bucket')}))",
                    f"p{int(q * 100)} · stage {{{{stage}}}}",
                )
                for q in (0.5, 0.9)
            ],
            "s",
            min_=0,
        ),
        timeseries(
            "Throughput, per rank",
            "Samples per second each rank trains on.",
            [(rate("zeroplane_samples_total"), "rank {{rank}}")],
            "short",
            stack=True,
            min_=0,
        ),
        timeseries(
            "Loss, per rank",
            "The last micro-batch loss each rank computed.",
            [(f"zeroplane_loss{{{SEL}}}", "rank {{rank}}")],
            "none",
        ),
        timeseries(
            "Optimizer steps",
            "Steps per second, and steps skipped on an fp16 overflow.",
            [
                (rate("zeroplane_steps_total"), "rank {{rank}} steps/s"),
                (rate("zeroplane_skipped_steps_total"), "rank {{rank}} skipped/s"),
            ],
            "short",
            min_=0,
        ),
        row("Mixture of experts"),
        timeseries(
            "Tokens per expert (load balance)",
            "Token rows each expert received per second under expert parallelism, by layer "
            "and expert: an even load is flat lines; a hot expert stands out.",
            [
                (
                    f"sum by (layer, expert) ({rate('zeroplane_expert_tokens_total')})",
                    "{{layer}} expert {{expert}}",
                )
            ],
            "short",
            min_=0,
        ),
        timeseries(
            "Dropped tokens",
            "Routed assignments dropped over an expert's capacity (capacity_factor) per "
            "second, by layer; zero when routing is dropless.",
            [
                (
                    f"sum by (layer) ({rate('zeroplane_expert_dropped_tokens_total')})",
                    "{{layer}}",
                )
            ],
            "short",
            min_=0,
        ),
        timeseries(
            "Token all-to-all traffic",
            "Bytes per second each rank's token all-to-alls sent and received (dispatch "
            "and combine, forward and backward), summed over layers.",
            [
                (
                    f"sum by (rank) ({rate('zeroplane_expert_all_to_all_bytes_total')})",
                    "rank {{rank}}",
                )
            ],
            "Bps",
            min_=0,
        ),
        row("Control plane"),
        timeseries(
            "Workers by state",
            "member: in the current generation; standby: registered, waiting; lost: a member "
            "that left or missed its lease, until the next generation forms.",
            [(f"zeroplane_coordinator_workers{{{JOB}}}", "{{state}}")],
            "short",
            stack=True,
            min_=0,
        ),
        timeseries(
            "Membership events",
            "Lease expiries, generations formed, generations that grew or shrank the job, "
            "and stalls the coordinator named (by kind: silent, stuck, mismatch, waiting; "
            "'stalled' is 1 while one lasts). `zeroplane status` says which ranks wait where.",
            [
                (
                    f"increase(zeroplane_coordinator_lease_expiries_total{{{JOB}}}[{RATE}])",
                    "lease expiries",
                ),
                (
                    f"sum by (kind) "
                    f"(increase(zeroplane_coordinator_stalls_total{{{JOB}}}[{RATE}]))",
                    "stalls {{kind}}",
                ),
                (f"zeroplane_coordinator_stalled{{{JOB}}} > 0", "stalled ({{kind}})"),
                (
                    f"increase(zeroplane_coordinator_generations_total{{{JOB}}}[{RATE}])",
                    "generations",
                ),
                (
                    f"sum by (direction) "
                    f"(increase(zeroplane_coordinator_scale_events_total{{{JOB}}}[{RATE}]))",
                    "scale {{direction}}",
                ),
            ],
            "short",
            draw="bars",
            min_=0,
        ),
        timeseries(
            "Training paused for membership changes",
            "Seconds each rank's training stood still per membership change, by kind: "
            "scale_up and scale_down are live re-shards; crash runs from the failed collective "
            "to training again, rollback to replicas or a checkpoint included.",
            [
                (
                    f"sum by (rank, kind) "
                    f"(increase(zeroplane_membership_pause_seconds_total{{{SEL}}}[{RATE}])) "
                    f"/ sum by (rank, kind) "
                    f"(increase(zeroplane_membership_changes_total{{{SEL}}}[{RATE}]))",
                    "rank {{rank}} {{kind}}",
                )
            ],
            "s",
            draw="bars",
            min_=0,
        ),
        timeseries(
            "Generation formation time",
            "Mean seconds from the first membership change to the generation that follows "
            "it, since the coordinator started.",
            [
                (
                    f"zeroplane_coordinator_generation_formation_seconds_sum{{{JOB}}} "
                    f"/ zeroplane_coordinator_generation_formation_seconds_count{{{JOB}}}",
                    "mean",
                )
            ],
            "s",
            min_=0,
        ),
        timeseries(
            "Coordinator RPCs by method and code",
            "Finished RPCs per second.",
            [
                (
                    f"sum by (method, code) "
                    f"(rate(zeroplane_coordinator_rpcs_total{{{JOB}}}[{RATE}]))",
                    "{{method}} {{code}}",
                )
            ],
            "reqps",
            min_=0,
        ),
        timeseries(
            "Coordinator RPC latency (p99)",
            "Unary RPCs; a method with no calls in the window shows no point.",
            [
                (
                    f"histogram_quantile(0.99, sum by (method, le) "
                    f"(rate(zeroplane_coordinator_rpc_duration_seconds_bucket{{{JOB}}}[{RATE}])))",
                    "{{method}}",
                )
            ],
            "s",
            min_=0,
        ),
    ]


def layout(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assign ids and grid positions: rows span 24 columns; panels fill rows of two."""
    y, x, out = 0, 0, []
    for i, panel in enumerate(items, start=1):
        panel = {"id": i, **panel}
        if panel["type"] == "row":
            if x:
                y, x = y + 8, 0
            panel["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
            y += 1
        else:
            width = 24 if panel["type"] == "table" else 12
            if x + width > 24:
                y, x = y + 8, 0
            panel["gridPos"] = {"h": 8, "w": width, "x": x, "y": y}
            x += width
            if x >= 24:
                y, x = y + 8, 0
        out.append(panel)
    return out


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DS,
        "query": {"query": query, "refId": f"var-{name}", "qryType": 1},
        "refresh": 2,
        "sort": 3,
        "multi": name != "job",
        "includeAll": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "options": [],
        "hide": 0,
    }


def dashboard() -> dict[str, Any]:
    return {
        "uid": "zeroplane",
        "title": "zeroplane",
        "description": "ZeRO training with zeroplane: memory per rank against the stage-0 "
        "baseline, collective bandwidth, compression, step time, throughput and membership.",
        "tags": ["zeroplane", "training", "zero"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 41,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                },
                {
                    "datasource": DS,
                    "enable": True,
                    "hide": False,
                    "iconColor": "orange",
                    "name": "New generation",
                    "target": {
                        "refId": "Anno",
                        "datasource": DS,
                        "expr": f"changes(zeroplane_coordinator_generation{{{JOB}}}[1m]) > 0",
                        "interval": "30s",
                    },
                },
            ]
        },
        "templating": {
            "list": [
                {
                    "type": "datasource",
                    "name": "datasource",
                    "label": "Prometheus",
                    "query": "prometheus",
                    "hide": 0,
                    "includeAll": False,
                    "multi": False,
                    "options": [],
                    "refresh": 1,
                    "regex": "",
                },
                variable("job", "job", "label_values(zeroplane_worker_info, job)"),
                variable(
                    "stage", "stage", 'label_values(zeroplane_worker_info{job=~"$job"}, stage)'
                ),
                variable(
                    "rank",
                    "rank",
                    'label_values(zeroplane_worker_info{job=~"$job", stage=~"$stage"}, rank)',
                ),
            ]
        },
        "panels": layout(panels()),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the JSON is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
