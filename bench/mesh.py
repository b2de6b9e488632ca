"""ZeRO on a device mesh, side by side: per-rank memory, bytes moved and step time.

    python bench/mesh.py                       # ~5-10 min on 2 loaded cores
    python bench/mesh.py --steps 3 --json out/mesh.json

One run, 4 ranks on gloo, a ≈20M-parameter GPT (worker.models, 8 layers, d=384,
vocab 8192, untied) and one global batch (8 sequences of 128 tokens), for:

* ``dp4-z3``: zeroplane ZeRO stage 3 over dp=4;
* ``tp2dp2-z1``: tensor parallel 2 (worker/tp.py, torch's parallelize_module)
  x ZeRO stage 1 over dp=2;
* ``pp2dp2-z1``: pipeline 2 stages (worker/pipeline.py, torch's GPipe, 4
  micro-batches) x ZeRO stage 1 over dp=2;
* ``fsdp2+tp``: torchtitan-style FSDP2 (``fully_shard`` each block and the root
  over dp=2) on top of the same tensor-parallel plan over tp=2;
* the combinations that were refused before issue #35: ``tp2dp2-z3`` (tp x ZeRO
  stage 3), ``pp2dp2-z2`` (a pipeline x ZeRO stage 2, through ``train_batch``)
  and ``tp2dp2-z1-ckpt`` (tp x stage 1 with activation checkpointing of every
  block, ``"units"``).

Columns, per rank (rank 0; the mesh is symmetric but for the pipeline's first
and last stage, shown as two rows):

* model state: bytes of parameters, gradients and optimizer state this rank
  holds after a step (zeroplane's ``memory_report``; for FSDP2 the local
  tensors of its sharded DTensors and of AdamW's state);
* activations: bytes of distinct non-parameter storages autograd saved in one
  step's forward(s) (saved-tensor hooks, the same way for every system); for
  the pipeline, over all its micro-batches (GPipe keeps all of them until
  their backward, so this is its peak);
* dp / tp / pp bytes: what the rank sends per step. dp is measured (the
  collectives module's wire bytes of the ZeRO collectives; FSDP2's is the
  formula ``3*Ψ_rank*(dp-1)/dp`` for its gather-gather-scatter); tp is torch
  DTensor's all-reduces counted (a dispatch mode that counts torch's functional
  all-reduce; torch's ``CommDebugMode`` trips over stage 3's hooks) times their size and the
  ring factor ``2(t-1)/t``; pp is the activations and gradients the stage
  sends (``PipelineStage``'s p2p, by formula: one ``b*s*h`` tensor per
  micro-batch each way);
* formula: the model state the ZeRO formulas (coordinator/core/memory.py
  ``model_state_bytes``, fp32, AdamW's two states) give for this rank's local
  parameters (its tp slices, its pipeline stage) over its dp group; state/formula
  is what padding and alignment add;
* step time: the median of ``--steps`` timed steps after ``--warmup``; on a
  shared 2-core machine this mostly shows CPU contention.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import free_port, quiet_gloo_warnings

WORLD = 4
GLOBAL_BATCH, SEQ = 8, 128
SYSTEMS = (
    "dp4-z3", "tp2dp2-z1", "tp2dp2-z3", "tp2dp2-z1-ckpt", "pp2dp2-z1", "pp2dp2-z2", "fsdp2+tp",
)  # fmt: skip
# what each zeroplane system runs: (stage, tp, pp, activation checkpointing)
LAYOUTS = {
    "dp4-z3": (3, 1, 1, "none"),
    "tp2dp2-z1": (1, 2, 1, "none"),
    "tp2dp2-z3": (3, 2, 1, "none"),
    "tp2dp2-z1-ckpt": (1, 2, 1, "units"),
    "pp2dp2-z1": (1, 1, 2, "none"),
    "pp2dp2-z2": (2, 1, 2, "none"),
}


def gpt():
    from worker.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=8192, block_size=SEQ, n_layer=8, n_head=8, n_embd=384, tie_weights=False
    )
    return GPT(cfg)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 8192, (GLOBAL_BATCH, SEQ), generator=g)
    return idx, torch.roll(idx, 1, 1)


def saved_bytes(model: torch.nn.Module, run) -> tuple[object, int]:
    """Run ``run()``; bytes of distinct non-parameter storages autograd packed."""
    params = set()
    for p in model.parameters():
        params.add(getattr(p, "_local_tensor", p).untyped_storage()._cdata)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = getattr(t, "_local_tensor", t).untyped_storage()
        if storage._cdata not in params:
            seen.setdefault(storage._cdata, storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(seen.values())


def data_bytes(report: dict) -> int:
    return sum(v["wire_bytes"] for op, v in report.items() if op != "control")


class AllReduces(TorchDispatchMode):
    """Counts the all-reduces DTensor issues (torch's functional collectives)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "all_reduce" in str(func):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def tp_bytes(calls: int, tp: int, numel: int) -> float:
    return calls * numel * 4 * 2 * (tp - 1) / tp


def run_rank(rank: int, port: int, system: str, warmup: int, steps: int, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    quiet_gloo_warnings()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=600),
    )
    try:
        out[rank] = measure(system, rank, warmup, steps)
    finally:
        dist.destroy_process_group()


def measure(system: str, rank: int, warmup: int, steps: int) -> dict:
    import worker
    from coordinator.core.memory import model_state_bytes
    from worker.mesh import ParallelConfig, parallelize
    from worker.pipeline import pipeline

    model = gpt()
    numel = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    hidden = model.cfg.n_embd
    row: dict = {"system": system, "rank": rank, "psi": numel}
    if system not in LAYOUTS:
        return measure_fsdp2_tp(model, rank, warmup, steps)
    stage, tp, pp, ckpt = LAYOUTS[system]
    config = worker.ZeroConfig(stage=stage, activation_checkpointing=ckpt)
    if pp > 1:
        engine = pipeline(
            model,
            opt,
            config=config,
            parallel=ParallelConfig(pipeline_parallel=pp, microbatches=4),
        )
        row["pp_stage"] = engine.coords.pp
    elif tp > 1:
        engine = parallelize(model, opt, config=config, parallel=ParallelConfig(tensor_parallel=tp))
    else:
        engine = worker.initialize(model, opt, config=config)
    dp = engine.shape.dp if pp * tp > 1 else WORLD
    d = engine.coords.dp if pp * tp > 1 else rank
    local = sum(p.numel() for p in engine.module.parameters())
    row["formula"] = model_state_bytes(local, stage=stage, world_size=dp, dtype="fp32").total
    rows = GLOBAL_BATCH // dp
    times, acts, moved_dp, moved_tp = [], 0, 0, 0.0
    for step in range(warmup + steps + 1):
        idx, tgt = batch(step)
        idx, tgt = idx[rows * d : rows * (d + 1)], tgt[rows * d : rows * (d + 1)]
        before = engine.comm_report()
        start = time.perf_counter()
        counter = AllReduces() if tp > 1 else contextlib.nullcontext()
        if pp > 1:
            _, acts = saved_bytes(
                engine.engine.module, lambda i=idx, t=tgt: engine.train_step(i, t)
            )
        else:
            with counter:
                loss, acts = saved_bytes(model, lambda i=idx, t=tgt: engine(i, t))
                engine.backward(loss)
            engine.step()
        elapsed = time.perf_counter() - start
        after = engine.comm_report()
        if step >= warmup and step < warmup + steps:
            times.append(elapsed)
        # the collectives module books a collective's full logical tensor; a rank
        # sends (dp-1)/dp of it in a ring
        moved_dp = (data_bytes(after) - data_bytes(before)) * (dp - 1) / dp
        if tp > 1:
            moved_tp = tp_bytes(counter.calls, tp, rows * SEQ * hidden)
    report = engine.memory_report()
    row.update(
        model_state=report["params"] + report["grads"] + report["master"] + report["optimizer"],
        activations=acts,
        dp_bytes=moved_dp,
        tp_bytes=moved_tp,
        pp_bytes=2 * 4 * (rows // 4) * SEQ * hidden * 4 if pp > 1 else 0,
        step_s=statistics.median(times),
    )
    return row


def measure_fsdp2_tp(model, rank: int, warmup: int, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from worker.tp import gpt_plan

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    numel = sum(p.numel() for p in model.parameters())
    parallelize_module(model, mesh["tp"], gpt_plan(model))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    d = mesh["dp"].get_local_rank()
    rows = GLOBAL_BATCH // 2
    times, acts, moved_tp = [], 0, 0.0
    for step in range(warmup + steps + 1):
        idx, tgt = batch(step)
        idx, tgt = idx[rows * d : rows * (d + 1)], tgt[rows * d : rows * (d + 1)]
        start = time.perf_counter()
        counter = AllReduces()
        with counter:
            loss, acts = saved_bytes(model, lambda i=idx, t=tgt: model(i, t))
            loss.backward()
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        if step >= warmup and step < warmup + steps:
            times.append(elapsed)
        moved_tp = tp_bytes(counter.calls, 2, rows * SEQ * model.cfg.n_embd)
    local = sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters())
    state = sum(
        getattr(t, "_local_tensor", t).numel() * 4
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    # between steps FSDP2 frees the gathered parameters and keeps sharded grads
    return {
        "system": "fsdp2+tp",
        "rank": rank,
        "psi": numel,
        "model_state": 4 * local * 2 + state,
        "activations": acts,
        "dp_bytes": 3 * 4 * local * (2 - 1),  # formula: local shard x dp x (dp-1)/dp x 3
        "tp_bytes": moved_tp,
        "pp_bytes": 0,
        "step_s": statistics.median(times),
    }


def run_system(system: str, warmup: int, steps: int) -> list[dict]:
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(run_rank, args=(free_port(), system, warmup, steps, out), nprocs=WORLD)
    return [out[r] for r in sorted(out.keys())]


def mb(x: float) -> str:
    return f"{x / 1e6:8.2f}"


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["system"] == "dp4-z3" and r["rank"] == 0), None)
    lines = [
        f"GPT, {rows[0]['psi'] / 1e6:.1f}M parameters, global batch {GLOBAL_BATCH}x{SEQ}, "
        f"{WORLD} ranks on gloo; MB = 1e6 bytes, per rank, per step",
        f"{'system':<16}{'rank':>5}{'state MB':>10}{'formula':>9}{'act MB':>9}{'dp MB':>9}"
        f"{'tp MB':>9}{'pp MB':>9}{'step s':>8}{'state/dp4-z3':>14}",
    ]
    for r in rows:
        ratio = r["model_state"] / base["model_state"] if base else float("nan")
        formula = mb(r["formula"]) if "formula" in r else "       -"
        lines.append(
            f"{r['system']:<16}{r['rank']:>5}{mb(r['model_state']):>10}{formula:>9}"
            f"{mb(r['activations']):>9}{mb(r['dp_bytes']):>9}{mb(r['tp_bytes']):>9}"
            f"{mb(r['pp_bytes']):>9}{r['step_s']:>8.2f}{ratio:>14.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for system in args.systems:
        try:
            ranks = run_system(system, args.warmup, args.steps)
        except Exception as exc:  # a peer that fails is reported, the others still run
            print(f"{system}: failed: {exc}", file=sys.stderr)
            continue
        keep = [ranks[0]]
        if system.startswith("pp"):
            keep.append(next(r for r in ranks if r.get("pp_stage") == 1))
        rows += keep
        print(table(rows), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
