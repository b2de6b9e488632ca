"""DeepSpeed's MoE layer in the drop-in (worker/deepspeed/moe/sharded_moe.py [Note:
DeepSpeed's gates]): its gates against the routing written out here with torch, and,
where DeepSpeed is installed, against DeepSpeed 0.19's own gates and layer. The
layer trained under ``zeroplane run`` with expert parallelism is in
tests/test_deepspeed_scripts.py."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from worker.deepspeed.moe import sharded_moe
from worker.deepspeed.moe.layer import MoE, expert_parallel_of

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def logits_of(tokens: int, experts: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)) * 2


def test_a_dropless_top1_gate_routes_each_token_to_its_argmax_with_its_probability() -> None:
    logits = logits_of(12, 3)
    routes = sharded_moe.top1gating(logits, 1.0, 0, drop_tokens=False, use_rts=False)
    probs = F.softmax(logits, dim=1)
    assert torch.equal(routes.index[:, 0], probs.argmax(1))
    torch.testing.assert_close(routes.weight[:, 0], probs.max(1).values)
    fraction = torch.bincount(probs.argmax(1), minlength=3).float() / 12
    torch.testing.assert_close(routes.l_aux, 3 * (probs.mean(0) * fraction).sum())


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_a_top1_gate_keeps_at_most_its_capacity_per_expert(factor: float) -> None:
    logits = logits_of(16, 4, seed=1) + torch.tensor([3.0, 0, 0, 0])  # expert 0 crowded
    routes = sharded_moe.top1gating(logits, factor, 1)
    capacity = max(math.ceil(16 / 4 * factor), 1)
    chosen = F.softmax(logits, dim=1).argmax(1)
    kept = routes.index[:, 0]
    for e in range(4):
        assert int((kept == e).sum()) == min(int((chosen == e).sum()), capacity)
    dropped = kept == -1
    assert dropped.any() and (routes.weight[dropped] == 0).all()
    assert torch.equal(kept[~dropped], chosen[~dropped])
    assert torch.equal(routes.exp_counts, torch.bincount(chosen, minlength=4))


def test_a_top2_gate_keeps_first_choices_first_and_renormalizes() -> None:
    logits = logits_of(10, 4, seed=2)
    routes = sharded_moe.top2gating(logits, 0.5, 1, top2_2nd_expert_sampling=False)
    probs = F.softmax(logits, dim=1)
    top = probs.topk(2, dim=1).indices
    capacity = math.ceil(10 / 4 * 1.0)  # 2 x 0.5
    # by position: every first choice, in token order, before any second one
    taken = [0] * 4
    want = torch.full((10, 2), -1)
    for k in range(2):
        for s in range(10):
            e = int(top[s, k])
            if taken[e] < capacity:
                want[s, k], taken[e] = e, taken[e] + 1
    assert torch.equal(routes.index, want)
    both = (want >= 0).all(1)
    pair = probs.gather(1, top)
    torch.testing.assert_close(routes.weight[both], pair[both] / pair[both].sum(1, keepdim=True))
    only_first = (want[:, 0] >= 0) & (want[:, 1] < 0)
    assert torch.equal(routes.weight[only_first, 0], torch.ones(int(only_first.sum())))


def test_the_layer_is_each_token_through_its_experts_weighted() -> None:
    torch.manual_seed(0)
    layer = MoE(6, nn.Linear(6, 6), num_experts=3, k=2, min_capacity=0, drop_tokens=False,
                use_residual=True)  # fmt: skip
    x = torch.randn(2, 5, 6)
    torch.manual_seed(1)
    out, l_aux, counts = layer(x)
    torch.manual_seed(1)  # the same Gumbel draw for the second choices
    routes = layer.deepspeed_moe.gate(x.reshape(-1, 6))
    experts = list(layer.deepspeed_moe.experts.deepspeed_experts.children())
    rows = x.reshape(-1, 6)
    want = torch.stack([
        sum(w * experts[int(e)](rows[s]) for e, w in zip(routes.index[s], routes.weight[s],
                                                         strict=True))
        for s in range(rows.shape[0])
    ]).reshape(x.shape)  # fmt: skip
    coef = F.softmax(layer.coefficient(x), dim=-1)
    want = want * coef[..., :1] + layer.mlp(x) * coef[..., 1:]
    torch.testing.assert_close(out, want)
    assert int(counts.sum()) == 20 and l_aux.requires_grad
    assert all(p.allreduce is False and p.group_name == "ep_size_1"
               for e in experts for p in e.parameters())  # fmt: skip


def test_what_the_layer_cannot_be_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="multiple of ep_size=2"):
        MoE(4, nn.Linear(4, 4), num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="use_tutel"):
        MoE(4, nn.Linear(4, 4), num_experts=2, use_tutel=True)
    with pytest.raises(ValueError, match="noisy_gate_policy='Gauss'"):
        MoE(4, nn.Linear(4, 4), num_experts=2, noisy_gate_policy="Gauss")
    two = nn.ModuleList([MoE(4, nn.Linear(4, 4), 2, ep_size=2), MoE(4, nn.Linear(4, 4), 4, 4)])
    with pytest.raises(ValueError, match="different ep_size"):
        expert_parallel_of(two)
    layer = MoE(4, nn.Linear(4, 4), num_experts=2, min_capacity=4)
    with pytest.raises(ValueError, match="fewer than its min_capacity=4"):
        layer(torch.randn(3, 4))


GATES = [(k, drop, rts, noisy) for k in (1, 2, 3) for drop in (True, False) for rts in (True, False)
         for noisy in ((None, "RSample") if k == 1 else (None,))]  # fmt: skip


@pytest.mark.parametrize(("k", "drop", "rts", "noisy"), GATES)
def test_the_gates_equal_deepspeeds(k: int, drop: bool, rts: bool, noisy: str | None) -> None:
    ds = pytest.importorskip("deepspeed.moe.sharded_moe")
    for seed, (tokens, experts, factor, least) in enumerate(
        [(8, 4, 1.0, 0), (16, 4, 0.5, 1), (32, 8, 2.0, 4), (64, 16, 1.0, 2)]
    ):
        logits = logits_of(tokens, experts, seed)
        start = torch.get_rng_state()
        if k == 1:
            theirs = ds.top1gating(logits.clone(), factor, least, None, noisy, drop, rts, None,
                                   True)  # fmt: skip
        elif k == 2:
            theirs = ds.top2gating(logits.clone(), factor, least, drop, None, True, True)
        else:
            theirs = ds.topkgating(logits.clone(), k, factor, least, drop, None, "probs", True)
        torch.set_rng_state(start)
        if k == 1:
            ours = sharded_moe.top1gating(logits.clone(), factor, least, None, noisy, drop, rts)
        elif k == 2:
            ours = sharded_moe.top2gating(logits.clone(), factor, least, drop, True)
        else:
            ours = sharded_moe.topkgating(logits.clone(), k, factor, least, drop)
        l_aux, _, _, index, _, weight, counts = theirs
        assert torch.equal(ours.index, index.t().long())
        torch.testing.assert_close(ours.weight, weight.t())
        torch.testing.assert_close(ours.l_aux, l_aux)
        assert torch.equal(ours.exp_counts, counts)


def test_the_layer_trains_as_deepspeeds() -> None:
    """One process, ep 1: the same construction draws the same weights; the forward,
    the gate loss and every gradient equal DeepSpeed's layer's."""
    layer_mod = pytest.importorskip("deepspeed.moe.layer")
    made = []
    for cls in (layer_mod.MoE, MoE):
        torch.manual_seed(0)
        made.append(cls(8, nn.Linear(8, 8), num_experts=4, k=1, min_capacity=2,
                        noisy_gate_policy="Jitter", use_residual=True))  # fmt: skip
    theirs, ours = made
    x = torch.randn(3, 6, 8)
    results = []
    for layer in (theirs, ours):
        torch.manual_seed(5)
        out, l_aux, counts = layer(x)
        (out.square().mean() + 0.1 * l_aux).backward()
        results.append((out, l_aux, counts, {n: p.grad for n, p in layer.named_parameters()}))
    (o1, a1, c1, g1), (o2, a2, c2, g2) = results
    torch.testing.assert_close(o2, o1)
    torch.testing.assert_close(a2, a1)
    assert torch.equal(c2, c1)
    assert g1.keys() == g2.keys()
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], msg=name)
