"""Collectives of ranks on one host go through shared memory (worker/shared_exchange.py).

Real gloo ranks gather and reduce-scatter tensors through ``Collectives`` and
compare each result with the concatenation or the sum of what every rank
contributed (each rank knows the others' tensors: they are drawn from a seed
per rank). The sizes vary so that the ring grows and wraps, collectives are
issued ahead of their waits as stage 3 prefetches them, gathers and
reduce-scatters interleave, and the files are gone from /dev/shm.
"""

from __future__ import annotations

import os

import pytest
import torch

SIZES = [20_000, 70_000, 150_000, 5_000, 60_000, 150_000, 300_000, 64, 90_000, 300_000]


def _contribution(rank: int, i: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(n, generator=g).to(dtype)


def gather_many(dtype_name: str, ahead: int) -> dict:
    import torch.distributed as dist

    from worker.collectives import Collectives
    from worker.shared_exchange import MIN_SHARED_BYTES

    dtype = getattr(torch, dtype_name)
    rank, world = dist.get_rank(), dist.get_world_size()
    before = set(os.listdir("/dev/shm"))
    comm = Collectives(None)
    outputs, handles = [], []
    mismatches = []
    for i, n in enumerate(SIZES * 2):
        out = torch.empty(n * world, dtype=dtype)
        # as stage 3 gathers: the input is this rank's slot of the output
        out.view(world, -1)[rank].copy_(_contribution(rank, i, n, dtype))
        handles.append(comm.all_gather(out, out.view(world, -1)[rank], async_op=True))
        outputs.append(out)
        if len(handles) > ahead:  # wait ``ahead`` gathers behind the issue
            handles[len(handles) - ahead - 1].wait()
    for h in handles:
        h.wait()
    for i, (n, out) in enumerate(zip(SIZES * 2, outputs, strict=True)):
        want = torch.cat([_contribution(r, i, n, dtype) for r in range(world)])
        if not torch.equal(out, want):
            mismatches.append(i)
    # reduce-scatters, between gathers as in a backward, waited ``ahead`` behind; each
    # input is overwritten once issued (through shared memory it is free then)
    summed = dtype if dtype.is_floating_point else torch.float32
    reduced, handles = [], []
    for i, n in enumerate(SIZES):
        full = _contribution(rank, 100 + i, n * world, summed)
        reduced.append(torch.empty(n, dtype=summed))
        comm.all_gather(torch.empty(n * world), torch.ones(n))  # between them
        handles.append(comm.reduce_scatter(reduced[-1], full, async_op=True))
        if comm._host is not None and full.numel() * full.element_size() >= MIN_SHARED_BYTES:
            full.fill_(float("nan"))
        if len(handles) > ahead:
            handles[len(handles) - ahead - 1].wait()
    for h in handles:
        h.wait()
    for i, n in enumerate(SIZES):
        parts = [_contribution(r, 100 + i, n * world, summed) for r in range(world)]
        # the ranks' chunks added one after another in rank order, in fp32 for bf16
        want = parts[0].float()
        for part in parts[1:]:
            want += part
        if not torch.equal(reduced[i], want.to(summed).view(world, -1)[rank]):
            mismatches.append(("reduce_scatter", i))
    host = comm._host
    files = [os.fstat(fd) for fd in (host.fd, host.bell)] if host else []
    return {
        # the security guide's row: 0600, and no name left to open
        "modes": [(f.st_mode & 0o777, f.st_nlink) for f in files],
        "mismatches": mismatches,
        "shared": host is not None,
        "gathers": comm.stats["all_gather"].calls - len(SIZES),
        "capacity": host.capacity if host else 0,
        "left": sorted(set(os.listdir("/dev/shm")) - before),
        # no receive buffer as large as an input (only gloo's, for the exchanges too
        # small for shared memory), but one chunk's
        "receive_bytes": max((t.numel() * t.element_size() for t in comm._scratch), default=0),
        "chunk_bytes": host._chunk.numel() if host and host._chunk is not None else 0,
    }


@pytest.mark.parametrize(
    ("world", "dtype", "ahead"), [(2, "float32", 1), (3, "bfloat16", 0), (3, "uint8", 2)]
)
def test_exchanges_through_shared_memory_equal_the_concatenation_and_the_sum(
    pools, world: int, dtype: str, ahead: int
) -> None:
    results = pools(world).run(gather_many, dtype, ahead)
    for r in results:
        assert r["shared"], "ranks of one host exchange through /dev/shm"
        assert r["mismatches"] == [], r["mismatches"]
        assert r["gathers"] == 2 * len(SIZES)
        assert r["left"] == [], "the shared file is unlinked once every rank opened it"
        assert r["modes"] == [(0o600, 0), (0o600, 0)]
        # a reduce-scatter reads one chunk at a time: no buffer of its input's size
        summed = 2 if dtype == "bfloat16" else 4
        assert r["receive_bytes"] < max(SIZES) * world * summed, r["receive_bytes"]
        assert r["chunk_bytes"] == max(SIZES) * summed, r["chunk_bytes"]
    # the ring: three times the largest region (a reduce-scatter's: world x its input)
    largest = max(SIZES) * world * world * summed
    assert results[0]["capacity"] >= 3 * largest


def reduce_in_pieces(dtype_name: str, limit: int) -> dict:
    """Reduce-scatters whose regions are over ``limit`` bytes (made the largest here),
    so that each goes in pieces (the last one narrower)."""
    import torch.distributed as dist

    import worker.shared_exchange as shared
    from worker.collectives import Collectives

    dtype = getattr(torch, dtype_name)
    rank, world = dist.get_rank(), dist.get_world_size()
    comm, mismatches = Collectives(None), []
    before, shared.MAX_REGION_BYTES = shared.MAX_REGION_BYTES, limit
    try:
        for i, n in enumerate([70_001, 150_000, 20_000]):
            mine = torch.empty(n, dtype=dtype)
            full = _contribution(rank, 200 + i, n * world, dtype)
            comm.reduce_scatter(mine, full, async_op=True).wait()
            parts = [_contribution(r, 200 + i, n * world, dtype) for r in range(world)]
            want = parts[0].float()
            for part in parts[1:]:
                want += part
            if not torch.equal(mine, want.to(dtype).view(world, -1)[rank]):
                mismatches.append(i)
        host = comm._host
        return {
            "mismatches": mismatches,
            "shared": host is not None,
            "largest": host.largest if host else 0,
            "chunk_bytes": host._chunk.numel() if host and host._chunk is not None else 0,
            "receive_buffers": len(comm._scratch),
        }
    finally:
        shared.MAX_REGION_BYTES = before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_reduce_scatter_over_the_region_limit_goes_in_pieces(pools, dtype: str) -> None:
    world, limit = 3, 1 << 20
    for r in pools(world).run(reduce_in_pieces, dtype, limit):
        assert r["shared"] and r["mismatches"] == [], r
        assert r["receive_buffers"] == 0, r
        # every region within the limit, and read a piece's chunk at a time
        assert 0 < r["largest"] <= limit, r
        assert r["chunk_bytes"] <= limit // world**2, r


def gather_disagreeing() -> str:
    import torch.distributed as dist

    from worker.collectives import CollectiveError, Collectives

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Collectives(None)
    n = 100_000 if rank == 0 else 50_000  # a data-dependent unit: sizes differ
    out = torch.empty(n * world)
    try:
        comm.all_gather(out, torch.ones(n))
    except CollectiveError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_gather_different_sizes_fail_with_the_reason(pools) -> None:
    for message in pools(2).run(gather_disagreeing):
        assert "disagree on exchange #1" in message and "all-gather of" in message, message


def gather_off(value: str) -> bool:
    from worker.shared_exchange import SHM_DISABLE_ENV

    os.environ[SHM_DISABLE_ENV] = value
    try:
        result = gather_many("float32", 1)
    finally:
        del os.environ[SHM_DISABLE_ENV]
    assert result["mismatches"] == []
    return result["shared"]


def test_the_environment_turns_it_off(pools) -> None:
    assert pools(2).run(gather_off, "1") == [False, False]


def _failing_rank(rank: int, world: int, port: int, scenario: str, results) -> None:
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from worker.collectives import CollectiveError, Collectives
    from worker.compat import close_connections_to

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    comm = Collectives(None)
    n = 100_000
    comm.all_gather(torch.empty(world * n), torch.ones(n))  # opens the shared file
    if scenario == "dies" and rank == world - 1:
        os._exit(9)  # lost mid-job
    if scenario == "stuck" and rank == 1:
        time.sleep(1.5)  # stuck in the script (or stopped) past the moment rank 0 gives up
    if scenario == "stuck" and rank == 0:
        # as the coordinator's release of a rank it dropped (worker/rendezvous.py)
        threading.Timer(0.5, close_connections_to, args=([1],)).start()
    start = time.monotonic()
    try:
        # rank 0's shard of the first may be there before it gave up: that one completes
        for _ in range(3):
            comm.all_gather(torch.empty(world * n), torch.ones(n))
        results.put((rank, "gathered", time.monotonic() - start))
    except CollectiveError as exc:
        results.put((rank, str(exc), time.monotonic() - start))
    if scenario == "stuck" and rank == 0:
        time.sleep(2.5)  # alive, on to the next generation, as rank 1 comes back
    results.close()
    results.join_thread()  # flushed before the exit below
    os._exit(0)  # without tearing down a group whose peer is gone


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("scenario", "world", "want"),
    [
        # "rank 2 (pid …) exited", or "rank 2 is gone" when its doorbell had no reader
        ("dies", 3, {0: "rank 2 ", 1: "rank 2 "}),
        ("stuck", 2, {0: "gave up on rank(s) [1]", 1: "rank 0 left the group"}),
    ],
)
def test_a_lost_or_released_peer_fails_a_shared_wait_at_once(
    scenario: str, world: int, want: dict[int, str]
) -> None:
    """Not at the collective timeout (60 s): a dead peer's doorbell has no reader, and
    a rank that gives up on a peer rings it a last time ([Note: exchanges through shared
    memory])."""
    import torch.multiprocessing as mp

    from coordinator.core.ports import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_failing_rank, args=(r, world, port, scenario, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in want:
            rank, message, seconds = results.get(timeout=90)
            got[rank] = (message, seconds)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, words in want.items():
        message, seconds = got[rank]
        assert words in message and "through shared memory failed" in message, (rank, message)
        assert seconds < 10, (rank, seconds)


def _exiting_rank(rank: int, port: int, results, go) -> None:
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from worker.collectives import CollectiveError, Collectives

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    comm = Collectives(None)
    n = 100_000
    comm.all_gather(torch.empty(2 * n), torch.ones(n))  # opens the shared file
    out = torch.empty(2 * n)
    if rank == 0:
        go.wait(60)  # rank 1 waits (and is stopped) in its last exchange
    handle = comm.all_gather(out, torch.full((n,), float(rank + 1)), async_op=True)
    if rank == 1:
        results.put((rank, "waiting", os.getpid()))
    try:
        handle.wait()
        want = torch.cat([torch.full((n,), 1.0), torch.full((n,), 2.0)])
        results.put((rank, "equal" if torch.equal(out, want) else "wrong", time.monotonic()))
    except CollectiveError as exc:
        results.put((rank, str(exc), time.monotonic()))
    results.close()
    results.join_thread()
    os._exit(0)  # its last exchange done, gone before its peer has read it


@pytest.mark.timeout(120)
def test_a_peer_that_rang_and_exited_is_heard_not_lost() -> None:
    """A rank whose last exchange is done exits while its peer still waits in it: the
    peer finds the doorbell's reader gone in the same poll that brings the ring, and must
    read the exchange rather than call the peer lost (a clean-clone CI failure of
    test_no_rank_aborts_at_exit_after_async_collectives). Rank 1 is stopped inside its
    wait until rank 0 has rung and exited, so that both events are there at once."""
    import signal
    import time

    import torch.multiprocessing as mp

    from coordinator.core.ports import free_port

    ctx = mp.get_context("spawn")
    results, go = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [
        ctx.Process(target=_exiting_rank, args=(r, port, results, go), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    got = {}
    try:
        rank, what, pid = results.get(timeout=90)
        assert (rank, what) == (1, "waiting")
        time.sleep(0.5)  # into its poll
        os.kill(pid, signal.SIGSTOP)
        try:
            go.set()
            procs[0].join(timeout=60)
            assert procs[0].exitcode == 0
            rank, what, _ = results.get(timeout=10)
            got[rank] = what
        finally:
            os.kill(pid, signal.SIGCONT)
        rank, what, _ = results.get(timeout=60)
        got[rank] = what
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert got == {0: "equal", 1: "equal"}, got
