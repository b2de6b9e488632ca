"""tests/scripts/ds_train.py's model and batches trained with FSDP2 (``fully_shard``) and
saved or resumed with torch Distributed Checkpoint, as FSDP2 users hold their state:

    torchrun --nproc-per-node 2 tests/scripts/fsdp2_train.py --steps 5 --save dcp/
    torchrun --nproc-per-node 2 tests/scripts/fsdp2_train.py --load dcp/ --steps 10 --out f.pt

``--save``/``--load``: ``dcp.save``/``dcp.load`` of ``{"model": get_model_state_dict,
"optimizer": get_optimizer_state_dict}`` (``--flatten``: saved with the optimizer's
keys flattened, as torchtitan saves them); the step is ``optimizer.state[...]["step"]``.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard

_spec = importlib.util.spec_from_file_location("ds_train", Path(__file__).with_name("ds_train.py"))
ds_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ds_train)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--flatten", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = ds_train.build()
    for layer in (model.body[0], model.body[2], model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(ds_train.groups(model), lr=ds_train.LR)
    start = 0
    if args.load:
        state = {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, opt),
        }
        dcp.load(state, checkpoint_id=args.load)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optimizer"])
        start = int(next(iter(opt.state.values()))["step"])
    micro = ds_train.MICRO
    for step in range(start, args.steps):
        x, y = ds_train.batch(step, world)
        mine = slice(rank * micro, (rank + 1) * micro)
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    if args.save:
        options = StateDictOptions(flatten_optimizer_state_dict=args.flatten)
        state = {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, opt, options=options),
        }
        dcp.save(state, checkpoint_id=args.save)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if args.out and rank == 0:
        torch.save({k: v.float() for k, v in full.items() if k != "scale"}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
