"""A coordinator no request can poison (issue #15, items 8-13): absurd inventories and
numbers, large inventories, reads before authentication, outside requests, error and log
sizes, files and flags. Each test starts a real server on loopback where it can."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from coordinator.control import published as published_module
from coordinator.control.statefile import MAGIC, load_snapshot, save_snapshot
from coordinator.core.conversions import param_to_proto
from coordinator.core.layout import ParamSpec
from coordinator.core.messages import WorkerInfo
from coordinator.core.settings import HttpConfig
from tests.coordinator_util import (
    AUTH,
    TOKEN,
    HealthProbe,
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


def rejected(call, request, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        result = call(request, metadata=AUTH, timeout=10, **kw)
        if hasattr(result, "__next__"):
            next(result)
    return err.value


def assert_serving(stub: pb_grpc.CoordinatorStub, channel: grpc.Channel) -> None:
    stub.Status(pb.StatusRequest(), metadata=AUTH, timeout=5)
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


# ---- 8. absurd inventories ----------------------------------------------------------------


def test_an_absurd_parameter_shape_is_invalid_argument_naming_the_field() -> None:
    with running(config()) as server:
        channel, stub = raw_stub(server.port)
        with channel:
            for shape, field in (
                ([2**32, 2**32], "shape"),  # 2**64 elements
                ([2**62, 2**62, 2**62], "shape"),
                ([4, -1], "negative"),
                ([4, 0], "shape"),
            ):
                request = register_request("a")
                request.inventory[1].shape[:] = shape
                err = rejected(stub.Register, request)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (shape, err.details())
                assert field in err.details() and "block.0.weight" in err.details(), err.details()
                assert_serving(stub, channel)
            # a legitimate worker still registers and gets its generation
            with client(server) as a:
                a.register(worker("a"), inventory())
                assert a.generation is not None and a.generation.id == 1
            assert_serving(stub, channel)


def test_sizes_summing_past_2_64_are_invalid_argument() -> None:
    big = [ParamSpec(name=f"w{i}", shape=(2**24, 2**24), dtype="float32") for i in range(2**16 + 1)]
    with running(config()) as server:
        channel, stub = raw_stub(server.port)
        with channel:
            err = rejected(stub.Register, register_request("a", big))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "inventory" in err.details() and "elements" in err.details(), err.details()
            assert_serving(stub, channel)
            with client(server) as a:
                a.register(worker("a"), inventory())
                assert a.generation is not None


@pytest.mark.parametrize(
    ("field", "mutate"),
    [
        ("device_memory_bytes", lambda r: setattr(r.worker, "device_memory_bytes", 2**64 - 1)),
        ("group", lambda r: setattr(r.inventory[0], "group", 2**32 - 1)),
        ("unit", lambda r: setattr(r.inventory[0], "unit", 2**32 - 1)),
        ("dtype", lambda r: setattr(r.inventory[0], "dtype", "x" * 40)),
        ("free_ports", lambda r: r.worker.free_ports.append(70000)),
    ],
)
def test_absurd_numbers_in_a_registration_are_invalid_argument(field, mutate) -> None:
    with running(config()) as server:
        channel, stub = raw_stub(server.port)
        with channel:
            request = register_request("a")
            mutate(request)
            err = rejected(stub.Register, request)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in err.details(), err.details()
            assert_serving(stub, channel)


def test_absurd_numbers_in_a_heartbeat_or_a_watch_are_invalid_argument() -> None:
    with running(config()) as server, client(server) as a:
        a.register(worker("a"), inventory())
        channel, stub = raw_stub(server.port)
        with channel:
            huge = 2**64 - 1
            for field, request in (
                ("generation_id", pb.HeartbeatRequest(worker_id="a", generation_id=huge)),
                (
                    "step",
                    pb.HeartbeatRequest(
                        worker_id="a", generation_id=1, report=pb.WorkerReport(step=huge)
                    ),
                ),
                (
                    "model_state_bytes",
                    pb.HeartbeatRequest(
                        worker_id="a",
                        generation_id=1,
                        report=pb.WorkerReport(model_state_bytes={"params": huge}),
                    ),
                ),
            ):
                err = rejected(stub.Heartbeat, request)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, field
                assert field in err.details(), err.details()
            request = pb.WatchGenerationsRequest(worker_id="a", after_generation_id=huge)
            err = rejected(stub.WatchGenerations, request)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "after_generation_id" in err.details()
            assert_serving(stub, channel)


def test_a_generation_that_fails_to_encode_is_never_published(monkeypatch, caplog) -> None:
    """Formation is atomic: an encoding failure leaves the old state whole, says why once,
    and the next change of membership forms normally."""
    real = published_module.generation_steps
    broken = {"on": True}

    def encode(generation):
        if broken["on"]:
            raise ValueError("Value out of range: 18446744073709551616")
        return (yield from real(generation))

    monkeypatch.setattr(published_module, "generation_steps", encode)
    caplog.set_level(logging.INFO)
    with running(config(min_workers=1)) as server:
        channel, stub = raw_stub(server.port)
        with channel:
            response = stub.Register(register_request("a"), metadata=AUTH, timeout=10)
            assert response.generation_id == 0
            time.sleep(0.5)  # several reconcile ticks
            status = stub.Status(pb.StatusRequest(), metadata=AUTH, timeout=5)
            assert status.generation_id == 0 and "cannot form" in status.waiting_reason
            # a watch waits (no UNKNOWN), and says nothing until a generation is published
            watch = stub.WatchGenerations(
                pb.WatchGenerationsRequest(worker_id="a"), metadata=AUTH, timeout=0.5
            )
            with pytest.raises(grpc.RpcError) as err:
                next(watch)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            failures = [r for r in caplog.records if "cannot form" in r.getMessage()]
            assert len(failures) == 1, [r.getMessage() for r in caplog.records]
            assert not [r for r in caplog.records if "reconcile failed" in r.getMessage()]

            broken["on"] = False
            stub.Register(register_request("b"), metadata=AUTH, timeout=10)
            gen = next(
                stub.WatchGenerations(
                    pb.WatchGenerationsRequest(worker_id="a"), metadata=AUTH, timeout=10
                )
            )
            assert gen.id == 1 and [m.worker_id for m in gen.members] == ["a", "b"]
            assert_serving(stub, channel)


def test_a_state_file_whose_generation_lists_an_unknown_member_is_refused(tmp_path) -> None:
    path = tmp_path / "state.json"
    with running(config(state_file=path)) as server, client(server) as a:
        a.register(worker("a"), inventory())
        assert a.generation is not None
    snapshot = load_snapshot(path)
    assert snapshot is not None
    save_snapshot(path, dataclasses.replace(snapshot, members=()))
    with pytest.raises(ValueError, match=rf"{path.name}.*'a'"):
        load_snapshot(path)
    # the server refuses to start on it, naming the file, rather than answering INTERNAL
    with pytest.raises(ValueError, match=path.name):
        running(config(state_file=path)).__enter__()


# ---- 9. large inventories do not block the server ----------------------------------------


def big_inventory(n: int) -> list[ParamSpec]:
    return [
        ParamSpec(name=f"layers.{i}.mlp.weight", shape=(64, 64), dtype="bfloat16", unit=i // 8)
        for i in range(n)
    ]


def test_a_duplicate_in_a_large_inventory_is_found_without_stalling_the_server() -> None:
    specs = big_inventory(30_000)
    specs.append(specs[-1])  # found last: the old check counted every name before it
    request = register_request("a", specs)
    with running(config()) as server, HealthProbe(server.port) as probe:
        channel, stub = raw_stub(server.port)
        with channel:
            err = rejected(stub.Register, request)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "twice" in err.details()
    # the old check was quadratic: 30k parameters with one duplicate stalled it 16 s
    assert probe.worst < 0.5, probe.worst


def test_a_100k_parameter_inventory_registers_without_blocking_health(tmp_path) -> None:
    """Registration (conversion, digest, layout, encoding, the state file) runs off the
    event loop; the state file holds the inventory once, not per generation."""
    specs = big_inventory(100_000)
    requests = [register_request(w, specs) for w in ("a", "b", "c")]
    state = tmp_path / "state.json"
    with (
        coordinator_process(
            "--state-file", str(state), "--max-workers", "3", "--stage", "3",
            "--lease-timeout", "120", "--join-window", "0",
        ) as port,
        HealthProbe(port) as probe,
        grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):  # fmt: skip
        stub = pb_grpc.CoordinatorStub(channel)
        for i, request in enumerate(requests):
            response = stub.Register(request, metadata=AUTH, timeout=60)
            assert response.generation_id == i + 1
        inventories = list(tmp_path.glob("state.json.inventory-*"))
        assert len(inventories) == 1
        written = inventories[0].stat().st_mtime_ns
        # a generation is a few kilobytes in the state file, whatever the inventory
        assert state.stat().st_size < 16_384, state.stat().st_size
        stub.Leave(pb.LeaveRequest(worker_id="c"), metadata=AUTH, timeout=60)
        status = stub.Status(pb.StatusRequest(), metadata=AUTH, timeout=10)
        assert status.generation_id == 4
        assert inventories[0].stat().st_mtime_ns == written
    # the event loop never stalled (the old one did for seconds at each registration)
    assert probe.worst < 0.5, probe.worst
    snapshot = load_snapshot(state)
    assert snapshot is not None and snapshot.generation is not None
    assert snapshot.generation.world_size == 2 and len(snapshot.inventory) == 100_000
    assert snapshot.generation.reshard is not None and snapshot.generation.reshard.left_ranks == (
        2,
    )


def test_a_generation_serialized_in_pieces_parses_to_the_whole() -> None:
    from coordinator.core.generation_codec import (
        generation_from_proto,
        generation_to_proto,
        serialize_steps,
    )
    from coordinator.core.layout import compute_layout
    from coordinator.core.messages import Generation, Member
    from coordinator.core.reshard import ReshardSchedule, reshard_schedule
    from coordinator.core.steps import finish

    specs = big_inventory(3000)
    before = compute_layout(specs, 2, bucket_numel=10_000, align=2)
    after = compute_layout(specs, 3, bucket_numel=10_000, align=2, by_unit=True)
    gen = Generation(
        id=2,
        members=tuple(Member(worker_id=f"w{i}", rank=i, host="h") for i in range(3)),
        rendezvous_endpoint="h:1",
        stage=3,
        stage_reason="r",
        layout=after,
        bucket_numel=10_000,
        align=2,
        reshard=ReshardSchedule(
            from_generation_id=1,
            from_world_size=2,
            from_stage=2,
            moves=tuple(reshard_schedule(before, after)),
            lost_ranks=(1,),
        ),
        inventory_digest="d",
        epoch="e",
    )
    msg = generation_to_proto(gen)
    data = finish(serialize_steps(msg))
    assert pb.Generation.FromString(data) == msg
    assert generation_from_proto(pb.Generation.FromString(data)) == gen


def test_a_format_1_state_file_still_loads(tmp_path) -> None:
    from google.protobuf import json_format

    from coordinator.control.membership import Membership
    from coordinator.core.conversions import worker_to_proto
    from coordinator.core.generation_codec import generation_to_proto
    from coordinator.core.settings import MembershipConfig, PlanConfig

    m = Membership(MembershipConfig(min_workers=2, max_workers=2), PlanConfig(bucket_numel=100))
    m.register(worker("a"), inventory())
    m.register(worker("b"), inventory())
    gen = m.maybe_form()
    old = pb.PersistedState(
        format_version=1,
        inventory=[param_to_proto(p) for p in inventory()],
        generation=generation_to_proto(gen),
        members=[worker_to_proto(worker(w)) for w in ("a", "b")],
        epoch=m.epoch,
    )
    path = tmp_path / "old.json"
    path.write_text(json_format.MessageToJson(old, preserving_proto_field_name=True))
    snapshot = load_snapshot(path)
    assert snapshot is not None and snapshot.generation == gen and snapshot.epoch == m.epoch
    # saved again, it is format 3 (binary) and loads to the same generation
    save_snapshot(path, snapshot)
    assert path.read_bytes().startswith(MAGIC)
    again = load_snapshot(path)
    assert again is not None and again.generation == gen


# ---- 10. nothing is read before authentication --------------------------------------------


def _rss_peak_kib(pid: int) -> int:
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmHWM"].split()[0])


@contextlib.contextmanager
def coordinator_process(*args: str) -> Iterator[int]:
    """A ``zeroplane coordinator`` process of its own (so that what the test does in this
    process does not share its interpreter); yields its port, the process as ``.proc``."""
    env = {**os.environ, "ZEROPLANE_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "coordinator", "--host", "127.0.0.1",
         "--port", "0", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    coordinator_process.proc = proc
    try:
        line = proc.stdout.readline()
        assert line.startswith("zeroplane coordinator listening on"), line
        yield int(line.rsplit(":", 1)[1])
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_a_tokenless_compressed_bomb_is_refused_before_decompression() -> None:
    with coordinator_process() as port:
        pid = coordinator_process.proc.pid
        channel = grpc.insecure_channel(
            f"127.0.0.1:{port}",
            options=[("grpc.max_send_message_length", -1)],
            compression=grpc.Compression.Gzip,
        )
        with channel:
            stub = pb_grpc.CoordinatorStub(channel)
            stub.Status(pb.StatusRequest(), metadata=AUTH, timeout=10)  # warm, authenticated
            before = _rss_peak_kib(pid)
            bomb = pb.LeaveRequest(worker_id="a", reason="A" * (120 << 20))  # ~120 KiB gzipped
            for call in (stub.Leave, stub.Register, stub.Status):
                with pytest.raises(grpc.RpcError) as err:
                    call(bomb, timeout=30)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            after = _rss_peak_kib(pid)
            stub.Status(pb.StatusRequest(), metadata=AUTH, timeout=10)  # still serving
    # decompressed, the body alone would be 120 MiB (the old peak grew by ~390 MiB)
    assert after - before < 32 << 10, (before, after)


# ---- 12. errors and logs stay small and honest --------------------------------------------


def test_a_huge_worker_id_gets_a_short_answer() -> None:
    with running(config()) as server:
        channel, stub = raw_stub(server.port)
        with channel:
            huge = "x" * (1 << 20)
            for call, request in (
                (stub.Heartbeat, pb.HeartbeatRequest(worker_id=huge)),
                (stub.Leave, pb.LeaveRequest(worker_id=huge)),
                (stub.WatchGenerations, pb.WatchGenerationsRequest(worker_id=huge)),
                (stub.Register, pb.RegisterRequest(worker=pb.WorkerInfo(worker_id=huge))),
            ):
                err = rejected(call, request)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.code()
                assert "worker_id" in err.details() and len(err.details()) < 1024
            err = rejected(stub.Heartbeat, pb.HeartbeatRequest(worker_id="y" * 250))
            assert err.code() == grpc.StatusCode.NOT_FOUND and len(err.details()) < 1024


def test_a_leave_reason_cannot_forge_log_lines(caplog) -> None:
    caplog.set_level(logging.INFO)
    with running(config()) as server, client(server) as a:
        a.register(worker("a"), inventory())
        a.leave("done\n2030-01-01 00:00:00 INFO coordinator.control.membership: forged\x1b[2J")
        wait_until(lambda: server.status().generation_id == 1)
    lines = [r.getMessage() for r in caplog.records if "left a" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "\x1b" not in lines[0], lines
    assert "\\n2030" in lines[0]


def test_a_token_that_is_not_utf8_is_not_logged(caplog) -> None:
    from tests.grpc_raw import raw_call

    caplog.set_level(logging.DEBUG)
    with running(config()) as server:
        code = raw_call(
            server.port,
            "/zeroplane.coordinator.v1.Coordinator/Status",
            b"",
            metadata=((b"authorization", b"Bearer \xff\xfesecret-part"),),
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED.value[0]
        good = ((b"authorization", f"Bearer {TOKEN}".encode()),)
        assert (
            raw_call(
                server.port, "/zeroplane.coordinator.v1.Coordinator/Status", b"", metadata=good
            )
            == 0
        )
    logged = [r for r in caplog.records if "secret-part" in r.getMessage() or r.exc_info]
    assert not logged, [r.getMessage() for r in logged]


def test_cancelled_watch_streams_log_no_traceback(caplog) -> None:
    caplog.set_level(logging.DEBUG)
    with running(config(max_workers=2)) as server, client(server) as a:
        a.register(worker("a"), inventory())
        channel, stub = raw_stub(server.port)
        calls = [
            stub.WatchGenerations(
                pb.WatchGenerationsRequest(worker_id=w, after_generation_id=after),
                metadata=AUTH,
                timeout=timeout,
            )
            for w in ("a", "", "nobody")
            for after in (0, 1, 5)
            for timeout in (0.2, None)
        ]
        time.sleep(0.5)
        for call in calls[::2]:
            call.cancel()
        channel.close()  # the rest go with their connection
        time.sleep(0.3)
        open_again = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        waiting = pb_grpc.CoordinatorStub(open_again).WatchGenerations(
            pb.WatchGenerationsRequest(worker_id="a", after_generation_id=1), metadata=AUTH
        )
        time.sleep(0.2)
    # ... and the server stopped with a stream still open
    open_again.close()
    del waiting
    noisy = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not noisy, [(r.name, r.getMessage()) for r in noisy]


# ---- 11. no request reaches outside ------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint",
    [
        "file:///etc/passwd",
        "https://127.0.0.1:9100/",
        "gopher://127.0.0.1:70/",
        "http://user:pw@127.0.0.1:9100/",
        "http://127.0.0.1:9100/metrics?x=1",
        "127.0.0.1",
        "127.0.0.1:0",
        "127.0.0.1:99999",
        "10.1.2.3:9100",  # neither the registering peer nor the worker's own host
        "169.254.169.254:80",
    ],
)
def test_a_metrics_endpoint_elsewhere_is_refused_at_registration(endpoint) -> None:
    with running(config()) as server:
        channel, stub = raw_stub(server.port)
        with channel:
            request = register_request("a")
            request.worker.metrics_endpoint = endpoint
            err = rejected(stub.Register, request)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
            assert "metrics_endpoint" in err.details()


class _Http:
    """A local HTTP server answering every GET with ``status`` (and ``headers``); counts hits."""

    def __init__(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self
        self.hits: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.hits.append(self.path)
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _get_json(url: str) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_the_status_page_scrapes_only_the_registering_peer_and_follows_no_redirect() -> None:
    secret = _Http(200, b"zeroplane_steps_total 1\n")
    redirect = _Http(302, headers={"Location": f"http://127.0.0.1:{secret.port}/metrics"})
    named = _Http(200, b"zeroplane_steps_total 7\n")
    cfg = dataclasses.replace(config(), http=HttpConfig(port=0))
    try:
        with running(cfg) as server, client(server) as a, client(server) as b:
            a.register(worker("a", metrics_endpoint=f"127.0.0.1:{redirect.port}"), inventory())
            # a name the coordinator never resolves: it scrapes the peer's address instead
            b.register(
                WorkerInfo(
                    worker_id="b",
                    host="worker-b.invalid",
                    metrics_endpoint=f"worker-b.invalid:{named.port}",
                ),
                inventory(),
            )
            wait_until(lambda: server.status().generation_id == 2)
            body = _get_json(f"http://{server.http_address}/api/status")
            ranks = {r["worker_id"]: r for r in body["ranks"]}
            assert ranks["a"]["error"], ranks["a"]
            assert ranks["b"]["steps"] == 7 and not ranks["b"]["error"], ranks["b"]
        assert redirect.hits and not secret.hits  # the redirect was not followed
    finally:
        for http in (secret, redirect, named):
            http.close()


def test_the_status_page_does_not_publish_the_rendezvous_store() -> None:
    # the store has no authentication: its address stays off the unauthenticated page
    cfg = dataclasses.replace(config(), http=HttpConfig(port=0))
    with running(cfg) as server, client(server) as a:
        a.register(worker("a"), inventory())
        gen = a.wait_for_generation(timeout=10)
        text = json.dumps(_get_json(f"http://{server.http_address}/api/status"))
        assert gen.rendezvous_endpoint and gen.rendezvous_endpoint not in text


# ---- 13. files and flags -----------------------------------------------------------------


def test_a_state_file_that_is_not_utf8_is_an_error_naming_it(tmp_path, capsys) -> None:
    from coordinator.cli import main

    path = tmp_path / "state.json"
    path.write_bytes(b'{"format_version": 2, "epoch": "\xff\xfe"}')
    with pytest.raises(ValueError, match=r"state\.json"):
        load_snapshot(path)
    argv = ["coordinator", "--port", "0", "--host", "127.0.0.1", "--state-file", str(path)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "state.json" in err and "Traceback" not in err


def test_a_state_file_in_a_missing_directory_is_refused_at_start(tmp_path, capsys) -> None:
    from coordinator.cli import main

    missing = tmp_path / "no-such-dir" / "state.json"
    assert main(["coordinator", "--port", "0", "--state-file", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "--state-file" in err and "no-such-dir" in err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["coordinator", "--join-window", "nan"], "--join-window"),
        (["coordinator", "--join-window", "inf"], "--join-window"),
        (["coordinator", "--grace", "nan"], "--grace"),
        (["coordinator", "--grace", "-1"], "--grace"),
        (["coordinator", "--lease-timeout", "nan"], "--lease-timeout"),
        (["coordinator", "--lease-timeout", "inf"], "--lease-timeout"),
        (["coordinator", "--heartbeat-interval", "nan"], "--heartbeat-interval"),
        (["coordinator", "--headroom", "nan"], "--headroom"),
        (["coordinator", "--headroom", "1.5"], "--headroom"),
        (["run", "--grace", "nan", "x.py"], "--grace"),
        (["run", "--gpus-per-worker", "nan", "x.py"], "--gpus-per-worker"),
        (["status", "--timeout", "nan"], "--timeout"),
        (["status", "--timeout", "0"], "--timeout"),
        (["status", "--window", "nan"], "--window"),
        (["plan", "--params", "1e9", "--headroom", "nan"], "--headroom"),
        (["plan", "--params", "1e9", "--world-sizes", "a,b"], "--world-sizes"),
        (["plan", "--params", "1e9", "--world-sizes", "1,,2"], "--world-sizes"),
        (["plan", "--params", "1e9", "--world-sizes", "0"], "--world-sizes"),
    ],
)
def test_a_bad_number_in_a_flag_is_refused_naming_the_flag(argv, flag, capsys) -> None:
    from coordinator.cli import main

    # should a bad value get through, fail fast rather than serve or wait
    if argv[0] == "coordinator":
        argv = [*argv, "--host", "256.0.0.1"]
    if argv[0] == "status":
        argv = [*argv, "--coordinator", "127.0.0.1:1"]
    with pytest.raises(SystemExit) as exit_:
        code = main(argv)
        raise SystemExit(code)  # a command that reports the error itself returns 2
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err, err


def test_the_config_classes_refuse_nan(tmp_path) -> None:
    from coordinator.control.client import ClientConfig
    from coordinator.core.settings import MembershipConfig, PlanConfig, ServerConfig

    nan = float("nan")
    for make in (
        lambda: MembershipConfig(join_window_s=nan),
        lambda: MembershipConfig(lease_timeout_s=nan),
        lambda: MembershipConfig(reattach_grace_s=nan),
        lambda: MembershipConfig(disconnect_grace_s=nan),
        lambda: ServerConfig(grace_s=nan),
        lambda: ServerConfig(state_file=tmp_path / "missing" / "state.json"),
        lambda: PlanConfig(headroom=nan),
        lambda: ClientConfig(address="h:1", rpc_timeout_s=nan),
        lambda: ClientConfig(address="h:1", backoff_max_s=float("inf")),
    ):
        with pytest.raises(ValueError):
            make()


def test_a_token_file_others_can_read_is_warned_about(tmp_path, caplog) -> None:
    from coordinator.core.settings import load_token

    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="coordinator.core.settings"):
        assert load_token(token) == "s3cret"
    assert not caplog.records
    token.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="coordinator.core.settings"):
        assert load_token(token) == "s3cret"
    assert len(caplog.records) == 1 and str(token) in caplog.records[0].getMessage()
    assert "0644" in caplog.records[0].getMessage()


# ---- #16: client retries are gRPC's own --------------------------------------------------


class _Flaky:
    """A Coordinator that answers Status UNAVAILABLE ``failures`` times, then OK."""

    def __init__(self, failures: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.failures = failures
        self.attempts: list[str | None] = []
        self.server = grpc.server(ThreadPoolExecutor(max_workers=2))
        handler = grpc.unary_unary_rpc_method_handler(
            self._status,
            request_deserializer=pb.StatusRequest.FromString,
            response_serializer=pb.StatusResponse.SerializeToString,
        )
        self.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "zeroplane.coordinator.v1.Coordinator", {"Status": handler}
                ),
            )
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def _status(self, request, context):
        self.attempts.append(dict(context.invocation_metadata()).get("grpc-previous-rpc-attempts"))
        if len(self.attempts) <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        return pb.StatusResponse(
            phase="running",
            settings=pb.MembershipSettings(
                min_workers=1, max_workers=1, lease_timeout_s=1, heartbeat_interval_s=0.1
            ),
        )


def test_the_client_retries_unavailable_with_grpcs_retry_policy() -> None:
    flaky = _Flaky(failures=2)
    flaky.server.start()
    try:
        with client(flaky.port, backoff_initial_s=0.01, backoff_max_s=0.05) as c:
            assert c.status().phase == "running"
        # the retries are gRPC's (its attempts say so), not a loop of fresh calls
        assert flaky.attempts == [None, "1", "2"]
    finally:
        flaky.server.stop(0)


def test_the_client_waits_for_a_coordinator_that_is_not_up_yet() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = config(port=port)
    result: dict[str, object] = {}

    def register() -> None:
        with client(port, connect_timeout_s=20) as c:
            result["generation"] = c.register(worker("a"), inventory()).generation_id

    thread = threading.Thread(target=register)
    thread.start()
    time.sleep(1.0)  # the client is waiting for a coordinator meanwhile
    with running(cfg):
        thread.join(timeout=20)
    assert result == {"generation": 1}


def test_closing_a_client_ends_a_registration_that_waits_for_the_coordinator() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    c = client(port, connect_timeout_s=30)
    errors: list[BaseException] = []

    def register() -> None:
        try:
            c.register(worker("a"), inventory())
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=register)
    thread.start()
    time.sleep(0.5)
    started = time.monotonic()
    c.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and errors and time.monotonic() - started < 5


def test_a_coordinator_without_a_token_is_closed_by_default(capsys) -> None:
    from coordinator.cli import main
    from coordinator.commands.coordinator import serving_host

    assert serving_host(None, token=None, insecure=False) == "127.0.0.1"
    assert serving_host(None, token="t", insecure=False) == "0.0.0.0"
    assert serving_host("0.0.0.0", token="t", insecure=False) == "0.0.0.0"
    assert serving_host("0.0.0.0", token=None, insecure=True) == "0.0.0.0"
    assert serving_host("::1", token=None, insecure=False) == "::1"
    # open to the network without a token: refused before anything binds
    assert main(["coordinator", "--port", "0", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0 without a token" in err and "--insecure" in err
    # HTTP, which has no authentication, stays on loopback unless asked
    import argparse

    from coordinator.commands.coordinator import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert parser.parse_args(["coordinator"]).http_host == "127.0.0.1"
