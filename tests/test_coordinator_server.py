"""A real coordinator on loopback (port 0) with real clients."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator.cli import main
from coordinator.control.client import (
    ClientConfig,
    CoordinatorAuthError,
    CoordinatorClient,
    CoordinatorTlsError,
    CoordinatorUnavailableError,
    RequestRejectedError,
    StaleGenerationError,
)
from coordinator.control.embedded import EmbeddedCoordinator
from coordinator.control.host_agent import HostAgent
from coordinator.control.server import create_server
from coordinator.core.layout import ParamSpec
from coordinator.core.meshplan import MeshCoords
from coordinator.core.messages import GENERATION_METADATA_KEY, WorkerReport
from coordinator.core.settings import HOST_AGENT_ENV, CoordinatorConfig
from tests.coordinator_util import (
    AUTH,
    TOKEN,
    client,
    config,
    inventory,
    raw_stub,
    register_request,
    running,
    wait_until,
    worker,
)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent


def test_registration_forms_generations_and_reshards() -> None:
    with running(config(min_workers=2, max_workers=3, join_window_s=0.3)) as server:
        a, b, c = client(server), client(server), client(server)
        try:
            a.register(worker("a", device_memory_bytes=10**9), inventory())
            a.start()
            time.sleep(0.4)  # past the join window, but one worker is below min_workers
            assert a.generation is None
            assert "1 of at least 2" in server.status().waiting_reason
            b.register(worker("b", device_memory_bytes=10**9), inventory())
            b.start()

            g1 = a.wait_for_generation(timeout=10)
            assert b.wait_for_generation(timeout=10) == g1
            assert (g1.id, g1.world_size, g1.stage) == (1, 2, 2)
            assert [m.worker_id for m in g1.members] == ["a", "b"]
            # Hosted by rank 0 on a port it reported free (at register or in a heartbeat).
            assert g1.rendezvous_host == "127.0.0.1" and g1.rendezvous_port != server.port
            assert g1.layout.world_size == 2 and g1.bucket_numel == 100 and g1.reshard is None

            # Memory reported in heartbeats shows in status.
            a.set_report(
                WorkerReport(
                    model_state_bytes={"params": 1000, "grads": 500, "optimizer": 8000},
                    step=7,
                    applied_generation_id=1,
                )
            )
            row = wait_until(
                lambda: (
                    (w := server.status().worker("a")) and w.report and w.report.step == 7 and w
                ),
                what="a's report in status",
            )
            assert row.report.model_state_bytes == {"params": 1000, "grads": 500, "optimizer": 8000}

            # A third worker joins: generation 2 after the join window, with a reshard schedule.
            c.register(worker("c"), inventory())
            c.start()
            g2 = a.wait_for_generation(after=1, timeout=10)
            assert [(m.worker_id, m.previous_rank) for m in g2.members] == [
                ("a", 0),
                ("b", 1),
                ("c", None),
            ]
            assert g2.reshard is not None and g2.reshard.from_generation_id == 1
            assert g2.reshard.lost_ranks == ()
            trainable = sum(p.numel for p in inventory() if p.requires_grad)
            assert sum(m.numel for m in g2.reshard.moves) == trainable
            assert g2.rendezvous_endpoint != g1.rendezvous_endpoint
            assert c.wait_for_generation(timeout=10).id == 2

            # A leave forms the next generation at once.
            c.close(leave=True, reason="scale down")
            g3 = b.wait_for_generation(after=2, timeout=10)
            assert g3.world_size == 2 and g3.reshard is not None
            assert (g3.reshard.left_ranks, g3.reshard.lost_ranks) == ((2,), ())
            kinds = [e.kind for e in server.status().events]
            assert kinds.count("generation") == 3 and "left" in kinds
        finally:
            for x in (a, b, c):
                x.close()


def test_a_watch_stream_sends_each_generation_once() -> None:
    """A watcher gets every new generation once and then waits: the stream must not
    resend the one it already sent (a loop that did cost each worker a core and
    made training under the coordinator 7x slower than under torchrun)."""
    with running(config(min_workers=1, max_workers=2)) as server:
        channel, stub = raw_stub(server.port)
        with channel:
            stub.Register(register_request("a"), metadata=AUTH, timeout=5)
            stream = stub.WatchGenerations(
                pb.WatchGenerationsRequest(worker_id="a", after_generation_id=0),
                metadata=AUTH,
                timeout=2.0,
            )
            received = [next(stream).id]
            stub.Register(register_request("b"), metadata=AUTH, timeout=5)
            with pytest.raises(grpc.RpcError) as err:
                for generation in stream:
                    received.append(generation.id)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert received == [1, 2]


def test_missing_or_wrong_token_is_unauthenticated() -> None:
    with running(config()) as server:
        channel, stub = raw_stub(server.port)
        with channel:
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
                with pytest.raises(grpc.RpcError) as err:
                    stub.Status(pb.StatusRequest(), metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                next(stub.WatchGenerations(pb.WatchGenerationsRequest(), timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # Probes carry no token: the health service is open.
            health = health_pb2_grpc.HealthStub(channel)
            response = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        with client(server, token="not-the-token") as bad, pytest.raises(CoordinatorAuthError):
            bad.register(worker("a"), inventory())


def test_stale_generation_is_failed_precondition() -> None:
    with running(config(max_workers=2)) as server:
        a, b = client(server), client(server)
        try:
            a.register(worker("a"), inventory())
            assert a.generation is not None and a.generation.id == 1
            b.register(worker("b"), inventory())  # forms generation 2
            with pytest.raises(StaleGenerationError) as err:
                a.heartbeat()
            assert err.value.current == 2
            channel, stub = raw_stub(server.port)
            with channel:
                with pytest.raises(grpc.RpcError) as raw:
                    stub.Heartbeat(
                        pb.HeartbeatRequest(worker_id="a", generation_id=1), metadata=AUTH
                    )
                assert raw.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert dict(raw.value.trailing_metadata())[GENERATION_METADATA_KEY] == "2"
            a.fetch_generation(after=1)
            assert a.heartbeat() > 0  # caught up
        finally:
            a.close()
            b.close()


def test_inventory_mismatch_names_the_first_differing_parameter() -> None:
    with running(config(min_workers=2)) as server, client(server) as a, client(server) as b:
        a.register(worker("a"), inventory())
        other = inventory()
        other[1] = ParamSpec(name="block.0.weight", shape=(8, 9), dtype="float32", unit=1)
        with pytest.raises(RequestRejectedError, match=r"'block\.0\.weight' has shape \(8, 9\)"):
            b.register(worker("b"), other)
        channel, stub = raw_stub(server.port)
        with channel, pytest.raises(grpc.RpcError) as raw:
            stub.Register(register_request("b", other), metadata=AUTH)
        assert raw.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "block.0.weight" in raw.value.details()


def test_malformed_and_oversized_requests_are_invalid_argument() -> None:
    with running(config(max_request_bytes=4096)) as server:
        channel, stub = raw_stub(server.port)
        with channel:

            def code_of(call, *args) -> tuple[grpc.StatusCode, str]:
                with pytest.raises(grpc.RpcError) as err:
                    result = call(*args, metadata=AUTH, timeout=5)
                    if hasattr(result, "__next__"):
                        next(result)
                return err.value.code(), err.value.details()

            prefix = "/zeroplane.coordinator.v1.Coordinator/"
            garbage = b"\xff\xff\xff\xff\x0f"
            for method in ("Register", "Heartbeat", "Leave", "Status"):
                code, detail = code_of(channel.unary_unary(prefix + method), garbage)
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in detail
            code, _ = code_of(channel.unary_stream(prefix + "WatchGenerations"), garbage)
            assert code == grpc.StatusCode.INVALID_ARGUMENT

            big = [
                ParamSpec(name=f"layer.{i}.weight", shape=(4, 4), dtype="float32")
                for i in range(300)
            ]
            code, detail = code_of(stub.Register, register_request("a", big))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "over the limit of 4096" in detail

            bad_shape = register_request("a")
            bad_shape.inventory[0].shape[:] = [4, -1]
            code, detail = code_of(stub.Register, bad_shape)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "negative dim" in detail
            code, detail = code_of(stub.Register, register_request(""))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "worker_id" in detail
            code, detail = code_of(
                stub.Heartbeat, pb.HeartbeatRequest(worker_id="a", free_ports=[0])
            )
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "free_ports" in detail

            # The server kept serving.
            response = stub.Register(register_request("a"), metadata=AUTH, timeout=5)
            assert response.worker_id == "a"
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING


@contextmanager
def two_members(cfg: CoordinatorConfig) -> Iterator[tuple]:
    """A running coordinator with clients a and b, both members of generation 1."""
    with running(cfg) as server, client(server) as a, client(server) as b:
        a.register(worker("a"), inventory())
        b.register(worker("b"), inventory())
        a.start()
        b.start()
        g1 = a.wait_for_generation(timeout=10)
        assert g1.world_size == 2
        yield server, a, b, g1


def test_lease_expiry_is_visible_in_status() -> None:
    cfg = config(max_workers=2, join_window_s=0.5, lease_timeout_s=1.0)
    with two_members(cfg) as (server, a, b, _):
        b._stop_heartbeats.set()  # a hung worker: heartbeats stop, its connection stays
        g2 = a.wait_for_generation(after=1, timeout=10)
        assert [m.worker_id for m in g2.members] == ["a"]
        assert g2.reshard is not None and g2.reshard.lost_ranks == (1,)
        status = server.status()
        assert [w.info.worker_id for w in status.workers] == ["a"]
        expired = [e for e in status.events if e.kind == "expired"]
        assert [e.worker_id for e in expired] == ["b"] and "no heartbeat" in expired[0].detail


def test_a_closed_connection_drops_the_worker_long_before_its_lease() -> None:
    """A crashed worker's connection closes with its process: the coordinator drops
    it one heartbeat interval later, not at the end of a 60 s lease."""
    cfg = config(max_workers=2, join_window_s=0.5, lease_timeout_s=60.0)
    with two_members(cfg) as (server, a, b, _):
        closed = time.monotonic()
        b.close()  # no leave: the stream and the heartbeats just stop
        g2 = a.wait_for_generation(after=1, timeout=20)
        assert time.monotonic() - closed < 20  # the wait above would have raised
        assert [m.worker_id for m in g2.members] == ["a"]
        assert g2.reshard is not None and g2.reshard.lost_ranks == (1,)
        expired = [e for e in server.status().events if e.kind == "expired"]
        assert [e.worker_id for e in expired] == ["b"]
        assert "connection closed" in expired[0].detail


def test_a_launcher_seeing_a_process_exit_drops_the_worker_at_once() -> None:
    """A launcher that runs the workers (zeroplane run) tells its embedded coordinator
    of an exit as it sees it: no connection grace, no lease; the worker's client,
    still connected here, cannot delay it."""
    cfg = config(max_workers=2, join_window_s=0.5, lease_timeout_s=60.0)
    cfg = dataclasses.replace(
        cfg, membership=dataclasses.replace(cfg.membership, disconnect_grace_s=30.0)
    )
    with two_members(cfg) as (server, a, b, _):
        b._stop_heartbeats.set()
        server.worker_exited("b", "was killed by SIGKILL")
        g2 = a.wait_for_generation(after=1, timeout=5)
        assert [m.worker_id for m in g2.members] == ["a"]
        assert g2.reshard is not None and g2.reshard.lost_ranks == (1,)
        expired = [e for e in server.status().events if e.kind == "expired"]
        assert [(e.worker_id, e.detail) for e in expired] == [
            ("b", "its process was killed by SIGKILL")
        ]
        server.worker_exited("b", "exited with code 0")  # told twice, or after a leave
        assert server.status().generation_id == 2


def test_a_member_waiting_to_re_form_says_what_the_coordinator_waits_for() -> None:
    from worker.rendezvous import MEMBERSHIP_WAIT_ENV, ControlPlane

    cfg = config(min_workers=2, max_workers=2, lease_timeout_s=30.0)
    with two_members(cfg) as (_, a, b, g1):
        b.close(leave=True, reason="scale down")  # the job is now below min_workers
        plane = ControlPlane(a, g1, "gloo", timedelta(seconds=1), patience_s=0.5)
        with pytest.raises(TimeoutError) as caught:
            plane.wait_to_re_form()
        message = str(caught.value)
        assert MEMBERSHIP_WAIT_ENV in message and "needs at least 2" in message, message


def test_a_member_asked_to_leave_says_so_at_once() -> None:
    """A SIGTERM's announcement does not wait for the next heartbeat (30 s apart
    here): the coordinator's status marks the worker leaving within seconds."""
    cfg = config(max_workers=2, join_window_s=5.0, lease_timeout_s=90.0)
    cfg = dataclasses.replace(
        cfg, membership=dataclasses.replace(cfg.membership, heartbeat_interval_s=30.0)
    )
    with two_members(cfg) as (server, _, b, _):
        b.announce_leaving()
        deadline = time.monotonic() + 5
        while not any(w.leaving for w in server.status().workers):
            assert time.monotonic() < deadline, "the coordinator never heard b is leaving"
            time.sleep(0.05)
        assert [w.info.worker_id for w in server.status().workers if w.leaving] == ["b"]


def test_a_member_asked_to_leave_waits_for_a_generation_unless_the_job_is_over() -> None:
    """Below min_workers a member asked to leave keeps waiting (a replacement may be
    starting, and it hands over in that generation); once its launcher says the job
    is stopping, it gives up waiting (None) instead of waiting out its patience."""
    from worker.rendezvous import ControlPlane

    cfg = config(min_workers=2, max_workers=2, lease_timeout_s=30.0)
    with two_members(cfg) as (server, a, b, g1):
        b.close(leave=True, reason="scale down")  # the job is now below min_workers
        plane = ControlPlane(a, g1, "gloo", timedelta(seconds=1), patience_s=1.0)
        with pytest.raises(TimeoutError):
            plane.wait_to_re_form(stop=lambda: True)
        server.job_stopping("the launcher got SIGTERM")
        assert "the job is stopping (the launcher got SIGTERM)" in server.status().waiting_reason
        a.announce_leaving()  # its heartbeat, sent now, hears that the job is over
        plane = ControlPlane(a, g1, "gloo", timedelta(seconds=1), patience_s=60.0)
        started = time.monotonic()
        assert plane.wait_to_re_form(stop=lambda: True) is None
        assert time.monotonic() - started < 10


@pytest.mark.parametrize("raw", ["soon", "0", "-5", "nan"])
def test_worker_time_settings_from_the_environment_name_a_bad_value(monkeypatch, raw) -> None:
    from worker.rendezvous import MEMBERSHIP_WAIT_ENV, env_seconds

    monkeypatch.setenv(MEMBERSHIP_WAIT_ENV, raw)
    with pytest.raises(ValueError, match=rf"\$ZEROPLANE_MEMBERSHIP_WAIT_S .*{raw!r}"):
        env_seconds(MEMBERSHIP_WAIT_ENV, 600.0)
    monkeypatch.delenv(MEMBERSHIP_WAIT_ENV)
    assert env_seconds(MEMBERSHIP_WAIT_ENV, 600.0) == 600.0


@pytest.mark.parametrize("through_agent", [False, True], ids=["own-heartbeats", "host-agent"])
def test_restart_from_the_state_file_and_reattach(tmp_path: Path, through_agent: bool) -> None:
    state = tmp_path / "coordinator-state.json"
    cfg = config(max_workers=2, join_window_s=0.5, lease_timeout_s=1.0, state_file=state)
    first, port = create_server(cfg)
    first.start()
    agent = None
    kw: dict[str, object] = {"backoff_max_s": 0.2}
    if through_agent:
        # the heartbeats of both go through one host agent's stream, which must reopen
        agent = HostAgent.for_coordinator(
            lambda: ClientConfig(address=f"127.0.0.1:{port}", token=TOKEN, rpc_timeout_s=1.0)
        )
        kw["host_agent"] = agent.start()[HOST_AGENT_ENV]
    a, b = client(port, **kw), client(port, **kw)
    second = None
    try:
        a.register(worker("a"), inventory())
        b.register(worker("b"), inventory())
        a.start()
        b.start()
        g1 = a.wait_for_generation(timeout=10)
        assert state.exists()
        first.stop(grace=0)
        wait_until(lambda: not a.connected and not b.connected, what="clients to notice")
        time.sleep(1.5)  # longer than a lease: workers go on training meanwhile

        second, _ = create_server(
            dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, port=port))
        )
        second.start()
        wait_until(lambda: a.connected and b.connected, what="clients to re-attach")

        # Restored leases carry a re-attach grace; renewed ones are back to the 1 s timeout.
        def renewed():
            status = second.status()
            return all(w.lease_remaining_s <= 1.0 for w in status.workers) and status

        status = wait_until(renewed, what="heartbeats to renew the restored leases")
        assert status.generation_id == 1 and status.rendezvous_endpoint == g1.rendezvous_endpoint
        assert [(w.info.worker_id, w.state) for w in status.workers] == [
            ("a", "member"),
            ("b", "member"),
        ]
        assert "restored" in [e.kind for e in status.events]
        assert "registered" not in [e.kind for e in status.events]  # re-attached, not re-admitted

        # The watch stream is back too: a leave reaches the survivor as generation 2.
        b.close(leave=True)
        g2 = a.wait_for_generation(after=1, timeout=10)
        assert g2.world_size == 1 and g2.reshard is not None
        if agent is not None:
            assert agent.beats_sent > 0
            assert (
                second.metrics.registry.get_sample_value(
                    "zeroplane_coordinator_rpcs_total",
                    {"method": "Coordinator/Heartbeat", "code": "OK"},
                )
                is None
            )
    finally:
        a.close()
        b.close()
        if agent is not None:
            agent.stop()
        first.stop(grace=0)
        if second is not None:
            second.stop(grace=0)


def test_unreachable_coordinator_is_a_clear_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    with (
        client(port, connect_timeout_s=0.5, rpc_timeout_s=0.5) as c,
        pytest.raises(CoordinatorUnavailableError, match=rf"127\.0\.0\.1:{port} is unreachable"),
    ):
        c.register(worker("a"), inventory())
    assert time.monotonic() - started < 5


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls_with_token(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    with running(config(tls_cert_file=cert, tls_key_file=key)) as server:
        tls = CoordinatorClient(
            ClientConfig(
                address=f"127.0.0.1:{server.port}", token=TOKEN, tls=True,
                tls_root_cert_file=cert, connect_timeout_s=5,
            )
        )  # fmt: skip
        with tls:
            assert tls.register(worker("a"), inventory()).worker_id == "a"
        plaintext = client(server, connect_timeout_s=0.5)
        # refused at once, saying why (tests/test_tls.py has the other mismatches)
        with plaintext, pytest.raises(CoordinatorTlsError, match="speaks TLS"):
            plaintext.register(worker("b"), inventory())


def test_cli_status_shows_members_generation_and_memory(tmp_path: Path, capsys) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")  # as a mounted Secret may have it
    with running(config()) as server, client(server) as a:
        a.register(worker("a", device_kind="cuda", device_memory_bytes=80 * 10**9), inventory())
        a.set_report(WorkerReport(model_state_bytes={"params": 2_000_000, "optimizer": 16_000_000}))
        a.start()
        wait_until(lambda: (w := server.status().worker("a")) and w.report, what="report")
        argv = [
            "status",
            "--coordinator",
            f"127.0.0.1:{server.port}",
            "--token-file",
            str(token_file),
        ]
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "phase: running   generation 1   world size 1   stage 2" in out
        row = next(line for line in out.splitlines() if line.startswith("0 "))
        assert row.split()[:5] == ["0", "a", "member", "127.0.0.1", "cuda"]
        assert "2 MB" in row and "16 MB" in row and "18 MB" in row
        assert main([*argv[:3], "--timeout", "1"]) == 1  # no token
        assert "rejected the credentials" in capsys.readouterr().err


def test_cli_coordinator_serves_until_sigterm(tmp_path: Path) -> None:
    env = {**os.environ, "ZEROPLANE_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "coordinator", "--host", "127.0.0.1",
         "--port", "0", "--state-file", str(tmp_path / "state.json"), "--lease-timeout", "2",
         "--join-window", "0", "--stage", "1", "--grace", "1"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("zeroplane coordinator listening on 127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1])
        with client(port) as a:
            a.register(worker("a"), inventory())
            assert a.generation is not None and a.generation.stage == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert (tmp_path / "state.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_embedded_coordinator_hands_workers_their_environment(monkeypatch, tmp_path) -> None:
    embedded = EmbeddedCoordinator(config())
    env = embedded.start()
    try:
        assert set(env) == {"ZEROPLANE_COORDINATOR", "ZEROPLANE_TOKEN"}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        with CoordinatorClient(ClientConfig.from_env(connect_timeout_s=5)) as c:
            assert c.register(worker("a"), inventory()).generation_id == 1
        # A token file (a mounted Secret) wins over the variable.
        (tmp_path / "token").write_text("from-file\n")
        monkeypatch.setenv("ZEROPLANE_TOKEN_FILE", str(tmp_path / "token"))
        assert ClientConfig.from_env().token == "from-file"
        monkeypatch.delenv("ZEROPLANE_COORDINATOR")
        with pytest.raises(ValueError, match="ZEROPLANE_COORDINATOR is not set"):
            ClientConfig.from_env()
    finally:
        embedded.stop()


def test_a_worker_registering_again_carries_the_mesh_position_it_holds() -> None:
    """A mesh worker's client sends the position its engine holds (hold_position) with
    a registration again; the coordinator places it there. Here it held tp 1 and
    registers again with a fresh coordinator before "b": by registration order it
    would be tp 0."""
    cfg = config(lease_timeout_s=1.0, min_workers=2, max_workers=2)
    first, port = create_server(cfg)
    first.start()
    second = None
    try:
        with client(port, backoff_max_s=0.2) as a:
            epoch = a.register(dataclasses.replace(worker("a"), mesh=(2, 1)), inventory()).epoch
            a.start()
            a.hold_position(MeshCoords(pp=0, dp=0, tp=1))
            first.stop(grace=0)
            second, _ = create_server(
                dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, port=port))
            )
            second.start()
            wait_until(lambda: a.registration is not None and a.registration.epoch != epoch,
                       what="a registered with the new coordinator")  # fmt: skip
            with client(port) as b:
                b.register(dataclasses.replace(worker("b"), mesh=(2, 1)), inventory())
                b.start()
                gen = wait_until(lambda: b.generation, what="the first generation")
                assert gen.mesh is not None and gen.mesh.tp == 2
                assert gen.coords(gen.rank_of("a")).tp == 1
                assert gen.coords(gen.rank_of("b")).tp == 0
    finally:
        first.stop(grace=0)
        if second is not None:
            second.stop(grace=0)


def test_a_coordinator_restarted_without_state_is_followed_as_a_new_epoch() -> None:
    cfg = config(lease_timeout_s=1.0)
    first, port = create_server(cfg)
    first.start()
    second = None
    try:
        with client(port, backoff_max_s=0.2) as a:
            a.register(worker("a"), inventory())
            a.start()
            old = a.wait_for_generation(timeout=10)
            first.stop(grace=0)
            second, _ = create_server(
                dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, port=port))
            )
            second.start()
            # The fresh coordinator does not know a: it registers again, sees a new epoch
            # and takes the new generation 1 rather than keeping its old one.
            new = wait_until(
                lambda: (g := a.generation) is not None and g.epoch != old.epoch and g,
                what="the new epoch's generation",
            )
            assert new.id == 1 and new.rank_of("a") == 0
            assert a.registration is not None and a.registration.epoch == new.epoch
    finally:
        first.stop(grace=0)
        if second is not None:
            second.stop(grace=0)
