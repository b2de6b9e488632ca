"""Worker and coordinator metrics: names, values against the engine's own reports,
the Prometheus text format (promtool), service discovery and the status API."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import worker
from coordinator.control import telemetry as coordinator_metrics
from coordinator.control.client import CoordinatorAuthError
from coordinator.control.observe import RankSample, figures, parse_sample
from coordinator.core.memory import model_state_bytes
from coordinator.core.messages import WorkerReport
from coordinator.core.settings import METRICS_PORT_ENV, HttpConfig
from tests.coordinator_util import client, config, inventory, running, wait_until
from tests.coordinator_util import worker as info
from worker import metrics as worker_metrics
from worker.stats import StepStats

CUDA_ONLY = {
    "zeroplane_device_memory_allocated_bytes",
    "zeroplane_device_memory_reserved_bytes",
    "zeroplane_device_memory_peak_bytes",
    "zeroplane_device_memory_total_bytes",
}


def promtool_check(text: str) -> None:
    """``promtool check metrics`` on ``text``; skipped (outside CI) without promtool."""
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing in CI (scripts/install-test-deps.sh installs it)")
        pytest.skip("promtool not installed: apt-get install --no-install-recommends prometheus")
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def families(text: str) -> set[str]:
    out = set()
    for family in text_string_to_metric_families(text):
        # the parser drops _total from counter family names; METRIC_NAMES keeps it
        out.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return out


def value(text: str, name: str, **labels: str) -> float:
    want = set(labels.items())
    hits = [v for (n, ls), v in samples(text).items() if n == name and want <= ls]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples"
    return hits[0]


def small_engine(stage: int = 0, dtype: str = "fp32", **config) -> worker.ZeroEngine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model[0].bias.requires_grad_(False)  # frozen: counted in params and in the baseline
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return worker.initialize(
        model, opt, config=worker.ZeroConfig(stage=stage, dtype=dtype, **config)
    )


def train(engine: worker.ZeroEngine, steps: int) -> None:
    for _ in range(steps):
        loss = engine(torch.randn(4, 8)).float().pow(2).mean()
        engine.backward(loss)
        engine.step(samples=4, tokens=32)


# ---------------------------------------------------------------- worker


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_worker_metrics_match_the_engine(dtype: str) -> None:
    engine = small_engine(dtype=dtype)
    train(engine, 3)
    text = worker_metrics.metrics_text(engine)
    promtool_check(text)
    assert families(text) == set(worker_metrics.METRIC_NAMES) - CUDA_ONLY

    report = engine.memory_report()
    for kind in ("params", "grads", "master", "optimizer", "buffers", "compression"):
        got = value(text, "zeroplane_model_state_bytes", kind=kind, rank="0", stage="0")
        assert got == report[kind], kind
    # One rank at stage 0 holds exactly the stage-0 formula (no padding on one rank).
    psi = engine.layout.numel
    formula = model_state_bytes(psi, stage=0, world_size=1, dtype=dtype, optimizer_states=2)
    frozen = 16 * 4  # the frozen fp32 bias, cast to the compute dtype
    frozen = frozen if dtype == "fp32" else frozen // 2
    base = {
        k: value(text, "zeroplane_model_state_baseline_bytes", kind=k)
        for k in formula.as_dict()
        if k != "total"
    }
    assert base == {
        "params": formula.params + frozen,
        "grads": formula.grads,
        "master": formula.master,
        "optimizer": formula.optimizer,
    }
    # the held optimizer state is the formula's plus Adam's step counters (4 bytes each)
    assert 0 <= report["optimizer"] - base["optimizer"] <= 4 * 8

    assert value(text, "zeroplane_trainable_parameters") == psi
    assert value(text, "zeroplane_steps_total") == 3
    assert value(text, "zeroplane_samples_total") == 12
    assert value(text, "zeroplane_tokens_total") == 96
    assert value(text, "zeroplane_step_duration_seconds_count") == 3
    assert value(text, "zeroplane_step_duration_seconds_bucket", le="+Inf") == 3
    assert value(text, "zeroplane_step_duration_seconds_sum") > 0
    assert value(text, "zeroplane_loss") > 0
    assert value(text, "zeroplane_compression_ratio") == 1.0
    assert value(text, "zeroplane_host_memory_resident_bytes") > 1 << 20
    for op in worker_metrics.COLLECTIVE_OPS:  # present, zero: one process moves nothing
        assert value(text, "zeroplane_collective_bytes_total", op=op) == 0
    info_labels = next(ls for (n, ls) in samples(text) if n == "zeroplane_worker_info")
    assert dict(info_labels)["torch_version"] == torch.__version__
    assert dict(info_labels)["device_kind"] == "cpu"


def test_step_stats_histogram_is_consistent() -> None:
    stats = StepStats()
    for seconds in (0.003, 0.02, 0.02, 7.0, 500.0):
        stats.bucket_counts[
            next(i for i, b in enumerate(worker.stats.STEP_SECONDS_BUCKETS) if seconds <= b)
        ] += 1
        stats.seconds_sum += seconds
    buckets, total = stats.histogram()
    counts = dict(buckets)
    assert counts["0.005"] == 1 and counts["0.025"] == 3 and counts["10.0"] == 4
    assert counts["+Inf"] == 5
    assert total == pytest.approx(507.043)
    assert [c for _, c in buckets] == sorted(c for _, c in buckets)


def test_gradient_accumulation_books_one_step_per_boundary() -> None:
    engine = small_engine(gradient_accumulation_steps=2)
    train(engine, 4)
    text = worker_metrics.metrics_text(engine)
    assert value(text, "zeroplane_steps_total") == 2
    assert value(text, "zeroplane_step_duration_seconds_count") == 2
    assert value(text, "zeroplane_samples_total") == 16  # every micro-batch counts


@pytest.mark.timeout(60)
def test_metrics_served_over_http_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(METRICS_PORT_ENV, "0")
    monkeypatch.setenv("ZEROPLANE_METRICS_HOST", "127.0.0.1")
    engine = small_engine()
    try:
        assert engine.metrics is not None
        train(engine, 1)
        url = f"http://127.0.0.1:{engine.metrics.port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        assert value(text, "zeroplane_steps_total") == 1
        sample = parse_sample(text, at=0.0)
        assert sample.steps == 1 and sample.baseline["grads"] > 0
    finally:
        engine.close()
    assert engine.metrics is None
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)


@pytest.mark.timeout(60)
def test_serve_metrics_of_an_engine_shows_each_step_boundary() -> None:
    engine = small_engine()
    server, port = worker_metrics.serve_metrics(engine, 0, host="127.0.0.1")
    try:
        url = f"http://127.0.0.1:{port}/metrics"

        def steps() -> float:
            return value(
                urllib.request.urlopen(url, timeout=5).read().decode(), "zeroplane_steps_total"
            )

        assert steps() == 0  # served from the start, before any step
        train(engine, 2)
        assert steps() == 2
    finally:
        server.close()
        engine.close()


def test_metrics_port_is_validated() -> None:
    with pytest.raises(ValueError, match="metrics_port"):
        worker.ZeroConfig(metrics_port=70000)
    assert worker.ZeroConfig().metrics_port is None


def collectives_case(stage: int, compression: str) -> dict:
    engine = small_engine(stage=stage, compression=compression)
    train(engine, 3)
    text = worker_metrics.metrics_text(engine)
    comm = engine.comm_report()
    return {
        "text": text,
        "comm": comm,
        "ratio": value(text, "zeroplane_compression_ratio"),
        "raw": value(text, "zeroplane_compression_raw_bytes_total"),
        "wire": value(text, "zeroplane_compression_wire_bytes_total"),
    }


@pytest.mark.timeout(180)
def test_collective_counters_come_from_the_collectives_module(pools) -> None:
    plain, int8 = (pools(2).run(collectives_case, 2, c)[0] for c in ("none", "int8"))
    promtool_check(plain["text"])
    for op, stats in plain["comm"].items():
        assert value(plain["text"], "zeroplane_collective_bytes_total", op=op) == stats["bytes"]
        assert value(plain["text"], "zeroplane_collective_seconds_total", op=op) == pytest.approx(
            stats["seconds"]
        )
        assert value(plain["text"], "zeroplane_collective_calls_total", op=op) == stats["calls"]
    assert plain["comm"]["reduce_scatter"]["bytes"] > 0 and plain["comm"]["all_gather"]["bytes"] > 0
    assert plain["ratio"] == 1.0 and plain["raw"] == plain["wire"] > 0
    assert int8["ratio"] == pytest.approx(int8["raw"] / int8["wire"]) and int8["ratio"] > 1.2


# ---------------------------------------------------------------- coordinator


def get(address: str, path: str) -> tuple[str, str]:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as response:
        return response.headers["Content-Type"], response.read().decode()


@pytest.mark.timeout(60)
def test_coordinator_metrics_sd_and_status_api() -> None:
    cfg = dataclasses.replace(
        config(lease_timeout_s=0.6, stage=2), http=HttpConfig(port=0, job_name="t-job")
    )
    with running(cfg) as server:
        http = server.http_address
        assert http is not None
        c = client(server)
        try:
            c.register(info("w0", metrics_endpoint="127.0.0.1:1"), inventory())
            c.set_report(WorkerReport(model_state_bytes={"params": 10}, step=3))
            c.start()
            wait_until(lambda: server.status().generation_id == 1, what="a generation")
            # one RPC refused for its token, counted by code
            bad = client(server, token="wrong-token-0123456789", connect_timeout_s=1.0)
            with pytest.raises(CoordinatorAuthError):
                bad.status()
            bad.close()

            _, sd = get(http, "/sd")
            groups = json.loads(sd)
            assert groups == [
                {
                    "targets": ["127.0.0.1:1"],
                    "labels": {
                        "job": "t-job",
                        "__meta_zeroplane_worker_id": "w0",
                        "__meta_zeroplane_host": "127.0.0.1",
                        "__meta_zeroplane_state": "member",
                        "__meta_zeroplane_generation": "1",
                        "__meta_zeroplane_rank": "0",
                        "__meta_zeroplane_stage": "2",
                    },
                }
            ]
            _, api = get(http, "/api/status")
            status = json.loads(api)
            assert status["job"] == "t-job" and status["stage"] == 2
            assert status["workers"][0]["worker_id"] == "w0"
            # its endpoint does not answer: the rank row says so instead of failing the page
            assert "cannot read metrics" in status["ranks"][0]["error"]

            content_type, page = get(http, "/")
            assert content_type.startswith("text/html")
            assert "api/status" in page and "<script" in page
            assert "src=" not in page and "https://" not in page  # nothing external

            _, text = get(http, "/metrics")
            promtool_check(text)
            assert families(text) <= set(coordinator_metrics.METRIC_NAMES)
            assert value(text, "zeroplane_coordinator_workers", state="member") == 1
            assert value(text, "zeroplane_coordinator_generation") == 1
            assert value(text, "zeroplane_coordinator_stage") == 2
            assert value(text, "zeroplane_coordinator_scale_events_total", direction="up") == 1
            assert value(text, "zeroplane_coordinator_registrations_total", kind="new") == 1
            assert value(text, "zeroplane_coordinator_generation_formation_seconds_count") == 1
            reg = value(
                text, "zeroplane_coordinator_rpcs_total", method="Coordinator/Register", code="OK"
            )
            assert reg == 1
            assert (
                value(
                    text,
                    "zeroplane_coordinator_rpcs_total",
                    method="Coordinator/Status",
                    code="UNAUTHENTICATED",
                )
                >= 1
            )
            assert (
                value(
                    text,
                    "zeroplane_coordinator_rpc_duration_seconds_count",
                    method="Coordinator/Register",
                )
                == 1
            )
        finally:
            c.close()  # no leave: the lease runs out

        def expired() -> bool:
            _, text = get(http, "/metrics")
            return value(text, "zeroplane_coordinator_lease_expiries_total") == 1

        wait_until(expired, timeout=10, what="a lease expiry")
        _, sd = get(http, "/sd")
        assert json.loads(sd) == []  # a lost worker is no longer a target
    with pytest.raises(urllib.error.URLError):
        get(http, "/healthz")


def test_figures_are_rate_ratios_over_the_window() -> None:
    first = RankSample(
        at=10.0,
        collective_bytes={"all_reduce": 1000.0},
        collective_seconds={"all_reduce": 1.0},
        step_count=10,
        step_sum=2.0,
        steps=10,
        samples=40,
        compression_raw=1000,
        compression_wire=500,
    )
    last = dataclasses.replace(
        first,
        at=20.0,
        collective_bytes={"all_reduce": 5000.0},
        collective_seconds={"all_reduce": 3.0},
        step_count=30,
        step_sum=8.0,
        steps=30,
        samples=120,
        compression_raw=5000,
        compression_wire=1500,
        model_state={"params": 4.0, "grads": 2.0, "compression": 9.0},
        baseline={"params": 4.0, "grads": 4.0},
    )
    f = figures("e", [last, first])
    assert f.window_s == 10.0
    assert f.bandwidth == {"all_reduce": 2000.0}
    assert f.step_seconds == pytest.approx(0.3)
    assert f.samples_per_second == 8.0
    assert f.compression_ratio == 4.0
    assert f.kept == 0.75  # compression residuals are not in the baseline's kinds
    # one sample: averages since start
    only = figures("e", [first])
    assert only.window_s == 0 and only.bandwidth == {"all_reduce": 1000.0}
    assert only.step_seconds == pytest.approx(0.2) and only.samples_per_second is None
    # a counter reset (new process group) drops the samples from before it
    reset = dataclasses.replace(first, at=30.0, steps=2, step_count=2, step_sum=1.0)
    assert figures("e", [first, last, reset]).step_seconds == pytest.approx(0.5)


def test_cuda_memory_gauges(monkeypatch) -> None:
    # No GPU here: the CUDA branch runs against stand-ins for torch.cuda's memory queries.
    engine = small_engine()
    train(engine, 1)
    engine.device = torch.device("cuda", 0)
    fake = {"memory_allocated": 11, "memory_reserved": 22, "max_memory_allocated": 33}
    for name, number in fake.items():
        monkeypatch.setattr(torch.cuda, name, lambda device, n=number: n)

    class Props:
        total_memory = 44

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    text = worker_metrics.metrics_text(engine)
    promtool_check(text)
    assert families(text) == set(worker_metrics.METRIC_NAMES)
    for kind, number in (("allocated", 11), ("reserved", 22), ("peak", 33), ("total", 44)):
        assert value(text, f"zeroplane_device_memory_{kind}_bytes") == number
    assert 'device_kind="cuda"' in text


def test_expert_load_is_the_busiest_expert_over_the_mean_over_the_window() -> None:
    from coordinator.commands.status import format_figures
    from coordinator.control.observe import expert_balance

    text = """# TYPE zeroplane_expert_tokens counter
zeroplane_expert_tokens_total{layer="l0",expert="0"} 10
zeroplane_expert_tokens_total{layer="l0",expert="1"} 10
zeroplane_expert_tokens_total{layer="l1",expert="0"} 5
zeroplane_expert_tokens_total{layer="l1",expert="1"} 5
# TYPE zeroplane_expert_dropped_tokens counter
zeroplane_expert_dropped_tokens_total{layer="l0"} 0
zeroplane_expert_dropped_tokens_total{layer="l1"} 0
"""
    first = parse_sample(text, at=1.0)
    assert first.expert_tokens == {"l0": {"0": 10.0, "1": 10.0}, "l1": {"0": 5.0, "1": 5.0}}
    later = dataclasses.replace(
        first,
        at=11.0,
        steps=1,
        step_count=1,
        expert_tokens={"l0": {"0": 40.0, "1": 20.0}, "l1": {"0": 15.0, "1": 15.0}},
        expert_dropped={"l0": 6.0, "l1": 0.0},
    )
    f = figures("e", [first, later])
    # over the window l0's experts got 30 and 10 rows: 30 over a mean of 20
    assert f.expert_tokens["l0"] == {"0": 30.0, "1": 10.0}
    assert (f.expert_load, f.expert_layer) == (1.5, "l0")
    assert f.expert_dropped_share == pytest.approx(6 / (30 + 10 + 10 + 10 + 6))
    # another rank holding experts 2 and 3 of l0, evenly loaded: the job's balance
    other = {"l0": {"2": 20.0, "3": 20.0}}
    load, layer = expert_balance([f.expert_tokens, other])
    assert layer == "l0" and load == pytest.approx(30 / 20)
    table = format_figures([{**f.as_dict(), "rank": 0}])
    assert "expert load" in table and "1.50" in table and "every rank's experts 1.50 (l0)" in table
    assert "expert load" not in format_figures([{**figures("e", [RankSample(at=1)]).as_dict()}])
