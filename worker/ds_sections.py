"""The optimizer and learning-rate schedule that a DeepSpeed config's ``optimizer``
and ``scheduler`` sections describe, built as torch objects.

``worker.initialize(model, config=ds_config)`` builds them as
``deepspeed.initialize(model=model, config=ds_config)`` does, when the script
passes no optimizer or scheduler of its own.

[Note: DeepSpeed's schedules as torch schedulers]
DeepSpeed's schedules (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``,
``LRRangeTest``, ``OneCycle``) are plain objects counting
``last_batch_iteration`` from -1; construction sets the rate of iteration -1
and each ``step()`` moves one iteration on. Here each is a torch
``LRScheduler`` whose rates are a closed-form function of that iteration,
which is torch's ``last_epoch - 1`` (torch steps once when it constructs a
scheduler). The rates are DeepSpeed's step for step (tested against its
classes), and the engine steps, saves and seeks them like any torch scheduler
(worker/schedule.py). A name that is not one of DeepSpeed's is looked up in
``torch.optim.lr_scheduler``, as DeepSpeed does.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = [
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "optimizer_from_deepspeed",
    "scheduler_from_deepspeed",
]

# DeepSpeed's own optimizers, which have no torch counterpart here
_NOT_HERE = ("lamb", "onebitadam", "zerooneadam", "onebitlamb", "lion", "muadam", "muadamw",
             "musgd", "muon")  # fmt: skip


def _section(section: Any, name: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(section, Mapping) or not isinstance(section.get("type"), str):
        raise ValueError(f"DeepSpeed config: {name!r} must be an object with a string 'type'")
    unknown = sorted(set(section) - {"type", "params"})
    if unknown:
        raise ValueError(f"DeepSpeed config: {name!r} has unknown keys {unknown}")
    params = section.get("params") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"DeepSpeed config: {name}.params must be an object")
    auto = sorted(k for k, v in params.items() if v == "auto")
    if auto:
        raise ValueError(
            f'DeepSpeed config: {name}.params {auto} are "auto" (Hugging Face\'s trainer '
            f"fills them in): give their values, or pass your own {name} to worker.initialize"
        )
    return section["type"], dict(params)


def _construct(cls: type, first: Any, params: dict[str, Any], where: str) -> Any:
    """``cls(first, **params)``, naming ``where`` and the key when a key is not
    one of ``cls``'s parameters or its value is refused."""
    accepted = inspect.signature(cls).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        unknown = sorted(set(params) - set(accepted))
        if unknown:
            raise ValueError(f"DeepSpeed config: {where} does not take {unknown}")
    try:
        return cls(first, **params)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"DeepSpeed config: {where}: {exc}") from exc


def optimizer_from_deepspeed(
    section: Mapping[str, Any], params: Iterable[torch.nn.Parameter] | Iterable[dict]
) -> torch.optim.Optimizer:
    """The optimizer of a DeepSpeed ``optimizer`` section, over ``params``.

    ``Adam`` and ``AdamW`` (any case) are torch's: ``AdamW``, or ``Adam`` with
    ``adam_w_mode`` true (DeepSpeed's default) is ``torch.optim.AdamW``, and
    ``weight_decay`` defaults to 0 as in DeepSpeed's FusedAdam (torch's AdamW
    would take 0.01). ``torch_adam`` is accepted (the optimizer is torch's
    anyway); ``bias_correction: false`` is refused (torch's Adam always
    corrects). ``Adagrad`` is ``torch.optim.Adagrad``; any other name is looked
    up in ``torch.optim``, as DeepSpeed does. DeepSpeed's own optimizers
    (Lamb, 1-bit Adam, Lion, ...) are refused: pass a torch optimizer instead.
    """
    kind, kwargs = _section(section, "optimizer")
    where = f"optimizer {kind!r}"
    if "max_grad_norm" in kwargs:
        raise ValueError(
            f"DeepSpeed config: {where}: 'max_grad_norm' is not an optimizer parameter; "
            "use the top-level 'gradient_clipping'"
        )
    name = kind.lower()
    if name in ("adam", "adamw"):
        kwargs.pop("torch_adam", None)
        adam_w_mode = kwargs.pop("adam_w_mode", True)
        if not kwargs.pop("bias_correction", True):
            raise ValueError(f"DeepSpeed config: {where}: bias_correction false is not supported")
        kwargs.setdefault("weight_decay", 0.0)
        cls = torch.optim.AdamW if name == "adamw" or adam_w_mode else torch.optim.Adam
        return _construct(cls, params, kwargs, where)
    if name == "adagrad":
        return _construct(torch.optim.Adagrad, params, kwargs, where)
    if name in _NOT_HERE:
        raise ValueError(
            f"DeepSpeed config: {where} is one of DeepSpeed's own optimizers, which zeroplane "
            "does not have; pass a torch optimizer to worker.initialize instead"
        )
    cls = getattr(torch.optim, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(
            f"DeepSpeed config: unknown optimizer type {kind!r}: Adam, AdamW, Adagrad or "
            "the name of a torch.optim optimizer"
        )
    return _construct(cls, params, kwargs, where)


def scheduler_from_deepspeed(
    section: Mapping[str, Any],
) -> Callable[[torch.optim.Optimizer], LRScheduler]:
    """What builds the schedule of a DeepSpeed ``scheduler`` section from the
    optimizer ([Note: DeepSpeed's schedules as torch schedulers])."""
    kind, kwargs = _section(section, "scheduler")
    cls = _SCHEDULES.get(kind) or getattr(torch.optim.lr_scheduler, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, LRScheduler)):
        raise ValueError(
            f"DeepSpeed config: unknown scheduler type {kind!r}: one of "
            f"{sorted(_SCHEDULES)} or the name of a torch.optim.lr_scheduler class"
        )
    if kind in _SCHEDULES and kwargs.pop("last_batch_iteration", -1) != -1:
        raise ValueError(
            f"DeepSpeed config: scheduler {kind!r}: last_batch_iteration must be -1 (the "
            "engine puts the schedule at its own step when it restores a checkpoint)"
        )
    return lambda optimizer: _construct(cls, optimizer, kwargs, f"scheduler {kind!r}")


# ---------------------------------------------------------------------------- the schedules


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[float]:
    """One value per param group: a list of that length, or one value for all."""
    groups = len(optimizer.param_groups)
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != groups:
            raise ValueError(f"expected {groups} values of {name}, got {len(value)}")
        return [float(v) for v in value]
    return [float(value)] * groups


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _warmup_type(value: Any) -> str:
    if value not in ("log", "linear"):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {value!r}")
    return value


def _warmup(it: int, steps: int, kind: str) -> float:
    """DeepSpeed's warmup fraction at iteration ``it`` of ``steps``: log or linear."""
    return math.log(it + 1) / math.log(steps) if kind == "log" else it / steps


class _DeepSpeedSchedule(LRScheduler):
    """Rates as a function of DeepSpeed's iteration ``it`` (-1 before the first step)."""

    def rates(self, it: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self.rates(self.last_epoch - 1)

    def _get_closed_form_lr(self) -> list[float]:
        return self.get_lr()


class WarmupLR(_DeepSpeedSchedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` (default: the optimizer's rates)
    over ``warmup_num_steps``, logarithmically or linearly, then flat."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
    ) -> None:
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.warmup_type = _warmup_type(warmup_type)
        super().__init__(optimizer)

    def gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return _warmup(it, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def rates(self, it: int) -> list[float]:
        if it < 0:
            return list(self.min_lrs)
        g = self.gamma(it)
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then a linear decay to 0 at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
    ) -> None:
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return super().gamma(it)
        remaining = self.total_num_steps - self.warmup_num_steps
        return max(0.0, (self.total_num_steps - it) / max(1.0, remaining))


class WarmupCosineLR(_DeepSpeedSchedule):
    """The optimizer's rates times a ratio that warms up from ``warmup_min_ratio``
    to 1 over ``warmup_num_steps``, then follows a cosine down to
    ``cos_min_ratio`` at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
    ) -> None:
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        self.warmup_min_ratio, self.cos_min_ratio = float(warmup_min_ratio), float(cos_min_ratio)
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.warmup_type = _warmup_type(warmup_type)
        super().__init__(optimizer)

    def ratio(self, it: int) -> float:
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            r = _warmup(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + r * (1.0 - self.warmup_min_ratio)
        done = it - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def rates(self, it: int) -> list[float]:
        return [base * self.ratio(it) for base in self.base_lrs]


class LRRangeTest(_DeepSpeedSchedule):
    """From ``lr_range_test_min_lr`` up by ``lr_range_test_step_rate`` every
    ``lr_range_test_step_size`` steps (in stairs, or continuously)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
    ) -> None:
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate, self.staircase = (
            float(lr_range_test_step_rate),
            bool(lr_range_test_staircase),
        )
        super().__init__(optimizer)

    def rates(self, it: int) -> list[float]:
        interval = (it + 1) / self.step_size
        increase = 1 + self.step_rate * (math.floor(interval) if self.staircase else interval)
        return [lo * increase for lo in self.min_lrs]


class OneCycle(_DeepSpeedSchedule):
    """One cycle from ``cycle_min_lr`` up to ``cycle_max_lr`` and back (in stairs if
    counts are given), then a decay by ``decay_lr_rate`` every
    ``decay_step_size`` steps; with ``cycle_momentum`` (and an optimizer with
    ``betas``) the first beta cycles the other way, between ``cycle_max_mom``
    and ``cycle_min_mom``, and the second is set to 0.99, as DeepSpeed does."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
    ) -> None:
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0 or second < 0:
            raise ValueError(
                "cycle_first_step_size must be positive and cycle_second_step_size not "
                f"negative, got {cycle_first_step_size!r} and {cycle_second_step_size!r}"
            )
        self.first, self.second, self.total = first, second, first + second
        self.first_stairs = cycle_first_stair_count
        self.second_stairs = (
            cycle_first_stair_count
            if cycle_second_stair_count is None
            else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        no_decay = math.isclose(decay_step_size, 0)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = no_decay or math.isclose(self.decay_lr_rate, 0)
        self.cycle_momentum = bool(cycle_momentum) and "betas" in optimizer.defaults
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        self.decay_mom_rate = float(decay_mom_rate)
        self.skip_mom_decay = no_decay or math.isclose(self.decay_mom_rate, 0)
        super().__init__(optimizer)

    def _scale(self, it: int) -> float:
        done = it + 1
        x = 1.0 + done / self.total - math.floor(1 + done / self.total)
        ratio = self.first / self.total
        if x <= ratio:
            scale, stairs = x / ratio, self.first_stairs
        else:
            scale, stairs = (x - 1) / (ratio - 1), self.second_stairs
        if stairs > 0:
            at = done % self.total
            position = at if at <= self.first else self.total - at
            size = self.first if at <= self.first else self.second
            scale = math.floor(position * stairs / size) / stairs
        return scale

    def rates(self, it: int) -> list[float]:
        if it < self.total:
            scale = self._scale(it)
            return [
                lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)
            ]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * (it - self.total + 1) / self.decay_step_size
        return [lo / factor for lo in self.min_lrs]

    def momenta(self, it: int) -> list[float]:
        if it < 0:
            return list(self.min_moms)
        if it < self.total:
            scale = self._scale(it)
            return [
                hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms, strict=True)
            ]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * (it - self.total + 1) / self.decay_step_size
        return [hi * factor for hi in self.max_moms]

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        if self.cycle_momentum:
            for group, beta in zip(
                self.optimizer.param_groups, self.momenta(self.last_epoch - 1), strict=True
            ):
                group["betas"] = (beta, 0.99)


_SCHEDULES: dict[str, type[LRScheduler]] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, LRRangeTest, OneCycle)
}
