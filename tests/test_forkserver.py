"""Workers forked by the fork server run as `python script.py` would
(coordinator/launchers/spawner.py)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from coordinator.launchers.local import LaunchSpec, LocalJob
from coordinator.launchers.spawner import SERVER_MODULE, ForkServer, forkable

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

# What a worker reports about itself, as JSON on one stdout line; rank 1 then fails
# the way its argument says.
SCRIPT = """\
import json, os, sys
preloaded = "torch" in sys.modules
print(json.dumps({
    "rank": os.environ["RANK"],
    "argv": sys.argv,
    "path0": sys.path[0],
    "name": __name__,
    "preloaded": preloaded,
    "pid": os.getpid(),
    "own_session": os.getsid(0) == os.getpid(),
    "cwd": os.getcwd(),
    "marker": os.environ.get("MARKER"),
}))
print("to stderr", file=sys.stderr)
if os.environ["RANK"] == "1":
    if sys.argv[1] == "exit":
        raise SystemExit(7)
    if sys.argv[1] == "raise":
        raise RuntimeError("the script failed")
"""


def run_job(command: tuple[str, ...], nproc: int = 2, **spec) -> tuple[object, list]:
    lines: list[tuple[int, str, str]] = []
    job = LocalJob(
        LaunchSpec(command=command, nproc=nproc, env={"MARKER": "m"}, **spec),
        on_line=lambda rank, stream, line: lines.append((rank, stream, line)),
    )
    with job:
        result = job.wait(timeout=120)
    return result, lines


def reports(lines: list) -> dict[int, dict]:
    out = {}
    for rank, stream, line in lines:
        if stream == "stdout" and line.startswith("{"):
            out[rank] = json.loads(line)
    return out


@pytest.mark.timeout(180)
def test_forked_workers_run_as_a_fresh_interpreter_would(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text(SCRIPT)
    for how in ("exit", "raise"):
        result, lines = run_job((sys.executable, str(script), how), fork_server=True)
        got = reports(lines)
        assert set(got) == {0, 1}, lines
        for rank, r in got.items():
            assert r["rank"] == str(rank)
            assert r["argv"] == [str(script), how]
            assert r["path0"] == str(tmp_path)
            assert r["name"] == "__main__"
            assert r["preloaded"], "torch was not imported by the server"
            assert r["own_session"] and r["marker"] == "m"
        assert got[0]["pid"] != got[1]["pid"]
        assert (0, "stderr", "to stderr") in lines and (1, "stderr", "to stderr") in lines
        if how == "exit":
            assert result.returncode == 7 and result.failed_rank == 1, result
        else:
            assert result.returncode == 1 and result.failed_rank == 1, result
            err = [line for rank, stream, line in lines if rank == 1 and stream == "stderr"]
            assert "RuntimeError: the script failed" in err, err


@pytest.mark.timeout(120)
def test_forked_module_and_fresh_fallback(tmp_path: Path) -> None:
    (tmp_path / "showmod.py").write_text(SCRIPT)
    # -m: sys.path[0] is the working directory, argv[0] the module's file
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        result, lines = run_job((sys.executable, "-m", "showmod", "ok"), 1, fork_server=True)
    finally:
        os.chdir(cwd)
    got = reports(lines)[0]
    assert result.returncode == 0, result
    assert got["argv"] == [str(tmp_path / "showmod.py"), "ok"] and got["preloaded"]
    assert got["path0"] == str(tmp_path) and got["cwd"] == str(tmp_path)
    # a module the server imported ahead runs as python -m runs it, without a warning
    result, lines = run_job((sys.executable, "-m", "worker.config"), 1, fork_server=True)
    err = [line for _, stream, line in lines if stream == "stderr"]
    assert result.returncode == 0 and not any("RuntimeWarning" in line for line in err), err
    # what cannot be run ends as the interpreter ends it
    for command, code, says in (
        ((sys.executable, str(tmp_path / "missing.py")), 2, "can't open file"),
        ((sys.executable, "-m", "no_such_module_here"), 1, "No module named no_such_module_here"),
    ):
        result, lines = run_job(command, 1, fork_server=True)
        err = [line for _, stream, line in lines if stream == "stderr"]
        assert result.returncode == code and any(says in line for line in err), (result, err)
    # a command the server cannot run starts as a fresh process
    result, lines = run_job((sys.executable, "-c", SCRIPT, "ok"), nproc=1, fork_server=True)
    assert result.returncode == 0 and reports(lines)[0]["preloaded"] is False


def test_forkable_commands() -> None:
    py = sys.executable
    assert forkable((py, "train.py", "--x")) and forkable((py, "-m", "pkg.mod"))
    assert not forkable((py, "-c", "print()"))
    assert not forkable((py, "-u", "train.py"))
    assert not forkable((py, "-m"))
    assert not forkable(("/usr/bin/env", "python", "train.py"))
    assert not forkable((py,))


@pytest.mark.timeout(120)
def test_a_killed_worker_is_reported_and_a_killed_server_loses_no_worker(tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text("import os, time\nprint('up', os.getpid(), flush=True)\ntime.sleep(60)\n")
    server = ForkServer({**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        a = server.fork((sys.executable, str(script)), dict(os.environ))
        b = server.fork((sys.executable, str(script)), dict(os.environ))
        assert a.stdout is not None and a.stdout.readline().split()[0] == b"up"
        os.kill(a.pid, signal.SIGKILL)
        assert a.wait(timeout=10) == -signal.SIGKILL
        assert b.poll() is None
        # the server dies: its workers carry on, and their exit is still reported
        # (this process, a subreaper, adopts them: spawner.py [Note: workers outlive
        # the fork server])
        os.kill(server.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while server.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.alive
        time.sleep(0.5)
        assert b.poll() is None, "the worker died with its fork server"
        os.kill(b.pid, signal.SIGTERM)
        assert b.wait(timeout=15) == -signal.SIGTERM
        with pytest.raises(OSError, match="fork server"):
            server.fork((sys.executable, str(script)), dict(os.environ))
        with pytest.raises(ValueError, match="cannot run"):
            server.fork((sys.executable, "-c", "pass"), {})
    finally:
        server.close()
    assert SERVER_MODULE == "worker.forkserver"


def _fork_server_of(launcher: int) -> int | None:
    """The pid of the fork server that ``launcher`` started, from /proc."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == launcher and SERVER_MODULE.encode() in argv:
            return int(entry.name)
    return None


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_job_loses_no_worker_and_no_step_when_its_fork_server_dies(
    tmp_path: Path, sig: signal.Signals
) -> None:
    import subprocess

    import torch

    from tests.test_run_e2e import EXAMPLE, ROOT, reference

    out, steps, log = tmp_path / "final.pt", 24, tmp_path / "run.log"
    with log.open("w") as sink:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "run", "--nproc", "2", "--min-nproc",
             "1", "--max-nproc", "2", "--no-http", "--stage", "2", str(EXAMPLE), "--steps",
             str(steps), "--optimizer", "sgd", "--step-sleep", "0.2", "--out", str(out)],
            cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        server = None
        while server is None and time.monotonic() < deadline:
            server = _fork_server_of(launcher.pid)
            time.sleep(0.1)
        assert server is not None, "no fork server under the launcher"
        # training: both workers were forked by the server and have stepped (the
        # example logs every 10 steps; 14 more at 0.2 s each are still to come)
        while "step 10 loss" not in log.read_text():
            assert launcher.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "no step 10 in two minutes"
            time.sleep(0.05)
        os.kill(server, sig)
        launcher.wait(timeout=200)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    output = log.read_text()
    assert launcher.returncode == 0, output[-4000:]
    assert "carry on" in output, output[-4000:]
    # no worker was lost: one generation of two all along, nothing restored
    assert "recovered" not in output and "restarting" not in output, output[-4000:]
    got, want = torch.load(out, weights_only=True), reference(steps, 12, optimizer="sgd")
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-5
