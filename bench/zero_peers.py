"""zeroplane beside its peers: step time and model-state bytes in one run.

Spawns ``--world`` processes on gloo (127.0.0.1, one thread each, same seed)
and, inside the same processes, trains every system one after another on the
same model and the same batches:

* ``ddp``    torch DistributedDataParallel (``gradient_as_bucket_view=True``),
* ``fsdp2``  ``fully_shard`` on each block and the root, on a CPU device mesh,
* ``ds0-3``  DeepSpeed ZeRO stages 0-3 (fp32, torch AdamW passed in),
* ``zp0-3``  zeroplane stages 0-3 (``worker.initialize``),
* ``zp3r``   zeroplane stage 3 with ``stage3_max_reuse_distance=1e9``, DeepSpeed's
  default: every unit stays gathered from its forward into its backward
  (``ds3`` runs that way),
* ``zp1o-zp3o`` / ``ds1o-ds3o``  the same stages with the optimizer offloaded to
  host memory (ZeRO-Offload; not in the default list, name them in
  ``--systems``): zeroplane with ``offload_optimizer="cpu"`` (torch's fused CPU
  AdamW), DeepSpeed with ``offload_optimizer: {device: cpu}`` and its own
  ``DeepSpeedCPUAdam`` (it compiles ``cpu_adam`` on first use, ~45 s). On a CPU
  run the "host" is the same memory: this measures the offload path's own cost.
* ``zp3l`` / ``zp3rl``  a diagnostic, not a system (name them to run them): ``zp3`` /
  ``zp3r`` with every stage-3 gather replaced by a local copy of this rank's own
  shard into every slot, the bytes the all-gather would have written. Hooks,
  resizes, prefetch and the backward's reduce-scatters run as shipped; the
  parameters are wrong by design, so is the loss. Beside ``zp3``/``zp3r`` in one
  run, the difference is what moving the parameters costs, the rest is stage 3's
  own bookkeeping.
* ``zp3t`` / ``zp3rt``  diagnostics: ``zp3`` / ``zp3r`` with their gathers and
  reduce-scatters over gloo's own transport (loopback TCP), not this host's shared
  memory (worker/shared_exchange.py), as every stage-3 collective ran before.
* ``zp3u`` / ``zp3c``  diagnostics too: ``zp3`` with ``stage3_check_gathers=False``
  (no agreement even in the first step) and ``True`` (every gather of every step
  agreed), so that beside ``zp3`` (the default, ``"first"``) the cost of the
  gathers' agreement (worker/gather_check.py) shows.

Every system uses fp32 torch AdamW with the same hyperparameters. By default
(``--schedule interleaved``) all systems are built at once and stepped in turn,
step i of each before step i+1 of any, so load from other processes on a shared
machine lands on every system alike; ``--schedule sequential`` runs one system
after another, each torn down (DeepSpeed engines destroyed) before the next.
``--rounds R`` repeats the whole thing R times from fresh builds; the median is
taken over all timed steps of all rounds.

Run ``python bench/zero_peers.py --help``; bench/README.md says what each
number in the table means.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

# Run from a checkout without installing the package.
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    fmt_ratio,
    free_port,
    gloo_group,
    median_ms,
    quiet_gloo_warnings,
    rank_env,
    ratio,
    rel_iqr,
    timed_step,
)
from coordinator.core.memory import model_state_bytes  # noqa: E402
from worker.models import GPT, MLP, GPTConfig  # noqa: E402

LR = 1e-3
MICRO_BATCH = 8
SEQ_LEN = 64
KINDS = ("params", "grads", "master", "optimizer")
ALL_SYSTEMS = ("ddp", "fsdp2", "zp0", "zp1", "zp2", "zp3", "zp3r", "ds0", "ds1", "ds2", "ds3")
OFFLOAD_SYSTEMS = tuple(f"{p}{s}o" for p in ("zp", "ds") for s in (1, 2, 3))
DIAGNOSTIC_SYSTEMS = ("zp3l", "zp3rl", "zp3u", "zp3c", "zp3t", "zp3rt")
NAMED_ONLY = OFFLOAD_SYSTEMS + DIAGNOSTIC_SYSTEMS
STAGE_OF = (
    {"ddp": 0, "fsdp2": 3}
    | dict.fromkeys(("zp3r", *DIAGNOSTIC_SYSTEMS), 3)
    | {f"{p}{s}": s for p in ("zp", "ds") for s in range(4)}
    | {name: int(name[2]) for name in OFFLOAD_SYSTEMS}
)

Tensor = torch.Tensor


# --------------------------------------------------------------------------- models


class MLPLoss(nn.Module):
    """worker.models.MLP with an MSE loss, so every system calls ``model(x, y) -> loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP(d_in=256, width=1024, depth=10, d_out=256)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return F.mse_loss(self.net(x), y)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    # The modules FSDP2 shards one by one (then the root).
    blocks: Callable[[nn.Module], list[nn.Module]]
    batch: Callable[[torch.Generator], tuple[Tensor, Tensor]]


def _gpt_batch(g: torch.Generator) -> tuple[Tensor, Tensor]:
    idx = torch.randint(0, GPT_CFG.vocab_size, (MICRO_BATCH, SEQ_LEN + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def _mlp_batch(g: torch.Generator) -> tuple[Tensor, Tensor]:
    # One row per token, so the MLP sees as many rows as the GPT sees tokens.
    rows = MICRO_BATCH * SEQ_LEN
    return torch.randn(rows, 256, generator=g), torch.randn(rows, 256, generator=g)


# 12 blocks of d=256 plus a 2048-token vocabulary: 10.02M parameters.
GPT_CFG = GPTConfig(vocab_size=2048, block_size=SEQ_LEN, n_layer=12, n_head=4, n_embd=256)

MODELS = {
    "gpt": ModelSpec(
        name="gpt",
        build=lambda: GPT(GPT_CFG),
        blocks=lambda m: list(m.blocks),
        batch=_gpt_batch,
    ),
    # 256 -> 10 x 1024 -> 256: 9.97M parameters.
    "mlp": ModelSpec(
        name="mlp",
        build=MLPLoss,
        blocks=lambda m: [x for x in m.net if isinstance(x, nn.Linear)],
        batch=_mlp_batch,
    ),
}


# --------------------------------------------------------------------------- counting bytes


class StateCounter:
    """Sums tensor bytes by kind, each storage once.

    A storage is counted whole, once, under the first kind it is seen with:
    a parameter that is a view into a flat buffer counts the flat buffer
    (padding included) and the buffer is not counted again for the next view.
    DTensors count their local shard only.
    """

    def __init__(self) -> None:
        self._seen: set[int] = set()
        self.bytes: dict[str, int] = dict.fromkeys((*KINDS, "other"), 0)

    def add(self, kind: str, tensors: Iterable[Tensor | None]) -> None:
        from torch.distributed.tensor import DTensor

        for t in tensors:
            if t is None:
                continue
            if isinstance(t, DTensor):
                t = t.to_local()
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in self._seen:
                continue
            self._seen.add(storage.data_ptr())
            self.bytes[kind] += storage.nbytes()

    def report(self) -> dict[str, int]:
        return self.bytes | {"total": sum(self.bytes[k] for k in KINDS)}


def _optimizer_state(opt: torch.optim.Optimizer) -> list[Tensor]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, Tensor)]


def _torch_state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """DDP and FSDP2: params, their .grad (local shards for DTensors) and AdamW state."""
    c = StateCounter()
    params = list(model.parameters())
    c.add("params", (p.data for p in params))
    c.add("grads", (p.grad for p in params))
    c.add("optimizer", _optimizer_state(opt))
    return c.report()


def _reachable_tensors(root: object, depth: int = 4) -> Iterable[Tensor]:
    """Tensors reachable from a DeepSpeed object through its attributes and containers."""
    seen: set[int] = set()
    stack: list[tuple[object, int]] = [(root, 0)]
    while stack:
        obj, d = stack.pop()
        if id(obj) in seen or d > depth:
            continue
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            yield obj
            if obj.grad is not None:
                yield obj.grad
        elif isinstance(obj, dict):
            stack.extend((v, d + 1) for v in obj.values())
        elif isinstance(obj, list | tuple | set):
            stack.extend((v, d + 1) for v in obj)
        elif type(obj).__module__.startswith("deepspeed") and hasattr(obj, "__dict__"):
            stack.extend((v, d + 1) for v in vars(obj).values())


def _deepspeed_state_bytes(engine: Any, stage: int) -> dict[str, int]:
    """DeepSpeed: the tensors each stage keeps, by name, then anything else it holds.

    params    module parameters' storage (the flat fp32 groups at stages 1-2; at stage 3
              ``ds_tensor``, the partition, plus the full data of parameters DeepSpeed
              keeps unpartitioned below its persistence threshold);
    master    its separate fp32 partition (``single_partition_of_fp32_groups`` at
              stages 1-2, ``fp32_partitioned_groups_flat`` at stage 3): a copy even in fp32;
    grads     ``.grad`` of parameters and of the master partition, plus the gradient
              partition buffers (``grads_in_partition``/``averaged_gradients`` at 1-2,
              ``grad_partitions_flat_buffer`` at 3);
    optimizer the torch AdamW state on the partition;
    other     every other tensor reachable from the ZeRO optimizer, e.g. the
              reduce-bucket staging buffers (allocated with ``torch.empty`` at the full
              ``reduce_bucket_size``; on CPU untouched pages cost nothing). Not in total.
    """
    c = StateCounter()
    params = list(engine.module.parameters())
    c.add("params", (p.data for p in params))
    c.add("params", (getattr(p, "ds_tensor", None) for p in params))
    zopt = engine.optimizer
    if stage == 0:
        c.add("grads", (p.grad for p in params))
        c.add("optimizer", _optimizer_state(zopt))
        return c.report()
    master = (
        zopt.fp32_partitioned_groups_flat if stage == 3 else zopt.single_partition_of_fp32_groups
    )
    c.add("master", master)
    c.add("optimizer", _optimizer_state(zopt.optimizer))
    c.add("grads", (p.grad for p in params))
    c.add("grads", (m.grad for m in master))
    if stage == 3:
        c.add("grads", [getattr(zopt, "grad_partitions_flat_buffer", None)])
    else:
        c.add("grads", [getattr(zopt, "grads_in_partition", None)])
        for grads in getattr(zopt, "averaged_gradients", {}).values():
            c.add("grads", grads or [])
    c.add("other", _reachable_tensors(zopt))
    return c.report()


# --------------------------------------------------------------------------- systems


@dataclass
class Harness:
    """One system, built around a fresh model: forward+backward, then the optimizer step."""

    forward_backward: Callable[[Tensor, Tensor], Tensor]
    step: Callable[[], None]
    state_bytes: Callable[[], dict[str, int]]
    close: Callable[[], None] = lambda: None


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def _torch_harness(wrapped: nn.Module) -> Harness:
    opt = _adamw(wrapped.parameters())

    def forward_backward(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        loss = wrapped(x, y)
        loss.backward()
        return loss.detach()

    return Harness(forward_backward, opt.step, lambda: _torch_state_bytes(wrapped, opt))


def build_ddp(model: nn.Module, spec: ModelSpec, ctx: RankContext) -> Harness:
    from torch.nn.parallel import DistributedDataParallel as DDP

    # Gradients as views into DDP's buckets: no second copy, the fairest baseline.
    return _torch_harness(DDP(model, gradient_as_bucket_view=True))


def build_fsdp2(model: nn.Module, spec: ModelSpec, ctx: RankContext) -> Harness:
    from torch.distributed.fsdp import fully_shard

    for block in spec.blocks(model):
        fully_shard(block, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    return _torch_harness(model)


def build_deepspeed(
    model: nn.Module, stage: int, ctx: RankContext, offload: bool = False
) -> Harness:
    import deepspeed

    zero: dict[str, Any] = {"stage": stage}
    optimizer: torch.optim.Optimizer = _adamw(model.parameters())
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        # ZeRO-Offload as DeepSpeed runs it: its vectorized CPU Adam, AdamW mode
        optimizer = DeepSpeedCPUAdam(
            model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, adamw_mode=True
        )
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": MICRO_BATCH * ctx.world,
        "zero_optimization": zero,
        # A torch optimizer passed in: no fused_adam to compile, same update as the others.
        "zero_allow_untested_optimizer": True,
        # DeepSpeed 0.19 clips at 1.0 unless told otherwise; nobody else clips here.
        "gradient_clipping": 0.0,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    torch.set_num_threads(1)  # in case DeepSpeed's CPU accelerator changed it

    def forward_backward(x: Tensor, y: Tensor) -> Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        return loss.detach()

    def close() -> None:
        engine.destroy()

    return Harness(
        forward_backward, engine.step, lambda: _deepspeed_state_bytes(engine, stage), close
    )


class _LocalGathers:
    """The collectives a ``zp3l``/``zp3rl`` gather unit is given: every other call goes to
    the real ones, an all-gather copies this rank's input into every slot instead."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def all_gather(self, output: Tensor, input: Tensor, **_: Any) -> Any:
        n = self._comm.world_size
        output.view(n, -1).copy_(input.reshape(1, -1).expand(n, -1))
        return _Done()


class _Done:
    def wait(self) -> None:
        pass


def _gather_locally(engine: Any) -> None:
    """Diagnostic (``zp3l``, ``zp3rl``): stage 3's gathers become local copies."""
    for unit in engine.units:
        real = unit.gather
        unit.gather = lambda comm, real=real: real(_LocalGathers(comm))


def _gather_over_tcp(engine: Any) -> None:
    """Diagnostic (``zp3t``, ``zp3rt``): the engine's collectives over gloo's own
    transport, not this host's shared memory (worker/shared_exchange.py)."""
    for unit in engine.units:
        real = unit.gather

        def gather(comm: Any, real: Any = real) -> Any:
            comm._host_opened, comm._host = True, None  # never opened: gloo's broadcasts
            return real(comm)

        unit.gather = gather


def build_zeroplane(
    model: nn.Module,
    stage: int,
    ctx: RankContext,
    offload: bool = False,
    keep: bool = False,
    local: bool = False,
    checked: bool | str = "first",
    tcp: bool = False,
) -> Harness:
    import worker

    opt = _adamw(model.parameters())
    config = worker.ZeroConfig(
        stage=stage,
        dtype="fp32",
        offload_optimizer="cpu" if offload else "none",
        stage3_max_reuse_distance=10**9 if keep else 0,
        stage3_check_gathers=checked,
    )
    engine = worker.initialize(model, opt, config=config)
    if local:
        _gather_locally(engine)
    if tcp:
        _gather_over_tcp(engine)

    def forward_backward(x: Tensor, y: Tensor) -> Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        return loss.detach()

    def state_bytes() -> dict[str, int]:
        return {k: int(v) for k, v in engine.memory_report().items()}

    close = getattr(engine, "close", lambda: None)
    return Harness(forward_backward, engine.step, state_bytes, close)


def make_harness(system: str, model: nn.Module, spec: ModelSpec, ctx: RankContext) -> Harness:
    if system == "ddp":
        return build_ddp(model, spec, ctx)
    if system == "fsdp2":
        return build_fsdp2(model, spec, ctx)
    offload = system in OFFLOAD_SYSTEMS
    if system.startswith("ds"):
        return build_deepspeed(model, STAGE_OF[system], ctx, offload)
    if system.startswith("zp"):
        return build_zeroplane(
            model,
            STAGE_OF[system],
            ctx,
            offload,
            keep=system in ("zp3r", "zp3rl", "zp3rt"),
            local=system in ("zp3l", "zp3rl"),
            checked={"zp3u": False, "zp3c": True}.get(system, "first"),
            tcp=system in ("zp3t", "zp3rt"),
        )
    known = ", ".join(ALL_SYSTEMS + NAMED_ONLY)
    raise ValueError(f"unknown system {system!r}; choose from {known}")


# --------------------------------------------------------------------------- the run


@dataclass
class RankContext:
    rank: int
    world: int
    mesh: Any = None


@dataclass
class Result:
    model: str
    system: str
    stage: int
    step_s: list[float] = field(default_factory=list)  # max over ranks, per timed step
    cpu_s: list[float] = field(default_factory=list)  # process CPU time, max over ranks
    state_bytes: list[dict[str, int]] = field(default_factory=list)  # per rank
    loss: float = float("nan")  # mean over ranks, after the same number of steps


def available_systems(requested: list[str]) -> tuple[list[str], list[str]]:
    """Drop the systems that cannot run here; return (kept, messages)."""
    kept, notes = [], []
    for s in requested:
        if s.startswith("ds"):
            try:
                import deepspeed  # noqa: F401
            except ImportError as e:
                notes.append(f"skipping {s}: DeepSpeed is not installed ({e})")
                continue
        if s.startswith("zp"):
            try:
                import worker

                worker.initialize  # noqa: B018
                worker.ZeroConfig  # noqa: B018
            except (ImportError, AttributeError) as e:
                notes.append(f"skipping {s}: zeroplane's worker.initialize is not there ({e})")
                continue
        kept.append(s)
    return kept, notes


def _batches(spec: ModelSpec, n: int, seed: int, rank: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return [spec.batch(g) for _ in range(n)]


class SystemRun:
    """One system on this rank: built from the seed, warmed up, timed step by step, counted.

    Each timed step starts and ends with a barrier, so ranks start together and a
    step ends when the slowest rank does.
    """

    def __init__(self, system: str, spec: ModelSpec, ctx: RankContext, args: argparse.Namespace):
        self.system, self.ctx = system, ctx
        self.batches = _batches(spec, args.warmup + args.steps + 1, args.seed, ctx.rank)
        self.next = 0
        self.wall: list[float] = []
        self.cpu: list[float] = []
        torch.manual_seed(args.seed)
        dist.barrier()
        self.harness: Harness | None = make_harness(system, spec.build(), spec, ctx)
        for _ in range(args.warmup):
            self._step()

    def _step(self) -> Tensor:
        assert self.harness is not None
        x, y = self.batches[self.next]
        self.next += 1
        loss = self.harness.forward_backward(x, y)
        self.harness.step()
        return loss

    def timed_step(self) -> None:
        _, wall, cpu = timed_step(self._step)
        self.wall.append(wall)
        self.cpu.append(cpu)

    def finish(self, measure: bool) -> tuple[dict[str, int] | None, float]:
        """One last, untimed step that counts the bytes; returns (bytes, mean loss)."""
        h = self.harness
        assert h is not None
        x, y = self.batches[-1]
        loss = h.forward_backward(x, y)
        # The larger of: after backward (gradients live) and after the step.
        state = h.state_bytes() if measure else None
        h.step()
        if state is not None:
            state = max(state, h.state_bytes(), key=lambda r: r["total"])
        loss_t = loss.reshape(1).clone()
        dist.all_reduce(loss_t)
        return state, loss_t.item() / self.ctx.world

    def close(self) -> None:
        if self.harness is not None:
            self.harness.close()
            self.harness = None
        gc.collect()


def _quiet_libraries() -> None:
    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    quiet_gloo_warnings()


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    world = args.world
    # a spawned process starts from the module's defaults
    use_gpt(args.gpt_layers, args.gpt_vocab, args.micro_batch)
    # DeepSpeed reads these even when the process group already exists.
    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    _quiet_libraries()
    with gloo_group("127.0.0.1", port, rank, world, timedelta(minutes=10)):
        _rank_body(rank, world, args)


def _record(
    results: dict[tuple[str, str], Result], model: str, run: SystemRun, rnd: int, t0: float
) -> None:
    """Count the bytes (first round), gather every rank's times, print progress on rank 0."""
    state, loss = run.finish(measure=rnd == 0)
    per_rank: list[Any] = [None] * run.ctx.world
    dist.all_gather_object(per_rank, (run.wall, run.cpu, state))
    res = results.setdefault((model, run.system), Result(model, run.system, STAGE_OF[run.system]))
    res.step_s += [max(ts) for ts in zip(*(r[0] for r in per_rank), strict=True)]
    res.cpu_s += [max(cs) for cs in zip(*(r[1] for r in per_rank), strict=True)]
    if rnd == 0:
        res.state_bytes = [r[2] for r in per_rank]
        res.loss = loss
    if run.ctx.rank == 0:
        print(
            f"  {model} {run.system:<5} round {rnd + 1}: median "
            f"{median_ms(res.step_s[-len(run.wall) :]):7.1f} ms "
            f"({time.perf_counter() - t0:.0f} s into the round)",
            flush=True,
        )


def _rank_body(rank: int, world: int, args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    ctx = RankContext(rank=rank, world=world)
    if "fsdp2" in args.systems:
        ctx.mesh = init_device_mesh("cpu", (world,))
    if any(s.startswith("ds") for s in args.systems):
        import deepspeed

        # Joins the existing gloo group; builds DeepSpeed's shm comm op the first time.
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        _quiet_libraries()
        torch.set_num_threads(1)

    results: dict[tuple[str, str], Result] = {}
    for model_name in args.models:
        spec = MODELS[model_name]
        for rnd in range(args.rounds):
            t0 = time.perf_counter()
            if args.schedule == "sequential":
                for system in args.systems:
                    run = SystemRun(system, spec, ctx, args)
                    try:
                        for _ in range(args.steps):
                            run.timed_step()
                        _record(results, model_name, run, rnd, t0)
                    finally:
                        run.close()
            else:
                runs: list[SystemRun] = []
                try:
                    for system in args.systems:
                        runs.append(SystemRun(system, spec, ctx, args))
                    # Step i of every system before step i+1 of any: all see the same load.
                    for _ in range(args.steps):
                        for run in runs:
                            run.timed_step()
                    for run in runs:
                        _record(results, model_name, run, rnd, t0)
                finally:
                    for run in runs:
                        run.close()
    if rank == 0:
        print()
        print(format_table(list(results.values()), args))
        if args.json:
            Path(args.json).write_text(json.dumps(to_json(list(results.values()), args), indent=2))
            print(f"\nwrote {args.json}")


# --------------------------------------------------------------------------- reporting


def _median_ms(r: Result | None) -> float | None:
    return median_ms(r.step_s) if r and r.step_s else None


def _cpu_ms(r: Result | None) -> float | None:
    return median_ms(r.cpu_s) if r and r.cpu_s else None


def _state_total(r: Result | None) -> int | None:
    return max(s["total"] for s in r.state_bytes) if r and r.state_bytes else None


def time_ratio(
    a: Result | None, b: Result | None, paired: bool, attr: str = "step_s"
) -> float | None:
    """a's step time over b's.

    Interleaved runs time step i of every system in the same few seconds, so the
    median of the per-step ratios cancels load that changes over the run; the
    ratio of the medians does not. Sequential runs have no pairs to match.
    """
    if a is None or b is None:
        return None
    xs, ys = getattr(a, attr), getattr(b, attr)
    if not xs or not ys:
        return None
    if paired and len(xs) == len(ys):
        return statistics.median(x / y for x, y in zip(xs, ys, strict=True))
    return statistics.median(xs) / statistics.median(ys)


def _ds_peer(r: Result) -> str:
    """The DeepSpeed system a row is compared with: same stage, same offload."""
    if r.system.startswith(("zp", "ds")):
        return "ds" + r.system[2:].removesuffix("r")
    return f"ds{r.stage}"


def _target(r: Result, by: dict[str, Result], paired: bool) -> str:
    """zeroplane's goals: stages 0-2 <= 1.05x DDP, stage 3 <= FSDP2, each < DeepSpeed's stage."""
    if not r.system.startswith("zp") or r.system in DIAGNOSTIC_SYSTEMS:
        return ""
    checks = []
    vs_ddp = time_ratio(r, by.get("ddp"), paired)
    vs_fsdp = time_ratio(r, by.get("fsdp2"), paired)
    vs_ds = time_ratio(r, by.get(_ds_peer(r)), paired)
    if r.stage < 3 and vs_ddp is not None:
        checks.append(vs_ddp <= 1.05)
    if r.stage == 3 and vs_fsdp is not None:
        checks.append(vs_fsdp <= 1.0)
    if vs_ds is not None:
        checks.append(vs_ds < 1.0)
    return "-" if not checks else ("ok" if all(checks) else "MISS")


def _spread(r: Result) -> str:
    """Inter-quartile range over the median: how noisy this row was."""
    if len(r.step_s) < 4:
        return "-"
    return f"{100 * rel_iqr(r.step_s):.0f}%"


def format_table(results: list[Result], args: argparse.Namespace) -> str:
    header = (
        f"{'model':<5} {'system':<6} {'stage':>5} {'step ms':>8} {'IQR':>5} {'xDDP':>6} "
        f"{'xFSDP2':>7} {'xDS':>6} {'cpu ms':>7} {'xDDPcpu':>7} {'state MiB/rank':>14} "
        f"{'xDDP B':>7} {'xZeRO':>6} {'loss':>9} {'target':>6}"
    )
    lines = [
        f"world {args.world}, gloo, 1 thread/rank, micro-batch {MICRO_BATCH}, seq {SEQ_LEN}, "
        f"fp32 AdamW; median of {args.steps} x {args.rounds} steps after {args.warmup} warm-up, "
        f"{args.schedule}"
        + (
            "; time ratios are medians of per-step ratios" if args.schedule == "interleaved" else ""
        ),
        header,
        "-" * len(header),
    ]
    notes = []
    paired = args.schedule == "interleaved"
    for model_name in dict.fromkeys(r.model for r in results):
        by = {r.system: r for r in results if r.model == model_name}
        ddp, ddp_b = by.get("ddp"), _state_total(by.get("ddp"))
        n = sum(p.numel() for p in MODELS[model_name].build().parameters())
        for r in by.values():
            b = _state_total(r)
            ds = by.get(_ds_peer(r)) if r.system != "fsdp2" else None
            vs_fsdp = fmt_ratio(time_ratio(r, by.get("fsdp2"), paired)) if r.stage == 3 else ""
            formula = model_state_bytes(n, stage=r.stage, world_size=args.world, dtype="fp32")
            lines.append(
                f"{r.model:<5} {r.system:<6} {r.stage:>5} {_median_ms(r):>8.1f} {_spread(r):>5} "
                f"{fmt_ratio(time_ratio(r, ddp, paired)):>6} {vs_fsdp:>7} "
                f"{fmt_ratio(time_ratio(r, ds, paired)):>6} "
                f"{_cpu_ms(r):>7.1f} {fmt_ratio(time_ratio(r, ddp, paired, 'cpu_s')):>7} "
                f"{b / 2**20 if b is not None else float('nan'):>14.2f} "
                f"{fmt_ratio(ratio(b, ddp_b)):>7} {fmt_ratio(ratio(b, formula.total)):>6} "
                f"{r.loss:>9.5f} {_target(r, by, paired):>6}"
            )
            other = max((s.get("other", 0) for s in r.state_bytes), default=0)
            if other > 2**20:
                notes.append(
                    f"{model_name} {r.system} also holds {other / 2**20:.0f} MiB of other "
                    "tensors (communication staging; see README), not in its total"
                )
        lines.append(f"{model_name}: {n / 1e6:.2f}M parameters, 16Ψ = {16 * n / 2**20:.1f} MiB")
    return "\n".join(lines + notes)


def to_json(results: list[Result], args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for r in results:
        row = asdict(r)
        row["median_step_ms"] = _median_ms(r)
        row["median_cpu_ms"] = _cpu_ms(r)
        row["state_bytes_per_rank_max"] = _state_total(r)
        rows.append(row)
    return {
        "world": args.world,
        "backend": "gloo",
        "threads_per_rank": 1,
        "micro_batch": MICRO_BATCH,
        "seq_len": SEQ_LEN,
        "gpt_layers": GPT_CFG.n_layer,
        "gpt_vocab": GPT_CFG.vocab_size,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
        "schedule": args.schedule,
        "torch": torch.__version__,
        "results": rows,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("gpt", "mlp", "both"), default="both")
    p.add_argument("--steps", type=int, default=15, help="timed steps per system per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after each build")
    p.add_argument("--rounds", type=int, default=2, help="repeats of the whole list, fresh builds")
    p.add_argument(
        "--systems",
        nargs="+",
        default=list(ALL_SYSTEMS),
        metavar="SYSTEM",
        help=f"any of: {' '.join(ALL_SYSTEMS + NAMED_ONLY)} (the last eight are not run "
        "unless named: six offload the optimizer, zp3l/zp3rl are stage 3 with its gathers "
        "replaced by local copies, a diagnostic)",
    )
    p.add_argument(
        "--schedule",
        choices=("sequential", "interleaved"),
        default="interleaved",
        help="sequential: one system after another, each torn down before the next; "
        "interleaved: all systems built at once and stepped in turn (steadier ratios on a "
        "busy machine)",
    )
    p.add_argument("--world", type=int, default=2)
    p.add_argument(
        "--gpt-layers", type=int, default=GPT_CFG.n_layer, help="the GPT's blocks (d=256)"
    )
    p.add_argument("--gpt-vocab", type=int, default=GPT_CFG.vocab_size, help="the GPT's vocabulary")
    p.add_argument(
        "--micro-batch", type=int, default=MICRO_BATCH, help="sequences (GPT) per rank per step"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    p.add_argument(
        "--table-from", metavar="JSON", help="print the table of an earlier --json run and exit"
    )
    args = p.parse_args(argv)
    unknown = sorted(set(args.systems) - set(ALL_SYSTEMS) - set(NAMED_ONLY))
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {' '.join(ALL_SYSTEMS + NAMED_ONLY)}")
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0 or args.world < 1:
        p.error("--steps and --rounds must be >= 1, --warmup >= 0, --world >= 1")
    args.models = ["gpt", "mlp"] if args.model == "both" else [args.model]
    use_gpt(args.gpt_layers, args.gpt_vocab, args.micro_batch)
    return args


def use_gpt(layers: int, vocab: int, micro_batch: int = MICRO_BATCH) -> None:
    """The GPT every system builds: ``--gpt-layers`` blocks, a ``--gpt-vocab`` vocabulary
    (the held-out peer check's smaller units: 8 layers, 4096 tokens, 7.4M parameters)."""
    global GPT_CFG, MICRO_BATCH
    GPT_CFG = dataclasses.replace(GPT_CFG, n_layer=layers, vocab_size=vocab)
    MICRO_BATCH = micro_batch


def table_from_json(path: str) -> str:
    data = json.loads(Path(path).read_text())
    use_gpt(
        data.get("gpt_layers", GPT_CFG.n_layer),
        data.get("gpt_vocab", GPT_CFG.vocab_size),
        data.get("micro_batch", MICRO_BATCH),
    )
    names = {f.name for f in fields(Result)}
    results = [Result(**{k: v for k, v in row.items() if k in names}) for row in data["results"]]
    args = argparse.Namespace(
        **{k: data[k] for k in ("world", "steps", "rounds", "warmup")},
        schedule=data.get("schedule", "sequential"),
    )
    return format_table(results, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table_from:
        print(table_from_json(args.table_from))
        return 0
    # This benchmark is CPU/gloo even on a GPU machine; DeepSpeed would otherwise pick CUDA.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    args.systems, notes = available_systems(args.systems)
    for note in notes:
        print(note, flush=True)
    if not args.systems:
        print("nothing to run")
        return 1
    print(f"systems: {' '.join(args.systems)}; models: {' '.join(args.models)}", flush=True)
    mp.spawn(rank_main, args=(args, free_port()), nprocs=args.world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
