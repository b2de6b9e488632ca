"""Random malformed, unauthenticated and absurd requests against a live coordinator.

Used by tests/test_coordinator_fuzz.py (a few hundred requests per RPC) and by
bench/coordinator_fuzz.py (ten thousand). Everything random comes from one
``random.Random(seed)``: a run is replayed by its seed (the requests are; what
the server answers may depend on timing, as leases expire and generations form).

Each request is one of the five RPCs, built by one of a few families:

* ``absurd``: a well-formed message whose fields take extreme values (huge
  dims and counts, ids with control characters or a megabyte long, shapes
  that overflow, metrics endpoints elsewhere, duplicate parameters);
* ``garbage``: random bytes, or a valid message cut short or with bytes flipped;
* ``tokenless``: no token, a wrong one, or a token that is not valid UTF-8
  (sent as raw HTTP/2, which a grpc client refuses to send);
* ``compressed``: an ``absurd`` or ``garbage`` body, gzip-compressed;
* ``valid``: a request a worker could send (registering with the job's
  inventory, heartbeating, leaving), so the state the others hit keeps moving.

Every answer must be a status the API documents; never INTERNAL or UNKNOWN.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import Message

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator.core.conversions import param_to_proto
from tests.coordinator_util import AUTH, TOKEN, inventory
from tests.grpc_raw import raw_call

__all__ = ["EXPECTED", "KINDS", "FuzzResult", "fuzz"]

SERVICE = "/zeroplane.coordinator.v1.Coordinator/"
KINDS = ("Register", "Heartbeat", "WatchGenerations", "Leave", "Status")
FAMILIES = ("absurd", "garbage", "tokenless", "compressed", "valid")
# What the API answers (coordinator.proto); DEADLINE_EXCEEDED: a watch that waits.
EXPECTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
REQUEST_TYPES = {
    "Register": pb.RegisterRequest,
    "Heartbeat": pb.HeartbeatRequest,
    "WatchGenerations": pb.WatchGenerationsRequest,
    "Leave": pb.LeaveRequest,
    "Status": pb.StatusRequest,
}
_U64 = (1 << 64) - 1
_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass
class FuzzResult:
    seed: int
    sent: Counter = field(default_factory=Counter)  # by RPC
    families: Counter = field(default_factory=Counter)
    codes: Counter = field(default_factory=Counter)  # by status name
    # (rpc, family, code, detail) of every answer not in EXPECTED
    unexpected: list[tuple[str, str, str, str]] = field(default_factory=list)
    # the inventory of a registration that was accepted: the job's
    job_inventory: list[pb.ParamInfo] | None = None


# ---- random values -----------------------------------------------------------------------


class _Gen:
    def __init__(self, rng: random.Random, known_ids: list[str]) -> None:
        self.r = rng
        self.known = known_ids

    def text(self, *, big: bool = True) -> str:
        r = self.r
        choice = r.randrange(10)
        if choice == 0:
            return ""
        if choice == 1 and big:
            return r.choice("x\n\x1b") * r.choice((254, 4096, 1 << 20))
        if choice == 2:
            return "".join(chr(r.randrange(0, 0x20)) for _ in range(r.randrange(1, 20)))
        if choice == 3:
            return "".join(chr(r.randrange(0x80, 0x2FFF)) for _ in range(r.randrange(1, 20)))
        if choice == 4:
            return r.choice(("../../etc/passwd", "a b", "%s%n", "${jndi:x}", "\ud7ff"))
        return "".join(r.choice("abcxyz-_.0123") for _ in range(r.randrange(1, 30)))

    def worker_id(self) -> str:
        if self.known and self.r.random() < 0.4:
            return self.r.choice(self.known)
        return self.text()

    def u64(self) -> int:
        return self.r.choice((0, 1, 2, 1 << 31, 1 << 32, 1 << 53, 1 << 62, 1 << 63, _U64))

    def u32(self) -> int:
        return self.r.choice((0, 1, 7, 65535, 65536, 1 << 31, (1 << 32) - 1))

    def dim(self) -> int:
        return self.r.choice(
            (-1, 0, 1, 3, 64, 1 << 20, 1 << 32, 1 << 48, (1 << 63) - 1, -(1 << 63))
        )

    def endpoint(self) -> str:
        return self.r.choice(
            (
                "",
                "file:///etc/passwd",
                "http://169.254.169.254:80/latest",
                "127.0.0.1:9100",
                "http://127.0.0.1:1/x",
                "https://127.0.0.1:443/",
                "gopher://x:70",
                "127.0.0.1:0",
                "[::1]:9100",
                "10.0.0.1:9100",
                self.text(big=False),
            )
        )

    def param(self) -> pb.ParamInfo:
        r = self.r
        return pb.ParamInfo(
            name=self.text(big=r.random() < 0.1),
            shape=[self.dim() for _ in range(r.choice((0, 1, 2, 3, 40)))],
            dtype=r.choice(("float32", "bfloat16", "", "x" * 40, self.text(big=False))),
            requires_grad=r.random() < 0.7,
            group=self.u32(),
            unit=self.u32(),
        )

    def worker_info(self) -> pb.WorkerInfo:
        r = self.r
        return pb.WorkerInfo(
            worker_id=self.worker_id(),
            host=r.choice(("127.0.0.1", "::1", "", self.text())),
            device_kind=r.choice(("cpu", "cuda", self.text())),
            device_memory_bytes=self.u64(),
            metrics_endpoint=self.endpoint(),
            free_ports=[self.u32() for _ in range(r.choice((0, 1, 2, 9, 20)))],
            incarnation=self.text(big=False),
        )

    def report(self) -> pb.WorkerReport:
        r = self.r
        kinds = {self.text(big=False): self.u64() for _ in range(r.choice((0, 1, 3, 20)))}
        return pb.WorkerReport(
            model_state_bytes=kinds,
            device_allocated_bytes=self.u64(),
            device_reserved_bytes=self.u64(),
            step=self.u64(),
            applied_generation_id=self.u64(),
        )

    def absurd(self, kind: str, generation: int) -> Message:
        r = self.r
        if kind == "Register":
            params = [self.param() for _ in range(r.choice((0, 1, 5, 50)))]
            if params and r.random() < 0.2:
                params.append(params[0])  # a duplicate
            if r.random() < 0.1:  # a valid inventory with one absurd parameter
                params = [param_to_proto(p) for p in inventory()] + params[:1]
            return pb.RegisterRequest(worker=self.worker_info(), inventory=params)
        if kind == "Heartbeat":
            msg = pb.HeartbeatRequest(
                worker_id=self.worker_id(),
                generation_id=r.choice((generation, self.u64())),
                free_ports=[self.u32() for _ in range(r.choice((0, 2, 9)))],
            )
            if r.random() < 0.7:
                msg.report.CopyFrom(self.report())
            return msg
        if kind == "WatchGenerations":
            after = r.choice((0, max(0, generation - 1), self.u64()))
            return pb.WatchGenerationsRequest(worker_id=self.worker_id(), after_generation_id=after)
        if kind == "Leave":
            return pb.LeaveRequest(worker_id=self.worker_id(), reason=self.text())
        return pb.StatusRequest()

    def garbage(self, kind: str, generation: int) -> bytes:
        r = self.r
        choice = r.randrange(4)
        if choice == 0:
            return bytes(r.randrange(256) for _ in range(r.choice((1, 5, 64, 4096))))
        valid = self.absurd(kind, generation).SerializeToString()
        if choice == 1 and valid:
            return valid[: r.randrange(len(valid))]
        if choice == 2 and valid:
            data = bytearray(valid)
            for _ in range(r.randrange(1, 8)):
                data[r.randrange(len(data))] = r.randrange(256)
            return bytes(data)
        # a deeply nested or oversized length prefix
        return b"\x0a\xff\xff\xff\xff\x0f" + b"\x0a\x02" * r.randrange(1, 200)

    def opening(self) -> pb.RegisterRequest:
        """A registration whose inventory is whole but one parameter overflows: sent
        first, when it would become the job's inventory."""
        request = self.valid("Register", 0, self.r.choice(self.known))
        big = self.r.choice(([1 << 32, 1 << 32], [1 << 62, 4], [1 << 24] * 3))
        huge = pb.ParamInfo(name="huge", shape=big, dtype="float32", requires_grad=True)
        request.inventory.append(huge)
        return request

    def valid(self, kind: str, generation: int, worker_id: str) -> Message:
        if kind == "Register":
            return pb.RegisterRequest(
                worker=pb.WorkerInfo(worker_id=worker_id, host="127.0.0.1", free_ports=[40000]),
                inventory=[param_to_proto(p) for p in inventory()],
            )
        if kind == "Heartbeat":
            return pb.HeartbeatRequest(worker_id=worker_id, generation_id=generation)
        if kind == "WatchGenerations":
            return pb.WatchGenerationsRequest(worker_id=worker_id, after_generation_id=0)
        if kind == "Leave":
            return pb.LeaveRequest(worker_id=worker_id, reason="fuzz")
        return pb.StatusRequest()


# ---- sending -----------------------------------------------------------------------------


def _code_of(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    return exc.code(), (exc.details() or "")[:200]


def _send(
    channels: dict[str, grpc.Channel],
    port: int,
    kind: str,
    family: str,
    body: bytes,
    metadata: tuple,
    raw_token: bytes | None,
) -> tuple[grpc.StatusCode, str]:
    if raw_token is not None:
        # raw_call keeps within HTTP/2's initial flow-control window (64 KiB)
        raw = body[:60_000]
        code = raw_call(port, SERVICE + kind, raw, metadata=((b"authorization", raw_token),))
        if code is None:
            return grpc.StatusCode.UNKNOWN, "no grpc-status in the raw answer"
        return _CODES.get(code, grpc.StatusCode.UNKNOWN), "raw"
    channel = channels["gzip" if family == "compressed" else "plain"]
    try:
        if kind == "WatchGenerations":
            stream = channel.unary_stream(SERVICE + kind)(body, metadata=metadata, timeout=0.3)
            try:
                next(stream)
            finally:
                stream.cancel()
        else:
            channel.unary_unary(SERVICE + kind)(body, metadata=metadata, timeout=10)
    except grpc.RpcError as exc:
        return _code_of(exc)
    return grpc.StatusCode.OK, ""


def fuzz(
    port: int,
    *,
    seed: int,
    per_kind: int,
    threads: int = 8,
) -> FuzzResult:
    """Send ``per_kind`` random requests of each RPC to the coordinator at 127.0.0.1:``port``
    (token ``tests.coordinator_util.TOKEN``), ``threads`` at a time; what came back."""
    rng = random.Random(seed)
    known: list[str] = [f"fuzz-{i}" for i in range(4)]
    gen = _Gen(rng, known)
    opening = [gen.opening().SerializeToString() for _ in range(3)]
    plan = []
    # Built up front from the seed alone, so a seed replays the same requests.
    for i in range(per_kind * len(KINDS)):
        kind = KINDS[i % len(KINDS)]
        family = rng.choice(FAMILIES)
        now = rng.randrange(4)  # a generation id the job may well be at
        metadata: tuple = AUTH
        raw_token = None
        if family == "tokenless":
            auth = rng.randrange(3)
            if auth == 0:
                metadata = ()
            elif auth == 1:
                metadata = (("authorization", rng.choice(("Bearer nope", "Basic x", TOKEN))),)
            else:
                raw_token = b"Bearer \xff\xfe" + TOKEN.encode()
            body = gen.absurd(kind, now).SerializeToString()
        elif family == "valid":
            body = gen.valid(kind, now, rng.choice(known)).SerializeToString()
        elif rng.random() < 0.5:
            body = gen.absurd(kind, now).SerializeToString()
        else:
            body = gen.garbage(kind, now)
        plan.append((kind, family, body, metadata, raw_token))

    result = FuzzResult(seed=seed)
    lock = threading.Lock()
    plain = grpc.insecure_channel(f"127.0.0.1:{port}")
    gzip = grpc.insecure_channel(f"127.0.0.1:{port}", compression=grpc.Compression.Gzip)
    channels = {"plain": plain, "gzip": gzip}

    def one(item: tuple) -> None:
        kind, family, body, metadata, raw_token = item
        code, detail = _send(channels, port, kind, family, body, metadata, raw_token)
        with lock:
            result.sent[kind] += 1
            result.families[family] += 1
            result.codes[code.name] += 1
            if code not in EXPECTED:
                result.unexpected.append((kind, family, code.name, detail))
            if kind == "Register" and code == grpc.StatusCode.OK and not result.job_inventory:
                result.job_inventory = list(pb.RegisterRequest.FromString(body).inventory)

    try:
        # first, one at a time: absurd inventories, before any other sets the job's
        for body in opening:
            one(("Register", "absurd", body, AUTH, None))
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(one, plan))
    finally:
        plain.close()
        gzip.close()
    return result
