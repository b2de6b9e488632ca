"""A model built on the meta device comes to life on its rank's device, a module at a time.

[Note: birth on the meta device]
ZeRO-3 holds 16Ψ/N bytes of model state per rank once it trains, but a model
that the script builds whole first costs every rank the full model, and the
flat buffers made from it, before the first step: a floor that does not fall
with N. A model built under ``torch.device("meta")`` holds no values, so the
engine brings it to life itself, one module at a time (:class:`Birth`):

1. the module's own meta parameters and buffers (``recurse=False``) get
   storage on the rank's device, the same ``Parameter`` objects
   (``torch.utils.swap_tensors``: the optimizer and the inventory still hold
   them);
2. they are initialized: by the module's ``reset_parameters()`` (FSDP2's
   convention), in ``model.modules()`` order, or by the script's
   ``init(module)`` in ``model.apply(init)``'s order (:class:`Birth` says why
   two orders); every rank draws from its default generator exactly as the
   construction it reproduces would, so a model whose construction
   initializes only through ``reset_parameters`` (torch's own layers) gets
   the values an ordinary construction with the same seed gives, at every
   world size and stage, and one initialized by ``model.apply(fn)`` after
   construction gets that with ``init=fn``;
3. rank 0's values reach every rank (a broadcast of that module's tensors, as
   the ordinary path broadcasts the whole model once);
4. every bucket whose parameters all came to life is built at once: this rank
   keeps its shard (stage 3) or the bucket's flat buffer (stages 0-2), and the
   parameter's own storage goes.

So a rank holds at most the buckets built so far plus the parameters of the
buckets still waiting for a module: at stage 3 its shard of the model and
about one gather unit (two where a unit's modules are apart in module order,
as the root's embedding and head are). A module that holds meta tensors but
has neither ``init`` nor ``reset_parameters`` is an error naming the tensor
before anything is allocated, and so is a meta tensor left afterwards: never
a silent model of uninitialized memory.

``init`` and ``reset_parameters`` must initialize only the module's own
tensors (``recurse=False``); each is called once per module.

A module whose parameters are slices of larger ones (tensor parallelism)
initializes on the whole tensors and keeps its slices (:class:`SlicedInit`,
worker/tp.py [Note: birth under tensor parallelism]).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = [
    "Birth",
    "Init",
    "SlicedInit",
    "default_device",
    "materialize_empty",
    "meta_names",
    "meta_parameters",
    "place_module",
    "placeholder",
    "release_freed_host_memory",
    "skip_init",
]

logger = logging.getLogger(__name__)

B = TypeVar("B")


@dataclass(frozen=True, slots=True)
class SlicedInit:
    """How a model whose modules hold slices of their parameters comes to life
    (tensor parallelism: worker/mesh.py builds it): each module initializes as
    ``init`` says (a function of the module, or None for its
    ``reset_parameters()``, as for any model) while ``whole(module)`` holds its
    whole tensors in place of the slices, and keeps its slices on the way out
    (worker/tp.py [Note: birth under tensor parallelism])."""

    init: Callable[[nn.Module], None] | None
    whole: Callable[[nn.Module], AbstractContextManager[None]]


Init = Callable[[nn.Module], None] | SlicedInit


def skip_init(module: nn.Module) -> None:
    """``init=skip_init``: leave the tensors that come to life uninitialized, for
    weights that a file brings next (``engine.load_weights``, ``worker.from_pretrained``):
    nothing is drawn, nothing is broadcast."""


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Build a model whose parameters never exist whole: every parameter a module
    registers inside this context is put on the meta device (one at a time, as it
    is registered), while buffers keep the values the constructors computed (a
    rotary embedding's ``inv_freq``, which the meta device would lose). The
    engine brings the parameters to life sharded ([Note: birth on the meta
    device]), each module's ``reset_parameters()`` (or ``init``) giving the values
    an ordinary construction would; values a constructor set any other way are
    not kept, so such a module needs ``init``.

        with worker.meta_parameters():
            model = MyModel(cfg)
        engine = worker.initialize(model, optimizer, config=...)

    It uses torch's own hook for parameter registration, removed on exit.

    Why not DeepSpeed's ``zero.Init``, partitioning each module as its ``__init__``
    ends: the shard layout needs the whole inventory (every parameter's group,
    gather unit and place in a bucket), known only once the model is built, so
    values kept until then would be the whole model; and it wraps every module
    class's constructor. Here nothing exists but each parameter for the instant of
    its registration, and the engine partitions once the layout is known."""

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> Any:
        if param is None or param.is_meta:
            return None
        return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    handle = nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


def meta_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s parameters and buffers that are on the meta device."""
    tensors = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    return [name for name, t in tensors if t.is_meta]


def default_device(device: torch.device | str | None = None) -> torch.device:
    """Where a model with no device of its own lives: ``device`` if given, else the
    launcher's local rank's GPU (``cuda:$LOCAL_RANK``, as ``deepspeed.initialize``
    places a model) when CUDA is there, else the CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def placeholder(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of ``t``'s shape and dtype on ``device`` that holds one element: for
    a parameter whose values a transfer or a checkpoint brings, not its module."""
    return torch.empty(1, dtype=t.dtype, device=device).expand(t.shape)


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


def release_freed_host_memory() -> None:
    """Hand the host memory freed since the last call back to the system.

    [Note: freed host memory]
    glibc serves a multi-MiB allocation from its heap once one of that size was
    freed (its mmap threshold rises to it), and keeps what is freed there: a
    model coming to life on the CPU frees a module's tensors as each bucket
    takes them, and without this the resident set kept every freed module
    (bench/birth.py, N=8, 38M parameters: 237 MiB through birth and 378 MiB
    through the first step, an ordinary construction's 380, against 157 and
    229 with the threshold fixed). ``malloc_trim`` returns the free pages."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _as_it_is(module: nn.Module) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


def _swap(p: nn.Parameter, values: torch.Tensor) -> None:
    torch.utils.swap_tensors(p, nn.Parameter(values, requires_grad=p.requires_grad))


def _post_order(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """``module.apply``'s order: each module after its children (each module once)."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(mod: nn.Module, name: str) -> None:
        if id(mod) in seen:
            return
        seen.add(id(mod))
        for child_name, child in mod.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)
        out.append((name, mod))

    visit(module, prefix)
    return out


class Birth:
    """Bring ``module``'s meta tensors to life on ``device`` ([Note: birth on the meta
    device]). ``broadcast(tensors)`` gives every rank rank 0's values; ``cast(module)``
    applies mixed precision to a module's frozen parameters once initialized.

    Two orders, each that of the construction it reproduces:
    - ``reset_parameters`` (no ``init``): ``model.modules()`` order, as each module
      initialized itself when it was built; a weight tied between modules is its
      first holder's, and the later holders draw into a throwaway tensor, as an
      ordinary construction's ``b.weight = a.weight`` discards what ``b`` drew;
    - ``init``: ``model.apply(init)``'s order (children before their parent), as
      scripts run it after building (Hugging Face's ``post_init``, nanoGPT's
      ``self.apply(self._init_weights)``); every holder of a tied weight writes it.
      Each module's ``reset_parameters()`` runs first, on a forked generator, for
      the values construction gives and ``init`` leaves alone (a norm's ones and
      zeros); the default generator's draws are ``init``'s alone. So a model gets
      exactly what "build, seed, ``model.apply(init)``" gives.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        device: torch.device,
        init: Init | None = None,
        broadcast: Callable[[list[torch.Tensor]], None] = lambda tensors: None,
        cast: Callable[[nn.Module], None] = lambda module: None,
    ) -> None:
        self.whole: Callable[[nn.Module], AbstractContextManager[None]] = _as_it_is
        if isinstance(init, SlicedInit):
            self.whole, init = init.whole, init.init
        self.module, self.device, self.init = module, device, init
        self.broadcast, self.cast = broadcast, cast
        order = module.named_modules() if init is None else _post_order(module)
        self._rng_devices = [device] if device.type == "cuda" else []
        # the modules to initialize, in order; each meta parameter's first holder and
        # how many of its holders must initialize before it has its values
        self.pending: list[tuple[str, nn.Module]] = []
        self.first: dict[nn.Parameter, nn.Module] = {}
        self.writers: dict[nn.Parameter, int] = {}
        # (a stage-3 parameter may be sharded by the time a later holder initializes)
        self.shapes: dict[nn.Parameter, tuple[torch.Size, torch.dtype]] = {}
        for name, mod in order:
            own = [
                *mod.named_parameters(recurse=False, remove_duplicate=False),
                *mod.named_buffers(recurse=False, remove_duplicate=False),
            ]
            meta = [n for n, t in own if t.is_meta]
            if not meta:
                continue
            if init is None and not callable(getattr(mod, "reset_parameters", None)):
                where = f"{name}.{meta[0]}" if name else meta[0]
                raise ValueError(
                    f"{where!r} is on the meta device and its module "
                    f"({type(mod).__name__}) has no reset_parameters(): pass "
                    "worker.initialize(..., init=fn), fn(module) initializing a module's "
                    "own parameters and buffers, or build that module with values"
                )
            self.pending.append((name, mod))
            for p in dict.fromkeys(mod.parameters(recurse=False)):
                if p.is_meta:
                    self.first.setdefault(p, mod)
                    self.shapes[p] = (p.shape, p.dtype)
                    self.writers[p] = 1 if init is None else self.writers.get(p, 0) + 1

    def build(
        self,
        specs: Sequence[object],
        params_of: Callable[[object], list[nn.Parameter]],
        build: Callable[[object], B],
    ) -> list[B]:
        """Initialize every pending module in order and ``build`` each of ``specs``
        (in any order, returned in theirs) as soon as its ``params_of`` all have
        their values."""
        built: dict[int, B] = {}
        waiting: list[int] = []
        specs_of: dict[nn.Parameter, list[int]] = {}
        for i, spec in enumerate(specs):
            unready = [q for q in dict.fromkeys(params_of(spec)) if q in self.writers]
            waiting.append(len(unready))
            for q in unready:
                specs_of.setdefault(q, []).append(i)
            if not unready:  # parameters that were never meta
                built[i] = build(spec)
        for name, mod in self.pending:
            freed = False
            for q in self._bring_to_life(name, mod):
                for i in specs_of.get(q, ()):
                    waiting[i] -= 1
                    if waiting[i] == 0:
                        built[i] = build(specs[i])
                        freed = True
            if freed and self.device.type == "cpu":
                release_freed_host_memory()  # [Note: freed host memory]
        self.pending = []
        left = meta_names(self.module)
        if left:
            raise RuntimeError(f"still on the meta device after initialization: {left[:8]}")
        return [built[i] for i in range(len(specs))]

    def _bring_to_life(self, name: str, mod: nn.Module) -> list[nn.Parameter]:
        """Initialize ``mod``'s own tensors; the parameters that now have their values."""
        params = mod._parameters
        mine = [p for p in dict.fromkeys(mod.parameters(recurse=False)) if p in self.writers]
        throwaway: dict[str, nn.Parameter] = {}  # tied weights an earlier holder initialized
        with torch.no_grad():
            for key, p in params.items():
                if p is None or p not in self.writers:
                    continue
                if p.is_meta:
                    _swap(p, torch.empty_like(p, device=self.device))
                elif self.first[p] is not mod:
                    throwaway[key] = p
                    shape, dtype = self.shapes[p]
                    params[key] = nn.Parameter(torch.empty(shape, dtype=dtype, device=self.device))
            for key, b in mod._buffers.items():
                if b is not None and b.is_meta:
                    mod._buffers[key] = torch.empty_like(b, device=self.device)
            drawn = self.init is not skip_init  # values worth sending to the other ranks
            with self.whole(mod) if drawn else contextlib.nullcontext():
                reset = getattr(mod, "reset_parameters", None)
                try:
                    if self.init is None:
                        mod.reset_parameters()
                    elif callable(reset) and drawn:
                        # the values construction gave (a norm's ones), drawn aside: the
                        # default generator's draws are init's alone, as in model.apply(init)
                        with torch.random.fork_rng(devices=self._rng_devices):
                            reset()
                finally:
                    params.update(throwaway)
                if self.init is not None:
                    self.init(mod)
            born = []
            for p in mine:
                if self.init is None and self.first[p] is not mod:
                    continue
                self.writers[p] -= 1
                if self.writers[p] == 0:
                    born.append(p)
            self.broadcast([*(born if drawn else ()), *(b for b in mod.buffers(recurse=False))])
            self.cast(mod)
        logger.debug("initialized %s (%s)", name or "the root module", type(mod).__name__)
        return born


def materialize_empty(module: nn.Module, device: torch.device) -> None:
    """Give ``module``'s meta parameters placeholders on ``device`` and its meta buffers
    storage (uninitialized): for a rank whose values come from its peers or a
    checkpoint, never from the module."""
    with torch.no_grad():
        for p in dict.fromkeys(module.parameters()):
            if p.is_meta:
                _swap(p, placeholder(p, device))
        for mod in module.modules():
            for key, b in mod._buffers.items():
                if b is not None and b.is_meta:
                    mod._buffers[key] = torch.empty_like(b, device=device)


def _launcher_gpu() -> bool:
    """Whether a launcher named this process's local rank on a machine with CUDA."""
    return "LOCAL_RANK" in os.environ and torch.cuda.is_available()


def place_module(module: nn.Module, device: torch.device | str | None = None) -> torch.device:
    """The device ``module`` trains on, moving it there when it must move.

    ``device`` given: there (the module's tensors that have values move to it).
    Otherwise a module on the CPU goes to ``cuda:$LOCAL_RANK`` when a launcher named
    a local rank and CUDA is there, as ``deepspeed.initialize`` does; a module on
    another device stays; a module wholly on the meta device lives where
    :func:`default_device` says (it comes to life there, [Note: birth on the meta
    device])."""
    devices = {t.device for t in module.parameters() if not t.is_meta}
    if len(devices) > 1:
        raise ValueError(
            f"the model's parameters are on several devices: {sorted(map(str, devices))}"
        )
    here = devices.pop() if devices else None
    if device is not None:
        target = torch.device(device)
    elif here is None or (here.type == "cpu" and _launcher_gpu()):
        target = default_device()
    else:
        return here
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    if here is not None and here != target:
        module._apply(lambda t: t if t.is_meta else t.to(target))
        logger.info("moved the model from %s to %s", here, target)
    return target
