"""Peak memory per rank through a model's birth and its first step, beside the peers.

    python bench/birth.py                      # N = 2, 4, 8; every method
    python bench/birth.py --worlds 2 4 --methods ordinary meta

One job of N gloo ranks per (method, N), each rank a fresh process. A rank's
figure is the growth of its resident set from just before the model is built
(torch imported, process group formed; the kernel's high-water mark reset
through /proc/self/clear_refs) to its peak through ``initialize`` and one
training step; the table shows the largest over the ranks, against the
model-state bound 16Ψ/N (fp32 AdamW at stage 3) plus one gathered unit, and
the issue's target 1.25 × that.

Methods:
- ordinary: the model built with values on every rank, then ``worker.initialize``;
- meta: built under ``torch.device("meta")``, brought to life by the engine
  (worker/birth.py [Note: birth on the meta device]);
- pretrained: built on meta and loaded from a safetensors file by range
  (``init=skip_init`` + ``engine.load_weights``; worker/pretrained.py);
- fsdp2: FSDP2's meta path (``fully_shard`` per block and root, ``to_empty``,
  ``reset_parameters``);
- ds_zero_init: DeepSpeed's ``zero.Init`` around the construction, then
  ``deepspeed.initialize`` at stage 3 (bench extra; skipped if not installed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import free_port, rank_env  # noqa: E402

METHODS = ("ordinary", "meta", "pretrained", "fsdp2", "ds_zero_init")
VOCAB, D, BLOCKS, SEQ, MICRO = 8192, 512, 14, 32, 2
if os.environ.get("BIRTH_TINY"):  # the process's fixed overhead: the same run, a tiny model
    VOCAB, D = 64, 16
MIB = 1 << 20


def build_model():
    """About 38.6M parameters of nn.Embedding / nn.LayerNorm / nn.Linear blocks."""
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(D)
            self.up = nn.Linear(D, 4 * D)
            self.down = nn.Linear(4 * D, D)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, D)
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.norm = nn.LayerNorm(D)
            self.head = nn.Linear(D, VOCAB, bias=False)

        def forward(self, idx, targets):
            x = self.emb(idx)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return Net()


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _run_rank(method: str, weights: str) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts here
    base = _rss_kib("VmRSS")
    marks: dict[str, int] = {}

    def mark(what: str) -> None:
        marks[what] = _rss_kib("VmHWM") - base

    psi = _methods()[method](weights, idx, mark)
    mark("step")
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "psi": psi, **marks}


def _methods():
    import torch

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3)

    def zeroplane(model, **kwargs):
        import worker

        engine = worker.initialize(
            model, adamw, config=worker.ZeroConfig(stage=3, stage3_min_unit_numel=1), **kwargs
        )
        return engine

    def train(engine, idx, mark):
        mark("birth")
        engine.backward(engine(idx, idx))
        engine.step()

    def ordinary(weights, idx, mark):
        torch.manual_seed(0)
        engine = zeroplane(build_model())
        train(engine, idx, mark)
        return _psi(engine)

    def meta(weights, idx, mark):
        with torch.device("meta"):
            model = build_model()
        torch.manual_seed(0)
        engine = zeroplane(model)
        train(engine, idx, mark)
        return _psi(engine)

    def pretrained(weights, idx, mark):
        from worker.birth import skip_init

        with torch.device("meta"):
            model = build_model()
        engine = zeroplane(model, init=skip_init)
        engine.load_weights(weights)
        train(engine, idx, mark)
        return _psi(engine)

    def fsdp2(weights, idx, mark):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        with torch.device("meta"):
            model = build_model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        opt = adamw(model.parameters())
        mark("birth")
        model(idx, idx).backward()
        opt.step()
        return sum(p.numel() for p in model.parameters())  # DTensors: the global count

    def ds_zero_init(weights, idx, mark):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        world = torch.distributed.get_world_size()
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "train_batch_size": MICRO * world,
            "zero_optimization": {"stage": 3},
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,
            "steps_per_print": 1 << 30,
        }
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build_model()
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=adamw(model.parameters()), config=config
        )
        torch.set_num_threads(1)
        mark("birth")
        engine.backward(engine(idx, idx))
        engine.step()
        return sum(p.ds_numel for p in model.parameters())

    return {
        "ordinary": ordinary,
        "meta": meta,
        "pretrained": pretrained,
        "fsdp2": fsdp2,
        "ds_zero_init": ds_zero_init,
    }


def _psi(engine) -> int:
    return sum(s.numel for b in engine.layout.buckets for s in b.slots)


def _job(method: str, world: int, weights: str, tiny: bool = False) -> dict | None:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, **rank_env(rank, world, port), "OMP_NUM_THREADS": "1"}
        if tiny:
            env["BIRTH_TINY"] = "1"
        cmd = [sys.executable, __file__, "--rank-of", method, "--weights", weights]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        if p.returncode != 0:
            for q in procs:
                q.kill()
            return None
        results.append(json.loads(out.strip().splitlines()[-1]))
    return {
        "birth_kib": max(r["birth"] for r in results),
        "step_kib": max(r["step"] for r in results),
        "psi": results[0]["psi"],
    }


def _save_weights(path: Path, tiny: bool = False) -> None:
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[2]); from bench.birth import build_model; "
        "from safetensors.torch import save_file; torch.manual_seed(0); m = build_model(); "
        "save_file({k: v.contiguous() for k, v in m.state_dict().items()}, sys.argv[1])"
    )
    env = {**os.environ, **({"BIRTH_TINY": "1"} if tiny else {})}
    subprocess.run([sys.executable, "-c", code, str(path), str(ROOT)], check=True, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)
    parser.add_argument("--weights", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        print(json.dumps(_run_rank(args.rank_of, args.weights)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        weights, tiny_weights = Path(tmp) / "model.safetensors", Path(tmp) / "tiny.safetensors"
        _save_weights(weights)
        _save_weights(tiny_weights, tiny=True)
        rows = []
        for world in args.worlds:
            for method in args.methods:
                got = _job(method, world, str(weights))
                fixed = _job(method, world, str(tiny_weights), tiny=True)
                rows.append((world, method, got, fixed))
                print(f"N={world} {method}: {got} fixed {fixed}", file=sys.stderr, flush=True)
    psi = next(g["psi"] for _, _, g, _ in rows if g is not None)
    # the largest gathered unit: with stage3_min_unit_numel=1 every module that holds
    # parameters is a unit of its own, the embedding and the head (VOCAB x D each) the
    # largest (a block's linears are 4 D x D)
    unit = max(VOCAB * D, 4 * D * D + 4 * D)
    print(
        f"Ψ = {psi / 1e6:.1f}M parameters (fp32 AdamW, stage 3); the largest gathered "
        f"unit {unit * 4 / MIB:.0f} MiB. Peaks are each rank's resident-set growth (the "
        "largest rank), through birth (initialize) and through the first step; "
        "'fixed' is the same run with a tiny model (the process's own overhead).\n"
    )
    print(
        "| N | method | birth peak | first-step peak | fixed (birth, step) | 16Ψ/N + unit "
        "| birth ÷ bound | first step ÷ bound |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for world, method, got, fixed in rows:
        bound = (16 * psi / world + 4 * unit) / MIB
        if got is None or fixed is None:
            print(f"| {world} | {method} | failed | | | {bound:.0f} MiB | | |")
            continue
        birth, step = got["birth_kib"] / 1024, got["step_kib"] / 1024
        fixed_birth, fixed_step = fixed["birth_kib"] / 1024, fixed["step_kib"] / 1024
        print(
            f"| {world} | {method} | {birth:.0f} MiB | {step:.0f} MiB "
            f"| {fixed_birth:.0f}, {fixed_step:.0f} MiB | {bound:.0f} MiB "
            f"| {(birth - fixed_birth) / bound:.2f} | {(step - fixed_step) / bound:.2f} |"
        )


if __name__ == "__main__":
    main()
