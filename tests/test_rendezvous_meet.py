"""How ranks meet at a generation's store (worker/rendezvous.py `ControlPlane._meet`):
a newcomer waiting for rank 0 to host the store keeps looking often
([Note: a newcomer waits at the store]); a group that never forms ends the process
([Note: a group that never forms])."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest

from worker import rendezvous
from worker.rendezvous import STUCK_FORMING_EXIT, ControlPlane

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class _Generation:
    rendezvous_endpoint: str
    world_size: int
    id: int = 7

    def rank_of(self, worker_id: str) -> int:
        return int(worker_id)


@dataclass
class _Client:
    worker_id: str
    job_finished: bool = False
    generation: _Generation | None = None


@dataclass
class _Sleeps:
    """``time.sleep`` as the meeting calls it, recorded per thread."""

    real: object = time.sleep
    by_thread: dict[str, list[float]] = field(default_factory=dict)

    def __call__(self, seconds: float) -> None:
        self.by_thread.setdefault(threading.current_thread().name, []).append(seconds)
        self.real(seconds)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_a_newcomer_waiting_for_the_store_looks_often_and_then_meets_at_once(monkeypatch):
    port = _free_port()
    gen = _Generation(f"127.0.0.1:{port}", world_size=2)
    sleeps = _Sleeps()
    monkeypatch.setattr(rendezvous.time, "sleep", sleeps)
    # the newcomer is rank 1 and arrives first; rank 0 opens the store later
    planes = [ControlPlane(_Client(str(r)), gen, "gloo", timedelta(seconds=10)) for r in (0, 1)]
    met: dict[int, object] = {}
    deadline = time.monotonic() + 30

    def meet(rank: int) -> None:
        met[rank] = planes[rank]._meet(gen, deadline)

    newcomer = threading.Thread(target=meet, args=(1,), name="newcomer")
    newcomer.start()
    sleeps.real(0.6)  # several times the longest interval: the newcomer has backed off
    assert newcomer.is_alive(), "the newcomer met nobody"
    probing = list(sleeps.by_thread["newcomer"])
    meet(0)
    newcomer.join(timeout=20)
    assert not newcomer.is_alive(), "the newcomer did not see rank 0 arrive"
    assert met[0] is not None and met[1] is not None

    # before the store is up, the newcomer looks at least every _MEET_PROBE_S (it
    # used to back off to _MEET_POLL_S, and met up to that long after rank 0 arrived)
    assert len(probing) > 10 and max(probing) <= rendezvous._MEET_PROBE_S, probing


def _listening_on(port: int) -> set[str]:
    """The local addresses listening on TCP ``port`` (IPv4), from /proc/net/tcp."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # LISTEN
            out.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return out


def test_a_served_store_listens_on_the_workers_address_alone() -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from coordinator.core.ports import free_port
    from worker.compat import serving_store

    port = free_port("127.0.0.1")
    store = serving_store("127.0.0.1", port, 2, timedelta(seconds=5))
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=5))
    client.set("k", "v")
    assert store.get("k") == b"v"
    # not 0.0.0.0: the store is unauthenticated (README, Security)
    assert _listening_on(port) == {"127.0.0.1"}


def test_a_group_that_never_forms_ends_the_process_saying_why() -> None:
    """worker/rendezvous.py [Note: a group that never forms]: a block that outlives
    twice the timeout and the margin ends the process with its own status; one that
    returns in time leaves it running."""
    code = (
        "import time, datetime, logging\n"
        "import worker.rendezvous as r\n"
        "logging.basicConfig()\n"
        "r._FORM_MARGIN_S = 0.2\n"
        "with r._exit_if_stuck(datetime.timedelta(seconds=0.05), 'forming generation 7'):\n"
        "    pass\n"
        "with r._exit_if_stuck(datetime.timedelta(seconds=0.05), 'forming generation 8'):\n"
        "    time.sleep(30)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == STUCK_FORMING_EXIT, done.stderr
    assert "forming generation 8 did not finish within 0s" in done.stderr
    assert "generation 7" not in done.stderr
