"""Buffers written ahead of a build: what :meth:`ShardState.build` and
:meth:`ShardState.import_ranges` would make for a rank of a world, listed so that a
thread can make them while the rank trains (worker/flat.py :class:`Reserve`).

[Note: a build from buffers written ahead]
A membership change builds every buffer of the new layout (``full``, the
master partition, the gradient buffer) and the import makes the optimizer
state, while every rank waits. Fresh memory costs a page fault per 4 KiB,
and on two cores shared by three ranks far more than the copy into it:
in bench/elastic.py a member's build and import took 0.37 s and 0.16 s
at the first scale-up. A member that knows of a scale-up before switching
(worker/rendezvous.py [Note: meeting ahead]) writes them in a thread while
it trains: :func:`reserve_plan` lists what the build and the import would
make (by size, dtype and device; the optimizer state's fields as this
rank's optimizer holds them now), a thread makes them
(:meth:`Reserve.make`) and puts them in the state's ``reserve``, and the
build and the import take these instead. A build for another rank or world
just finds fewer matches. Host buffers (with
offload) are not reserved. The cost: the new layout's buffers exist from
the vote to the switch, a step or a few earlier than they would.
"""

from __future__ import annotations

import inspect
from typing import Protocol

import torch

from coordinator.core.layout import Bucket, Layout
from worker.offload import Placement
from worker.optim import ShardOptimizer
from worker.stages import GradReducer, ParamStorage, Stage

__all__ = ["Builds", "Request", "probe_state_fields", "reserve_plan", "state_fields"]

# a tensor to make ahead: (numel, dtype, device)
Request = tuple[int, torch.dtype, torch.device]


class Builds(Protocol):
    """What the plan reads of a shard state (worker/state.py :class:`ShardState`)."""

    stage: Stage
    placement: Placement
    params: ParamStorage
    reducer: GradReducer
    dtype: torch.dtype
    device: torch.device

    def layout_for(self, world_size: int) -> Layout: ...

    def shard_range(self, spec: Bucket, rank: int) -> tuple[int, int]: ...


def reserve_plan(
    state: Builds,
    rank: int,
    world_size: int,
    *,
    buffers: bool,
    fields: dict[str, torch.dtype],
) -> list[Request]:
    """What ``state`` builds and imports on the device for ``rank`` of ``world_size``:
    with ``buffers``, each bucket's buffers; for every piece of the rank's shards, one
    tensor per optimizer state field of ``fields`` (with optimizer offload, none:
    host buffers are not reserved)."""
    out: list[Request] = []
    on_device = not state.placement.optimizer_on_host
    if not on_device:
        fields = {}
    for spec in state.layout_for(world_size).buckets:
        lo, hi = state.shard_range(spec, rank)
        sharded = state.stage.params.sharded
        if buffers and not sharded:
            out.append((spec.padded_numel, state.dtype, state.device))
        if buffers and (state.params.master_apart or sharded) and on_device:
            out.append((hi - lo, torch.float32, state.device))
        if buffers and sharded and not state.placement.params_on_host:
            out.append((hi - lo, state.dtype, state.device))  # the parameter shard
        if buffers:
            out.append((state.reducer.grad_numel(spec), state.dtype, state.device))
        for piece in spec.pieces(lo, hi):
            out += [(piece.numel, dtype, state.device) for dtype in fields.values()]
    return out


def state_fields(
    optimizer: ShardOptimizer, user_optimizer: torch.optim.Optimizer, device: torch.device
) -> dict[str, torch.dtype]:
    """The per-element fields of ``optimizer``'s state and their dtypes, as it holds
    them now; holding none yet, as one step of a fresh ``user_optimizer`` of its class
    on ``device`` makes them (:func:`probe_state_fields`)."""
    state = optimizer.inner.state
    for piece in optimizer.pieces:
        held = state.get(piece.view)
        if held:
            n = piece.view.numel()
            return {
                k: v.dtype
                for k, v in held.items()
                if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == n
            }
    return probe_state_fields(user_optimizer, device)


def probe_state_fields(
    optimizer: torch.optim.Optimizer, device: torch.device
) -> dict[str, torch.dtype]:
    """The per-element state fields ``optimizer``'s class makes, from one step of a
    fresh instance (its defaults, those its constructor takes) on a 2x3 zero
    parameter with a zero gradient; {} when that fails (a class that takes other
    arguments). Only a hint of what to write ahead: a wrong one finds no match."""
    p = torch.zeros(2, 3, device=device, requires_grad=True)
    p.grad = torch.zeros_like(p)
    cls = type(optimizer)
    try:
        takes = inspect.signature(cls.__init__).parameters
        if any(a.kind is inspect.Parameter.VAR_KEYWORD for a in takes.values()):
            kwargs = dict(optimizer.defaults)
        else:  # torch's AdamW lists Adam's decoupled_weight_decay, which it does not take
            kwargs = {k: v for k, v in optimizer.defaults.items() if k in takes}
        probe = cls([p], **kwargs)
        probe.step()
    except Exception:  # any failure only means nothing is written ahead
        return {}
    return {
        k: v.dtype
        for k, v in probe.state.get(p, {}).items()
        if isinstance(v, torch.Tensor) and v.shape == p.shape
    }
