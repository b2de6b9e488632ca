"""Expert parallelism beside ZeRO-3: model state per rank, bytes moved, step time.

    python bench/moe.py                          # ~3-6 min on 2 loaded cores
    python bench/moe.py --experts 8 --steps 3 --json out/moe.json

One run, 4 ranks on gloo, a Mixtral-like model (transformers' ``MixtralForCausalLM``:
4 layers, d=128, expert FFN 256, top-2, vocab 4096) with 8 and 16 experts a layer,
one global batch of 8 sequences of 64 tokens (2 a rank), AdamW, fp32, ZeRO stage 3
everywhere, for ``ep`` = 1 (plain ZeRO-3: every expert's weights gathered by every
rank), 2 and 4 (worker/moe/dispatch.py: E/ep experts a rank, tokens by all-to-all).

Columns, for rank 0 (the ranks are symmetric):

* state: model-state bytes after a step (``engine.memory_report()['total']``),
  and the formula: ZeRO-3's 16 bytes an element over the world for the dense
  part, and for the experts 16 bytes an element of this rank's E/ep experts over
  their expert-data-parallel group of world/ep ranks (coordinator/core/memory.py
  ``model_state_bytes``); state/formula is what bucket padding adds;
* gathered: parameter bytes this rank's all-gathers bring in a step (measured), and
  in brackets the experts' part (under ep, the ``experts`` group's all-gathers,
  measured; under plain ZeRO-3, the expert elements of the units each all-gather
  brought, counted at the gathers);
* a2a: the token all-to-all bytes this rank sends and receives in a step
  (dispatch and combine, forward and backward);
* step: the median of ``--steps`` timed steps after ``--warmup``, and its ratio
  to ep=1's, measured in the same run (one shared 2-core machine: mostly CPU
  contention).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import free_port, gloo_group, quiet_gloo_warnings

WORLD, ROWS, SEQ, VOCAB = 4, 2, 64, 4096


def model(experts: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, num_local_experts=experts,
        num_experts_per_tok=2, max_position_embeddings=SEQ, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)


def measure(experts: int, ep: int, rank: int, warmup: int, steps: int) -> dict:
    import worker
    from coordinator.core.memory import model_state_bytes
    from worker.parallel import ParallelConfig

    m = model(experts)
    expert_numel = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)
    dense_numel = sum(p.numel() for p in m.parameters()) - expert_numel
    config = worker.ZeroConfig(stage=3)
    engine = worker.initialize(
        m,
        torch.optim.AdamW(m.parameters(), lr=1e-4),
        config=config,
        parallel=ParallelConfig(expert_parallel=ep) if ep > 1 else None,
    )
    formula = model_state_bytes(dense_numel, stage=3, world_size=WORLD, dtype="fp32").total
    formula += model_state_bytes(
        expert_numel // ep, stage=3, world_size=WORLD // ep, dtype="fp32"
    ).total
    times, gathered, expert_gathered, a2a = [], [], [], []
    counted = _count_expert_gathers(engine) if ep == 1 else None
    for step in range(warmup + steps):
        ids = batch(step, rank)
        was = 0 if counted is None else counted[0]
        before = engine.comm_report(by_group=True)
        start = time.perf_counter()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        times.append(time.perf_counter() - start)
        after = engine.comm_report(by_group=True)
        moved = _delta(before, after)
        gathered.append(sum(v.get("all_gather", 0) for v in moved.values()))
        if counted is None:
            expert_gathered.append(moved.get("experts", {}).get("all_gather", 0))
        else:  # plain ZeRO-3: the expert elements of the units gathered
            expert_gathered.append(counted[0] - was)
        a2a.append(sum(v.get("all_to_all", 0) for v in moved.values()))
    row = {
        "experts": experts,
        "ep": ep,
        "psi_dense": dense_numel,
        "psi_experts": expert_numel,
        "state": engine.memory_report()["total"],
        "formula": formula,
        "gathered": statistics.median(gathered[warmup:]),
        "expert_gathered": statistics.median(expert_gathered[warmup:]),
        "a2a": statistics.median(a2a[warmup:]),
        "step_s": statistics.median(times[warmup:]),
    }
    engine.close()
    return row


def _delta(before: dict, after: dict) -> dict[str, dict[str, int]]:
    """Bytes received by op and scope between two ``comm_report(by_group=True)``."""
    out: dict[str, dict[str, int]] = {}
    for scope, ops in after.items():
        for op, stats in ops.items():
            was = before.get(scope, {}).get(op, {}).get("bytes", 0)
            out.setdefault(scope, {})[op] = stats["bytes"] - was
    return out


def _count_expert_gathers(engine) -> list[int]:
    """Under plain ZeRO-3, count the bytes of expert elements each gather brings: every
    unit's gather that issues a collective adds its buckets' expert slots (one
    all-gather brings the whole bucket). Returns the running total, in a list."""
    from worker.flat import UnitState

    total = [0]
    for unit in engine.units:
        size = sum(
            s.numel * b.full.element_size()
            for b in unit.buckets
            for s in b.spec.slots
            if ".experts." in s.name
        )
        if not size:
            continue

        def counted(comm, unit=unit, size=size, gather=unit.gather) -> None:
            if unit.state is UnitState.SHARDED:
                total[0] += size
            gather(comm)

        unit.gather = counted
    return total


def run_rank(rank: int, port: int, cases: list, warmup: int, steps: int, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    quiet_gloo_warnings()
    with gloo_group("127.0.0.1", port, rank, WORLD, timedelta(seconds=600)):
        rows = [measure(e, ep, rank, warmup, steps) for e, ep in cases]
        if rank == 0:
            out["rows"] = rows


def table(rows: list[dict]) -> str:
    lines = [
        "| experts | ep | state MB | formula MB | state/formula | gathered MB (experts) "
        "| a2a MB | step ms | step vs ep=1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r["experts"]: r["step_s"] for r in rows if r["ep"] == 1}
    for r in rows:
        lines.append(
            f"| {r['experts']} | {r['ep']} | {r['state'] / 1e6:.2f} | {r['formula'] / 1e6:.2f} "
            f"| {r['state'] / r['formula']:.3f} | {r['gathered'] / 1e6:.2f} "
            f"({r['expert_gathered'] / 1e6:.2f}) | {r['a2a'] / 1e6:.2f} "
            f"| {r['step_s'] * 1e3:.0f} | {r['step_s'] / base[r['experts']]:.2f}x |"
        )
    return "\n".join(lines)


def beside(rows: list[dict], peers: list[dict]) -> str:
    """zeroplane's rows beside DeepSpeed's for the same (experts, ep), as ratios."""
    lines = [
        "| experts | ep | zeroplane state MB | DeepSpeed state MB | state zp/DS "
        "| zeroplane step ms | DeepSpeed step ms | step zp/DS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_case = {(r["experts"], r["ep"]): r for r in peers}
    for r in rows:
        d = by_case.get((r["experts"], r["ep"]))
        if d is None or "error" in d:
            why = "not run" if d is None else f"refused: {d['error'][:60]}"
            lines.append(f"| {r['experts']} | {r['ep']} | {r['state'] / 1e6:.2f} | {why} |")
            continue
        lines.append(
            f"| {r['experts']} | {r['ep']} | {r['state'] / 1e6:.2f} | {d['state'] / 1e6:.2f} "
            f"| {r['state'] / d['state']:.2f}x | {r['step_s'] * 1e3:.0f} "
            f"| {d['step_s'] * 1e3:.0f} | {r['step_s'] / d['step_s']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, nargs="+", default=[8, 16])
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--peers",
        action="store_true",
        help="then the same cases under DeepSpeed (bench/moe_deepspeed.py: ZeRO-3, AutoEP "
        "for ep > 1), each in fresh processes, and the ratios",
    )
    args = p.parse_args()
    cases = [(e, ep) for e in args.experts for ep in args.ep]
    out = mp.Manager().dict()
    mp.spawn(
        run_rank, args=(free_port(), cases, args.warmup, args.steps, out), nprocs=WORLD, join=True
    )
    rows = out["rows"]
    print(table(rows))
    if args.peers:
        from bench.moe_deepspeed import run_cases

        peers = run_cases([(e, ep, ep > 1, 3) for e, ep in cases], args.warmup, args.steps)
        print(beside(rows, peers))
        rows = [*rows, *({"peer": "deepspeed", **r} for r in peers)]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
