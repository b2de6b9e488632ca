"""DeepSpeed's expert parallelism (AutoEP) beside ZeRO-3 on bench/moe.py's model and batch.

    python bench/moe_deepspeed.py --ep1-autoep            # ~6-8 min on 2 loaded cores
    python bench/moe_deepspeed.py --experts 8 --ep 2 --steps 3 --json out/moe_ds.json

The same run as bench/moe.py, on DeepSpeed 0.19 instead of zeroplane: 4 ranks on gloo
(``deepspeed.init_distributed(dist_backend="gloo")``, ``DS_ACCELERATOR=cpu``), one
thread a rank, transformers' ``MixtralForCausalLM`` built by ``bench.moe.model`` (4
layers, d=128, expert FFN 256, top-2, vocab 4096, 8 or 16 experts), 2 sequences of 64
tokens a rank (``bench.moe.batch``), ``torch.optim.AdamW(lr=1e-4)`` handed to
``deepspeed.initialize`` (no optimizer named in the config: no fused_adam build), fp32.
Each (experts, ep) case runs in a fresh ``mp.spawn`` of 4 ranks, so no DeepSpeed
process group or ZeRO hook leaks from one case into the next.

Mechanism:

* ep = 1: plain ZeRO stage 3 on the unmodified HF model (its own
  ``MixtralSparseMoeBlock``; every rank gathers every expert), as bench/moe.py's ep=1;
* ep > 1: DeepSpeed's AutoEP, config ``"expert_parallel": {"enabled": true,
  "autoep_size": ep, "preset_model": "mixtral"}``. ``deepspeed.initialize`` replaces each
  ``model.layers.N.mlp`` with an ``AutoEPMoELayer`` (``TokenChoiceTopKRouter``: softmax
  in fp32, top-2, renormalised, as Mixtral; no capacity, no token drop; E/ep experts a
  rank as ``GroupedExperts`` w1/w3/w2 SwiGLU; tokens by all-to-all in the ep group) and
  ZeRO-3 partitions the experts over their expert-data-parallel group of 4/ep ranks and
  the rest over all 4 (engine.py ``_partition_autoep_zero3_experts``). The client
  AdamW is built over ``model.parameters()``: DeepSpeed remaps it onto the replaced
  expert parameters itself (``_remap_client_optimizer_after_module_replacement``);
  ``split_params_into_different_moe_groups_for_optimizer`` cannot be applied beforehand,
  as the expert parameters do not exist before ``initialize``. ``--ep1-autoep`` adds
  rows for AutoEP with ``autoep_size=1`` (AutoEP's layer, no all-to-all).
* ``"stage3_param_persistence_threshold": 0``: DeepSpeed's default (1e5 elements) would
  keep every small parameter (norms, routers, 128x128 attention projections) whole on
  every rank between steps; zeroplane's ZeRO-3 keeps none, so neither does this run.

Refused or worked around (DeepSpeed 0.19.8, transformers 5.25):

* ZeRO-3 with DeepSpeed's own ``deepspeed.moe.layer.MoE`` is refused: "Native DeepSpeed
  MoE is not supported with ZeRO Stage 3. Use AutoEP or choose ZeRO stage 1/2."
  (engine.py); AutoEP is the path that takes ZeRO-3, so this script uses it.
* AutoEP's Mixtral preset fails inside ``initialize`` with transformers 5.25:
  "TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given"
  (auto_ep_presets/base.py calls ``registry.get(key, default)`` with a class-name
  string; transformers' registry ``get`` takes a model only). ``_shim_transformers``
  gives that ``get`` a plain-dict path for string keys; DeepSpeed's and transformers'
  computations are untouched (it only retargets the ``router_logits`` output recorder,
  which this run does not ask for).
* ``torch._grouped_mm``, AutoEP's default expert GEMM, is in this CPU build and used.

Columns, for rank 0 (the ranks are symmetric):

* state: model-state bytes this rank holds, summed over distinct tensor storages (a
  storage counted once however many views share it; ZeRO-3 in fp32 uses the partitioned
  parameter buffer as the fp32 master): the parameters (ZeRO-3's ``ds_tensor``
  partitions, i.e. ``fp16_partitioned_groups_flat`` / ``fp32_partitioned_groups_flat``,
  and any parameter storage left materialised), the gradients
  (``grad_partitions_flat_buffer`` for ZeRO-3; ``averaged_gradients`` and ``.grad`` of
  the master partitions for ZeRO-1/2) taken after backward, and AdamW's
  ``exp_avg``/``exp_avg_sq``/``step`` tensors taken after the step; the tensors of the
  first snapshot are held until the second so no address is reused in between. Not
  counted: activations, communication buckets, prefetch buffers. ``--json`` also
  writes the split and bench/moe.py's formula (16 bytes an element over the ranks
  that share it). Measured: 20 bytes an element (state/formula = 1.25 in every row),
  as ZeRO-3 keeps an fp32 master partition beside the fp32 parameter partition even
  in fp32: stage3.py ``_create_fp32_partitions`` reuses the parameter partition only
  if ``tensor.device == self.device``, and ``self.device`` is the string ``"cpu"``,
  which a ``torch.device`` never equals; the experts' share is E/ep experts over 4/ep
  ranks = E/4 whatever ep, so the state is the same for every ep;
* step: the median of ``--steps`` timed steps (forward, ``engine.backward``,
  ``engine.step``) after ``--warmup``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import free_port, quiet_gloo_warnings, rank_env
from bench.moe import ROWS, WORLD, batch, model


def _shim_transformers() -> None:
    """Let AutoEP's ``registry.get(class_name, default)`` work on transformers 5.25's
    ``_CanRecordRegistry``, whose ``get`` takes a model only (see the module docstring)."""
    from transformers.utils import output_capturing as oc

    original = oc._CanRecordRegistry.get
    if getattr(original, "_dsmoe_shim", False):
        return

    def get(self, key, *default):
        if isinstance(key, str):
            return dict.get(self, key, *default)
        return original(self, key)

    get._dsmoe_shim = True
    oc._CanRecordRegistry.get = get


def ds_config(stage: int, ep: int, autoep: bool) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        "zero_allow_untested_optimizer": True,
    }
    if autoep:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"}
    return config


def _tensors(obj, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)


def _param_tensors(engine) -> list:
    zero = engine.optimizer
    out: list = []
    for p in engine.module.parameters():
        if hasattr(p, "ds_tensor"):
            out.append(p.ds_tensor)
        if p.numel() > 0:  # a whole parameter left materialised (ZeRO-1/2: all of them)
            out.append(p.data)
    for name in (
        "fp16_partitioned_groups_flat",
        "fp32_partitioned_groups_flat",
        "bit16_groups_flat",
        "single_partition_of_fp32_groups",
    ):
        _tensors(getattr(zero, name, None), out)
    return out


def _grad_tensors(engine) -> list:
    zero = engine.optimizer
    out: list = []
    _tensors(getattr(zero, "grad_partitions_flat_buffer", None), out)
    _tensors(getattr(zero, "averaged_gradients", None), out)
    for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        for t in getattr(zero, name, None) or []:
            if isinstance(t, torch.Tensor) and t.grad is not None:
                out.append(t.grad)
    for p in engine.module.parameters():
        if p.grad is not None:
            out.append(p.grad)
    return out


def _optimizer_tensors(engine) -> list:
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    out: list = []
    _tensors(list(inner.state.values()), out)
    return out


def _bytes_by_kind(snapshots: list[tuple[str, list]]) -> dict[str, int]:
    """Bytes of distinct storages, each under the first kind that names it."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for kind, tensors in snapshots:
        out.setdefault(kind, 0)
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            out[kind] += storage.nbytes()
    return out


def measure(experts: int, ep: int, autoep: bool, stage: int, rank: int, warmup: int, steps: int):
    import deepspeed

    m = model(experts)
    expert_numel = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)
    dense_numel = sum(p.numel() for p in m.parameters()) - expert_numel
    engine, *_ = deepspeed.initialize(
        model=m,
        optimizer=torch.optim.AdamW(m.parameters(), lr=1e-4),
        config=ds_config(stage, ep, autoep),
    )
    times = []
    for step in range(warmup + steps):
        ids = batch(step, rank)
        start = time.perf_counter()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        times.append(time.perf_counter() - start)
    # one more step, untimed, to take the state: grads after backward, the rest after step
    ids = batch(warmup + steps, rank)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    grads = _grad_tensors(engine)  # held: no storage address is reused before the count
    engine.step()
    kinds = _bytes_by_kind(
        [
            ("params", _param_tensors(engine)),
            ("grads", grads),
            ("optim", _optimizer_tensors(engine)),
        ]
    )
    # bench/moe.py's formula: fp32 param + grad + AdamW's two moments, 16 bytes an element,
    # over the ranks that share it (ZeRO-1/2: the 4-byte parameters stay whole)
    shared = expert_numel / ep / (WORLD // ep)
    if stage == 3:
        formula = 16 * (dense_numel / WORLD + shared)
    else:
        formula = 4 * (dense_numel + expert_numel / ep) + 12 * (dense_numel / WORLD + shared)
    row = {
        "experts": experts,
        "ep": ep,
        "mechanism": "autoep" if autoep else "zero",
        "stage": stage,
        "psi_dense": dense_numel,
        "psi_experts": expert_numel,
        **{f"state_{k}": v for k, v in kinds.items()},
        "state": sum(kinds.values()),
        "formula": formula,
        "step_s": statistics.median(times[warmup:]),
        "times_s": times,
    }
    engine.destroy()
    return row


def run_rank(rank: int, port: int, case: tuple, warmup: int, steps: int, out) -> None:
    experts, ep, autoep, stage = case
    os.environ.update(rank_env(rank, WORLD, port))
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    quiet_gloo_warnings()
    import deepspeed

    _shim_transformers()
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        row = measure(experts, ep, autoep, stage, rank, warmup, steps)
        if rank == 0:
            out["row"] = row
    except Exception as e:
        if rank == 0:
            out["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def table(rows: list[dict]) -> str:
    lines = ["| experts | ep | stage | state MB | step ms |", "|---|---|---|---|---|"]
    for r in rows:
        ep = f"{r['ep']}" + (" (AutoEP)" if r["mechanism"] == "autoep" and r["ep"] == 1 else "")
        if "error" in r:
            lines.append(
                f"| {r['experts']} | {ep} | {r['stage']} | refused: {r['error'][:80]} | - |"
            )
            continue
        lines.append(
            f"| {r['experts']} | {ep} | {r['stage']} | {r['state'] / 1e6:.2f} "
            f"| {r['step_s'] * 1e3:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, nargs="+", default=[8, 16])
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--stage", type=int, default=3, choices=[1, 2, 3])
    p.add_argument("--ep1-autoep", action="store_true", help="add AutoEP autoep_size=1 rows")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    cases = []
    for e in args.experts:
        for ep in args.ep:
            cases.append((e, ep, ep > 1, args.stage))
            if ep == 1 and args.ep1_autoep:
                cases.append((e, 1, True, args.stage))
    rows = run_cases(cases, args.warmup, args.steps)
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


def run_cases(cases: list[tuple], warmup: int, steps: int) -> list[dict]:
    """Each case ``(experts, ep, autoep, stage)`` in fresh processes; a refused one is
    a row with DeepSpeed's message (bench/moe.py --peers runs these beside its own)."""
    rows = []
    manager = mp.Manager()
    for case in cases:
        out = manager.dict()
        try:
            mp.spawn(run_rank, args=(free_port(), case, warmup, steps, out), nprocs=WORLD)
            rows.append(out["row"])
        except Exception as e:  # a refused case: keep DeepSpeed's message, go on
            experts, ep, autoep, stage = case
            message = out.get("error", f"{type(e).__name__}: {e}")
            rows.append(
                {"experts": experts, "ep": ep, "mechanism": "autoep" if autoep else "zero",
                 "stage": stage, "error": message}
            )  # fmt: skip
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
