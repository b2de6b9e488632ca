"""Activation checkpointing, side by side: zeroplane beside FSDP2's checkpoint_wrapper.

    python bench/activations.py                   # ~2 min on 2 idle cores
    python bench/activations.py --steps 10 --seq 128

One run, 2 ranks on gloo, the ≈10M-parameter GPT of bench/zero_peers.py, each
system with and without checkpointing every block:

* ``zp0``/``zp3``: zeroplane stage 0 / 3, ``ZeroConfig(activation_checkpointing="units")``;
* ``fsdp2``: ``fully_shard`` on each block and the root, blocks wrapped in torch's
  ``checkpoint_wrapper`` (non-reentrant), as torchtitan applies it;
* ``ds0``/``ds3``: DeepSpeed ZeRO 0 / 3, each block called through
  ``deepspeed.checkpointing.checkpoint`` (DeepSpeed's reentrant checkpoint, as
  Megatron-DeepSpeed models do); skipped with a message when DeepSpeed is not
  installed (``pip install -e '.[bench]'``).

For each: the bytes autograd keeps for backward in one forward (counted the same
way for every system, with saved-tensor hooks: every distinct storage packed,
less those of parameters, whether sharded or gathered at that moment) and the
median step time. Ratios are checkpointed over not checkpointed, per system.
DeepSpeed's checkpoint keeps each block's inputs on its context object rather
than through ``save_for_backward``, so the hooks do not see them: its saved
bytes read lower by the block inputs (about 1 MiB per block here).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

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
    timed_step,
)
from worker.models import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab_size=2048, block_size=256, n_layer=12, n_head=4, n_embd=256)
SYSTEMS = ("zp0", "zp3", "fsdp2", "ds0", "ds3")


class DeepSpeedCheckpointed(nn.Module):
    """A block whose forward runs under ``deepspeed.checkpointing.checkpoint``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import deepspeed

        return deepspeed.checkpointing.checkpoint(self.block, x)


def has_deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def saved_bytes(model: nn.Module, forward) -> tuple[torch.Tensor, int]:
    """Run ``forward()``; the bytes of distinct non-parameter storages autograd packed."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        local = getattr(t, "_local_tensor", t)
        storage = local.untyped_storage()
        if storage._cdata not in params and not isinstance(t, nn.Parameter):
            seen.setdefault(storage._cdata, storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    return loss, sum(seen.values())


def build(system: str, checkpointing: bool, mesh) -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if system.startswith("zp"):
        import worker

        config = worker.ZeroConfig(
            stage=int(system[2:]), activation_checkpointing="units" if checkpointing else "none"
        )
        return model, worker.initialize(model, opt, config=config)
    if system.startswith("ds"):
        import deepspeed

        if checkpointing:
            deepspeed.checkpointing.configure(None, partition_activations=False)
            for i, block in enumerate(model.blocks):
                model.blocks[i] = DeepSpeedCheckpointed(block)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": int(system[2:])},
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,
            "steps_per_print": 1 << 30,
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        torch.set_num_threads(1)  # in case DeepSpeed's CPU accelerator changed it
        return model, engine
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    if checkpointing:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    quiet_gloo_warnings()
    torch.set_num_threads(1)
    os.environ.update(rank_env(rank, world, port))  # DeepSpeed reads LOCAL_RANK
    with gloo_group("127.0.0.1", port, rank, world, timedelta(seconds=120)):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(rank)
        idx = torch.randint(0, CFG.vocab_size, (args.micro_batch, args.seq + 1), generator=g)
        x, y = idx[:, :-1], idx[:, 1:]
        rows = []
        for system in args.systems:
            for ckpt in (False, True):
                model, runner = build(system, ckpt, mesh)
                engine = system[:2] in ("zp", "ds")  # wrapped: forward, backward, step

                def step(measure: bool = False, model=model, runner=runner, engine=engine):
                    fwd = (lambda: runner(x, y)) if engine else (lambda: model(x, y))
                    loss, nbytes = saved_bytes(model, fwd) if measure else (fwd(), 0)
                    if engine:
                        runner.backward(loss)
                        runner.step()
                    else:
                        loss.backward()
                        runner.step()
                        runner.zero_grad()
                    return nbytes

                for _ in range(args.warmup):
                    step()
                nbytes, _, _ = timed_step(lambda step=step: step(True))
                times = [timed_step(step)[1] for _ in range(args.steps)]
                rows.append((system, ckpt, nbytes, statistics.median(times)))
                if system.startswith("zp"):
                    runner.close()
                elif system.startswith("ds"):
                    runner.destroy()
                del model, runner
        if rank == 0:
            out.put(rows)
        dist.barrier()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    args = p.parse_args()
    if not has_deepspeed() and any(s.startswith("ds") for s in args.systems):
        print("DeepSpeed is not installed: its rows are skipped (pip install -e '.[bench]')")
        args.systems = [s for s in args.systems if not s.startswith("ds")]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(
        run_rank, args=(2, free_port(), args, out), nprocs=2, join=True, start_method="spawn"
    )
    rows = out.get()
    print(
        f"GPT {sum(p.numel() for p in GPT(CFG).parameters()) / 1e6:.2f}M params, 2 ranks, "
        f"gloo, micro-batch {args.micro_batch} x seq {args.seq}; median of {args.steps} steps"
    )
    header = (
        f"{'system':<7} {'ckpt':<5} {'saved MiB':>10} {'x saved':>8} {'step ms':>8} {'x time':>7}"
    )
    print(header)
    print("-" * len(header))
    base: dict[str, tuple[int, float]] = {}
    for system, ckpt, nbytes, seconds in rows:
        if not ckpt:
            base[system] = (nbytes, seconds)
        b = base.get(system, (None, None))
        print(
            f"{system:<7} {'yes' if ckpt else 'no':<5} {nbytes / 2**20:>10.2f} "
            f"{fmt_ratio(ratio(nbytes, b[0])):>8} {median_ms([seconds]):>8.1f} "
            f"{fmt_ratio(ratio(seconds, b[1])):>7}"
        )
    print("x saved / x time: with checkpointing over without, for the same system")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
