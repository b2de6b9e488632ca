"""Activations: checkpointing chosen modules, and measuring what backward keeps.

[Note: activation checkpointing]
``ZeroConfig(activation_checkpointing=...)`` picks modules whose activations
are not kept for backward but recomputed in it: ``"units"`` every gather
unit's module but the root (the blocks of an ``nn.ModuleList`` or
``nn.Sequential`` and modules of at least ``stage3_min_unit_numel``
parameters: the same units stage 3 gathers), an int ``k`` every k-th of them,
or a callable policy over modules. Only the outermost of nested choices is
checkpointed. Each chosen module's forward runs under torch's non-reentrant
``checkpoint``: its parameters stay in the autograd graph (so the engine's
graph walk stays exact and overlap is kept, worker/engine.py [Note: bucket
order]) and at stage 3 the recomputation runs the units' own forward hooks
again, gathering each unit for its recomputation and freeing it after, so
stage 3's bound (the running unit and the prefetched one) holds in backward
too. Parameter names, checkpoints and the module tree are unchanged: the
module's ``forward`` is wrapped on the instance, and :func:`unwrap` restores it.

[Note: saved-activation bytes]
What checkpointing saves is measured, not estimated: a
``saved_tensors_hooks`` pair around the forward counts the bytes of every
distinct storage autograd keeps for backward (parameters excluded; tensors a
checkpointed region recomputes are packed by the checkpoint's own hooks, so
they are not kept and not counted). A Python call per saved tensor costs a
little, so the engine measures the first forward after it is built and every
``MEASURE_EVERY``-th one after.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from worker.inventory import Inventory

__all__ = [
    "MEASURE_EVERY",
    "SavedBytes",
    "checkpoint_modules",
    "choose_modules",
    "unwrap",
    "without_kv_cache",
]

MEASURE_EVERY = 50

Policy = str | int | Callable[[nn.Module], bool]


def choose_modules(root: nn.Module, inventory: Inventory, policy: Policy) -> list[nn.Module]:
    """The modules ``policy`` checkpoints (see [Note: activation checkpointing])."""
    if policy == "none":
        return []
    if callable(policy):
        chosen = [m for m in root.modules() if m is not root and policy(m)]
    else:
        units = [m for index, m in inventory.unit_modules.items() if index != 0]
        step = 1 if policy == "units" else int(policy)
        chosen = units[step - 1 :: step]
    # the outermost of nested choices: checkpointing inside a checkpoint recomputes twice
    inner = {id(d) for m in chosen for d in m.modules() if d is not m}
    return [m for m in chosen if id(m) not in inner]


def checkpoint_modules(modules: list[nn.Module]) -> None:
    """Run each module's forward under torch's non-reentrant checkpoint."""
    for module in modules:
        if "forward" in vars(module):
            raise ValueError(
                f"{type(module).__name__} already has a forward of its own on the instance "
                "(checkpointed twice, or wrapped by another library)"
            )
        original = module.forward

        @functools.wraps(original)
        def forward(*args: Any, _original=original, _module=module, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _original(*args, **kwargs)
            return checkpoint(_shadowed(_module, _original), *args, use_reentrant=False, **kwargs)

        module.forward = forward  # type: ignore[method-assign]


def _shadowed(module: nn.Module, run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` with the parameters ``module`` sees now, in its recomputation too. A
    hook outside ``forward`` may shadow a parameter for the call (a tensor-parallel
    module's DTensor views, worker/tp.py [Note: local parameters, DTensor forward])
    and drop it after; the recomputation runs ``forward`` alone, so it would see the
    local shard where the forward saw the whole tensor. The forward's own views go
    back for it: the same tensors, so what it saves matches."""
    shadows = {n: v for n, v in vars(module).items() if n in module._parameters}
    if not shadows:
        return run

    def again(*args: Any, **kwargs: Any) -> Any:
        missing = [n for n in shadows if n not in vars(module)]
        vars(module).update({n: shadows[n] for n in missing})
        try:
            return run(*args, **kwargs)
        finally:
            for n in missing:
                vars(module).pop(n, None)

    return again


def unwrap(modules: list[nn.Module]) -> None:
    """Undo :func:`checkpoint_modules`."""
    for module in modules:
        vars(module).pop("forward", None)


def without_kv_cache(root: nn.Module) -> int:
    """Have every transformers model in ``root`` make no key/value cache in a training
    forward (a call that sets ``use_cache`` keeps its own); returns how many it hooked.

    [Note: no cache under recomputation]
    A transformers decoder whose config says ``use_cache`` makes a key/value cache
    in every forward and appends each layer's keys and values to it. A checkpointed
    layer runs again in backward and appends them again: its attention then sees
    twice the keys, which eager attention refuses against its mask ("the size of
    tensor a (24) must match the size of tensor b (12)", a Qwen2 at any stage with
    ``activation_checkpointing``) and sdpa's causal attention silently accepts
    (the duplicates weigh as one key each: a Llama trained right by luck).
    transformers' own gradient checkpointing turns the cache off for training; the
    engine does the same where it recomputes (activation checkpointing, context
    parallelism's attention), with a forward pre-hook on each transformers model it
    holds (the model may be the root or inside a module of the script's), so the
    config stays the user's and ``generate`` keeps its cache."""
    hooked = 0
    for m in root.modules():
        config = getattr(m, "config", None)
        if getattr(config, "use_cache", False) and _takes_use_cache(type(m)):
            m.register_forward_pre_hook(_no_cache, with_kwargs=True)
            hooked += 1
    return hooked


def _no_cache(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if module.training and torch.is_grad_enabled() and "use_cache" not in kwargs:
        kwargs = {**kwargs, "use_cache": False}
    return args, kwargs


@functools.cache
def _takes_use_cache(cls: type) -> bool:
    try:
        return "use_cache" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


class SavedBytes:
    """Counts the bytes autograd keeps for backward ([Note: saved-activation bytes])."""

    def __init__(self, params: Callable[[], set[int]], *, offload: bool = False) -> None:
        self._params = params  # ids (``_cdata``) of the parameters' storages
        self.last = 0  # bytes kept by the last measured forward
        self._calls = 0
        # [Note: saved activations in host memory]: ZeroConfig.offload_activations
        self.offload = offload

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Count this forward, if it is one to measure; move what it saves to host
        memory, where ``offload`` says.

        [Note: saved activations in host memory]
        With ``offload`` every tensor autograd saves outside the checkpointed
        regions (whose own hooks keep only their inputs: with activation
        checkpointing, what is saved is each unit's input) and that lives on an
        accelerator is copied to pinned host memory when saved and back when the
        backward reads it; parameters stay (they are the engine's). torch uses
        the innermost pair of saved-tensor hooks only, so measuring and offloading
        are one pair. On the CPU there is nothing to move."""
        self._calls += 1
        measure = self._calls == 1 or self._calls % MEASURE_EVERY == 0
        if not (measure or self.offload):
            yield
            return
        skip = self._params() if measure else set()
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> Any:
            if measure:
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in skip and key not in seen:
                    seen[key] = storage.nbytes()
            if self.offload and t.device.type != "cpu" and not isinstance(t, nn.Parameter):
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                return t.device, host.copy_(t, non_blocking=True)
            return t

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, tuple):
                device, host = packed
                return host.to(device, non_blocking=True)
            return packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
        if measure:
            self.last = sum(seen.values())
