"""DeepSpeed's Ulysses sequence parallelism (ALST) beside bench/context.py's rows.

    python bench/context_deepspeed.py                    # ~3-5 min on 2 loaded cores
    python bench/context_deepspeed.py --seqs 2048,4096 --json out/context_ds.json

The same model and batch as bench/context.py, on DeepSpeed 0.19 instead of zeroplane:
4 ranks on gloo (``deepspeed.init_distributed(dist_backend="gloo")``,
``DS_ACCELERATOR=cpu``), one thread a rank, ``bench.context.model()`` (transformers'
``LlamaForCausalLM``, 4 layers, d=128, 8 heads, 4 kv heads, vocabulary 16384) with
transformers' gradient checkpointing of every layer (as zeroplane's
``activation_checkpointing="units"``), ZeRO stage 3, fp32, AdamW (``torch_adam``).
Each (sp, seq) case runs in a fresh ``mp.spawn``.

Mechanism: ``UlyssesSPAttentionHF.register_with_transformers(model,
core_attn_implementation="sdpa", sequence_parallel_size=sp, ...)`` switches the
model's attention to DeepSpeed's all-to-all around sdpa and returns the
sequence-parallel ``mpu``, handed to ``deepspeed.initialize`` with
``"sequence_parallel_size": sp`` in the config. Each rank of a sequence-parallel group
takes its contiguous shard of the sequence, its position ids and its shard of the
labels shifted over the whole sequence (``shift_labels``), as ALST's data-loader
adapter makes them; sp = 1 is plain ZeRO-3 on the same model. ALST's tiled loss and
MLP are not used (bench/context.py's rows without the tiled loss compare).

Columns, for rank 0: saved (the bytes autograd keeps for backward in a step:
distinct tensor storages that are not parameters, counted by saved-tensor hooks
around the forward, as zeroplane's engine counts its own), peak (the growth of peak
resident memory over one step, as bench/context.py measures it) and step (median).
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
from bench.context import VOCAB, WORLD, _peak, _reset_peak, _rss, model


def _saving() -> tuple[object, dict[int, int]]:
    """Saved-tensor hooks that count distinct non-parameter storages."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            s = t.untyped_storage()
            seen.setdefault(s._cdata, s.nbytes())
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), seen


def measure(sp: int, seq: int, rank: int, steps: int) -> dict:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    m = model()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # (at sp = 1 it registers nothing and returns None: plain ZeRO-3)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=m, core_attn_implementation="sdpa", sequence_parallel_size=sp,
        micro_batch_size=1, seq_length=seq, seq_length_is_variable=True,
    )  # fmt: skip
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    }
    if sp > 1:
        config["sequence_parallel_size"] = sp
    engine, *_ = deepspeed.initialize(
        model=m, config=config, mpu=mpu, model_parameters=m.parameters()
    )
    sp_rank = 0 if mpu is None else dist.get_rank(mpu.get_sequence_parallel_group())
    share = rank // sp
    g = torch.Generator().manual_seed(share)
    ids = torch.randint(0, VOCAB, (1, seq), generator=g)
    mine = slice(sp_rank * seq // sp, (sp_rank + 1) * seq // sp)
    shift = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    batch = {
        "input_ids": ids[:, mine],
        "position_ids": torch.arange(seq)[None, mine],
        "labels": shift[:, mine],
        "shift_labels": shift[:, mine],
    }
    times, peaks, saved = [], [], 0
    for _ in range(steps + 1):
        _reset_peak()
        before = _rss()
        start = time.perf_counter()
        hooks, seen = _saving()
        with hooks:
            out = engine(**batch)
        engine.backward(out.loss)
        engine.step()
        times.append(time.perf_counter() - start)
        peaks.append(_peak() - before)
        saved = sum(seen.values())
    engine.destroy()
    return {
        "sp": sp,
        "seq": seq,
        "saved": saved,
        "peak": max(peaks[1:]),
        "step_s": statistics.median(times[1:]),
    }


def run_rank(rank: int, port: int, case: tuple, steps: int, out) -> None:
    sp, seq = case
    os.environ.update(rank_env(rank, WORLD, port))
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    quiet_gloo_warnings()
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    try:
        row = measure(sp, seq, rank, steps)
        if rank == 0:
            out["row"] = row
    except Exception as e:
        if rank == 0:
            out["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_cases(cases: list[tuple[int, int]], steps: int) -> list[dict]:
    """Each ``(sp, seq)`` in fresh processes; a refused one is a row with the error."""
    rows = []
    manager = mp.Manager()
    for sp, seq in cases:
        out = manager.dict()
        try:
            mp.spawn(run_rank, args=(free_port(), (sp, seq), steps, out), nprocs=WORLD)
            rows.append(out["row"])
        except Exception as e:  # keep DeepSpeed's message, go on
            rows.append({"sp": sp, "seq": seq, "error": out.get("error", f"{e}")})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| seq | sp | saved MB | peak MB | step ms |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['seq']} | {r['sp']} | refused: {r['error'][:80]} | - | - |")
            continue
        lines.append(
            f"| {r['seq']} | {r['sp']} | {r['saved'] / 1e6:.1f} | {r['peak'] / 1e6:.1f} "
            f"| {r['step_s'] * 1e3:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="2048,4096,8192")
    p.add_argument("--sp", default="1,2,4")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    cases = [(int(sp), int(seq)) for seq in args.seqs.split(",") for sp in args.sp.split(",")]
    rows = run_cases(cases, args.steps)
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
