"""Start the same small 3-worker job many times in a row and count the starts that
lose a worker: the check that no worker aborts at start (issue: one run in seven
once lost a worker to SIGABRT within a second of the first generation forming).

Each start is ``zeroplane run --nproc 3`` of a script that passes its own
``ZeroConfig(stage=1)``, takes a few optimizer steps on a small model and exits.
``--busy N`` keeps N cores busy meanwhile (a loaded machine). Prints one line per
start and a summary; exits 1 if any start failed, naming its exit code and the
last lines of its output.

    python bench/startup_stress.py --starts 30 --busy 1
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import torch
    import worker

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = worker.initialize(model, opt, config=worker.ZeroConfig(stage=1))
    for _ in range(3):
        x = torch.randn(4, 32)
        engine.backward(engine(x).square().mean())
        engine.step()
    engine.close()
    """
)


def _spin() -> None:
    while True:
        pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--starts", type=int, default=30)
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument(
        "--no-fork-server", action="store_true", help="start each worker as a fresh process"
    )
    p.add_argument("--busy", type=int, default=1, help="cores kept busy meanwhile")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per start")
    opts = p.parse_args()

    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(opts.busy)]
    for s in spinners:
        s.start()
    failures: list[str] = []
    seconds: list[float] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "start.py"
            script.write_text(SCRIPT)
            cmd = [
                sys.executable, "-m", "coordinator.cli", "run", "--nproc", str(opts.nproc),
                "--no-http", *(["--no-fork-server"] if opts.no_fork_server else []), str(script),
            ]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            for i in range(opts.starts):
                t0 = time.monotonic()
                try:
                    done = subprocess.run(
                        cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=opts.timeout,
                    )  # fmt: skip
                    code, out = done.returncode, done.stderr
                except subprocess.TimeoutExpired as exc:
                    code, out = -1, f"timed out after {opts.timeout:g}s\n{exc.stderr or ''}"
                seconds.append(time.monotonic() - t0)
                aborted = "terminate called" in out or "SIGABRT" in out
                print(f"start {i + 1:3d}: exit {code} in {seconds[-1]:.1f}s", flush=True)
                if code != 0 or aborted:
                    tail = "\n".join(out.splitlines()[-15:])
                    failures.append(f"start {i + 1}: exit {code}\n{tail}")
    finally:
        for s in spinners:
            s.kill()
    print(
        f"\n{opts.starts - len(failures)} of {opts.starts} starts of a {opts.nproc}-worker job "
        f"succeeded ({opts.busy} core(s) kept busy); median start-to-exit "
        f"{sorted(seconds)[len(seconds) // 2]:.1f}s"
    )
    for f in failures:
        print(f"\n{f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
