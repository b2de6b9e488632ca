"""Differences between the torch versions zeroplane supports (2.5 and newer), in one place."""

from __future__ import annotations

import contextlib
import inspect
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = [
    "abort_default_group",
    "all_gather_flat",
    "backend_for",
    "close_connections_to",
    "compile_disabled",
    "eager",
    "group_timeout",
    "on_closing_connections",
    "parallelize_local",
    "rebind_hook_mesh",
    "reduce_scatter_flat",
    "serving_store",
    "time_out_subgroups_as",
]

# torch 2.13 renamed the flat-tensor collectives (`*_single`) and deprecated the
# old names; older releases only have the old ones.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# a function torch.compile runs as it is, outside any graph (a graph break around
# it): torch.compiler.disable, in every torch zeroplane supports (2.1 and newer)
eager = torch.compiler.disable


def can_swap_storages() -> bool:
    """Whether torch swaps two storages' memory (``UntypedStorage._swap_data_ptr_``,
    worker/flat.py [Note: gathered storages from a pool]); without it, stage 3
    resizes its storages."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


@contextlib.contextmanager
def compile_disabled() -> Iterator[None]:
    """Everything called inside runs eager, compiled modules and functions included
    (``torch.compiler.set_stance("force_eager")`` from torch 2.6; before it, dynamo's
    ``disable`` switch)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is not None:
        with set_stance("force_eager"):
            yield
        return
    with torch._dynamo.config.patch(disable=True):
        yield


_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def serving_store(host: str, port: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """A generation's rendezvous store served by this rank, listening on ``host``'s
    address alone (the one the other ranks connect to), not on every interface.
    The store owns the listening socket (torch closes it with the store). Where
    ``host`` is not an address of this machine, or this torch cannot take a
    listening socket (``master_listen_fd``), it listens on every interface, as
    torch's own does."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        if ipaddress.ip_address(address[0]).is_loopback and host not in _LOOPBACK_NAMES:
            # a host name this machine maps to itself (Debian's 127.0.1.1) that the
            # other hosts resolve to its real address: binding loopback would lock them out
            raise ValueError(f"{host} resolves to the loopback address {address[0]} here")
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(max(128, world_size))
        store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
        sock.detach()  # the store's now
        return store
    except (OSError, RuntimeError, TypeError, ValueError) as exc:
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        logger.info("the store listens on every interface (not %s alone: %s)", host, exc)
    return dist.TCPStore(
        host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False
    )


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend for tensors on ``device``: NCCL for CUDA, gloo else."""
    return "nccl" if device.type == "cuda" else "gloo"


def abort_default_group(timeout: timedelta) -> None:
    """Tear down a default group that a dead peer broke, without waiting.

    First this rank's connections of a gloo group are closed, so that a survivor
    still waiting on this rank fails now rather than at the collective timeout
    ([Note: a survivor that learns late]).

    Releasing a gloo group runs its destructor, which waits for every operation
    still queued or in flight on it, and after a peer died one of them can wait
    on a survivor that has moved on, until the collective timeout (``timeout``;
    measured: 14.5 s of a 15 s timeout, aborting first or not). So the broken
    group is only unregistered here, and a thread holds it until its operations
    have timed out (``timeout`` and a margin), then releases it: the new
    generation's group forms at once, and the destructor returns at once.

    Releasing it matters: as long as it lives, the broken group's gloo transport
    thread (``gloo_tcp_loop``, one per group) can busy-poll a broken connection.
    Measured in a goodput run (3 ranks on 2 cores, 15 s timeout): 20-35 % of a
    core per survivor for the rest of the run (70 s and counting), per crash,
    every step of the job slower; released, the thread ends. Until then the
    transport threads alive at the abort (they all belong to the broken
    generation: the next group's is started after) get the lowest CPU priority;
    the new group's threads keep theirs.
    """
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return
    default = distributed_c10d._get_default_group()
    me = dist.get_rank()
    subgroups = [pg for pg, ranks in _group_ranks().items() if pg is not default and me in ranks]
    broken = [default, *subgroups]
    if dist.get_backend() == "gloo":
        _close_connections(dist.get_rank(), dist.get_world_size())
        for pg in subgroups:  # a DeviceMesh's tp and dp groups: a peer may wait there
            _close_connections(dist.get_rank(), dist.get_world_size(), group=pg)
    _lowest_priority(_TRANSPORT_THREADS)
    abort = getattr(distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        # NCCL: ends its kernels; already gone is fine, the destroy below covers it
        with contextlib.suppress(RuntimeError):
            abort()
    if dist.is_initialized():
        dist.destroy_process_group()
    threading.Thread(
        target=_release_later,
        args=(broken, timeout.total_seconds() + _RELEASE_MARGIN_S),
        name="zeroplane-release-broken-group",
        daemon=True,
    ).start()


# after the collective timeout, how long a broken group is still held
_RELEASE_MARGIN_S = 5.0

# a p2p tag nothing else uses: the probe receive below never matches a real message
_CLOSING_TAG = 0x7A7F


def _close_connections(rank: int, world_size: int, group: object | None = None) -> None:
    """Close this rank's connections of the broken default gloo group (or of
    ``group``, one of its subgroups), so that every peer still waiting on an
    operation with this rank fails now.

    [Note: a survivor that learns late]
    A peer that died breaks the connections to it, and whoever waits on it
    fails at once. But a survivor can be waiting on another survivor, one that
    has already failed and moved on to the next generation and will never send
    (a ring step of an all-reduce, a receive of the gradient log). Gloo does
    not notice: it waits for the whole collective timeout (measured: 15 s of
    a 15 s timeout in the recovery tests), and neither destroying nor
    aborting the group closes its sockets. What does close one is a wait
    that times out: gloo then closes that connection ("Application timeout
    caused pair closure"), and the peer's pending operations on it fail with
    "Connection closed by peer". So a rank leaving a broken group posts a
    receive nobody sends (its own tag) from each peer and waits a millisecond
    on it: every survivor learns of the loss within moments of the first one,
    and the one that closed its connections to it in turn does the same.
    """
    peers = range(world_size) if group is None else _group_ranks().get(group, {})
    close_connections_to([peer for peer in peers if peer != rank], group)


def time_out_subgroups_as(timeout: timedelta) -> None:
    """Give every process group made from now on in this process (``new_group``, a
    ``DeviceMesh``'s dimensions, the script's own) ``timeout`` unless it names its own:
    torch gives them 30 minutes (gloo) or 10 (NCCL), not the default group's, so a
    rank stuck on a tensor- or pipeline-parallel group outlived the job's collective
    timeout ([Note: naming a stall] in worker/whereabouts.py)."""
    from torch.distributed import distributed_c10d

    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        if hasattr(distributed_c10d, name):
            setattr(distributed_c10d, name, timeout)


def group_timeout(group: object | None) -> timedelta:
    """The collective timeout of ``group`` (None: the default group); torch's default
    for gloo where the group does not say."""
    from torch.distributed import distributed_c10d

    pg = group if group is not None else distributed_c10d._get_default_group()
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return distributed_c10d.default_pg_timeout


# what else closes its connections to peers along with gloo's (worker/shared_exchange.py)
_CLOSING: list[Callable[[list[int], object | None], None]] = []


def on_closing_connections(fn: Callable[[list[int], object | None], None]) -> Callable:
    """Run ``fn(peers, group)`` whenever :func:`close_connections_to` closes gloo's
    connections to ``peers`` in ``group`` (a decorator)."""
    _CLOSING.append(fn)
    return fn


def close_connections_to(peers: Iterable[int], group: object | None = None) -> None:
    """Close this rank's gloo connections to ``peers`` (global ranks) in ``group`` (None:
    the default group), so that an operation waiting on one of them fails now
    ([Note: a survivor that learns late]), and the gathers through this host's shared
    memory with them (worker/shared_exchange.py). Safe from another thread than the one
    that waits: a receive that times out closes its pair, whoever posted it."""
    peers = list(peers)
    for hang_up in _CLOSING:
        hang_up(peers, group)
    probe = torch.empty(1)
    for peer in peers:
        # the timeout is the point: it closes the connection (or it already was)
        with contextlib.suppress(Exception):
            work = dist.irecv(probe, src=peer, group=group, tag=_CLOSING_TAG)
            work.wait(timeout=timedelta(milliseconds=1))


def _group_ranks() -> dict[object, dict[int, int]]:
    """Every process group this process holds, with its members' global ranks."""
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    table = getattr(world, "pg_group_ranks", None)
    if table is None:
        table = getattr(distributed_c10d, "_pg_group_ranks", {})
    return dict(table)


def _release_later(holder: list[object], seconds: float) -> None:
    time.sleep(seconds)
    holder.clear()  # the last reference: the destructor runs here, off the training thread


# the threads gloo's TCP transport polls its connections on (one per group)
_TRANSPORT_THREADS = "gloo_tcp_loop"


def _lowest_priority(thread_name: str) -> None:
    """Give this process's threads named ``thread_name`` nice 19 (Linux: a nice
    value is per thread; lowering one's own priority needs no privilege)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return
    for task in tasks.iterdir():
        try:
            if (task / "comm").read_text().strip() == thread_name:
                os.setpriority(os.PRIO_PROCESS, int(task.name), 19)
        except OSError:  # the thread ended meanwhile
            continue


def parallelize_local(module: object, mesh: object, style: object) -> None:
    """torch's ``parallelize_module`` with each rank splitting its (identical) full
    tensors locally, without a scatter from the tp group's first rank: every rank
    already holds the same values, and a construction that communicates could not
    run on a newcomer whose tp peers are built already (worker/elastic/rings.py).
    torch before 2.6 has no ``src_data_rank``: its styles scatter as they always did."""
    from torch.distributed.tensor.parallel import parallelize_module

    if "src_data_rank" in inspect.signature(parallelize_module).parameters:
        parallelize_module(module, mesh, style, src_data_rank=None)
    else:
        parallelize_module(module, mesh, style)


def forget_meshes() -> None:
    """Drop DTensor's caches of sharding decisions and redistribution plans.

    A ``DeviceMesh`` equals another of the same ranks, shape and dim names whatever
    its process groups, so after a job re-forms (worker/elastic/rings.py) a
    cached decision keyed by the new mesh can hand back an output spec that holds
    the old mesh object, and its collective then names a process group that was
    destroyed ("Could not resolve the process group registered under the name
    ..."). The caches differ between torch versions: each one present is cleared."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        clear = getattr(getattr(propagator, name, None), "cache_clear", None)
        if clear is not None:
            clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:
        native()
    try:
        from torch.distributed.tensor import _redistribute
    except ImportError:  # pragma: no cover - every supported torch has it
        return
    plans = getattr(_redistribute, "_gen_transform_infos", None)
    if hasattr(plans, "cache_clear"):
        plans.cache_clear()
    planner = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if planner is not None:
        planner()


def rebind_hook_mesh(hook: object, mesh: object) -> bool:
    """Point a forward hook that torch's ``distribute_module`` registered (a closure
    over ``device_mesh``) at ``mesh``; False where ``hook`` closes over no mesh.
    The one place that knows how torch's tensor-parallel styles keep their mesh."""
    code = getattr(hook, "__code__", None)
    cells = getattr(hook, "__closure__", None)
    if code is None or not cells or "device_mesh" not in code.co_freevars:
        return False
    cells[code.co_freevars.index("device_mesh")].cell_contents = mesh
    return True
