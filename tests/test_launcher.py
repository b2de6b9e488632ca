"""The local launcher with real child processes (tiny Python scripts, no torch)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from coordinator.launchers.local import LaunchSpec, LocalJob, find_free_port, prefix_lines

REPO = Path(__file__).resolve().parents[1]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux")


def write_script(tmp_path: Path, source: str, name: str = "w.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def python(script: Path, *args: str) -> tuple[str, ...]:
    return (sys.executable, str(script), *args)


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie nobody has reaped yet counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def read_pids(directory: Path, n: int, timeout: float = 10.0) -> list[int]:
    files = [directory / f"pid{r}" for r in range(n)]
    assert wait_until(lambda: all(f.exists() and f.read_text().strip() for f in files), timeout)
    return [int(f.read_text()) for f in files]


class Lines:
    """An ``on_line`` handler that keeps what the workers printed."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, str, str]] = []

    def __call__(self, rank: int, stream: str, line: str) -> None:
        self.lines.append((rank, stream, line))


def cli(*args: str, **kw) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # our signals to it must not reach pytest
        **kw,
    )


def sleeper(before: str = "", after_pid: str = "") -> str:
    """A worker that runs ``before``, writes its pid, runs ``after_pid``, then sleeps."""
    return "\n".join(
        [
            "import os, signal, sys, time",
            "from pathlib import Path",
            before,
            "out = Path(sys.argv[1])",
            "rank = os.environ['RANK']",
            "(out / f'pid{rank}.tmp').write_text(str(os.getpid()))",
            "os.replace(out / f'pid{rank}.tmp', out / f'pid{rank}')",
            after_pid,
            "time.sleep(60)",
        ]
    )


# -- spec ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"command": ()}, "command"),
        ({"command": ("x",), "nproc": 0}, "nproc"),
        ({"command": ("x",), "stage": "4"}, "stage"),
        ({"command": ("x",), "master_port": 70000}, "master_port"),
        ({"command": ("x",), "grace_s": -1}, "grace_s"),
        ({"command": ("x",), "env": {"A": 1}}, "env"),
    ],
)
def test_spec_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"LaunchSpec\.{field}"):
        LaunchSpec(**kwargs)


def test_spec_normalises_stage_and_freezes_env():
    spec = LaunchSpec(command=["a", "b"], stage=2, env={"A": "1"})
    assert spec.command == ("a", "b")
    assert spec.stage == "2"
    with pytest.raises(TypeError):
        spec.env["B"] = "2"  # type: ignore[index]


def test_find_free_port():
    assert 0 < find_free_port() < 65536


# -- environment and output ------------------------------------------------------


@pytest.mark.timeout(30)
def test_workers_get_torchrun_environment(tmp_path):
    script = write_script(
        tmp_path,
        """
        import json, os, sys
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "ZEROPLANE_STAGE", "EXTRA", "OMP_NUM_THREADS"]
        env = {k: os.environ.get(k) for k in keys}
        with open(os.path.join(sys.argv[1], f"env{os.environ['RANK']}.json"), "w") as f:
            json.dump(env, f)
        """,
    )
    spec = LaunchSpec(
        command=python(script, str(tmp_path)), nproc=3, stage="auto", env={"EXTRA": "x"}
    )
    with LocalJob(spec, on_line=Lines()) as job:
        result = job.wait(timeout=20)
    assert result.ok and result.returncodes == (0, 0, 0)
    for rank in range(3):
        env = json.loads((tmp_path / f"env{rank}.json").read_text())
        assert env == {
            "RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(job.master_port),
            "ZEROPLANE_STAGE": "auto",
            "EXTRA": "x",
            "OMP_NUM_THREADS": env["OMP_NUM_THREADS"],
        }
    assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")


@pytest.mark.timeout(30)
def test_no_stage_means_no_stage_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("ZEROPLANE_STAGE", raising=False)
    script = write_script(
        tmp_path, "import os, sys; sys.exit(3 if 'ZEROPLANE_STAGE' in os.environ else 0)"
    )
    with LocalJob(LaunchSpec(command=python(script), nproc=1), on_line=Lines()) as job:
        assert job.wait(timeout=20).ok


@pytest.mark.timeout(30)
def test_output_lines_carry_rank_and_stream(tmp_path):
    script = write_script(
        tmp_path,
        """
        import os, sys
        r = os.environ["RANK"]
        print(f"out {r} a"); print(f"out {r} b")
        print(f"err {r}", file=sys.stderr)
        sys.stdout.write(f"tail {r} without newline")
        """,
    )
    lines = Lines()
    with LocalJob(LaunchSpec(command=python(script), nproc=2), on_line=lines) as job:
        assert job.wait(timeout=20).ok
    for r in (0, 1):
        mine = [(s, t) for rank, s, t in lines.lines if rank == r]
        assert [t for s, t in mine if s == "stdout"] == [
            f"out {r} a",
            f"out {r} b",
            f"tail {r} without newline",
        ]
        assert [t for s, t in mine if s == "stderr"] == [f"err {r}"]


def test_prefix_lines_format(capsys):
    handle = prefix_lines()
    handle(0, "stdout", "hello")
    handle(3, "stderr", "oops")
    handle(1, "stderr", "2026-11-30 10:00:00,001 INFO x: stamped already")
    captured = capsys.readouterr()
    assert captured.out == "[rank0] hello\n"  # the script's output, as printed
    # logs get the coordinator's timestamp format, once
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    err = captured.err.splitlines()
    assert re.fullmatch(stamp + r" \[rank3\] oops", err[0]), err
    assert err[1] == "[rank1] 2026-11-30 10:00:00,001 INFO x: stamped already"


@pytest.mark.timeout(30)
def test_cli_prefixes_output_and_returns_zero(tmp_path):
    script = write_script(tmp_path, "import os; print('hello from', os.environ['RANK'])")
    proc = cli("run", "--nproc", "2", "--stage", "1", str(script))
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert sorted(out.splitlines()) == ["[rank0] hello from 0", "[rank1] hello from 1"]


@pytest.mark.timeout(30)
def test_cli_passes_script_arguments(tmp_path):
    script = write_script(tmp_path, "import sys; print(sys.argv[1:])")
    proc = cli("run", str(script), "--flag", "x", "--nproc", "5")
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert out.strip() == "[rank0] ['--flag', 'x', '--nproc', '5']"


# -- failure ------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_failing_worker_fails_job_with_its_code_and_stops_the_others(tmp_path):
    script = write_script(
        tmp_path,
        sleeper(
            after_pid=(
                "while rank == '1' and not all((out / f'pid{r}').exists() for r in (0, 2)):\n"
                "    time.sleep(0.01)\n"
                "if rank == '1': sys.exit(7)"
            )
        ),
    )
    t0 = time.monotonic()
    with LocalJob(
        LaunchSpec(command=python(script, str(tmp_path)), nproc=3), on_line=Lines()
    ) as job:
        result = job.wait(timeout=20)
        pids = read_pids(tmp_path, 3)
    assert time.monotonic() - t0 < 15
    assert result.returncode == 7
    assert result.failed_rank == 1
    assert "rank 1 failed with exit code 7" in result.message
    assert result.returncodes[1] == 7
    assert result.returncodes[0] == result.returncodes[2] == -signal.SIGTERM
    assert not any(alive(p) for p in pids)


@pytest.mark.timeout(30)
def test_worker_killed_by_signal_gives_128_plus_signal(tmp_path):
    script = write_script(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    with LocalJob(LaunchSpec(command=python(script), nproc=1), on_line=Lines()) as job:
        result = job.wait(timeout=20)
    assert result.returncode == 128 + signal.SIGKILL
    assert "rank 0 was killed by SIGKILL" in result.message


@pytest.mark.timeout(30)
def test_cli_failure_exit_code_and_message(tmp_path):
    script = write_script(
        tmp_path, "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(5)\ntime.sleep(60)"
    )
    proc = cli("run", "--nproc", "2", str(script))
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 5
    assert "rank 1 failed with exit code 5" in err


@pytest.mark.timeout(30)
def test_cli_missing_script_fails_cleanly(tmp_path):
    proc = cli("run", "--nproc", "2", str(tmp_path / "missing.py"))
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 2
    assert "missing.py" in err


# -- stopping, signals and cleanup --------------------------------------------------


@pytest.mark.timeout(30)
def test_stop_escalates_to_sigkill_after_grace(tmp_path):
    script = write_script(
        tmp_path,
        sleeper("signal.signal(signal.SIGTERM, signal.SIG_IGN)"),
    )
    job = LocalJob(
        LaunchSpec(command=python(script, str(tmp_path)), nproc=2, grace_s=0.5), on_line=Lines()
    )
    job.start()
    pids = read_pids(tmp_path, 2)
    t0 = time.monotonic()
    result = job.stop()
    assert result is not None and result.returncodes == (-signal.SIGKILL, -signal.SIGKILL)
    assert result.returncode == 128 + signal.SIGTERM
    assert result.message == "stopped by the launcher"
    assert 0.4 < time.monotonic() - t0 < 10
    assert not any(alive(p) for p in pids)
    assert job.stop() is result  # idempotent


@pytest.mark.timeout(30)
def test_context_manager_stops_workers_on_exception(tmp_path):
    script = write_script(tmp_path, sleeper())
    with (
        pytest.raises(RuntimeError, match="boom"),
        LocalJob(LaunchSpec(command=python(script, str(tmp_path)), nproc=2), on_line=Lines()),
    ):
        pids = read_pids(tmp_path, 2)
        raise RuntimeError("boom")
    assert wait_until(lambda: not any(alive(p) for p in pids), 5)


@pytest.mark.timeout(30)
def test_leftover_grandchildren_are_killed(tmp_path):
    # The worker exits 0 but leaves a child behind in its process group.
    script = write_script(
        tmp_path,
        f"""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(tmp_path / "grandchild")!r}, "w").write(str(child.pid))
        """,
    )
    with LocalJob(LaunchSpec(command=python(script), nproc=1), on_line=Lines()) as job:
        assert job.wait(timeout=20).ok
    grandchild = int((tmp_path / "grandchild").read_text())
    assert wait_until(lambda: not alive(grandchild), 5)


class FakeService:
    def __init__(self) -> None:
        self.events: list[str] = []

    def start(self) -> dict[str, str]:
        self.events.append("start")
        return {"ZEROPLANE_COORDINATOR": "127.0.0.1:1234"}

    def stop(self) -> None:
        self.events.append("stop")

    def worker_exited(self, worker_id: str, how: str) -> None:
        self.events.append(f"exited {worker_id} {how}")


@pytest.mark.timeout(30)
def test_services_start_first_add_env_and_stop_last(tmp_path):
    script = write_script(tmp_path, "import os; print(os.environ['ZEROPLANE_COORDINATOR'])")
    service, lines = FakeService(), Lines()
    job = LocalJob(LaunchSpec(command=python(script), nproc=2), on_line=lines, services=[service])
    with job:
        assert service.events == ["start"]
        assert job.wait(timeout=20).ok
        exits = {f"exited {job.worker_id(r)} exited with code 0" for r in (0, 1)}
        assert set(service.events[1:3]) == exits and service.events[3:] == ["stop"]
    assert service.events[0] == "start" and service.events[3:] == ["stop"]
    assert sorted(lines.lines) == [(r, "stdout", "127.0.0.1:1234") for r in (0, 1)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_cli_forwards_signals_and_leaves_no_worker(tmp_path, signum):
    # The workers note which signal reached them: proof it was forwarded, not a kill.
    note = textwrap.dedent(
        """
        def note(signum, frame):
            Path(sys.argv[1], f"got{os.environ['RANK']}").write_text(str(signum))
            sys.exit(0)
        signal.signal(signal.SIGINT, note)
        signal.signal(signal.SIGTERM, note)
        """
    )
    script = write_script(tmp_path, sleeper(note))
    proc = cli("run", "--nproc", "2", str(script), str(tmp_path))
    pids = read_pids(tmp_path, 2)
    proc.send_signal(signum)
    proc.communicate(timeout=20)
    assert proc.returncode == 128 + signum
    for rank in (0, 1):
        assert (tmp_path / f"got{rank}").read_text() == str(int(signum))
    assert wait_until(lambda: not any(alive(p) for p in pids), 5)


@pytest.mark.timeout(30)
def test_second_signal_kills_stubborn_workers(tmp_path):
    script = write_script(
        tmp_path,
        sleeper("signal.signal(signal.SIGINT, signal.SIG_IGN)"),
    )
    proc = cli("run", "--nproc", "2", "--grace", "30", str(script), str(tmp_path))
    pids = read_pids(tmp_path, 2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert all(alive(p) for p in pids)  # they ignore SIGINT; grace is long
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=10)
    assert proc.returncode == 128 + signal.SIGINT
    assert wait_until(lambda: not any(alive(p) for p in pids), 5)


@linux_only
@pytest.mark.timeout(30)
def test_workers_die_with_a_killed_launcher(tmp_path):
    proc = cli("run", "--nproc", "2", str(write_script(tmp_path, sleeper())), str(tmp_path))
    pids = read_pids(tmp_path, 2)
    proc.kill()  # SIGKILL: the launcher gets no chance to clean up
    proc.communicate(timeout=10)
    assert wait_until(lambda: not any(alive(p) for p in pids), 5)


@pytest.mark.timeout(30)
def test_launcher_and_commands_do_not_import_torch():
    code = (
        "import sys, coordinator.launchers.local, coordinator.commands.run\n"
        "import coordinator.commands.demo\n"
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert proc.returncode == 0, proc.stderr or "torch was imported"


class ScalingJob:
    """What ``wait_scaling`` uses of a LocalJob: three running workers, one of which
    has already handed over (the coordinator no longer has it) but not yet exited."""

    stopping = False

    def __init__(self) -> None:
        self.running = [0, 1, 2]
        self.retired: list[int] = []
        self.polls = 0

    def left_unasked(self) -> list[int]:
        return []

    def worker_id(self, index: int) -> str:
        return f"w{index}"

    def retire_worker(self) -> int:
        self.retired.append(self.running.pop())
        return self.retired[-1]

    def add_worker(self) -> int:
        raise AssertionError("not asked to add")

    def poll(self) -> object:
        self.polls += 1
        if self.polls == 1:
            os.kill(os.getpid(), signal.SIGUSR2)  # `kill -USR2 <launcher>` right now
        return "done" if self.polls > 3 else None


@pytest.mark.parametrize(("departed", "retired"), [(set(), [2]), ({"w1"}, [])])
def test_a_retirement_counts_members_not_processes(departed, retired, capsys):
    """--min-workers 2 with three processes: a retire request goes ahead, unless one of
    the three has handed over already (still exiting): then the job is at 2 members."""
    from argparse import Namespace

    from coordinator.commands.keeping import wait_scaling

    job = ScalingJob()
    args = Namespace(nproc=3, min_workers=2, max_workers=4)
    assert wait_scaling(job, args, lambda: departed) == "done"
    assert job.retired == retired
    assert ("already at 2 workers" in capsys.readouterr().err) == (not retired)


@pytest.mark.timeout(60)
@pytest.mark.timeout(60)
def test_a_retired_worker_killed_while_it_leaves_has_left(tmp_path):
    """A worker asked to leave (SIGUSR2's retirement) that dies of anything else
    before it exits (chaos: a SIGKILL while it hands over) has left: the others go
    on, nobody replaces it, and the job ends well."""
    script = write_script(
        tmp_path,
        """
        import os, signal, sys, time
        out = sys.argv[1]
        signal.signal(signal.SIGTERM, lambda *_: open(os.path.join(out, "asked"), "w").close())
        open(os.path.join(out, "ready-" + os.environ["RANK"]), "w").close()
        if os.environ["RANK"] == "1":
            time.sleep(30)  # the one retired: killed while it "hands over"
        while not os.path.exists(os.path.join(out, "done")):
            time.sleep(0.05)
        """,
    )
    spec = LaunchSpec(command=python(script, str(tmp_path)), nproc=2)
    with LocalJob(spec, on_line=Lines(), restarts=3, training_over=lambda: False) as job:
        assert wait_until(lambda: (tmp_path / "ready-1").exists(), 30.0)
        job.retire_worker(1)
        assert wait_until(lambda: (tmp_path / "asked").exists(), 10.0)
        os.kill(job._procs[1].pid, signal.SIGKILL)
        assert wait_until(lambda: job.poll() is None and job.settled(1), 10.0)
        (tmp_path / "done").touch()
        result = job.wait(timeout=30)
    assert result.ok, result.message
    assert len(job._procs) == 2  # not replaced


def test_an_elastic_job_whose_every_worker_failed_restarts_them(tmp_path):
    """Every worker fails at once (the survivors of a loss nothing covered exit 1):
    an elastic job replaces them while restarts last, as torchrun restarts its
    group; a failure after a worker finished is the job's failure."""
    script = write_script(
        tmp_path,
        """
        import os, sys, time
        marker = os.path.join(sys.argv[1], "attempt")
        if not os.path.exists(marker):
            open(marker, "w").close()
            time.sleep(0.5)
            sys.exit(1)
        time.sleep(0.5)
        open(os.path.join(sys.argv[1], "done"), "w").close()
        """,
    )
    # one worker: when it fails, none is left running (two could fail a poll apart)
    spec = LaunchSpec(command=python(script, str(tmp_path)), nproc=1)
    with LocalJob(spec, on_line=Lines(), restarts=2) as job:
        assert job.wait(timeout=40).ok
    assert (tmp_path / "done").exists(), "the job ended before its replacement did"
    # a non-elastic job fails at the first failure
    (tmp_path / "attempt").unlink()
    with LocalJob(spec, on_line=Lines()) as job:
        assert job.wait(timeout=40).returncode == 1
    # one worker finished, then the other failed: nothing to restart
    late = write_script(
        tmp_path, "import os, sys, time; r = int(os.environ['RANK']); time.sleep(r); sys.exit(r)"
    )
    with LocalJob(LaunchSpec(command=python(late), nproc=2), on_line=Lines(), restarts=2) as job:
        assert job.wait(timeout=40).returncode == 1
    # ... unless the coordinator says training goes on: that exit 0 was a leave (a
    # SIGTERM from outside, not yet settled by the launcher's loop), so the failure
    # is replaced (chaos: a member handed over to the last one, which was then killed)
    leave_then_fail = write_script(
        tmp_path,
        """
        import os, sys, time
        if os.environ["RANK"] == "0":
            sys.exit(0)
        time.sleep(1)
        marker = os.path.join(sys.argv[1], "failed")
        if os.path.exists(marker):
            sys.exit(0)  # the replacement
        open(marker, "w").close()
        sys.exit(1)
        """,
    )
    spec = LaunchSpec(command=python(leave_then_fail, str(tmp_path)), nproc=2)
    with LocalJob(spec, on_line=Lines(), restarts=2, training_over=lambda: False) as job:
        result = job.wait(timeout=40)
    assert result.ok, result.message


class LeftJob:
    """What ``keep_minimum`` uses of a LocalJob: workers 0-2 started, worker 0 exited
    0 without being asked; ``restarts`` replacements allowed."""

    stopping = False

    def __init__(self, running: list[int], restarts: int) -> None:
        self.running, self.restarts = running, restarts
        self._settled: list[int] = []
        self.replaced: list[int] = []
        self.abandoned: str | None = None

    def left_unasked(self) -> list[int]:
        return [i for i in (0,) if i not in self._settled]

    def worker_id(self, index: int) -> str:
        return f"w{index}"

    def settle(self, index: int) -> None:
        self._settled.append(index)

    def settled(self, index: int) -> bool:
        return index in self._settled

    def replace(self, index: int, what: str) -> bool:
        if not self.restarts:
            return False
        self.restarts -= 1
        self.replaced.append(index)
        self._settled.append(index)
        return True

    def abandon(self, message: str) -> None:
        self.abandoned = message


@pytest.mark.parametrize(
    ("running", "restarts", "finished", "replaced", "abandoned"),
    [
        ([1, 2], 3, False, [], False),  # two members remain: a scale-down
        ([1], 3, False, [0], False),  # below the minimum: replaced
        ([1], 0, False, [], True),  # below it with nothing to replace it: stopped
        ([1], 3, True, [], False),  # training ended: an exit 0 is the job's end
        ([], 3, False, [], False),  # everyone has exited: nothing to keep going
    ],
)
def test_a_worker_leaving_from_outside_is_replaced_only_below_the_minimum(
    running, restarts, finished, replaced, abandoned
):
    from coordinator.commands.keeping import keep_minimum

    job = LeftJob(running, restarts)
    keep_minimum(job, 2, lambda: {"w0"}, lambda: finished)
    assert job.replaced == replaced
    assert (job.abandoned is not None) == abandoned
    if abandoned:
        assert "fewer than the 2 it needs" in job.abandoned


def test_members_count_as_whole_groups_place_them():
    """Two workers remain, but the coordinator can place neither in a whole group (both
    at one tp position): the leaver is replaced, not taken for a scale-down."""
    from coordinator.commands.keeping import keep_minimum

    job = LeftJob([1, 2], 3)
    keep_minimum(job, 2, lambda: {"w0"}, lambda: False, lambda workers: 0)
    assert job.replaced == [0]
    job = LeftJob([1, 2], 3)
    keep_minimum(job, 2, lambda: {"w0"}, lambda: False, len)
    assert job.replaced == []


@pytest.mark.parametrize(
    ("placed", "fits", "chosen"),
    [
        # two workers no generation places (a standby, a newcomer): they go first
        ({"w0": 0, "w1": 0, "w2": 1, "w3": 1}, True, [4, 5]),
        # one unplaced: a whole group goes, the current generation's last
        ({"w0": 0, "w1": 0, "w2": 1, "w3": 1, "w5": 2, "w4": 2}, True, [4, 5]),
        ({"w0": 0, "w1": 0, "w2": 1, "w3": 1, "w4": 0}, True, [2, 3]),
        # what would remain makes too few members in whole groups: nobody goes
        ({"w0": 0, "w1": 0, "w2": 1, "w3": 1}, False, []),
    ],
)
def test_a_retirement_takes_a_whole_group_or_workers_nobody_places(placed, fits, chosen):
    from coordinator.commands.keeping import retirees

    job = LeftJob([0, 1, 2, 3, 4, 5], 0)
    got = retirees(job, 2, 2, set, lambda rest: 4 if fits else 0, lambda: placed)
    assert got == chosen


def test_a_leaver_still_running_is_replaced_ahead_when_whole_groups_need_it():
    """Worker 2 said it leaves (still running); the others alone make no whole group
    (an ep job's other place): a whole group's worth starts now, before its exit. A
    leaver the rest can spare, or a job everyone leaves, starts nobody."""
    from coordinator.commands.keeping import keep_minimum

    job = LeftJob([1, 2], 5)
    job._settled.append(0)  # (worker 0's exit is not the point here)
    keep_minimum(job, 2, lambda: {"w2"}, lambda: False, lambda stay: 0, early=True)
    assert job.replaced == [2, 2]
    job = LeftJob([1, 2, 3, 4], 5)
    job._settled.append(0)
    keep_minimum(job, 2, lambda: {"w2"}, lambda: False, len, early=True)
    assert job.replaced == []
    job = LeftJob([1, 2], 5)
    job._settled.append(0)
    keep_minimum(job, 2, lambda: {"w1", "w2"}, lambda: False, lambda stay: 0, early=True)
    assert job.replaced == []


def test_a_script_that_never_joined_the_coordinator_is_not_a_leaver():
    """Under `zeroplane run` a plain script ends without registering: its exit 0
    while the others still run is not a leave, whatever the minimum."""
    from coordinator.commands.keeping import keep_minimum

    job = LeftJob([1], 3)
    keep_minimum(job, 2, set, lambda: False)
    assert job.replaced == [] and job.abandoned is None
