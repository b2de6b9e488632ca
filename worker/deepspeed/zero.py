"""``deepspeed.zero``: ``Init`` and ``GatheredParameters`` as DeepSpeed scripts use them.

    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = Model()                 # no rank ever holds it whole
    engine, *_ = deepspeed.initialize(model=model, ...)
    with deepspeed.zero.GatheredParameters(model.head.weight, modifier_rank=0):
        if rank == 0:
            model.head.weight.mul_(0.5)  # kept: rank 0's values reach every rank's shard

[Note: zero.Init and GatheredParameters]
``Init`` is zeroplane's birth on the meta device (worker/birth.py
``meta_parameters``): every parameter is put on the meta device as it is
registered, and the engine brings the model to life sharded, each module's
``reset_parameters()`` giving the values an ordinary construction with the same
seed gives (DeepSpeed partitions each module as its constructor ends; zeroplane
partitions once the layout is known, [Note: birth on the meta device]). Values a
constructor sets any other way (``model.apply(init)`` after it) are not kept: such
a model is built without ``Init``, or given ``init=`` through worker.initialize.

``GatheredParameters(params, modifier_rank=None)`` gives the parameters of an
engine that ``deepspeed.initialize`` made their full values for the block (the
engine's ``gathered_params``: a collective, every rank enters; at stages 0-2 they
are whole anyway). With ``modifier_rank=r``, what rank r wrote into them in the
block is broadcast from r and becomes every rank's state on exit: the fp32
masters of the parameters named (their optimizer state kept) and the compute
copies. Parameters no engine holds are left as they are, as DeepSpeed leaves
parameters that are not partitioned, and rank r's values are broadcast if a
process group exists. A parameter still on the meta device (built under ``Init``,
before ``initialize``) has no values to gather: an error says so.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from worker.birth import meta_parameters
from worker.entries import export_entries

__all__ = ["ENGINES", "GatheredParameters", "Init", "register_external_parameter"]

# The engines deepspeed.initialize made (worker/deepspeed/__init__.py), for
# GatheredParameters to find a parameter's engine.
ENGINES: weakref.WeakSet = weakref.WeakSet()


class Init(contextlib.ContextDecorator):
    """Build the model on the meta device; the engine brings it to life sharded
    ([Note: zero.Init and GatheredParameters]). DeepSpeed's arguments are accepted;
    ``enabled=False`` builds the model as usual."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        **kwargs: Any,
    ) -> None:
        if module is not None:
            raise ValueError(
                "zero.Init(module=...) partitions a model built already; zeroplane's engine "
                "shards it at deepspeed.initialize: pass the model there"
            )
        self.enabled = enabled
        self._context: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> Init:
        if self.enabled:
            self._context = meta_parameters()
            self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)
            self._context = None


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Nothing to do: zeroplane's stage 3 finds which gather unit uses a parameter by
    watching the first forward (worker/stages.py), wherever it is registered."""


def _engine_of(params: list[torch.Tensor]) -> Any:
    ids = {id(p) for p in params}
    for engine in list(ENGINES):
        held = {id(p) for p in engine.state.inventory.params.values()}
        if ids & (held | _expert_ids(engine)):
            return engine
    return None


def _expert_ids(engine: Any) -> set[int]:
    """The parameters of the experts an expert-parallel engine holds (none without)."""
    experts = getattr(engine, "experts", None)
    return set() if experts is None else {id(p) for p in experts.inventory.params.values()}


@contextlib.contextmanager
def GatheredParameters(
    params: torch.Tensor | Iterable[torch.Tensor],
    modifier_rank: int | None = None,
    fwd_module: nn.Module | None = None,
    enabled: bool = True,
) -> Iterator[None]:
    """The parameters' full values for the block; with ``modifier_rank``, that rank's
    writes kept ([Note: zero.Init and GatheredParameters])."""
    listed = [params] if isinstance(params, torch.Tensor) else [p for p in params if p is not None]
    if not enabled or not listed:
        yield
        return
    meta = [p for p in listed if p.is_meta]
    if meta:
        raise RuntimeError(
            "zero.GatheredParameters: a parameter is still on the meta device (built under "
            "zero.Init): it has values once deepspeed.initialize has brought the model to "
            "life; gather it after that"
        )
    engine = _engine_of(listed)
    if engine is None:
        yield
        if modifier_rank is not None and dist.is_initialized():
            with torch.no_grad():
                for p in listed:
                    dist.broadcast(p.data, src=modifier_rank)
        return
    if modifier_rank is not None and {id(p) for p in listed} & _expert_ids(engine):
        raise ValueError(
            "zero.GatheredParameters(modifier_rank=...) over experts split by expert "
            "parallelism: their writes would not be kept; change them before "
            "deepspeed.initialize, or load them with engine.load_weights"
        )
    with engine.gathered_params():
        yield
        if modifier_rank is None:
            return
        names = {id(p): name for name, p in engine.state.inventory.params.items()}
        written = {names[id(p)]: p.detach().clone() for p in listed if id(p) in names}
    _keep(engine, written, modifier_rank)


def _keep(engine: Any, written: dict[str, torch.Tensor], source: int) -> None:
    """``source``'s full values of ``written`` become every rank's: broadcast, then the
    masters of the ranges this rank owns (optimizer state kept) and frozen tensors."""
    state = engine.state
    comm = state.comm
    with torch.no_grad():
        for value in written.values():
            comm.broadcast(value, src=source)
        trainable = set(state.inventory.trainable)
        for name, value in written.items():
            if name not in trainable:
                state.inventory.params[name].copy_(value)
        if not trainable & set(written):
            return
        owned = state.owned()
        entries = export_entries(state.optimizer, owned, state.rank)
        for rng in owned:
            if rng.name in written:
                flat = written[rng.name].reshape(-1).to(torch.float32)
                entries[rng.key]["master"] = flat[rng.start : rng.stop].clone()
    state.import_ranges(entries)
