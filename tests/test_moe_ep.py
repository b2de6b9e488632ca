"""Expert parallelism (worker/moe/dispatch.py [Note: expert parallelism]): experts split
over ep ranks, tokens exchanged by all-to-all, the experts' ZeRO state sharded over
the ranks holding the same experts. Every case trains against one-process torch on
the union of the ranks' batches, under routing skewed so that a rank has no token
for some experts and one expert gets no token at all."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import worker
from tests.reference import max_diff, train_beside_torch
from tests.test_metrics import value
from tests.test_moe import Expert
from worker.moe import Experts
from worker.parallel import ParallelConfig

VOCAB, D, EXPERTS, STEPS = 32, 8, 8, 4
# each token's two experts, by token % 8: expert 7 is never chosen
PAIRS = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [4, 5], [5, 6], [6, 4], [0, 4]])


class Block(nn.Module):
    """Top-2 routing chosen by the token (so a test decides who uses which expert),
    weighted by the router's probabilities (so the router learns)."""

    def __init__(self, capacity_factor: float | None = None) -> None:
        super().__init__()
        self.gate = nn.Linear(D, EXPERTS, bias=False)
        self.experts = Experts((Expert() for _ in range(EXPERTS)), capacity_factor=capacity_factor)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, D)
        chosen = PAIRS[idx.reshape(-1) % len(PAIRS)]
        # not renormalized over the two: the other experts' logits get a gradient
        # that is not zero by cancellation (Adam would turn its rounding into steps)
        weights = F.softmax(self.gate(flat), dim=-1).gather(1, chosen)
        return self.experts(flat, chosen, weights).view_as(x)


class MoENet(nn.Module):
    def __init__(self, layers: int = 2, capacity_factor: float | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(capacity_factor) for _ in range(layers))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block(x, idx)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def skewed_batch(step: int, rank: int, rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's tokens are of two of the eight classes, (r, r + 4) at even steps and
    (r + 1) alone at odd ones: each rank leaves most experts without a token."""
    g = torch.Generator().manual_seed(100 * step + rank)
    classes = torch.tensor([rank % 8, (rank + 4) % 8] if step % 2 == 0 else [(rank + 1) % 8])
    cls = classes[torch.randint(0, len(classes), (rows, 6), generator=g)]
    idx = cls + 8 * torch.randint(0, VOCAB // 8, (rows, 6), generator=g)
    return idx, torch.roll(idx, 1, dims=1)


def train_ep_against_torch(
    ep: int, stage: int, accum: int, clip: float, tol: float = 1e-5, **options: object
) -> None:
    """``options``: more of ZeroConfig (bf16, fp16, offload, activation checkpointing);
    half precision steps by SGD, whose step follows the gradient's rounding linearly."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MoENet()
    torch.manual_seed(0)
    ref = MoENet()

    def opt(m: nn.Module) -> torch.optim.Optimizer:
        if options.get("dtype") in ("bf16", "fp16"):
            return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)

    config = worker.ZeroConfig(
        stage=stage,
        gradient_accumulation_steps=accum,
        gradient_clipping=clip,
        bucket_numel=97,
        stage3_min_unit_numel=1,
        **options,
    )
    engine = worker.initialize(
        model, opt(model), config=config, parallel=ParallelConfig(expert_parallel=ep)
    )
    # this rank holds its share of each layer's experts, nothing of the others'
    held = {n.split(".")[3] for n, _ in model.named_parameters() if ".experts." in n}
    place = rank % ep
    assert held == {str(e) for e in range(place * EXPERTS // ep, (place + 1) * EXPERTS // ep)}
    train_beside_torch(engine, ref, opt(ref), skewed_batch, steps=STEPS, accum=accum, clip=clip)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    got = engine.full_state_dict()
    assert set(got) == set(want)
    diff, name = max_diff(got, want)
    assert diff < tol, f"{name} differs from torch by {diff:.3g}"
    engine.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("stage", "accum", "clip"), [(1, 1, 0.05), (2, 2, 0.0), (3, 2, 0.05)])
def test_experts_split_over_two_ranks_train_like_torch(pools, stage: int, accum: int, clip: float):
    pools(2).run(train_ep_against_torch, 2, stage, accum, clip)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("ep", "stage", "accum", "clip"), [(2, 3, 1, 0.05), (4, 1, 2, 0.0), (4, 3, 2, 0.05)]
)
def test_experts_over_four_ranks_train_like_torch(pools, ep: int, stage: int, accum: int, clip):
    # ep=2: two ep groups, each expert's state sharded over the two ranks holding it
    pools(4).run(train_ep_against_torch, ep, stage, accum, clip)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("stage", "options", "tol"),
    [
        (3, {"activation_checkpointing": "units"}, 1e-5),
        (2, {"offload_optimizer": "cpu"}, 1e-5),
        (3, {"dtype": "bf16"}, 2e-2),
        (2, {"dtype": "fp16", "initial_scale_power": 4}, 2e-2),  # overflow checks span experts
    ],
    ids=["checkpointed", "offloaded", "bf16", "fp16"],
)
def test_expert_parallelism_composes_with_the_engine(pools, stage: int, options: dict, tol: float):
    pools(2).run(train_ep_against_torch, 2, stage, 1, 0.0, tol, **options)


def load_and_memory(capacity: float) -> None:
    """Capacity drops what the rule says on each rank's own tokens, as one process
    running each rank's batch does; the metrics count the rows each expert received
    and the drops; each rank's optimizer state is its share of the dense parameters
    over the world plus its experts' share over their group."""
    from worker import metrics as worker_metrics

    world, rank, ep = dist.get_world_size(), dist.get_rank(), 2
    torch.manual_seed(0)
    model = MoENet(capacity_factor=capacity)
    torch.manual_seed(0)
    ref = MoENet(capacity_factor=capacity)
    config = worker.ZeroConfig(stage=2, bucket_numel=97)
    engine = worker.initialize(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), config=config,
        parallel=ParallelConfig(expert_parallel=ep),
    )  # fmt: skip
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    received, dropped = torch.zeros(EXPERTS, dtype=torch.long), 0
    for step in range(2):
        engine.backward(engine(*skewed_batch(step, rank)))
        engine.step()
        for r in range(world):
            idx, tgt = skewed_batch(step, r)
            (ref(idx, tgt) / world).backward()
            counts = torch.bincount(PAIRS[idx.flatten() % len(PAIRS)].flatten(), minlength=8)
            kept = counts.clamp(max=math.ceil(capacity * idx.numel() * 2 / EXPERTS))
            dropped += int((counts - kept).sum()) if r == rank else 0
            if r // ep == rank // ep:  # the ranks that send this rank their tokens
                received += kept * 2  # both layers route alike
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    diff, name = max_diff(engine.full_state_dict(), dict(ref.named_parameters()))
    assert diff < 1e-5, f"{name} differs from torch by {diff:.3g}"

    text = worker_metrics.metrics_text(engine)
    first = (rank % ep) * EXPERTS // ep
    for e in range(first, first + EXPERTS // ep):
        got = sum(
            value(text, "zeroplane_expert_tokens_total", layer=f"blocks.{i}.experts", expert=str(e))
            for i in range(2)
        )
        assert got == received[e], (e, got, received[e])
    drops = sum(
        value(text, "zeroplane_expert_dropped_tokens_total", layer=f"blocks.{i}.experts")
        for i in range(2)
    )
    assert drops == dropped * 2 and (capacity >= 8 or dropped > 0)
    assert value(text, "zeroplane_expert_all_to_all_bytes_total", layer="blocks.0.experts") > 0

    experts = sum(p.numel() for n, p in ref.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for p in ref.parameters()) - experts
    want = 8 * (dense / world + experts / ep / (world // ep))  # Adam: two fp32 states
    got = engine.memory_report()["optimizer"]
    assert want <= got <= want * 1.05, (got, want)
    by_location = engine.memory_by_location()  # the experts' too, wherever they live
    assert by_location["device"]["optimizer"] + by_location["host"]["optimizer"] == got
    engine.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("capacity", [1.0, 8.0], ids=["capacity-1", "dropless"])
def test_capacity_metrics_and_memory(pools, capacity: float):
    pools(4).run(load_and_memory, capacity)


def tiny_mixtral(experts: int = 4):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=experts,
        num_experts_per_tok=2, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def tiny_hf(family: str):
    """A two-layer transformers 5.x MoE of ``family``, 4 experts, seeded."""
    import transformers as tf

    common = dict(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, intermediate_size=24,
        moe_intermediate_size=12, num_experts_per_tok=2,
    )  # fmt: skip
    if family == "mixtral":
        return tiny_mixtral()
    if family == "qwen2_moe":  # a shared expert beside the routed ones
        config = tf.Qwen2MoeConfig(**common, num_experts=4, shared_expert_intermediate_size=24)
        cls = tf.Qwen2MoeForCausalLM
    elif family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(**common, num_experts=4, head_dim=8)
        cls = tf.Qwen3MoeForCausalLM
    else:  # DeepSeek-V3: a dense first layer, shared experts, grouped routing
        config = tf.DeepseekV3Config(
            **common, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
            kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=8, n_group=1, topk_group=1,
        )  # fmt: skip
        cls = tf.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    return cls(config)


def train_fused_against_torch(ep: int, stage: int, family: str = "mixtral") -> None:
    """transformers 5.x's fused experts (one 3-D parameter per projection), split by rows."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model, ref = tiny_hf(family), tiny_hf(family)

    def opt(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-2)

    config = worker.ZeroConfig(stage=stage, gradient_clipping=0.5, stage3_min_unit_numel=1)
    engine = worker.initialize(
        model, opt(model), config=config, parallel=ParallelConfig(expert_parallel=ep)
    )
    held = dict(model.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"]
    assert held.shape[0] == 4 // ep
    ref_opt = opt(ref)

    def batch(step: int, r: int) -> torch.Tensor:
        return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step * 9 + r))

    for step in range(3):
        ids = batch(step, rank)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        for r in range(world):
            ids = batch(step, r)
            (ref(input_ids=ids, labels=ids).loss / world).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    diff, name = max_diff(engine.full_state_dict(), dict(ref.named_parameters()))
    assert diff < 1e-5, f"{name} differs from torch by {diff:.3g}"
    engine.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("family", "stage"), [("mixtral", 1), ("mixtral", 3), ("qwen2_moe", 2), ("deepseek_v3", 3)]
)
def test_fused_hf_experts_split_over_ranks_train_like_torch(pools, family: str, stage: int):
    pools(2).run(train_fused_against_torch, 2, stage, family)


@pytest.mark.timeout(240)
def test_fused_hf_experts_one_per_rank(pools):
    pools(4).run(train_fused_against_torch, 4, 2, "qwen3_moe")


def _build(ep: int, stage: int):
    torch.manual_seed(0)
    model = MoENet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    config = worker.ZeroConfig(stage=stage, bucket_numel=97, stage3_min_unit_numel=1)
    parallel = ParallelConfig(expert_parallel=ep) if ep > 1 else None
    return worker.initialize(model, opt, config=config, parallel=parallel)


def train_and_save(tmp: str, ep: int, stage: int) -> None:
    engine = _build(ep, stage)
    for step in range(2):
        engine.backward(engine(*skewed_batch(step, dist.get_rank())))
        engine.step()
    engine.save_checkpoint(tmp)
    engine.close()


def load_and_finish(tmp: str, ep: int, stage: int, saved_world: int) -> None:
    """Load at (ep, stage) on this world and train 2 more steps: the result is
    one-process torch's 4 steps, the first 2 over the saving world's batches."""
    world, rank = dist.get_world_size(), dist.get_rank()
    engine = _build(ep, stage)
    engine.load_checkpoint(tmp)
    assert engine.global_steps == 2
    for step in range(2, 4):
        engine.backward(engine(*skewed_batch(step, rank)))
        engine.step()
    torch.manual_seed(0)
    ref = MoENet()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(4):
        ranks = saved_world if step < 2 else world
        for r in range(ranks):
            (ref(*skewed_batch(step, r)) / ranks).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    diff, name = max_diff(engine.full_state_dict(), dict(ref.named_parameters()))
    assert diff < 1e-5, f"{name} differs from torch by {diff:.3g}"
    engine.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        ((4, 4, 3), (4, 2, 1)),
        ((4, 2, 2), (2, 1, 3)),
        ((2, 1, 3), (4, 4, 2)),
        ((2, 2, 1), (4, 2, 3)),
    ],
    ids=["ep4-to-ep2", "ep2-to-plain-on-2", "plain-on-2-to-ep4", "2-ranks-to-4-at-ep2"],
)
def test_a_checkpoint_resumes_at_another_ep_and_world(pools, tmp_path, saved, loaded):
    """(world, ep, stage) saved and loaded: the checkpoint is the whole model's."""
    pools(saved[0]).run(train_and_save, str(tmp_path), *saved[1:])
    pools(loaded[0]).run(load_and_finish, str(tmp_path), *loaded[1:], saved[0])


def fused_roundtrip(tmp: str, phase: str) -> dict[str, torch.Tensor] | None:
    """A fused model's checkpoint at ep=2, stage 3, read back without ep at stage 1."""
    model = tiny_mixtral()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if phase == "save":
        config = worker.ZeroConfig(stage=3, stage3_min_unit_numel=1)
        engine = worker.initialize(
            model, opt, config=config, parallel=ParallelConfig(expert_parallel=2)
        )
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        engine.save_checkpoint(tmp)
    else:
        engine = worker.initialize(model, opt, config=worker.ZeroConfig(stage=1))
        engine.load_checkpoint(tmp)
    full = engine.full_state_dict()
    engine.close()
    return full


@pytest.mark.timeout(240)
def test_a_fused_checkpoint_loads_without_expert_parallelism(pools, tmp_path):
    saved = pools(2).run(fused_roundtrip, str(tmp_path), "save")[0]
    loaded = pools(2).run(fused_roundtrip, str(tmp_path), "load")[0]
    diff, name = max_diff(loaded, saved)
    assert diff == 0, f"{name} differs by {diff:.3g}"
    assert not torch.equal(
        saved["model.layers.0.mlp.experts.down_proj"],
        tiny_mixtral().state_dict()["model.layers.0.mlp.experts.down_proj"],
    )


def pretrained_by_range(path: str, ep: int, family: str) -> None:
    """from_pretrained at ep (1: plain ZeRO-3) of a checkpoint that stores each expert
    apart, as transformers writes it: born on meta, each rank reading its ranges; the
    engine holds the saved model exactly, and save_pretrained writes it back."""
    model = tiny_hf(family)
    engine = worker.from_pretrained(
        path,
        lambda groups: torch.optim.AdamW(groups, lr=1e-3),
        config=worker.ZeroConfig(stage=3, stage3_min_unit_numel=1),
        parallel=ParallelConfig(expert_parallel=ep),
    )
    assert (engine.experts is not None) == (ep > 1)
    diff, name = max_diff(engine.full_state_dict(), dict(model.named_parameters()))
    assert diff == 0, f"{name} differs from the saved model by {diff:.3g}"
    engine.save_pretrained(f"{path}-again")
    engine.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("family", "ep"), [("qwen2_moe", 2), ("mixtral", 2), ("mixtral", 1)])
def test_from_pretrained_and_save_pretrained_at_ep(pools, tmp_path, family: str, ep: int):
    from transformers import AutoModelForCausalLM

    from worker.pretrained import WeightFiles

    path = tmp_path / family
    tiny_hf(family).save_pretrained(path)
    with WeightFiles(path) as files:  # transformers writes each expert apart
        assert not any(k.endswith("experts.gate_up_proj") for k in files._where)
    pools(2).run(pretrained_by_range, str(path), ep, family)
    again = AutoModelForCausalLM.from_pretrained(f"{path}-again")
    want = dict(tiny_hf(family).named_parameters())
    diff, name = max_diff(dict(again.named_parameters()), want)
    assert diff == 0, f"{name} differs by {diff:.3g} after the round trip"
