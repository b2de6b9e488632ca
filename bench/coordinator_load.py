"""The coordinator under load: many simulated workers against one coordinator process.

For each worker count (default 1,000 and 10,000) a fresh ``zeroplane
coordinator`` process is started on 127.0.0.1 (real CLI, token auth, INFO
logging to /dev/null) and a load generator in this process (grpc.aio, a few
channels) plays the workers:

1. registers them all (64 in flight), each with a 16-parameter inventory; the
   generation forms when the last one arrives (max workers = N);
2. **saturation**: closed loop, ``--inflight`` heartbeats in flight for
   ``--seconds``: the most heartbeats per second the coordinator sustains, with
   p50/p99 latency, and the coordinator process's CPU use meanwhile;
3. **paced**: open loop, every worker heartbeats once per ``--interval``
   (the coordinator's default 2 s; N/1000 s beyond 2,000 workers) for
   ``--seconds``, lease timeout 5 intervals: latency measured from the
   scheduled send time (no coordinated omission), achieved rate, and how many
   workers lost their lease by the end.

Then the time to form a 256-worker generation: 256 workers register at once
and open a WatchGenerations stream each; the clock runs from the first
registration to the last stream receiving generation 1. Also the time from
one worker leaving to the 255 others receiving generation 2 with its reshard
schedule (a 110M-parameter GPT-like inventory, so the schedule is not trivial).

With ``--scale`` it also simulates a 100,000-rank job (12,500 hosts x 8 ranks,
a 124M-parameter GPT-like inventory), in process, for the coordinator's CPU
time (``time.process_time`` deltas around the servicer's own code, no gRPC):
one host heartbeat per host (coordinator/control/membership.py [Note: host
heartbeats]) and the same ranks' per-rank heartbeats; forming the first
generation and re-forming after one host is lost (propose, build, commit, the
shared wire form; then the state file, coordinator/control/statefile.py [Note:
state file format]), the state file's load and a rewrite of it; and the
per-worker incremental message against the whole one. Then a real gRPC run at
a rate this machine can drive: ``--stream-hosts`` host agents on
HostHeartbeats streams against a coordinator process, its CPU per host beat
and the beats' latency.

The load generator shares the machine's cores with the coordinator, so on a
small machine it can be the bottleneck: the coordinator's CPU column says
which side was saturated.

    python bench/coordinator_load.py
    python bench/coordinator_load.py --workers 1000 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import stop_processes  # noqa: E402
from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb  # noqa: E402
from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2_grpc as pb_grpc  # noqa: E402

TOKEN = "bench-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
CLK_TCK = os.sysconf("SC_CLK_TCK")


def small_inventory() -> list[pb.ParamInfo]:
    return [
        pb.ParamInfo(name=f"layer.{i}.weight", shape=[64, 64], dtype="bfloat16", requires_grad=True)
        for i in range(16)
    ]


def gpt_inventory(layers: int = 12, d: int = 768, vocab: int = 50304) -> list[pb.ParamInfo]:
    specs = [("wte.weight", [vocab, d]), ("wpe.weight", [1024, d])]
    for i in range(layers):
        p = f"h.{i}."
        specs += [
            (p + "ln_1.weight", [d]),
            (p + "ln_1.bias", [d]),
            (p + "attn.weight", [3 * d, d]),
            (p + "attn.bias", [3 * d]),
            (p + "proj.weight", [d, d]),
            (p + "proj.bias", [d]),
            (p + "ln_2.weight", [d]),
            (p + "ln_2.bias", [d]),
            (p + "fc.weight", [4 * d, d]),
            (p + "fc.bias", [4 * d]),
            (p + "fc_out.weight", [d, 4 * d]),
            (p + "fc_out.bias", [d]),
        ]
    specs += [("ln_f.weight", [d]), ("ln_f.bias", [d])]
    return [
        pb.ParamInfo(name=n, shape=s, dtype="bfloat16", requires_grad=True, unit=i)
        for i, (n, s) in enumerate(specs)
    ]


class Coordinator:
    """A ``zeroplane coordinator`` subprocess."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "coordinator", "--host", "127.0.0.1",
             "--port", "0", "--grace", "1", *args],
            cwd=REPO, env={**os.environ, "ZEROPLANE_TOKEN": TOKEN},
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            stop_processes([self.proc])
            raise RuntimeError(f"coordinator did not start: {line!r}")
        self.address = line.split()[-1]

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime

    def stop(self) -> None:
        stop_processes([self.proc], grace=10)


@dataclass
class Phase:
    name: str
    rpcs: int
    seconds: float
    latencies: list[float]
    errors: int
    cpu: float  # coordinator CPU seconds / wall seconds

    @property
    def rate(self) -> float:
        return self.rpcs / self.seconds

    @property
    def cpu_us_per_rpc(self) -> float:
        # The coordinator's own cost, whoever was the bottleneck: 1e6 / this is
        # what one coordinator core could serve.
        return self.cpu * self.seconds / max(self.rpcs, 1) * 1e6

    def pct(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        data = sorted(self.latencies)
        return data[min(len(data) - 1, int(q * len(data)))] * 1e3


def channels(address: str, n: int = 4) -> list[grpc.aio.Channel]:
    # Distinct channel args so grpc does not share one subchannel (one TCP connection).
    return [grpc.aio.insecure_channel(address, options=[("bench.channel", i)]) for i in range(n)]


async def register_all(
    stubs: list, ids: list[str], inventory: list[pb.ParamInfo], inflight: int = 64
) -> float:
    sem = asyncio.Semaphore(inflight)

    async def one(i: int, wid: str) -> None:
        async with sem:
            req = pb.RegisterRequest(
                worker=pb.WorkerInfo(
                    worker_id=wid, host="127.0.0.1", device_kind="cuda",
                    device_memory_bytes=80 * 10**9, free_ports=[20000 + i % 40000],
                ),
                inventory=inventory,
            )  # fmt: skip
            await stubs[i % len(stubs)].Register(req, metadata=AUTH, timeout=60)

    start = time.perf_counter()
    await asyncio.gather(*(one(i, w) for i, w in enumerate(ids)))
    return time.perf_counter() - start


def heartbeat_request(wid: str, generation: int) -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(
        worker_id=wid,
        generation_id=generation,
        report=pb.WorkerReport(
            model_state_bytes={"params": 2 << 20, "grads": 2 << 20, "master": 4 << 20,
                               "optimizer": 8 << 20},
            step=100, applied_generation_id=generation,
        ),
    )  # fmt: skip


async def saturate(
    coord: Coordinator, stubs: list, ids: list[str], generation: int, seconds: float, inflight: int
) -> Phase:
    latencies: list[float] = []
    errors = 0
    counter = itertools.count()
    stop_at = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal errors
        while time.perf_counter() < stop_at:
            k = next(counter)
            req = heartbeat_request(ids[k % len(ids)], generation)
            t0 = time.perf_counter()
            try:
                await stubs[k % len(stubs)].Heartbeat(req, metadata=AUTH, timeout=10)
                latencies.append(time.perf_counter() - t0)
            except grpc.RpcError:
                errors += 1

    cpu0, t0 = coord.cpu_seconds(), time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(inflight)))
    wall = time.perf_counter() - t0
    return Phase("saturation", len(latencies), wall, latencies, errors,
                 (coord.cpu_seconds() - cpu0) / wall)  # fmt: skip


async def paced(
    coord: Coordinator, stubs: list, ids: list[str], generation: int, seconds: float,
    interval: float,
) -> Phase:  # fmt: skip
    latencies: list[float] = []
    errors = 0
    tasks: set[asyncio.Task] = set()
    rate = len(ids) / interval
    # Each worker keeps its own phase within the interval.

    async def one(k: int, due: float) -> None:
        nonlocal errors
        req = heartbeat_request(ids[k % len(ids)], generation)
        try:
            await stubs[k % len(stubs)].Heartbeat(req, metadata=AUTH, timeout=10)
            latencies.append(time.perf_counter() - due)  # from the scheduled time
        except grpc.RpcError:
            errors += 1

    cpu0, start = coord.cpu_seconds(), time.perf_counter()
    sent = 0
    while (now := time.perf_counter()) - start < seconds:
        due_count = int((now - start) * rate)
        while sent < due_count:
            task = asyncio.create_task(one(sent, start + sent / rate))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            sent += 1
        await asyncio.sleep(0.002)
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    return Phase(f"paced {interval:g}s", len(latencies), wall, latencies, errors,
                 (coord.cpu_seconds() - cpu0) / wall)  # fmt: skip


async def load(n: int, seconds: float, inflight: int, interval: float) -> tuple[list, float]:
    coord = Coordinator(
        "--min-workers", "1", "--max-workers", str(n), "--join-window", "3600",
        "--lease-timeout", str(5 * interval), "--heartbeat-interval", str(interval),
        "--stage", "1",
    )  # fmt: skip
    try:
        chans = channels(coord.address)
        stubs = [pb_grpc.CoordinatorStub(c) for c in chans]
        ids = [f"worker-{i:05d}" for i in range(n)]
        reg_s = await register_all(stubs, ids, small_inventory())
        status = await stubs[0].Status(pb.StatusRequest(), metadata=AUTH, timeout=60)
        assert status.generation_id == 1 and status.world_size == n, status.waiting_reason
        phases = [
            await saturate(coord, stubs, ids, 1, seconds, inflight),
            await paced(coord, stubs, ids, 1, seconds, interval),
        ]
        status = await stubs[0].Status(pb.StatusRequest(), metadata=AUTH, timeout=60)
        # Nobody re-registers, so every expired lease is a member fewer.
        lost = n - sum(w.state == "member" for w in status.workers)
        for c in chans:
            await c.close()
        return [(p, lost if p.name.startswith("paced") else None) for p in phases], reg_s
    finally:
        coord.stop()


async def formation(n: int = 256) -> tuple[float, float, int]:
    coord = Coordinator(
        "--min-workers", "1", "--max-workers", str(n), "--join-window", "3600",
        "--lease-timeout", "30", "--stage", "2",
    )  # fmt: skip
    try:
        chans = channels(coord.address)
        stubs = [pb_grpc.CoordinatorStub(c) for c in chans]
        ids = [f"worker-{i:03d}" for i in range(n)]
        inventory = gpt_inventory()
        got: dict[int, dict[str, float]] = {1: {}, 2: {}}
        done = {1: asyncio.Event(), 2: asyncio.Event()}
        calls = []

        async def watch(i: int, wid: str) -> None:
            call = stubs[i % len(stubs)].WatchGenerations(
                pb.WatchGenerationsRequest(worker_id=wid), metadata=AUTH
            )
            calls.append(call)
            try:
                async for gen in call:
                    got[gen.id][wid] = time.perf_counter()
                    expected = n if gen.id == 1 else n - 1
                    if len(got[gen.id]) == expected:
                        done[gen.id].set()
            except grpc.RpcError:
                pass

        watchers = [asyncio.create_task(watch(i, w)) for i, w in enumerate(ids)]
        await asyncio.sleep(0.5)  # streams open before the clock starts
        start = time.perf_counter()
        await register_all(stubs, ids, inventory, inflight=n)
        await asyncio.wait_for(done[1].wait(), 120)
        form_s = max(got[1].values()) - start

        # One leaves: the other 255 get generation 2 and its reshard schedule.
        leave_at = time.perf_counter()
        await stubs[0].Leave(pb.LeaveRequest(worker_id=ids[-1]), metadata=AUTH, timeout=30)
        await asyncio.wait_for(done[2].wait(), 120)
        reform_s = max(t for w, t in got[2].items() if w != ids[-1]) - leave_at
        moves = 0
        for c in calls:
            c.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        status = await stubs[0].Status(pb.StatusRequest(), metadata=AUTH, timeout=60)
        assert status.generation_id == 2 and status.world_size == n - 1
        call = stubs[0].WatchGenerations(
            pb.WatchGenerationsRequest(worker_id=ids[0], after_generation_id=1), metadata=AUTH
        )
        async for gen in call:
            moves = len(gen.reshard.moves)
            break
        call.cancel()
        for c in chans:
            await c.close()
        return form_s, reform_s, moves
    finally:
        coord.stop()


def scale(hosts: int, ranks: int, state_dir: Path) -> dict[str, float | str]:
    """The coordinator's CPU for a job of ``hosts`` x ``ranks``, in process."""
    from coordinator.control.membership import Membership
    from coordinator.control.published import publish_steps
    from coordinator.control.servicer import Servicer
    from coordinator.control.statefile import StateLog, StateStore, load_snapshot
    from coordinator.core.conversions import inventory_wire_steps, param_from_proto
    from coordinator.core.messages import WorkerInfo
    from coordinator.core.planner import PlanConfig
    from coordinator.core.settings import CoordinatorConfig, MembershipConfig, ServerConfig
    from coordinator.core.steps import finish

    cpu = time.process_time
    out: dict[str, float | str] = {}
    inventory = tuple(param_from_proto(p) for p in gpt_inventory())
    n = hosts * ranks
    cfg = CoordinatorConfig(
        server=ServerConfig(host="127.0.0.1", port=0, state_file=state_dir / "state.json"),
        membership=MembershipConfig(
            min_workers=1, max_workers=n, join_window_s=3600, lease_timeout_s=30
        ),
        plan=PlanConfig(stage=2),
    )
    m = Membership(cfg.membership, cfg.plan)
    servicer = Servicer(cfg, m)
    store = StateStore(cfg.server.state_file)
    host_ids = [f"host-{h:05d}" for h in range(hosts)]
    for host in host_ids:
        for r in range(ranks):
            info = WorkerInfo(
                worker_id=f"{host}-{r}", host=host, device_kind="cuda",
                device_memory_bytes=80 * 10**9, free_ports=(29500, 29600), incarnation="bench",
            )  # fmt: skip
            m.register(info, inventory)

    def form() -> tuple[float, object]:
        t0 = cpu()
        proposal = m.propose()
        generation, published = finish(publish_steps(proposal))
        assert m.commit(proposal, generation)
        snapshot = published.for_state_file(m.snapshot())
        if not snapshot.inventory_wire:
            wire = finish(inventory_wire_steps(snapshot.inventory))
            snapshot = dataclasses.replace(snapshot, inventory_wire=wire)
        t1 = cpu()
        asyncio.run(store.save(snapshot))
        out["save_cpu_s"] = cpu() - t1
        assert store.log is not None
        out["save_kind"] = store.log.last_write
        return t1 - t0, published

    out["form_cpu_s"], first = form()
    out["form_save_s"] = out["save_cpu_s"]
    out["form_save_kind"] = out["save_kind"]
    out["base_bytes"] = cfg.server.state_file.stat().st_size
    out["head_bytes"] = len(first._head)

    # heartbeats: one per host (8 ranks each), then one per rank, through the servicer
    gen = m.generation_id
    report = heartbeat_request("x", gen).report
    host_requests = [
        pb.HostHeartbeatRequest(
            host_id=host,
            ranks=[
                pb.RankBeat(worker_id=f"{host}-{r}", generation_id=gen, report=report)
                for r in range(ranks)
            ],
        ).SerializeToString()
        for host in host_ids
    ]
    parse = pb.HostHeartbeatRequest.FromString
    t0 = cpu()
    for data in host_requests:
        servicer._host_beat(parse(data), "10.0.0.1").SerializeToString()
    out["host_beat_us"] = (cpu() - t0) / hosts * 1e6
    rank_requests = [
        heartbeat_request(f"{host}-{r}", gen).SerializeToString()
        for host in host_ids[: max(1, hosts // 4)]
        for r in range(ranks)
    ]

    class _Context:
        def peer(self) -> str:
            return "ipv4:10.0.0.1:40000"

    context, parse_one = _Context(), pb.HeartbeatRequest.FromString
    t0 = cpu()
    for data in rank_requests:
        coro = servicer.heartbeat(parse_one(data), context)
        try:
            coro.send(None)
        except StopIteration as stop:
            stop.value.SerializeToString()
    out["rank_beat_us"] = (cpu() - t0) / len(rank_requests) * 1e6

    # one host lost: its ranks leave together, the next generation forms at once
    for r in range(ranks):
        m.process_exited(f"{host_ids[hosts // 2]}-{r}", "was lost with its host")
    out["reform_cpu_s"], published = form()
    sample = [mm.worker_id for mm in published.generation.members[:: max(1, n // 1000)]]
    t0 = cpu()
    sizes = [len(published.incremental(w, published.id - 1)) for w in sample]
    out["piece_us"] = (cpu() - t0) / len(sample) * 1e6
    out["piece_bytes"] = sum(sizes) / len(sizes)
    t0 = cpu()
    whole = asyncio.run(published.whole())
    out["whole_cpu_s"], out["whole_bytes"] = cpu() - t0, len(whole)
    out["moves"] = len(published.generation.reshard.moves)

    # the state file: its size, a restart's load, and a rewrite of it (the first save
    # after a restart, and every MAX_GENERATION_RECORDS generations)
    path = cfg.server.state_file
    out["file_bytes"] = path.stat().st_size
    t0 = cpu()
    restored = load_snapshot(path)
    out["load_cpu_s"] = cpu() - t0
    assert restored is not None and restored.generation is not None
    assert restored.generation.id == published.id
    assert restored.members == m.snapshot().members
    snapshot = published.for_state_file(m.snapshot())
    t0 = cpu()
    StateLog(path).save(snapshot)
    out["rewrite_cpu_s"] = cpu() - t0
    return out


async def stream_load(hosts: int, ranks: int, seconds: float, interval: float) -> Phase:
    """``hosts`` agents on HostHeartbeats streams, one beat per ``interval``, against a
    coordinator process: its CPU per host beat and the beats' latency."""
    n = hosts * ranks
    coord = Coordinator(
        "--min-workers", "1", "--max-workers", str(n), "--join-window", "3600",
        "--lease-timeout", "60", "--heartbeat-interval", str(interval),
        "--stage", "1",
    )  # fmt: skip
    try:
        chans = channels(coord.address)
        stubs = [pb_grpc.CoordinatorStub(c) for c in chans]
        ids = [f"host-{h:05d}-{r}" for h in range(hosts) for r in range(ranks)]
        await register_all(stubs, ids, small_inventory())
        latencies: list[float] = []
        errors = 0
        report = heartbeat_request("x", 1).report

        async def agent(h: int) -> None:
            nonlocal errors
            host = f"host-{h:05d}"
            call = stubs[h % len(stubs)].HostHeartbeats(metadata=AUTH)
            request = pb.HostHeartbeatRequest(
                host_id=host,
                ranks=[
                    pb.RankBeat(worker_id=f"{host}-{r}", generation_id=1, report=report)
                    for r in range(ranks)
                ],
            )
            start = time.perf_counter() + interval * h / hosts  # spread over the interval
            k = 0
            while (due := start + k * interval) < stop_at:
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                await call.write(request)
                reply = await call.read()
                latencies.append(time.perf_counter() - due)
                errors += sum(r.outcome != pb.RankBeatResult.OK for r in reply.ranks)
                k += 1
            await call.done_writing()

        cpu0, t0 = coord.cpu_seconds(), time.perf_counter()
        stop_at = t0 + seconds
        await asyncio.gather(*(agent(h) for h in range(hosts)))
        wall = time.perf_counter() - t0
        phase = Phase(f"host streams {interval:g}s", len(latencies), wall, latencies, errors,
                      (coord.cpu_seconds() - cpu0) / wall)  # fmt: skip
        for c in chans:
            await c.close()
        return phase
    finally:
        coord.stop()


def report_scale(args: argparse.Namespace) -> None:
    import tempfile

    hosts, ranks = args.scale_hosts, args.ranks_per_host
    with tempfile.TemporaryDirectory() as tmp:
        f = scale(hosts, ranks, Path(tmp))
    n = hosts * ranks
    print()
    print(f"{n:,} ranks on {hosts:,} hosts, in process (coordinator CPU, no gRPC):")
    print(f"  host heartbeat ({ranks} ranks):   {f['host_beat_us']:8.0f} us/host beat, "
          f"{f['host_beat_us'] / ranks:.1f} us/rank")  # fmt: skip
    print(f"  per-rank heartbeat:           {f['rank_beat_us']:8.1f} us (servicer code only)")
    print(f"  form generation 1:            {f['form_cpu_s']:8.2f} s CPU "
          f"+ {f['form_save_s']:.2f} s state file ({f['form_save_kind']} record, "
          f"{f['base_bytes'] / 1e6:.1f} MB; shared head "
          f"{f['head_bytes'] / 1e6:.1f} MB)")  # fmt: skip
    print(f"  re-form after a host loss:    {f['reform_cpu_s']:8.2f} s CPU "
          f"+ {f['save_cpu_s']:.2f} s state file ({f['save_kind']} record, "
          f"{f['moves']:,.0f} moves in the whole schedule)")  # fmt: skip
    print(f"  state file:                   {f['file_bytes'] / 1e6:8.1f} MB, "
          f"load {f['load_cpu_s']:.2f} s CPU, rewrite as one base record "
          f"{f['rewrite_cpu_s']:.2f} s CPU")  # fmt: skip
    print(f"  per-worker message:           {f['piece_us']:8.0f} us CPU, "
          f"{f['piece_bytes'] / 1e3:.1f} kB (members delta + own moves)")  # fmt: skip
    print(f"  whole message (old clients):  {f['whole_cpu_s']:8.2f} s CPU once, "
          f"{f['whole_bytes'] / 1e6:.1f} MB each")  # fmt: skip
    phase = asyncio.run(stream_load(args.stream_hosts, ranks, args.seconds, args.stream_interval))
    print(f"  gRPC, {args.stream_hosts} host streams x {ranks} ranks, one beat per "
          f"{args.stream_interval:g}s: {phase.rate:.0f} host beats/s, p50 {phase.pct(0.5):.1f} ms, "
          f"p99 {phase.pct(0.99):.1f} ms, coordinator {phase.cpu_us_per_rpc:.0f} us CPU/host beat "
          f"({phase.cpu_us_per_rpc / ranks:.0f} us/rank), errors {phase.errors}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workers", default="1000,10000", help="worker counts (default 1000,10000)"
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="per phase (default 8)")
    parser.add_argument("--inflight", type=int, default=128, help="saturation concurrency")
    parser.add_argument(
        "--interval",
        type=float,
        help="paced heartbeat interval (default: 2 s, or N/1000 s for more than 2000 workers, "
        "so the offered load stays within what one Python load generator can send)",
    )
    parser.add_argument("--form-workers", type=int, default=256)
    parser.add_argument("--scale", action="store_true", help="the 100k-rank simulation too")
    parser.add_argument("--scale-only", action="store_true", help="only the 100k-rank simulation")
    parser.add_argument("--scale-hosts", type=int, default=12500)
    parser.add_argument("--ranks-per-host", type=int, default=8)
    parser.add_argument("--stream-hosts", type=int, default=500, help="hosts in the gRPC run")
    parser.add_argument("--stream-interval", type=float, default=1.0)
    args = parser.parse_args()
    if args.scale_only:
        report_scale(args)
        return 0

    print(f"coordinator load, {os.cpu_count()} cores shared by coordinator and load generator")
    print("coord CPU: the coordinator process's CPU time over wall time (100% = one core)")
    print()
    header = (
        f"{'workers':>8}  {'phase':<12} {'register/s':>10} {'RPC/s':>8} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'errors':>6} {'coord CPU':>9} {'CPU us/RPC':>10} {'leases lost':>11}"
    )
    print(header)
    print("-" * len(header))
    for n in (int(w) for w in args.workers.split(",")):
        interval = args.interval or max(2.0, n / 1000)
        phases, reg_s = asyncio.run(load(n, args.seconds, args.inflight, interval))
        for p, lost in phases:
            print(
                f"{n:>8}  {p.name:<12} {n / reg_s:>10.0f} {p.rate:>8.0f} {p.pct(0.5):>8.2f} "
                f"{p.pct(0.99):>8.2f} {p.errors:>6} {p.cpu:>9.0%} {p.cpu_us_per_rpc:>10.0f} "
                f"{'-' if lost is None else lost:>11}",
                flush=True,
            )
    form_s, reform_s, moves = asyncio.run(formation(args.form_workers))
    print()
    n = args.form_workers
    print(f"form a {n}-worker generation (register + watch, 110M-param inventory): {form_s:.2f} s")
    print(f"re-form after one leave ({n} -> {n - 1}, {moves} reshard moves sent to each): "
          f"{reform_s:.2f} s")  # fmt: skip
    if args.scale:
        report_scale(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
