"""The autotuner's search: which configurations to measure, and which not to.

``zeroplane tune`` looks for the fastest configuration of one model on N ranks
over stage x micro-batch x gradient accumulation x activation checkpointing x
bucket size x compression x (at stage 3) units kept gathered into backward.
Measuring costs a short training run per
configuration, so the search is built to measure few:

1. **Prune with the memory model before running anything.** A configuration
   whose estimated bytes per rank (the planner's model states for its stage,
   plus activations per sample x micro-batch, plus compression residuals)
   exceed the usable device memory is never run; the table says why. This is
   DeepSpeed's autotuner's "fast mode": a profile of the model (its element
   count and what backward keeps per sample, with and without activation
   checkpointing) is all the estimate needs, and the profile comes from the
   first measured runs.
2. **Coordinate descent from a memory-model start.** The start is the lowest
   stage that fits without checkpointing (the least communication) at the
   largest micro-batch that fits there. A pass visits each dimension with
   the others fixed. Ordered ones (micro-batch, accumulation, bucket size)
   step to the next value up, or else down, while that is faster: throughput
   changes smoothly along them, so the far values need no run. Categorical
   ones (stage, activation checkpointing, compression, kept units) try every
   value. These
   are also the memory levers: a value that frees memory is tried at the
   largest micro-batch it lets fit too (the memory model's ordering), and a
   value that does not fit is repaired, by the largest micro-batch that fits
   or the lowest higher stage that does, rather than dropped; so the search
   does not stall at a micro-batch chosen under another lever. A move needs
   to beat the incumbent by the noise margin (3%). Passes repeat until one
   moves nothing or the budget is spent; every measurement is kept, and the
   answer is the fastest configuration measured.

The measurement is a function (:data:`Measure`): ``zeroplane tune`` passes
short runs on a pool of worker processes (worker/trials.py); tests pass
synthetic cost models and recorded grids. Torch-free.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from coordinator.core.memory import DTYPE_BYTES
from coordinator.core.planner import PlanConfig, estimate_memory, format_bytes

__all__ = [
    "COMPRESSIONS",
    "KEEP_ALL_UNITS",
    "Candidate",
    "Measure",
    "Measurement",
    "MemoryModel",
    "ModelProfile",
    "TrialRecord",
    "TuneResult",
    "TuneSpace",
    "render_trials",
    "tune",
]

logger = logging.getLogger(__name__)

COMPRESSIONS = ("none", "bf16", "fp16", "int8", "onebit")
# dimensions whose values change the memory a rank needs: a value that frees memory
# lets a larger micro-batch fit (compression: its error-feedback residual)
_LEVERS = ("stage", "activation_checkpointing", "compression", "keep_units")

# ZeroConfig.stage3_max_reuse_distance of a candidate that keeps every unit gathered
# from its forward into its backward (DeepSpeed's default)
KEEP_ALL_UNITS = 10**9


@dataclass(frozen=True, kw_only=True, order=True)
class Candidate:
    """One configuration the tuner may measure."""

    stage: int
    micro_batch: int
    grad_accum: int = 1
    activation_checkpointing: bool = False
    bucket_numel: int = 2**22
    compression: str = "none"
    # stage 3: every unit stays gathered from its forward into its backward (one
    # all-gather per step less each, the compute parameters held meanwhile); at
    # stages 0-2 there is nothing to keep, and it reads False
    keep_units: bool = False

    def __post_init__(self) -> None:
        if self.stage != 3:
            object.__setattr__(self, "keep_units", False)

    def zero_config(self, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The ``ZeroConfig`` fields of this candidate over ``base``'s."""
        return {
            **(base or {}),
            "stage": self.stage,
            "gradient_accumulation_steps": self.grad_accum,
            "activation_checkpointing": "units" if self.activation_checkpointing else "none",
            "bucket_numel": self.bucket_numel,
            "compression": self.compression,
        } | ({"stage3_max_reuse_distance": KEEP_ALL_UNITS} if self.keep_units else {})

    def label(self) -> str:
        ac = "ac" if self.activation_checkpointing else "-"
        kept = " kept" if self.keep_units else ""
        return (
            f"stage {self.stage}{kept} mb {self.micro_batch} ga {self.grad_accum} {ac} "
            f"bucket {_count(self.bucket_numel)} {self.compression}"
        )


def _count(n: int) -> str:
    for unit, scale in (("M", 2**20), ("K", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _positive_ints(name: str, values: Sequence[int]) -> tuple[int, ...]:
    out = tuple(values)
    if not out or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in out):
        raise ValueError(f"TuneSpace.{name} must be a non-empty list of integers >= 1, got {out!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"TuneSpace.{name} has duplicates: {out!r}")
    return tuple(sorted(out))


@dataclass(frozen=True, kw_only=True)
class TuneSpace:
    """The values each dimension may take.

    global_batch: if set, only candidates with ``micro_batch x grad_accum x
    world_size == global_batch`` (training computes the same thing whichever
    is chosen); otherwise every combination, compared by samples per second.
    """

    stages: tuple[int, ...] = (0, 1, 2, 3)
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    grad_accum: tuple[int, ...] = (1,)
    activation_checkpointing: tuple[bool, ...] = (False, True)
    bucket_numels: tuple[int, ...] = (2**20, 2**22, 2**24)
    compressions: tuple[str, ...] = ("none",)
    keep_units: tuple[bool, ...] = (False,)
    global_batch: int | None = None

    def __post_init__(self) -> None:
        stages = tuple(sorted(set(self.stages)))
        if not stages or any(s not in (0, 1, 2, 3) for s in stages):
            raise ValueError(f"TuneSpace.stages must be among 0-3, got {self.stages!r}")
        object.__setattr__(self, "stages", stages)
        for name in ("micro_batches", "grad_accum", "bucket_numels"):
            object.__setattr__(self, name, _positive_ints(name, getattr(self, name)))
        for name in ("activation_checkpointing", "keep_units"):
            flags = tuple(dict.fromkeys(getattr(self, name)))
            if not flags or any(not isinstance(v, bool) for v in flags):
                raise ValueError(
                    f"TuneSpace.{name} must be a non-empty list of bools, "
                    f"got {getattr(self, name)!r}"
                )
            object.__setattr__(self, name, tuple(sorted(flags)))
        comp = tuple(dict.fromkeys(self.compressions))
        if not comp or any(c not in COMPRESSIONS for c in comp):
            raise ValueError(
                f"TuneSpace.compressions must be among {', '.join(COMPRESSIONS)}, "
                f"got {self.compressions!r}"
            )
        object.__setattr__(self, "compressions", comp)
        if self.global_batch is not None and (
            isinstance(self.global_batch, bool)
            or not isinstance(self.global_batch, int)
            or self.global_batch < 1
        ):
            raise ValueError(
                f"TuneSpace.global_batch must be None or an integer >= 1, got {self.global_batch!r}"
            )

    def dimensions(self) -> dict[str, tuple[Any, ...]]:
        """Candidate field -> values, in the order coordinate descent visits them."""
        return {
            "micro_batch": self.micro_batches,
            "stage": self.stages,
            "activation_checkpointing": self.activation_checkpointing,
            "grad_accum": self.grad_accum,
            "bucket_numel": self.bucket_numels,
            "compression": self.compressions,
            "keep_units": self.keep_units,
        }

    def allows(self, c: Candidate, world_size: int) -> bool:
        return (
            self.global_batch is None
            or c.micro_batch * c.grad_accum * world_size == self.global_batch
        )

    def grid(self, world_size: int) -> list[Candidate]:
        """Every candidate of the space (the exhaustive search's trials, before pruning)."""
        out = [
            Candidate(
                stage=s,
                micro_batch=m,
                grad_accum=g,
                activation_checkpointing=a,
                bucket_numel=b,
                compression=c,
                keep_units=k,
            )
            for s in self.stages
            for m in self.micro_batches
            for g in self.grad_accum
            for a in self.activation_checkpointing
            for b in self.bucket_numels
            for c in self.compressions
            for k in self.keep_units
        ]
        # kept units exist at stage 3 only: the others come out once
        out = [c for c in dict.fromkeys(out) if self.allows(c, world_size)]
        if not out:
            raise ValueError(
                f"TuneSpace: no micro-batch x accumulation x {world_size} ranks makes the "
                f"global batch {self.global_batch}"
            )
        return out

    def default(self, name: str) -> Any:
        """The value a dimension starts at: the middle one (bucket), else the first."""
        values = self.dimensions()[name]
        return values[len(values) // 2] if name == "bucket_numel" else values[0]


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """What the memory model knows of the model and the machine (see the module notes).

    numel: trainable elements. activation_bytes_per_sample: what backward keeps
    per sample of a micro-batch with every activation kept;
    checkpointed_bytes_per_sample: the same with activation checkpointing.
    device_memory_bytes: one rank's memory (0: unknown, nothing is pruned).
    """

    numel: int
    world_size: int
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    optimizer_states: int = 2
    activation_bytes_per_sample: float = 0.0
    checkpointed_bytes_per_sample: float = 0.0
    device_memory_bytes: int = 0
    headroom: float = 0.1

    def __post_init__(self) -> None:
        for name in ("numel", "device_memory_bytes", "optimizer_states"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ModelProfile.{name} must be an integer >= 0, got {value!r}")
        if isinstance(self.world_size, bool) or self.world_size < 1:
            raise ValueError(f"ModelProfile.world_size must be >= 1, got {self.world_size!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"ModelProfile.dtype must be fp32, bf16 or fp16, got {self.dtype!r}")
        for name in ("activation_bytes_per_sample", "checkpointed_bytes_per_sample"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"ModelProfile.{name} must be a finite number >= 0, got {value!r}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"ModelProfile.headroom must be in [0, 1), got {self.headroom!r}")


class MemoryModel:
    """Bytes per rank of a candidate, by the planner's model-state formulas plus
    activations and compression residuals; what fits and, if not, why."""

    def __init__(self, profile: ModelProfile) -> None:
        self.profile = profile

    @property
    def usable_bytes(self) -> float:
        p = self.profile
        return p.device_memory_bytes * (1 - p.headroom)

    def estimate(self, c: Candidate) -> float:
        p = self.profile
        per_sample = (
            p.checkpointed_bytes_per_sample
            if c.activation_checkpointing
            else p.activation_bytes_per_sample
        )
        plan = PlanConfig(
            precision=p.dtype,
            optimizer_states=p.optimizer_states,
            activation_bytes=round(per_sample * c.micro_batch),
        )
        total = estimate_memory(p.numel, stage=c.stage, world_size=p.world_size, config=plan).total
        if c.compression != "none":
            # error feedback keeps an fp32 residual per gradient element this rank reduces
            total += 4 * p.numel
        if c.keep_units:
            # every unit's compute parameters, whole, from forward into backward
            total += (1 - 1 / p.world_size) * p.numel * DTYPE_BYTES[p.dtype]
        return total

    def misfit(self, c: Candidate) -> str | None:
        """Why ``c`` cannot fit (None: it fits, or the device memory is unknown)."""
        if not self.profile.device_memory_bytes:
            return None
        need, usable = self.estimate(c), self.usable_bytes
        if need <= usable:
            return None
        return f"needs {format_bytes(need)} per rank > {format_bytes(usable)} usable"


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """A short run's result: global samples per second (the objective), the bytes
    per rank it held (model state plus activations), or why it failed."""

    samples_per_s: float = 0.0
    memory_bytes: float | None = None
    error: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


Measure = Callable[[Candidate], Measurement]


@dataclass(frozen=True, kw_only=True)
class TrialRecord:
    """A row of the tuner's table: measured, failed or pruned (never run)."""

    candidate: Candidate
    status: Literal["measured", "failed", "pruned"]
    estimate_bytes: float
    samples_per_s: float | None = None
    memory_bytes: float | None = None
    reason: str = ""
    index: int | None = None  # the order measured; None when pruned


@dataclass(frozen=True, kw_only=True)
class TuneResult:
    best: Candidate | None
    best_samples_per_s: float
    records: tuple[TrialRecord, ...]
    strategy: str
    grid_size: int  # candidates in the space
    wall_s: float

    @property
    def trials(self) -> int:
        """Configurations actually run."""
        return sum(r.status != "pruned" for r in self.records)

    @property
    def pruned(self) -> int:
        return sum(r.status == "pruned" for r in self.records)

    def as_dict(self) -> dict[str, Any]:
        def cand(c: Candidate | None) -> dict[str, Any] | None:
            return None if c is None else {f.name: getattr(c, f.name) for f in fields(c)}

        return {
            "strategy": self.strategy,
            "best": cand(self.best),
            "best_samples_per_s": self.best_samples_per_s,
            "trials": self.trials,
            "pruned": self.pruned,
            "grid_size": self.grid_size,
            "wall_s": self.wall_s,
            "records": [
                {
                    "candidate": cand(r.candidate),
                    "status": r.status,
                    "estimate_bytes": r.estimate_bytes,
                    "samples_per_s": r.samples_per_s,
                    "memory_bytes": r.memory_bytes,
                    "reason": r.reason,
                    "index": r.index,
                }
                for r in self.records
            ],
        }


class _Search:
    """Memoized measurements and the trial table of one tuning run."""

    def __init__(
        self,
        memory: MemoryModel,
        measure: Measure,
        *,
        max_trials: int | None,
        deadline: float | None,
        on_trial: Callable[[TrialRecord], None] | None,
        clock: Callable[[], float],
        noise: float = 0.0,
    ) -> None:
        self.noise = noise
        self.memory = memory
        self._measure = measure
        self.max_trials = max_trials
        self.deadline = deadline
        self.on_trial = on_trial
        self.clock = clock
        self.records: dict[Candidate, TrialRecord] = {}
        self.runs = 0

    @property
    def exhausted(self) -> bool:
        if self.max_trials is not None and self.runs >= self.max_trials:
            return True
        return self.deadline is not None and self.clock() >= self.deadline

    def _record(self, record: TrialRecord) -> TrialRecord:
        self.records[record.candidate] = record
        if self.on_trial is not None:
            self.on_trial(record)
        return record

    def prune(self, c: Candidate) -> str | None:
        why = self.memory.misfit(c)
        if why is not None and c not in self.records:
            self._record(
                TrialRecord(
                    candidate=c,
                    status="pruned",
                    estimate_bytes=self.memory.estimate(c),
                    reason=why,
                )
            )
        return why

    def score(self, c: Candidate) -> float | None:
        """``c``'s samples/s (measured now if need be); None if it does not fit, failed,
        or the budget is spent."""
        known = self.records.get(c)
        if known is not None:
            return known.samples_per_s if known.status == "measured" else None
        if self.prune(c) is not None or self.exhausted:
            return None
        self.runs += 1
        try:
            m = self._measure(c)
        except Exception as exc:  # a measurement that raises is a failed trial
            logger.warning("trial %s failed: %s", c.label(), exc)
            m = Measurement(error=f"{type(exc).__name__}: {exc}")
        ok = m.error is None and m.samples_per_s > 0
        self._record(
            TrialRecord(
                candidate=c,
                status="measured" if ok else "failed",
                estimate_bytes=self.memory.estimate(c),
                samples_per_s=m.samples_per_s if ok else None,
                memory_bytes=m.memory_bytes,
                reason="" if ok else (m.error or "no throughput"),
                index=self.runs,
            )
        )
        return m.samples_per_s if ok else None

    def best(self) -> tuple[Candidate | None, float]:
        measured = [r for r in self.records.values() if r.status == "measured"]
        if not measured:
            return None, 0.0
        top = max(measured, key=lambda r: (r.samples_per_s or 0.0, -(r.index or 0)))
        return top.candidate, top.samples_per_s or 0.0


def _largest_fitting(
    search: _Search, space: TuneSpace, base: Candidate, world_size: int
) -> Candidate | None:
    """``base`` at the largest micro-batch the space allows and the memory model fits."""
    for m in reversed(space.micro_batches):
        c = replace(base, micro_batch=m)
        if space.allows(c, world_size) and search.memory.misfit(c) is None:
            return c
    return None


def _start(search: _Search, space: TuneSpace, world_size: int) -> Candidate | None:
    """The lowest stage that fits without checkpointing, at its largest micro-batch,
    the other dimensions at their defaults (falling back to checkpointing, then to
    any candidate that fits)."""
    defaults = {
        name: space.default(name)
        for name in (
            "grad_accum",
            "bucket_numel",
            "compression",
            "activation_checkpointing",
            "keep_units",
        )
    }
    for ac in space.activation_checkpointing:
        for stage in space.stages:
            for ga in space.grad_accum:
                base = Candidate(
                    **{**defaults, "activation_checkpointing": ac, "grad_accum": ga},
                    stage=stage,
                    micro_batch=space.micro_batches[0],
                )
                c = _largest_fitting(search, space, base, world_size)
                if c is not None:
                    return c
    fits = [c for c in space.grid(world_size) if search.memory.misfit(c) is None]
    return fits[0] if fits else None


def _repaired(search: _Search, space: TuneSpace, c: Candidate, world_size: int) -> list[Candidate]:
    """``c`` if it fits; else the nearest that do by the memory levers: the same at
    the largest micro-batch that fits, with activation checkpointing, and at the
    lowest higher stage that fits."""
    if not space.allows(c, world_size):
        return []
    if search.memory.misfit(c) is None:
        return [c]
    search.prune(c)  # on the table: the memory model said no
    out = []
    smaller = _largest_fitting(search, space, c, world_size)
    if smaller is not None and space.global_batch is None:
        out.append(smaller)
    if not c.activation_checkpointing and True in space.activation_checkpointing:
        checkpointed = replace(c, activation_checkpointing=True)
        if search.memory.misfit(checkpointed) is None:
            out.append(checkpointed)
    for stage in space.stages:
        if stage > c.stage:
            higher = replace(c, stage=stage)
            if search.memory.misfit(higher) is None:
                out.append(higher)
                break
    return out


def _with_global_batch(space: TuneSpace, c: Candidate, world_size: int) -> Candidate:
    """With a fixed global batch, the accumulation follows the micro-batch."""
    if space.global_batch is None:
        return c
    per_rank, rest = divmod(space.global_batch, world_size)
    if rest or per_rank % c.micro_batch:
        return c
    return replace(c, grad_accum=per_rank // c.micro_batch)


def _categorical(
    search: _Search, space: TuneSpace, at: Candidate, name: str, world_size: int
) -> list[Candidate]:
    """Every other value of dimension ``name``, repaired to fit; for a memory lever
    also at the largest micro-batch it lets fit (the memory model's ordering)."""
    out: list[Candidate] = []
    moves = [replace(at, **{name: value}) for value in space.dimensions()[name]]
    if name == "stage":  # stage 3 comes in two kinds: with its units kept or not
        moves = [replace(c, keep_units=k) for c in moves for k in space.keep_units]
    for c in dict.fromkeys(moves):
        if c == at:
            continue
        if name in _LEVERS:
            bigger = _largest_fitting(search, space, c, world_size)
            if bigger is not None and bigger.micro_batch > c.micro_batch:
                out.append(_with_global_batch(space, bigger, world_size))
        out.extend(_repaired(search, space, c, world_size))
    return list(dict.fromkeys(out))


def _line_search(
    search: _Search, space: TuneSpace, at: Candidate, best: float, name: str, world_size: int
) -> tuple[Candidate, float, bool]:
    """An ordered dimension: step to the next value up (or else down) while faster."""
    values = space.dimensions()[name]
    i = values.index(getattr(at, name))
    moved = False
    for direction in (1, -1):
        j = i + direction
        while 0 <= j < len(values):
            c = _with_global_batch(space, replace(at, **{name: values[j]}), world_size)
            if not space.allows(c, world_size):
                break
            if search.prune(c) is not None:
                break
            score = search.score(c)
            if score is None or score <= best * (1 + search.noise):
                break
            at, best, moved = c, score, True
            j += direction
        if moved:
            break
    return at, best, moved


# dimensions whose values have an order along which throughput changes smoothly
_ORDERED = ("micro_batch", "grad_accum", "bucket_numel")


def _coordinate(search: _Search, space: TuneSpace, world_size: int) -> None:
    at = _start(search, space, world_size)
    if at is None:
        return
    best = search.score(at)
    while best is None and not search.exhausted:
        # the start failed: try what fits, in the memory model's order
        rest = [
            c for c in space.grid(world_size) if c not in search.records and not search.prune(c)
        ]
        if not rest:
            return
        at = rest[0]
        best = search.score(at)
    if best is None:
        return
    moved = True
    while moved and not search.exhausted:
        moved = False
        for name, values in space.dimensions().items():
            if len(values) < 2:
                continue
            if name in _ORDERED:
                at, best, step = _line_search(search, space, at, best, name, world_size)
                moved |= step
                continue
            scored = [
                (c, s)
                for c in _categorical(search, space, at, name, world_size)
                if (s := search.score(c)) is not None
            ]
            if scored:
                c, s = max(scored, key=lambda cs: cs[1])
                if s > best * (1 + search.noise):
                    at, best, moved = c, s, True


def _grid(search: _Search, space: TuneSpace, world_size: int) -> None:
    for c in space.grid(world_size):
        search.score(c)


def tune(
    space: TuneSpace,
    memory: MemoryModel,
    measure: Measure,
    *,
    strategy: Literal["coordinate", "grid"] = "coordinate",
    max_trials: int | None = None,
    budget_s: float | None = None,
    noise: float = 0.03,
    on_trial: Callable[[TrialRecord], None] | None = None,
    seed_measurements: Iterable[tuple[Candidate, Measurement]] = (),
    clock: Callable[[], float] = time.monotonic,
) -> TuneResult:
    """Search ``space`` for the candidate with the most samples per second.

    ``strategy``: ``"coordinate"`` (see the module notes) or ``"grid"`` (every
    candidate that fits: the reference). ``max_trials`` / ``budget_s``: stop
    starting runs after that many, or that many seconds. ``noise``: a move needs
    to be faster by more than this fraction. ``seed_measurements``: runs made
    already (the profile runs), kept as trials without measuring again.
    """
    if strategy not in ("coordinate", "grid"):
        raise ValueError(f"tune strategy must be 'coordinate' or 'grid', got {strategy!r}")
    if max_trials is not None and (isinstance(max_trials, bool) or max_trials < 1):
        raise ValueError(f"tune max_trials must be None or >= 1, got {max_trials!r}")
    if budget_s is not None and not (math.isfinite(budget_s) and budget_s > 0):
        raise ValueError(f"tune budget_s must be None or a finite number > 0, got {budget_s!r}")
    if not (math.isfinite(noise) and 0 <= noise < 1):
        raise ValueError(f"tune noise must be in [0, 1), got {noise!r}")
    world_size = memory.profile.world_size
    start = clock()
    search = _Search(
        memory,
        measure,
        max_trials=max_trials,
        deadline=None if budget_s is None else start + budget_s,
        on_trial=on_trial,
        clock=clock,
        noise=noise,
    )
    seeded = dict(seed_measurements)
    if seeded:
        inner = search._measure
        search._measure = lambda c: seeded.pop(c) if c in seeded else inner(c)
        in_space = set(space.grid(world_size))
        for c in [c for c in seeded if c in in_space]:
            search.score(c)
    if strategy == "grid":
        _grid(search, space, world_size)
    else:
        _coordinate(search, space, world_size)
    best, rate = search.best()
    return TuneResult(
        best=best,
        best_samples_per_s=rate,
        records=tuple(search.records.values()),
        strategy=strategy,
        grid_size=len(space.grid(world_size)),
        wall_s=clock() - start,
    )


def render_trials(result: TuneResult) -> str:
    """The table of what was tried: throughput, memory (estimated and measured), why not."""
    header = ("#", "stage", "mb", "ga", "ac", "bucket", "comp", "samples/s", "est.", "meas.", "")
    # a stage-3 candidate that keeps its units gathered into backward: "3 kept"
    rows = [header]
    order = sorted(
        result.records,
        key=lambda r: (r.index is None, r.index or 0, r.candidate),
    )
    for r in order:
        c = r.candidate
        mark = " *" if c == result.best else ""
        rows.append(
            (
                "-" if r.index is None else str(r.index),
                f"{c.stage} kept" if c.keep_units else str(c.stage),
                str(c.micro_batch),
                str(c.grad_accum),
                "yes" if c.activation_checkpointing else "no",
                _count(c.bucket_numel),
                c.compression,
                "-" if r.samples_per_s is None else f"{r.samples_per_s:,.1f}{mark}",
                format_bytes(r.estimate_bytes),
                "-" if r.memory_bytes is None else format_bytes(r.memory_bytes),
                r.status if not r.reason else f"{r.status}: {r.reason}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for i, row in enumerate(rows):
        cells = [c.rjust(w) for c, w in zip(row[:-1], widths, strict=False)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths[:-1]) + "  ------")
    best = result.best
    lines.append("")
    lines.append(
        f"{result.strategy}: {result.trials} run(s), {result.pruned} pruned by the memory model, "
        f"of {result.grid_size} in the space"
        + (
            f"; best {best.label()} at {result.best_samples_per_s:,.1f} samples/s"
            if best
            else "; nothing ran successfully"
        )
    )
    return "\n".join(lines)
