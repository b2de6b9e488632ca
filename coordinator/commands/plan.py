"""``zeroplane plan``: memory per rank for every ZeRO stage, and the stage to run.

Like DeepSpeed's ``estimate_zero*_model_states_mem_needs``, but for all stages
and several world sizes at once. The model is a parameter count
(``--params 7.5e9``) or ``--model module:factory``, a callable returning an
``nn.Module``; only that branch imports the user's code (and so torch).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from decimal import ROUND_HALF_UP, Decimal

from coordinator.commands.args import (
    PRECISIONS,
    activation_shape,
    add_alias,
    add_shape_args,
    counts,
    fraction,
)
from coordinator.core.layout import ParamSpec
from coordinator.core.memory import BirthBytes, birth_bytes
from coordinator.core.meshplan import MeshChoice, choose_mesh, tp_sharded_numel
from coordinator.core.planner import (
    PCIE_BYTES_PER_S,
    STAGES,
    ActivationShape,
    PlanConfig,
    choose_stage,
    parse_bytes,
    parse_count,
)
from coordinator.core.sequences import plan_sequence

__all__ = ["add_parser", "inventory_of", "plan"]

_UNITS = (("TB", 1e12, "1e12"), ("GB", 1e9, "1e9"), ("MB", 1e6, "1e6"), ("KB", 1e3, "1e3"))


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan",
        help="memory per rank for each ZeRO stage, and the recommended stage",
        description=(
            "Model-state memory per rank for ZeRO stages 0-3 (the ZeRO paper's formulas: "
            "bf16/fp16 mixed precision 2+2+K bytes per parameter, fp32 4+4+K), plus a stated "
            "activation term, for each world size; and the lowest stage that fits the "
            "device memory with headroom. 1 GB = 1e9 bytes."
        ),
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--params", metavar="N", help="trainable parameter count: 7.5e9, 7.5B, 350M, ..."
    )
    model.add_argument(
        "--model",
        metavar="MODULE:FUNCTION",
        help="a callable returning an nn.Module, e.g. mypkg.models:build (it is called once)",
    )
    parser.add_argument(
        "--world-sizes",
        type=counts,
        default=[1, 2, 4, 8],
        metavar="N,N,...",
        help="data-parallel world sizes to plan for (default 1,2,4,8)",
    )
    parser.add_argument(
        "--device-memory",
        default="80GB",
        metavar="BYTES",
        help="memory of one device: 80GB, 24GiB, ... (default 80GB)",
    )
    precision = parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="bf16",
        help="training precision, as ZeroConfig(dtype=...): bf16/fp16 mixed precision keeps "
        "fp32 master weights beside the 2-byte parameters (default bf16)",
    )
    add_alias(parser, "--dtype", to=precision)
    parser.add_argument(
        "--optimizer-states",
        type=int,
        default=2,
        metavar="K",
        help="fp32 states per parameter the optimizer keeps (Adam 2, momentum SGD 1; default 2)",
    )
    parser.add_argument(
        "--headroom",
        type=fraction,
        default=0.1,
        metavar="FRACTION",
        help="fraction of device memory kept free (default 0.1)",
    )
    parser.add_argument(
        "--activations",
        default="0",
        metavar="BYTES",
        help="activation memory per rank, added to every stage (default 0: not included)",
    )
    shape = parser.add_argument_group(
        "activations from the model's shape",
        "estimate activations per rank from a transformer's shape instead of --activations "
        "(Korthikanti et al. 2022), with and without activation checkpointing; with --model, "
        "--layers/--hidden/--heads default to the model's config where it has one",
    )
    add_shape_args(shape)
    sequences = parser.add_argument_group(
        "long sequences",
        "with --seq: the longest sequence per rank that fits beside the ZeRO-3 state, with "
        "activation checkpointing, at every context-parallel degree dividing the world "
        "size, and the cp that --seq needs (coordinator/core/sequences.py)",
    )
    sequences.add_argument(
        "--vocab", type=int, metavar="V",
        help="vocabulary size, for the logits (default: the model's config; none with --params)",
    )  # fmt: skip
    experts = parser.add_argument_group(
        "mixture of experts",
        "with --ep: each layer's experts split over ep ranks, their state sharded over the "
        "world/ep ranks holding the same ones, the rest over the world ([Note: experts in "
        "the plan])",
    )
    experts.add_argument(
        "--ep", type=int, default=1, metavar="E",
        help="expert-parallel degree; every world size must be a multiple (default 1)",
    )  # fmt: skip
    experts.add_argument(
        "--expert-params", metavar="N",
        help="with --params: how many of them are the experts' (with --model: found in it)",
    )  # fmt: skip
    sequences.add_argument(
        "--tiled-loss", action="store_true",
        help="the loss is tiled (ZeroConfig.tiled_loss): no logits for the whole sequence",
    )  # fmt: skip
    offload = parser.add_argument_group(
        "offload",
        "when no stage fits the device, propose CPU offload of the optimizer (and at stage 3 "
        "the parameters), with the host memory it needs and the time its copies take",
    )
    offload.add_argument("--no-offload", action="store_true", help="never propose offload")
    offload.add_argument(
        "--host-memory",
        default="0",
        metavar="BYTES",
        help="host memory per rank, to check an offload against (default 0: unknown)",
    )
    offload.add_argument(
        "--pcie-bandwidth",
        default=f"{PCIE_BYTES_PER_S:.0f}",
        metavar="BYTES",
        help="device-host bytes per second (default 25GB: PCIe 4.0 x16)",
    )

    mesh = parser.add_argument_group(
        "device mesh",
        "the recommended (pp, dp, tp) mesh and ZeRO stage per world size "
        "(coordinator/core/meshplan.py choose_mesh): ZeRO alone first, tensor or pipeline "
        "parallelism only when it does not fit",
    )
    microbatches = mesh.add_argument(
        "--pipeline-microbatches", type=int, default=4, metavar="M",
        help="how many micro-batches a pipeline step splits the batch into (default 4)",
    )  # fmt: skip
    add_alias(mesh, "--microbatches", to=microbatches)
    mesh.add_argument(
        "--schedule", choices=("gpipe", "1f1b"), default="1f1b",
        help="pipeline schedule the activations are counted for (default 1f1b)",
    )  # fmt: skip
    mesh.add_argument(
        "--max-tp", type=int, default=8, metavar="T",
        help="largest tensor-parallel degree to consider (default 8: one node)",
    )  # fmt: skip
    mesh.add_argument(
        "--tp-share", type=fraction, default=None, metavar="FRACTION",
        help="with --params: the share of parameters tensor parallelism splits "
        "(default: 12*layers*hidden^2 when --layers/--hidden are given, else 0)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=plan)
    return parser


def inventory_of(module: object) -> list[ParamSpec]:
    """The parameter inventory of an ``nn.Module`` (duck-typed: no torch import here)."""
    return [
        ParamSpec(
            name=name,
            shape=tuple(p.shape),
            dtype=str(p.dtype).removeprefix("torch."),
            requires_grad=bool(p.requires_grad),
        )
        for name, p in module.named_parameters()
    ]


def _shape_of(model: object) -> dict[str, int]:
    """layers/hidden/heads (and vocab) from a model's config, where it has one (Hugging
    Face's, or zeroplane's GPT): what ``--layers``/``--hidden``/``--heads`` default to;
    and the elements of its experts modules, if any (``--ep``)."""
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    found: dict[str, int] = {}
    from worker.moe.dispatch import expert_modules  # (the model is a torch module)

    experts = sum(
        p.numel() for _, m in expert_modules(model) for p in m.parameters() if p.requires_grad
    )
    if experts:
        found["experts"] = experts
    for key, names in (
        ("layers", ("num_hidden_layers", "n_layer", "num_layers")),
        ("hidden", ("hidden_size", "n_embd", "d_model")),
        ("heads", ("num_attention_heads", "n_head", "num_heads")),
        ("vocab", ("vocab_size",)),
    ):
        for name in names:
            value = getattr(cfg, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                found[key] = value
                break
    return found


def _experts(
    args: argparse.Namespace, numel: int, shape: dict[str, int], world_sizes: list[int]
) -> tuple[int, int] | None:
    """(ep, the experts' elements) for ``--ep``; None without it."""
    if args.ep < 1:
        raise ValueError(f"--ep must be >= 1, got {args.ep}")
    if args.ep == 1:
        if args.expert_params is not None:
            raise ValueError("--expert-params needs --ep (the expert-parallel degree)")
        return None
    if args.expert_params is not None:
        if args.model is not None:
            raise ValueError("--expert-params is for --params; --model finds its experts")
        experts = parse_count(args.expert_params)
    elif args.params is not None:
        raise ValueError("--ep with --params needs --expert-params (the experts' share)")
    else:
        experts = shape.get("experts", 0)
        if not experts:
            raise ValueError(f"--ep {args.ep}: {args.model} has no experts module")
    if experts > numel:
        raise ValueError(f"--expert-params {experts:,} is more than the {numel:,} parameters")
    bad = [n for n in world_sizes if n % args.ep]
    if bad:
        raise ValueError(f"world sizes {bad} are not multiples of --ep {args.ep}")
    return args.ep, experts


def _activations(args: argparse.Namespace, defaults: dict[str, int]) -> ActivationShape | None:
    if args.seq is not None and args.activations != "0":
        raise ValueError("--activations and --seq both set activations: give one")
    return activation_shape(args, defaults)


def _load_model(spec: str) -> tuple[int, str, dict[str, int]]:
    numel, note, shape, _ = _load_model_sharded(spec)
    return numel, note, shape


def _load_model_sharded(spec: str) -> tuple[int, str, dict[str, int], int]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model must be MODULE:FUNCTION, got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {spec!r}: {exc}") from exc
    model = factory()
    if not hasattr(model, "named_parameters"):
        raise ValueError(f"{spec} returned {type(model).__name__}, not an nn.Module")
    inventory = inventory_of(model)
    numel = sum(p.numel for p in inventory if p.requires_grad)
    frozen = sum(p.numel for p in inventory if not p.requires_grad)
    note = f"{type(model).__name__} from {spec}: {len(inventory)} parameter tensors"
    if frozen:
        note += f", {frozen:,} frozen elements not counted"
    sharded = tp_sharded_numel((p.name, p.numel) for p in inventory if p.requires_grad)
    return numel, note, _shape_of(model), sharded


_OFFLOAD_MARK = {"none": "", "optimizer": "+oo", "params": "+op", "optimizer+params": "+oop"}


def _fixed(value: float, places: int) -> str:
    # Half up, as the ZeRO paper prints its table (41.25 -> 41.3).
    quantum = Decimal(1).scaleb(-places)
    return str(Decimal(repr(value)).quantize(quantum, rounding=ROUND_HALF_UP))


def _cell(value: float, scale: float) -> str:
    scaled = value / scale
    return _fixed(scaled, 1 if scaled >= 10 else 2)


def plan(args: argparse.Namespace) -> int:
    try:
        world_sizes = args.world_sizes
        device_memory = parse_bytes(args.device_memory)
        if args.params is not None:
            numel, source, shape = parse_count(args.params), "given", {}
            sharded = _sharded_share(args, numel)
        else:
            numel, source, shape, sharded = _load_model_sharded(args.model)
        if args.pipeline_microbatches < 1 or args.max_tp < 1:
            raise ValueError("--pipeline-microbatches and --max-tp must be >= 1")
        experts = _experts(args, numel, shape, world_sizes)
        numel -= 0 if experts is None else experts[1]
        config = PlanConfig(
            precision=args.precision,
            optimizer_states=args.optimizer_states,
            headroom=args.headroom,
            activation_bytes=parse_bytes(args.activations),
            activations=_activations(args, shape),
            offload=not args.no_offload,
            host_memory_bytes=parse_bytes(args.host_memory),
            pcie_bytes_per_s=float(parse_bytes(args.pcie_bandwidth)),
            experts=experts,
        )
    except ValueError as exc:
        print(f"zeroplane plan: {exc}", file=sys.stderr)
        return 2

    choices = [
        choose_stage(numel, world_size=n, device_memory_bytes=device_memory, config=config)
        for n in world_sizes
    ]
    meshes = (
        []
        if config.experts is not None
        else [
            choose_mesh(
                numel,
                sharded_numel=sharded,
                world_size=n,
                device_memory_bytes=device_memory,
                config=config,
                microbatches=args.pipeline_microbatches,
                schedule=args.schedule,
                max_tp=args.max_tp,
                heads=args.heads if args.heads is not None else shape.get("heads"),
                layers=args.layers if args.layers is not None else shape.get("layers"),
            )
            for n in world_sizes
        ]
    )
    vocab = args.vocab if args.vocab is not None else shape.get("vocab")
    sequences = (
        []
        if config.activations is None
        else [
            plan_sequence(
                numel,
                config.activations,
                world_size=n,
                device_memory_bytes=device_memory,
                config=config,
                vocab=vocab,
                tiled_loss=args.tiled_loss,
            )
            for n in world_sizes
        ]
    )
    layers = args.layers if args.layers is not None else shape.get("layers")
    hidden = args.hidden if args.hidden is not None else shape.get("hidden")
    # a transformer layer (4h² attention, 8h² MLP): the largest unit of such models
    unit_numel = 12 * hidden**2 if layers and hidden else 0
    if args.json:
        out = {
            "trainable_params": numel,
            "precision": config.precision,
            "optimizer_states": config.optimizer_states,
            "device_memory_bytes": device_memory,
            "headroom": config.headroom,
            "activation_bytes": config.activation_bytes,
            "activations": None if config.activations is None else vars(config.activations),
            "experts": None
            if config.experts is None
            else {"expert_parallel": config.experts[0], "numel": config.experts[1]},
            "sequences": [
                {
                    "world_size": p.world_size,
                    "seq": p.seq,
                    "needs_cp": p.needs,
                    "longest_by_cp": {str(cp): n for cp, n in p.longest.items()},
                }
                for p in sequences
            ],
            "plans": [
                {
                    "world_size": n,
                    "recommended_stage": c.stage,
                    "activation_checkpointing": c.checkpointing,
                    "offload": c.offload,
                    "offload_bytes_per_rank": None
                    if c.offload_estimate is None
                    else {
                        "device": c.offload_estimate.total,
                        "host": c.offload_estimate.host_total,
                        "transfer_per_step": c.offload_estimate.transfer_bytes,
                    },
                    "offload_seconds_per_step": c.offload_seconds,
                    "fits": c.fits,
                    "reason": c.reason,
                    "bytes_per_rank": {
                        str(e.stage): {
                            **e.model_states.as_dict(),
                            "activations": e.activation_bytes,
                            "total": e.total,
                        }
                        for e in c.estimates
                    },
                    "birth_bytes_per_rank": vars(_birth(numel, c.stage, n, config, unit_numel)),
                }
                for n, c in zip(world_sizes, choices, strict=True)
            ],
            "tp_sharded_params": sharded,
            "meshes": [_mesh_json(m) for m in meshes],
        }
        print(json.dumps(out, indent=2))
        return 0

    largest = max(e.total for c in choices for e in c.estimates)
    unit, scale, power = next((u for u in _UNITS if largest >= u[1]), ("B", 1.0, "1"))
    mixed = "mixed precision" if config.precision != "fp32" else "full precision"
    usable = device_memory * (1 - config.headroom)
    print(f"model: {numel:,} trainable parameters ({source})")
    if config.experts is not None:
        ep, experts = config.experts
        print(
            f"experts: {experts:,} more, split over ep={ep}: each rank holds 1/{ep} of every "
            f"layer's experts, sharded over world/{ep} ranks; the {numel:,} above over all"
        )
    print(
        f"precision: {config.precision} ({mixed}); optimizer: {config.optimizer_states} fp32 "
        "state(s) per parameter"
    )
    print(
        f"device memory: {_cell(device_memory, 1e9)} GB per rank, {config.headroom:.0%} "
        f"headroom -> {_cell(usable, 1e9)} GB usable"
    )
    act = config.activations
    if act is not None:
        kept = act.bytes(config.precision, checkpointing=False)
        ckpt = act.bytes(config.precision, checkpointing=True)
        print(
            f"activations: {act.layers} layers, hidden {act.hidden}, seq {act.seq}, "
            f"micro-batch {act.micro_batch}: {_cell(kept, 1e9)} GB per rank kept, "
            f"{_cell(ckpt, 1e9)} GB with activation checkpointing (+ac: the column "
            "uses it)"
        )
    elif config.activation_bytes:
        print(f"activations: {_cell(config.activation_bytes, 1e9)} GB per rank, in every column")
    else:
        print("activations: not included (0 per rank; --activations adds them)")
    print()
    header = ["world size", *(f"stage {s}" for s in STAGES), "recommended"]
    rows = [
        [
            str(n),
            *(_cell(e.total, scale) for e in c.estimates),
            f"{c.stage}{'+ac' if c.checkpointing else ''}{_OFFLOAD_MARK[c.offload]}"
            f"{'' if c.fits else '*'}",
        ]
        for n, c in zip(world_sizes, choices, strict=True)
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"memory per rank, {unit} (1 {unit} = {power} bytes)")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
    if any(not c.fits for c in choices):
        print("* does not fit in the usable device memory")
    if any(c.offload != "none" for c in choices):
        print("+oo: optimizer offloaded to host memory; +oop: optimizer and parameters")
    print()
    for n, c in zip(world_sizes, choices, strict=True):
        print(f"N={n}: stage {c.stage}: {c.reason}")
    print()
    unit_note = (
        f"a gather unit of {unit_numel:,} elements"
        if unit_numel
        else "gather units not known (--layers and --hidden give them)"
    )
    print(
        "birth, per rank: the peak while the engine is built, before the first step "
        f"(recommended stage; {unit_note}): an ordinary construction holds the whole "
        "fp32 model beside it, a model built on the meta device one unit"
    )
    for n, c in zip(world_sizes, choices, strict=True):
        b = _birth(numel, c.stage, n, config, unit_numel)
        training = c.estimates[c.stage].total
        print(
            f"N={n}: ordinary {_cell(b.ordinary, scale)} {unit}, meta "
            f"{_cell(b.meta, scale)} {unit}; training {_cell(training, scale)} {unit}"
        )
    print()
    print(
        f"mesh (pp x dp x tp) and stage: tensor parallelism splits {sharded:,} of the "
        f"{numel:,} parameters; pipeline activations for {args.pipeline_microbatches} "
        f"micro-batches, {args.schedule}"
    )
    by_size = dict(zip(world_sizes, choices, strict=True))
    for m in meshes:
        c = by_size[m.world_size]
        if not m.fits and c.fits and c.offload != "none":
            # the meshes are planned without offload: say what the stage table found
            print(
                f"N={m.world_size}: no mesh fits without offload; ZeRO alone with offload "
                f"does (stage {c.stage}{_OFFLOAD_MARK[c.offload]}, as above)"
            )
            continue
        star = "" if m.fits else " (does not fit)"
        print(f"N={m.world_size}: {m.reason}{star}")
    if not meshes:
        print("(expert parallelism runs over data parallelism only: no tp or pp beside it)")
    if sequences:
        print()
        logits = (
            "no logits (tiled loss)"
            if args.tiled_loss
            else f"the logits of {vocab:,} words"
            if vocab
            else "no logits (--vocab counts them)"
        )
        print(
            "long sequences (context parallelism): the longest sequence per cp group beside "
            f"the ZeRO-3 state, with activation checkpointing and {logits}"
        )
        for p in sequences:
            print(p.describe())
    return 0


def _birth(numel: int, stage: int, world_size: int, config: PlanConfig, unit: int) -> BirthBytes:
    return birth_bytes(
        numel, stage=stage, world_size=world_size, dtype=config.precision, unit_numel=unit
    )


def _sharded_share(args: argparse.Namespace, numel: int) -> int:
    if args.tp_share is not None:
        return round(numel * args.tp_share)
    if args.layers is not None and args.hidden is not None:
        return min(numel, 12 * args.layers * args.hidden**2)
    return 0


def _mesh_json(m: MeshChoice) -> dict:
    c = m.chosen
    return {
        "world_size": m.world_size,
        "pp": c.shape.pp,
        "dp": c.shape.dp,
        "tp": c.shape.tp,
        "stage": c.stage,
        "fits": m.fits,
        "reason": m.reason,
        "bytes_per_rank": {
            **c.model_states.as_dict(),
            "activations": c.activation_bytes,
            "total": c.total,
        },
    }
