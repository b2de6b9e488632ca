"""Context parallelism beside ZeRO-3: activation memory per rank by sequence length,
the longest sequence within a budget, and step time.

    python bench/context.py                       # ~5-10 min on 2 loaded cores
    python bench/context.py --json out/context.json --budget-mb 768

One run, 4 ranks on gloo, a Llama-like decoder (transformers' ``LlamaForCausalLM``:
4 layers, d=128, 8 heads, 4 key/value heads, MLP 384, vocabulary 16384), fp32, ZeRO
stage 3 with activation checkpointing of every layer, one sequence a cp group, for cp
= 1 (each rank its own sequence: plain ZeRO-3), 2 and 4, both kinds (all-to-all,
ring), with and without the tiled loss (256 tokens a tile).

Columns, for rank 0 (the ranks are symmetric):

* saved: the bytes autograd keeps for backward in a step, measured by the engine
  (``memory_report()['activations']``: every saved tensor's storage once);
* peak: the growth of the process's peak resident memory over one step from
  its resident memory before it (``VmHWM`` reset through ``/proc/self/clear_refs``,
  freed memory given back with ``malloc_trim`` first): what the step's activations,
  gradients in flight, gathered units and transient buffers cost together;
* step: the median of the timed steps, and its ratio to cp=1 at the same length.

Then the longest sequence whose peak growth stays within ``--budget-mb`` at cp = 1
and cp = 4 (all-to-all), without and with the tiled loss: lengths doubled from 1024
until one exceeds the budget, then halved between the last two.

Peers: ``--peers`` runs DeepSpeed's Ulysses for transformers models (ALST's
``UlyssesSPAttentionHF``, bench/context_deepspeed.py) on the same model and lengths
and prints its rows beside zeroplane's all-to-all ones, as ratios; torch's
experimental ``context_parallel`` is tried on the same model in the same run, and
what it did is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
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

WORLD, VOCAB = 4, 16384


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1 << 18,
        tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(case: dict, rank: int, steps: int) -> dict:
    import worker
    from worker.parallel import ParallelConfig

    cp, seq = case["cp"], case["seq"]
    m = model()
    parallel = (
        ParallelConfig(context_parallel=cp, context_parallel_kind=case["kind"]) if cp > 1 else None
    )
    config = worker.ZeroConfig(
        stage=3, activation_checkpointing="units", tiled_loss=256 if case["tiled"] else 0
    )
    engine = worker.initialize(
        m, torch.optim.AdamW(m.parameters(), lr=1e-4), config=config, parallel=parallel
    )
    share, _ = engine.data_rank
    g = torch.Generator().manual_seed(share)
    ids = torch.randint(0, VOCAB, (1, seq), generator=g)
    times, peaks = [], []
    for _ in range(steps + 1):
        _reset_peak()
        before = _rss()
        start = time.perf_counter()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        times.append(time.perf_counter() - start)
        peaks.append(_peak() - before)
    row = {
        **case,
        "saved": engine.memory_report()["activations"],
        "peak": max(peaks[1:]),
        "step_s": statistics.median(times[1:]),
    }
    engine.close()
    return row


def run_rank(rank: int, port: int, cases: list, steps: int, budget: int, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    quiet_gloo_warnings()
    with gloo_group("127.0.0.1", port, rank, WORLD, timedelta(seconds=1200)):
        rows = [measure(c, rank, steps) for c in cases]
        longest = {}
        for cp, tiled in ((1, False), (4, False), (1, True), (4, True)):
            longest[f"cp={cp}{' tiled' if tiled else ''}"] = _longest(cp, tiled, rank, budget)
        if rank == 0:
            out["rows"], out["longest"] = rows, longest


def _longest(cp: int, tiled: bool, rank: int, budget: int) -> int:
    """The longest sequence (a multiple of 1024) whose peak growth on every rank stays
    within ``budget`` bytes (0: not even 1024)."""

    def fits(seq: int) -> bool:
        row = measure({"cp": cp, "kind": "ulysses", "seq": seq, "tiled": tiled}, rank, 1)
        worst = torch.tensor([row["peak"]], dtype=torch.int64)
        torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
        return int(worst) <= budget

    low, high = 0, 1024
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1024:
        mid = (low + high) // 2 // 1024 * 1024
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def try_torch_context_parallel(seq: int) -> str:
    """torch's experimental ``context_parallel`` on the same model, in 2 ranks of their
    own: what it did (the first rank's own error, not a peer's closed connection)."""
    out = mp.Manager().dict()
    # a rank that raised is an exception here: its message is in ``out``
    with contextlib.suppress(Exception):
        mp.spawn(_torch_cp_rank, args=(free_port(), seq, out), nprocs=2)
    said = [out[r] for r in sorted(out.keys())]
    own = [m for m in said if "Connection closed" not in m] or said or ["no result"]
    return own[0]


def _torch_cp_rank(rank: int, port: int, seq: int, out: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    quiet_gloo_warnings()
    with gloo_group("127.0.0.1", port, rank, 2, timedelta(seconds=120)):
        try:
            from torch.distributed.tensor.experimental import context_parallel

            mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
            m = model()
            ids = torch.randint(0, VOCAB, (1, seq))
            pos = torch.arange(seq)[None]
            shift = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
            start = time.perf_counter()
            with context_parallel(mesh, buffers=[ids, pos, shift], buffer_seq_dims=[1, 1, 1]):
                loss = m(input_ids=ids, position_ids=pos, labels=shift, shift_labels=shift).loss
                loss.backward()
            out[rank] = f"ran: one step without ZeRO in {time.perf_counter() - start:.2f} s"
        except Exception as exc:  # what it says is the result
            out[rank] = f"{type(exc).__name__}: {exc}"[:200]


def table(rows: list[dict]) -> str:
    lines = [
        "| seq | cp | kind | tiled loss | saved MB | saved x cp / cp=1's | peak MB "
        "| step ms | step vs cp=1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(r["seq"], r["tiled"]): r for r in rows if r["cp"] == 1}
    for r in rows:
        b = base.get((r["seq"], r["tiled"]))
        scaled = "" if b is None else f"{r['saved'] * r['cp'] / b['saved']:.2f}"
        ratio = "" if b is None else f"{r['step_s'] / b['step_s']:.2f}x"
        lines.append(
            f"| {r['seq']} | {r['cp']} | {r['kind'] if r['cp'] > 1 else '-'} "
            f"| {'yes' if r['tiled'] else 'no'} | {r['saved'] / 1e6:.1f} | {scaled} "
            f"| {r['peak'] / 1e6:.1f} | {r['step_s'] * 1e3:.0f} | {ratio} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="2048,4096,8192", help="sequence lengths of the table")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--budget-mb", type=int, default=512, help="peak growth per rank allowed")
    p.add_argument("--peers", action="store_true", help="DeepSpeed's Ulysses beside")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    cases = [
        {"cp": cp, "kind": kind, "seq": seq, "tiled": tiled}
        for seq in (int(s) for s in args.seqs.split(","))
        for tiled in (False, True)
        for cp, kind in ((1, "ulysses"), (2, "ulysses"), (4, "ulysses"), (4, "ring"))
    ]
    out = mp.Manager().dict()
    port = free_port()
    mp.spawn(run_rank, args=(port, cases, args.steps, args.budget_mb * 10**6, out), nprocs=WORLD)
    rows, longest = out["rows"], out["longest"]
    print(table(rows))
    print()
    print(f"longest sequence with peak growth <= {args.budget_mb} MB a rank:")
    for name, n in longest.items():
        print(f"  {name}: {n}")
    one, four = longest["cp=1"], longest["cp=4"]
    if one and four:
        print(f"  cp=4 / cp=1: {four / one:.2f}x; tiled loss at cp=4 / cp=4: "
              f"{longest['cp=4 tiled'] / four:.2f}x")  # fmt: skip
    print()
    torch_cp = try_torch_context_parallel(1024)
    print(f"torch context_parallel (experimental): {torch_cp}")
    ds_rows: list[dict] = []
    if args.peers:
        from bench.context_deepspeed import run_cases

        seqs = sorted({r["seq"] for r in rows})
        ds_rows = run_cases([(sp, seq) for seq in seqs for sp in (1, 2, 4)], args.steps)
        print()
        print(beside(rows, ds_rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"rows": rows, "longest": dict(longest), "torch_cp": torch_cp,
               "deepspeed": ds_rows}  # fmt: skip
        args.json.write_text(json.dumps(doc, indent=1))


def beside(rows: list[dict], peers: list[dict]) -> str:
    """zeroplane's all-to-all rows (no tiled loss) beside DeepSpeed's Ulysses, as ratios."""
    lines = [
        "| seq | cp | zeroplane saved MB | DeepSpeed saved MB | saved zp/DS | zeroplane peak MB "
        "| DeepSpeed peak MB | peak zp/DS | step zp/DS |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_case = {(d["seq"], d["sp"]): d for d in peers}
    for r in rows:
        if r["tiled"] or r["kind"] != "ulysses":
            continue
        d = by_case.get((r["seq"], r["cp"]))
        if d is None or "error" in d:
            why = "not run" if d is None else f"DeepSpeed: {d['error'][:60]}"
            lines.append(f"| {r['seq']} | {r['cp']} | {r['saved'] / 1e6:.1f} | {why} |")
            continue
        lines.append(
            f"| {r['seq']} | {r['cp']} | {r['saved'] / 1e6:.1f} | {d['saved'] / 1e6:.1f} "
            f"| {r['saved'] / d['saved']:.2f}x | {r['peak'] / 1e6:.1f} | {d['peak'] / 1e6:.1f} "
            f"| {r['peak'] / d['peak']:.2f}x | {r['step_s'] / d['step_s']:.2f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
