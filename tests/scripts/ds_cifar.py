"""A DeepSpeed CIFAR-10 script in the shape of DeepSpeedExamples'
``training/cifar/cifar10_deepspeed.py`` (written here, not copied): its arguments with
``deepspeed.add_config_arguments``, ``init_distributed`` and a "rank 0 first" barrier
around the data, a small convolutional net, ``initialize`` with ``model_parameters``
and ``training_data`` and the config's optimizer and warm-up schedule, the epoch loop
over the loader ``initialize`` returns, the device from ``get_accelerator()``, and the
net itself evaluated after training. The dataset download is replaced by tensors of
CIFAR's shapes. ``--system`` picks ``import deepspeed`` or zeroplane's drop-in, the only
difference:

    torchrun --nproc-per-node 2 tests/scripts/ds_cifar.py --system deepspeed \\
        --deepspeed --deepspeed_config ds_config.json --out ds.pt
    zeroplane run --nproc 2 tests/scripts/ds_cifar.py --system zeroplane \\
        --deepspeed --deepspeed_config ds_config.json --out zp.pt
"""

from __future__ import annotations

import argparse
import importlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

SAMPLES = 64


class Net(nn.Module):
    """The example's net; with ``--moe`` its last layer's input goes through one
    DeepSpeed MoE layer per ``--num-experts`` entry, each of copies of one linear
    expert (``deepspeed`` is the module the script imported)."""

    def __init__(self, moe: argparse.Namespace | None = None, deepspeed=None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.moe = moe is not None and moe.moe
        if self.moe:
            fc3 = nn.Linear(84, 84)
            layers = []
            for n_e in moe.num_experts:
                layers.append(
                    deepspeed.moe.layer.MoE(
                        hidden_size=84,
                        expert=fc3,
                        num_experts=n_e,
                        ep_size=moe.ep_world_size,
                        use_residual=moe.mlp_type == "residual",
                        k=moe.top_k,
                        min_capacity=moe.min_capacity,
                        noisy_gate_policy=moe.noisy_gate_policy,
                    )
                )
            self.moe_layer_list = nn.ModuleList(layers)
            self.fc4 = nn.Linear(84, 10)
        else:
            self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.flatten(1)
        x = F.relu(self.fc2(F.relu(self.fc1(x))))
        if not self.moe:
            return self.fc3(x)
        for layer in self.moe_layer_list:
            x, _, _ = layer(x)
        return self.fc4(x)


def build(moe: argparse.Namespace | None = None, deepspeed=None) -> Net:
    torch.manual_seed(0)
    return Net(moe, deepspeed)


def add_moe_arguments(parser: argparse.ArgumentParser) -> None:
    """The example's mixture-of-experts flags."""
    parser.add_argument("--moe", default=False, action="store_true")
    parser.add_argument("--ep-world-size", default=1, type=int)
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1])
    parser.add_argument("--mlp-type", type=str, default="standard")
    parser.add_argument("--top-k", default=1, type=int)
    parser.add_argument("--min-capacity", default=0, type=int)
    parser.add_argument("--noisy-gate-policy", default=None, type=str)
    parser.add_argument("--moe-param-group", default=False, action="store_true")


def images(n: int, seed: int) -> TensorDataset:
    """``n`` normalized 3x32x32 images and their labels, as CIFAR-10's loader gives them."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(n, 3, 32, 32, generator=g)
    return TensorDataset(pixels, torch.randint(0, 10, (n,), generator=g))


def main() -> None:
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--system", choices=["deepspeed", "zeroplane"], required=True)
    system = first.parse_known_args()[0].system
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    name = "deepspeed" if system == "deepspeed" else "worker.deepspeed"
    deepspeed = importlib.import_module(name)  # the one line a port changes
    accelerator = importlib.import_module(f"{deepspeed.__name__}.accelerator")

    parser = argparse.ArgumentParser(description="CIFAR", parents=[first])
    parser.add_argument("-e", "--epochs", default=2, type=int)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", help="the trained parameters and the test predictions")
    add_moe_arguments(parser)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)

    deepspeed.init_distributed()
    if dist.get_rank() != 0:
        dist.barrier()  # rank 0 prepares the data first
    trainset = images(SAMPLES, seed=7)
    if dist.get_rank() == 0:
        dist.barrier()
    testset = images(8, seed=8)

    net = build(args, deepspeed)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        split = importlib.import_module(f"{deepspeed.__name__}.moe.utils")
        whole = {"params": list(net.parameters()), "name": "parameters"}
        parameters = split.split_params_into_different_moe_groups_for_optimizer(whole)
    model_engine, _optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset
    )
    local_device = accelerator.get_accelerator().device_name(model_engine.local_rank)
    bf16 = model_engine.bfloat16_enabled()
    criterion = nn.CrossEntropyLoss()
    for _epoch in range(args.epochs):
        for data in trainloader:
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if bf16:
                inputs = inputs.to(torch.bfloat16)
            loss = criterion(model_engine(inputs), labels)
            model_engine.backward(loss)
            model_engine.step()

    with torch.no_grad():  # the net itself, as the example evaluates it
        predicted = net(testset.tensors[0].to(local_device)).argmax(1)
    params = list(net.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        full = {n: p.detach().clone().float() for n, p in net.named_parameters()}
    if args.out and args.moe and args.ep_world_size > 1:  # each rank holds its experts
        torch.save({"params": full, "predicted": predicted}, f"{args.out}.{dist.get_rank()}")
    elif args.out and dist.get_rank() == 0:
        torch.save({"params": full, "predicted": predicted}, args.out)


if __name__ == "__main__":
    main()
