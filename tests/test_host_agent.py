"""The host agent (coordinator/control/host_agent.py [Note: the host agent]): a real
coordinator on loopback, real clients heartbeating through a real agent's Unix socket,
and a worker process killed to show a dead rank is lost at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from coordinator.control.client import ClientConfig, CoordinatorClient
from coordinator.control.host_agent import HostAgent
from coordinator.core.messages import WorkerReport
from tests.coordinator_util import TOKEN, config, inventory, running, wait_until, worker

ROOT = Path(__file__).resolve().parent.parent


def rpcs(server, method: str) -> float:
    """Finished RPCs of ``method`` the coordinator counted (its own metrics)."""
    return sum(
        server.metrics.registry.get_sample_value(
            "zeroplane_coordinator_rpcs_total", {"method": f"Coordinator/{method}", "code": code}
        )
        or 0.0
        for code in ("OK", "FAILED_PRECONDITION", "NOT_FOUND", "UNAVAILABLE")
    )


def agent_for(server) -> HostAgent:
    agent = HostAgent.for_coordinator(
        lambda: ClientConfig(address=f"127.0.0.1:{server.port}", token=TOKEN, rpc_timeout_s=2.0),
        host_id="host-a",
    )
    agent.start()
    return agent


def agent_client(server, agent: HostAgent | str) -> CoordinatorClient:
    path = agent if isinstance(agent, str) else agent.path
    return CoordinatorClient(
        ClientConfig(
            address=f"127.0.0.1:{server.port}",
            token=TOKEN,
            connect_timeout_s=5.0,
            rpc_timeout_s=2.0,
            backoff_max_s=0.3,
            host_agent=path,
        )
    )


def members(server) -> set[str]:
    return {w.info.worker_id for w in server.status().workers if w.state == "member"}


def leased(server) -> set[str]:
    """The workers holding a lease: members and those standing by."""
    return {w.info.worker_id for w in server.status().workers if w.state != "lost"}


def test_every_rank_beats_through_the_agent_and_keeps_its_lease() -> None:
    with running(config(lease_timeout_s=1.5, min_workers=3)) as server:
        agent = agent_for(server)
        clients = [agent_client(server, agent) for _ in range(3)]
        try:
            for i, c in enumerate(clients):
                c.register(worker(f"w{i}"), inventory())
                c.set_report(WorkerReport(model_state_bytes={"params": 10}, step=i + 3))
                c.start()
            for c in clients:
                c.wait_for_generation(timeout=10)
            # three leases of 1.5 s: every rank is renewed through the agent alone
            time.sleep(4.5)
            assert members(server) == {"w0", "w1", "w2"}
            assert rpcs(server, "Heartbeat") == 0
            assert agent.beats_sent >= 10  # on one HostHeartbeats stream, counted when it ends
            reports = server.last_reports()
            assert {w: reports[w].step for w in ("w0", "w1", "w2")} == {"w0": 3, "w1": 4, "w2": 5}
            # a final report reaches the coordinator before heartbeat(flush=True) returns
            clients[1].set_report(WorkerReport(model_state_bytes={"params": 10}, step=99))
            clients[1].heartbeat(flush=True)
            assert server.last_reports()["w1"].step == 99
            # a leave through the agent's host: the rank goes as left, not as lost
            clients[2].close(leave=True, reason="done here")
            wait_until(lambda: "w2" not in members(server), what="w2 to leave")
            time.sleep(1.0)  # the agent's heartbeats after its connection closed
            kinds = {(e.kind, e.worker_id) for e in server.status().events}
            assert ("left", "w2") in kinds and ("expired", "w2") not in kinds
            assert not any(kind == "expired" for kind, _ in kinds)
        finally:
            for c in clients:
                c.close()
            agent.stop()


WORKER = textwrap.dedent(
    """
    import sys, time
    from coordinator.control.client import ClientConfig, CoordinatorClient
    from tests.coordinator_util import TOKEN, inventory, worker
    port, path, name = sys.argv[1:4]
    c = CoordinatorClient(ClientConfig(address=f"127.0.0.1:{port}", token=TOKEN,
                                       rpc_timeout_s=2.0, host_agent=path))
    c.register(worker(name), inventory())
    c.start()
    print("registered", flush=True)
    time.sleep(600)
    """
)


def spawn_worker(server, agent: HostAgent, name: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(server.port), agent.path, name],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "registered"
    return proc


def drop_detail(server, worker_id: str) -> str:
    return next(
        e.detail for e in server.status().events if e.worker_id == worker_id and e.kind == "expired"
    )


@pytest.mark.parametrize("how", ["hung", "killed"])
def test_a_hung_or_killed_worker_is_lost_within_its_lease(how: str) -> None:
    """A stopped process keeps its sockets open and sends nothing: only the agent's
    leaving it out once its beat is older than the lease drops it (its watch stream
    stays open); until then the agent's beats carry their age, and the coordinator's
    lease for it runs down as if it heartbeat itself. A killed one closes both: it goes
    at once, whichever is seen first."""
    lease = 3.0 if how == "hung" else 60.0
    with running(config(lease_timeout_s=lease, min_workers=1)) as server:
        agent = agent_for(server)
        alive = agent_client(server, agent)
        proc = None
        try:
            alive.register(worker("alive"), inventory())
            alive.start()
            proc = spawn_worker(server, agent, "other")
            beats = agent.beats_sent
            wait_until(lambda: agent.beats_sent >= beats + 3, what="host beats")
            assert "other" in members(server)
            proc.send_signal(signal.SIGSTOP if how == "hung" else signal.SIGKILL)
            if how == "hung":  # still listed, its lease dated from its last beat
                wait_until(
                    lambda: any(
                        w.info.worker_id == "other" and w.lease_remaining_s < lease - 1.5
                        for w in server.status().workers
                    ),
                    timeout=15,
                    what="the hung worker's lease to run down",
                )
            wait_until(
                lambda: "other" not in leased(server),
                timeout=15,
                what=f"the {how} worker to be dropped",
            )
            if how == "hung":  # left out by its agent, or its lease ran out first
                detail = drop_detail(server, "other")
                assert "host agent" in detail or "no heartbeat" in detail, detail
            assert "alive" in members(server)
            assert rpcs(server, "Heartbeat") == 0
        finally:
            if proc is not None:
                proc.kill()
                proc.wait(timeout=10)
            alive.close()
            agent.stop()


def test_without_an_agent_a_worker_heartbeats_the_coordinator_itself(tmp_path) -> None:
    with running(config(lease_timeout_s=1.5, min_workers=1)) as server:
        c = agent_client(server, str(tmp_path / "no-agent.sock"))
        try:
            c.register(worker("solo"), inventory())
            c.start()
            time.sleep(3.0)
            assert "solo" in members(server)
            assert rpcs(server, "Heartbeat") >= 5
        finally:
            c.close()


def test_a_generation_formed_meanwhile_is_caught_up_through_the_agent() -> None:
    with running(config(lease_timeout_s=1.5, min_workers=1)) as server:
        agent = agent_for(server)
        first, second = agent_client(server, agent), agent_client(server, agent)
        try:
            first.register(worker("first"), inventory())
            first.start()
            g1 = first.wait_for_generation(timeout=10)
            second.register(worker("second"), inventory())
            second.start()
            g2 = first.wait_for_generation(after=g1.id, timeout=10)
            assert {m.worker_id for m in g2.members} == {"first", "second"}
            time.sleep(3.0)  # two leases on: both still members at the new generation
            assert members(server) == {"first", "second"}
            assert server.status().generation_id == g2.id
        finally:
            first.close()
            second.close()
            agent.stop()


@pytest.mark.parametrize("frame", [b"\xff\xff\xff\xff", b"\x00\x00\x00\x05abc"])
def test_a_malformed_frame_ends_that_connection_only(frame: bytes) -> None:
    import socket

    with running(config(lease_timeout_s=1.5, min_workers=1)) as server:
        agent = agent_for(server)
        c = agent_client(server, agent)
        try:
            c.register(worker("steady"), inventory())
            c.start()
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(agent.path)
                s.sendall(frame)
                s.shutdown(socket.SHUT_WR)
                s.settimeout(5)
                assert s.recv(10) == b""  # the agent hung up on it
            time.sleep(2.0)
            assert "steady" in members(server)
        finally:
            c.close()
            agent.stop()


def test_a_garbage_message_in_a_whole_frame_ends_that_connection_only() -> None:
    # a frame of the right length whose bytes are no AgentBeat: protobuf's DecodeError
    import socket

    with running(config(lease_timeout_s=1.5, min_workers=1)) as server:
        agent = agent_for(server)
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(agent.path)
                s.sendall(b"\x00\x00\x00\x03\xff\xff\xff")
                s.settimeout(5)
                assert s.recv(10) == b""
            c = agent_client(server, agent)  # the agent still serves the next one
            c.register(worker("after"), inventory())
            c.start()
            time.sleep(1.0)
            assert "after" in members(server)
            c.close()
        finally:
            agent.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_PEERCRED is Linux's")
def test_only_the_launchers_own_processes_and_no_more_than_it_starts_are_served() -> None:
    import socket

    with running(config(lease_timeout_s=1.5, min_workers=1)) as server:
        agent = HostAgent.for_coordinator(
            lambda: ClientConfig(address=f"127.0.0.1:{server.port}", token=TOKEN),
            host_id="host-a",
            max_ranks=1,
        )
        agent.start()
        sibling = subprocess.Popen(["sleep", "60"])
        try:
            # this process, as an agent whose launcher is another process (the sibling,
            # its child) sees it: of this user, but not started by that launcher
            agent.launcher_pid = sibling.pid
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(agent.path)
                s.settimeout(5)
                assert s.recv(10) == b""  # hung up on
            assert agent.refused == 1
            agent.launcher_pid = os.getpid()
            # the launcher's own rank is served; a second one is one more than it starts
            c = agent_client(server, agent)
            c.register(worker("mine"), inventory())
            c.start()
            wait_until(lambda: "mine" in members(server), timeout=10)
            wait_until(lambda: agent.beats_sent >= 1, timeout=10)  # its beat went through
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(agent.path)
                s.settimeout(5)
                assert s.recv(10) == b""
            assert agent.refused == 2
            c.close()
        finally:
            sibling.kill()
            sibling.wait()
            agent.stop()
