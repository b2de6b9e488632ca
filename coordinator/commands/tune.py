"""``zeroplane tune``: find the fastest configuration of a model by short measured runs.

Starts a pool of ``--nproc`` local workers (coordinator/tuning/trial_pool.py, worker/trials.py),
profiles the model with the first runs (its size, and what backward keeps per
sample with and without activation checkpointing), then searches stage x
micro-batch x gradient accumulation x activation checkpointing x bucket size x
compression x units kept into backward at stage 3 (coordinator/tuning/autotune.py),
never running what the memory model says cannot fit. Prints each trial as it
ends beside the progress line, then the table, and writes the best
configuration as a ZeroConfig JSON and a DeepSpeed JSON (plus every trial as
JSON).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from coordinator.commands.args import PRECISIONS, add_alias, seconds
from coordinator.core.dsjson import to_deepspeed
from coordinator.core.planner import format_bytes, parse_bytes, parse_count
from coordinator.launchers.progress import ProgressDisplay, ProgressSample
from coordinator.tuning.autotune import (
    COMPRESSIONS,
    Candidate,
    Measurement,
    MemoryModel,
    ModelProfile,
    TrialRecord,
    TuneResult,
    TuneSpace,
    render_trials,
    tune,
)
from coordinator.tuning.trial_pool import TrialPool, TrialSettings

__all__ = ["add_parser", "profile_model", "run_tune", "write_outputs"]

logger = logging.getLogger(__name__)


def _list(parse, what: str):
    def parse_list(text: str) -> tuple:
        try:
            values = tuple(parse(v.strip()) for v in text.split(",") if v.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{what}: {exc}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{what}: give at least one value, got {text!r}")
        return values

    return parse_list


def _compression(text: str) -> str:
    if text not in COMPRESSIONS:
        raise ValueError(f"{text!r} is not one of {', '.join(COMPRESSIONS)}")
    return text


_CHECKPOINTING = {"off": (False,), "on": (True,), "both": (False, True)}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "tune",
        help="find the fastest ZeRO configuration of a model by short measured runs",
        description=(
            "Find the fastest configuration of a model by short measured runs: profile the "
            "model, then search stage x micro-batch size x gradient accumulation x activation "
            "checkpointing x bucket size x compression x units kept (stage 3), never running "
            "what the memory model says cannot fit. Writes the best as zero_config.json and "
            "deepspeed.json in --out, with every trial in trials.json."
        ),
    )
    model = parser.add_argument_group("the model (one of)")
    model.add_argument(
        "--gpt",
        metavar="LAYERS,HIDDEN,HEADS,SEQ",
        help="the built-in GPT of this shape, e.g. 4,256,4,128",
    )
    model.add_argument(
        "--script",
        metavar="FILE.py",
        help="a training script that defines build() (the module) and batch(micro_batch, "
        "step, rank) (the forward's arguments; the forward returns the loss); it is "
        "imported, so its training must sit under `if __name__ == '__main__':`",
    )
    model.add_argument(
        "--model", metavar="MODULE:FUNCTION", help="a function returning the nn.Module"
    )
    model.add_argument(
        "--batch",
        metavar="MODULE:FUNCTION",
        help="with --model: (micro_batch, step, rank) -> the forward's arguments (it "
        "returns the loss)",
    )
    model.add_argument(
        "--tokens-per-sample",
        type=int,
        default=0,
        metavar="N",
        help="with --model: tokens in one sample, to report tokens/s (default 0: not reported)",
    )
    space = parser.add_argument_group(
        "the search space", "each a comma-separated list of the values to try"
    )
    space.add_argument(
        "--stages",
        type=_list(int, "--stages"),
        default=(0, 1, 2, 3),
        metavar="S,S,...",
        help="ZeRO stages (default 0,1,2,3)",
    )
    space.add_argument(
        "--micro-batches",
        type=_list(int, "--micro-batches"),
        default=(1, 2, 4, 8, 16),
        metavar="N,N,...",
        help="micro-batch sizes: samples per rank per forward (default 1,2,4,8,16)",
    )
    space.add_argument(
        "--grad-accum",
        type=_list(int, "--grad-accum"),
        default=(1,),
        metavar="N,N,...",
        help="gradient accumulation steps (default 1)",
    )
    checkpointing = space.add_argument(
        "--activation-checkpointing",
        choices=tuple(_CHECKPOINTING),
        default="both",
        help="activation checkpointing off, on or both (default)",
    )
    add_alias(space, "--checkpointing", to=checkpointing)
    buckets = space.add_argument(
        "--bucket-numels",
        type=_list(parse_count, "--bucket-numels"),
        default=(2**20, 2**22, 2**24),
        metavar="N,N,...",
        help="elements per bucket, as zeroplane coordinator --bucket-numel "
        "(default 1048576,4194304,16777216)",
    )
    add_alias(space, "--buckets", to=buckets)
    space.add_argument(
        "--compression",
        type=_list(_compression, "--compression"),
        default=("none",),
        metavar="C,C,...",
        help=f"gradient compression: {', '.join(COMPRESSIONS)} (default none)",
    )
    space.add_argument(
        "--keep-units",
        choices=tuple(_CHECKPOINTING),
        default="both",
        help="stage 3: keep every unit gathered from its forward into its backward "
        "(stage3_max_reuse_distance=1e9, DeepSpeed's default): off, on or both (default)",
    )
    space.add_argument(
        "--global-batch",
        type=int,
        default=None,
        metavar="N",
        help="keep micro-batch size x accumulation x ranks equal to this (default: any)",
    )
    parser.add_argument(
        "--nproc", type=int, default=1, metavar="N", help="ranks per trial (default 1)"
    )
    precision = parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="the trials' ZeroConfig(dtype=...) (default fp32, ZeroConfig's)",
    )
    add_alias(parser, "--dtype", to=precision)
    parser.add_argument(
        "--device-memory",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="one rank's memory for the memory model (e.g. 80GB); default: the GPU's, as "
        "the first trial reads it; on CPU nothing is pruned without it",
    )
    parser.add_argument(
        "--max-trials", type=int, default=None, metavar="N", help="runs at most (default: no limit)"
    )
    parser.add_argument(
        "--budget",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="time for the search (default: no limit)",
    )
    parser.add_argument(
        "--strategy",
        choices=("coordinate", "grid"),
        default="coordinate",
        help="coordinate: coordinate descent from the memory model's start, one dimension at a "
        "time (default); grid: every combination",
    )
    parser.add_argument(
        "--warmup", type=int, default=1, metavar="N", help="steps before timing (default 1)"
    )
    parser.add_argument(
        "--steps", type=int, default=5, metavar="N", help="timed steps per trial (default 5)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("tuned"),
        metavar="DIR",
        help="where the JSONs go (default ./tuned)",
    )
    parser.add_argument(
        "--progress",
        choices=("auto", "live", "plain"),
        default="auto",
        help="live on a terminal, plain lines otherwise (auto, the default)",
    )
    parser.set_defaults(func=tune_command, needs="torch")
    return parser


def profile_model(
    measure, space: TuneSpace, *, world_size: int, dtype: str, device_memory: int | None
) -> tuple[ModelProfile, list[tuple[Candidate, Measurement]]]:
    """The first runs: the model's size and what backward keeps per sample, with and
    without checkpointing (at the smallest micro-batch of the highest stage: the
    configuration most likely to fit, before anything is known)."""
    runs: list[tuple[Candidate, Measurement]] = []
    per_sample: dict[bool, float] = {}
    numel, memory = 0, device_memory
    for ac in space.activation_checkpointing:
        c = Candidate(
            stage=space.stages[-1],
            micro_batch=space.micro_batches[0],
            grad_accum=space.grad_accum[0],
            activation_checkpointing=ac,
            bucket_numel=space.default("bucket_numel"),
            compression=space.compressions[0],
        )
        m = measure(c)
        runs.append((c, m))
        if m.error is not None:
            raise RuntimeError(f"the profile run ({c.label()}) failed: {m.error}")
        numel = int(m.extra.get("numel", 0))
        per_sample[ac] = float(m.extra.get("activations_bytes", 0)) / c.micro_batch
        if memory is None and m.extra.get("device_memory_bytes"):
            memory = int(m.extra["device_memory_bytes"])
    kept = per_sample.get(False, per_sample.get(True, 0.0))
    profile = ModelProfile(
        numel=numel,
        world_size=world_size,
        dtype=dtype,  # type: ignore[arg-type]
        activation_bytes_per_sample=kept,
        checkpointed_bytes_per_sample=per_sample.get(True, kept),
        device_memory_bytes=memory or 0,
    )
    return profile, runs


def run_tune(
    measure,
    space: TuneSpace,
    *,
    world_size: int,
    dtype: str = "fp32",
    device_memory: int | None = None,
    strategy: str = "coordinate",
    max_trials: int | None = None,
    budget_s: float | None = None,
    display: ProgressDisplay | None = None,
) -> tuple[TuneResult, ModelProfile]:
    """Profile, then search; each trial is shown on ``display`` as it ends."""
    started = time.monotonic()
    runs = 0

    def shown(record: TrialRecord) -> None:
        nonlocal runs
        if display is None:
            return
        c = record.candidate
        if record.status == "pruned":
            display.message(f"pruned   {c.label()}: {record.reason}")
            return
        runs += 1
        if record.status == "failed":
            display.message(f"trial {runs:>3} {c.label()}: failed: {record.reason}")
        else:
            mem = "" if record.memory_bytes is None else f", {format_bytes(record.memory_bytes)}"
            display.message(
                f"trial {runs:>3} {c.label()}: {record.samples_per_s:,.1f} samples/s{mem}"
            )
        elapsed = time.monotonic() - started
        per = elapsed / runs
        display.update(
            ProgressSample(
                label="tune",
                unit="trial",
                step=runs,
                total=max_trials,
                step_s=per,
                eta_s=None if max_trials is None else max(0, max_trials - runs) * per,
                world_size=world_size,
            )
        )

    profile, seeds = profile_model(
        measure, space, world_size=world_size, dtype=dtype, device_memory=device_memory
    )
    if display is not None:
        display.message(
            f"profile: {profile.numel:,} trainable parameters; activations "
            f"{format_bytes(profile.activation_bytes_per_sample)}/sample kept, "
            f"{format_bytes(profile.checkpointed_bytes_per_sample)}/sample checkpointed; "
            + (
                f"{format_bytes(profile.device_memory_bytes)} per rank"
                if profile.device_memory_bytes
                else "device memory unknown: nothing is pruned (--device-memory)"
            )
        )
    result = tune(
        space,
        MemoryModel(profile),
        measure,
        strategy=strategy,  # type: ignore[arg-type]
        max_trials=max_trials,
        budget_s=budget_s,
        seed_measurements=seeds,
        on_trial=shown,
    )
    return result, profile


def write_outputs(result: TuneResult, out: Path, *, base: dict, world_size: int) -> dict[str, Path]:
    """``zero_config.json`` (ZeroConfig(**json) rebuilds it), ``deepspeed.json`` and
    ``trials.json`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"trials": out / "trials.json"}
    paths["trials"].write_text(json.dumps(result.as_dict(), indent=1))
    if result.best is not None:
        zero = result.best.zero_config(base)
        paths["zero_config"] = out / "zero_config.json"
        paths["zero_config"].write_text(json.dumps(zero, indent=1))
        ds = to_deepspeed(zero, micro_batch=result.best.micro_batch, world_size=world_size)
        paths["deepspeed"] = out / "deepspeed.json"
        paths["deepspeed"].write_text(json.dumps(ds, indent=1))
    return paths


def tune_command(args: argparse.Namespace) -> int:
    if args.script:
        if args.model or args.batch:
            print("zeroplane tune: --script or --model/--batch, not both", file=sys.stderr)
            return 2
        args.model, args.batch = f"{args.script}:build", f"{args.script}:batch"
    if bool(args.gpt) == bool(args.model):
        print(
            "zeroplane tune: give the model as --gpt, --script, or --model with --batch",
            file=sys.stderr,
        )
        return 2
    if args.model and not args.batch:
        print("zeroplane tune: --model needs --batch", file=sys.stderr)
        return 2
    try:
        space = TuneSpace(
            stages=args.stages,
            micro_batches=args.micro_batches,
            grad_accum=args.grad_accum,
            activation_checkpointing=_CHECKPOINTING[args.activation_checkpointing],
            bucket_numels=args.bucket_numels,
            compressions=args.compression,
            keep_units=_CHECKPOINTING[args.keep_units],
            global_batch=args.global_batch,
        )
        space.grid(args.nproc)
        settings = TrialSettings(
            model_args=(
                ("--gpt", args.gpt)
                if args.gpt
                else (
                    "--model",
                    args.model,
                    "--batch",
                    args.batch,
                    "--tokens-per-sample",
                    str(args.tokens_per_sample),
                )
            ),
            base_config={"dtype": args.precision},
            warmup=args.warmup,
            steps=args.steps,
        )
    except ValueError as exc:
        print(f"zeroplane tune: {exc}", file=sys.stderr)
        return 2
    if args.nproc < 1:
        print("zeroplane tune: --nproc must be >= 1", file=sys.stderr)
        return 2
    interactive = {"live": True, "plain": False}.get(args.progress)
    with (
        TrialPool(args.nproc, settings) as pool,
        ProgressDisplay(interactive=interactive, interval_s=30.0) as display,
    ):
        try:
            result, _ = run_tune(
                pool.measure,
                space,
                world_size=args.nproc,
                dtype=args.precision,
                device_memory=args.device_memory,
                strategy=args.strategy,
                max_trials=args.max_trials,
                budget_s=args.budget,
                display=display,
            )
        except RuntimeError as exc:
            print(f"zeroplane tune: {exc}", file=sys.stderr)
            print("\n".join(pool.output), file=sys.stderr)
            return 1
    print(render_trials(result))
    paths = write_outputs(result, args.out, base=settings.base_config, world_size=args.nproc)
    for what, path in paths.items():
        print(f"{what}: {path}")
    return 0 if result.best is not None else 1
