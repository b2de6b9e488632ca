"""``zeroplane demo``: its pieces, and the whole demo end to end on 2 workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from coordinator.commands import demo as demo_cmd
from coordinator.commands.demo import (
    DemoError,
    DemoOptions,
    StageResult,
    render_table,
    run_demo,
)
from coordinator.core.memory import model_state_bytes

REPO = Path(__file__).resolve().parents[1]

try:
    import worker

    HAVE_ENGINE = hasattr(worker, "initialize")
except ImportError:  # torch missing
    HAVE_ENGINE = False
needs_engine = pytest.mark.skipif(
    not HAVE_ENGINE, reason="worker.initialize is not available yet (the ZeRO engine)"
)


@pytest.fixture
def repo_on_path(monkeypatch):
    # Workers run `python -m worker.demo`; make that work without an installed package.
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{path}" if path else str(REPO))


# -- options and rendering (no torch) ---------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"nproc": 0}, "nproc"),
        ({"stages": (0, 4)}, "stages"),
        ({"stages": ()}, "stages"),
        ({"steps": 0}, "steps"),
        ({"dtype": "fp16"}, "dtype"),
        ({"nproc": 3, "batch_size": 16}, "batch_size"),
    ],
)
def test_options_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"DemoOptions\.{field}"):
        DemoOptions(**kwargs)


def test_parse_stages():
    assert demo_cmd._parse_stages("3,0") == (3, 0)
    with pytest.raises(Exception, match="stages"):
        demo_cmd._parse_stages("1,5")


def _result(stage: int, numel: int = 2**20, n: int = 2) -> StageResult:
    predicted = model_state_bytes(numel, stage=stage, world_size=n, dtype="fp32").as_dict()
    return StageResult(
        stage=stage,
        world_size=n,
        dtype="fp32",
        numel=numel,
        measured={k: int(v) for k, v in predicted.items()},
        predicted=predicted,
        losses=[5.5, 2.25],
        step_s=0.0123,
        comm_bytes_per_step=0.0,
        wall_s=1.0,
    )


def test_render_table():
    table = render_table([_result(s) for s in (0, 1, 2, 3)])
    lines = table.splitlines()
    assert "1,048,576 trainable parameters, 2 rank(s)" in lines[0]
    assert "Stage-0 baseline: 16.00 MiB (measured)" in lines[2]
    assert lines[4].split() == [
        "stage",
        "params",
        "grads",
        "optimizer",
        "measured",
        "predicted",
        "vs",
        "stage",
        "0",
        "ms/step",
        "final",
        "loss",
    ]
    rows = {line.split()[0]: line.split() for line in lines[6:]}
    assert [rows[s][6] for s in "0123"] == ["100.0%", "75.0%", "62.5%", "50.0%"]
    assert rows["3"][1:] == ["2.00", "2.00", "4.00", "8.00", "8.00", "50.0%", "12.3", "2.2500"]
    assert max(len(line) for line in lines) <= 88
    # Without stage 0 the baseline is the planner's stage-0 prediction.
    assert "Stage-0 baseline: 16.00 MiB (predicted)" in render_table([_result(3)])


@pytest.mark.timeout(60)
def test_failing_stage_raises_with_code_and_output(monkeypatch):
    def failing(options, stage, out):
        return (sys.executable, "-c", "import sys; print('about to fail'); sys.exit(3)")

    monkeypatch.setattr(demo_cmd, "_worker_command", failing)
    with pytest.raises(DemoError, match=r"stage 1: rank [01] failed with exit code 3") as info:
        run_demo(DemoOptions(nproc=2, stages=(1,), steps=1))
    assert info.value.returncode == 3
    assert "[rank0] about to fail" in info.value.output


@pytest.mark.timeout(60)
def test_ctrl_c_stops_the_stage_and_its_workers(monkeypatch, tmp_path):
    script = tmp_path / "w.py"
    script.write_text(
        "import os, sys, time\n"
        "open(os.path.join(sys.argv[1], 'pid' + os.environ['RANK']), 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    monkeypatch.setattr(
        demo_cmd, "_worker_command", lambda o, s, out: (sys.executable, str(script), str(tmp_path))
    )
    pids: list[int] = []

    def interrupt_once_started() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(list(tmp_path.glob("pid*"))) < 2:
            time.sleep(0.05)
        pids.extend(int(p.read_text()) for p in tmp_path.glob("pid*"))
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does to the demo

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    with pytest.raises(DemoError, match="stage 0: interrupted by SIGINT") as info:
        run_demo(DemoOptions(nproc=2, stages=(0, 1), steps=1))
    assert info.value.interrupted and info.value.returncode == 130
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# -- the worker script ----------------------------------------------------------------


def test_corpus_ships_with_the_package():
    pytest.importorskip("torch")
    from worker.demo import load_corpus

    data = load_corpus()
    assert data.numel() == 466_854
    assert int(data.max()) < 128 and b"Persuasion" in bytes(data[:40].tolist())


def test_batches_split_one_global_batch_across_ranks():
    torch = pytest.importorskip("torch")
    from worker.demo import DemoConfig, sample_batch

    data = torch.arange(1000)
    cfg = DemoConfig(batch_size=8, block_size=16)
    whole_x, whole_y = sample_batch(data, cfg, step=3, rank=0, world_size=1)
    parts = [sample_batch(data, cfg, step=3, rank=r, world_size=4) for r in range(4)]
    assert torch.equal(torch.cat([x for x, _ in parts]), whole_x)
    assert torch.equal(whole_y, whole_x + 1)
    assert not torch.equal(sample_batch(data, cfg, step=4, rank=0, world_size=1)[0], whole_x)


def test_worker_config_errors_name_the_field():
    pytest.importorskip("torch")
    from worker.demo import DemoConfig

    with pytest.raises(ValueError, match=r"DemoConfig\.steps"):
        DemoConfig(steps=0)
    with pytest.raises(ValueError, match=r"DemoConfig\.stage"):
        DemoConfig(stage=4)


# -- end to end -------------------------------------------------------------------------


@needs_engine
@pytest.mark.timeout(240)
def test_demo_every_stage_end_to_end(repo_on_path):
    try:
        results = run_demo(DemoOptions(nproc=2, stages=(0, 1, 2, 3), steps=2))
    except DemoError as exc:
        pytest.fail("\n".join([str(exc), "worker output:", *exc.output]))
    assert [r.stage for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r.world_size == 2 and r.numel > 500_000 and len(r.losses) == 2
        # Measured bytes are the formula's plus at most a little padding.
        assert r.predicted["total"] <= r.measured["total"] <= 1.01 * r.predicted["total"]
        assert r.step_s > 0
    totals = [r.measured["total"] for r in results]
    assert totals == sorted(totals, reverse=True) and totals[3] < 0.55 * totals[0]
    # Same seed, same data, fp32: every stage trains the same model.
    for r in results[1:]:
        assert r.losses == pytest.approx(results[0].losses, rel=1e-4)
    assert results[0].losses[0] == pytest.approx(5.55, abs=0.1)  # ln 256 at init


@needs_engine
@pytest.mark.timeout(120)
def test_demo_cli(repo_on_path):
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "demo", "--steps", "2", "--stages", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    assert "stage 2  done in" in proc.stdout
    assert "measured" in proc.stdout and "(predicted)" in proc.stdout


def test_a_stage_listed_twice_runs_twice(monkeypatch) -> None:
    """--stages 3,0,3: each run gets a directory of its own (it made one per stage, and
    the second 3 failed with FileExistsError)."""
    demo = demo_cmd
    ran = []

    def fake_stage(options, stage, out, on_progress, on_line, fork_server=None):
        out.mkdir()  # what the real one does first
        ran.append((stage, out.name))
        return stage

    monkeypatch.setattr(demo, "_run_stage", fake_stage)
    assert demo.run_demo(demo.DemoOptions(nproc=1, stages=(3, 0, 3), steps=1)) == [3, 0, 3]
    assert [s for s, _ in ran] == [3, 0, 3] and len({d for _, d in ran}) == 3
