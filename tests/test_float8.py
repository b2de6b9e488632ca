"""torchao's float8 training (``Float8Linear``, emulated on the CPU) under every ZeRO
stage: a model converted with ``convert_to_float8_training`` before
``worker.initialize`` trains as the same converted model does in one process. Each
rank's micro-batch is cast with its own dynamic scales, so the reference runs the
ranks' micro-batches one by one (tests/reference.py ``train_beside_torch``); at stage 3
the engine gathers a unit's weights whole before its forward, where torchao casts
them, so the weights' scales are the whole tensors' as in one process."""

from __future__ import annotations

import pytest
import torch

import worker
from tests.reference import max_diff, train_beside_torch
from worker.models import GPT, GPTConfig

float8 = pytest.importorskip("torchao.float8", reason="torchao is not installed")

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def converted() -> torch.nn.Module:
    """The built-in GPT, seeded, its blocks' linear layers float8 (the tied head kept)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    float8.convert_to_float8_training(
        model,
        config=float8.Float8LinearConfig(emulate=True),
        module_filter_fn=lambda module, name: name.startswith("blocks."),
    )
    return model


def batch(micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * micro + rank)
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.block_size), generator=g)
    return idx, torch.roll(idx, 1, 1)


def _opt(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)


def float8_against_torchao(stage: int, accum: int, clip: float, gather: str = "none") -> float:
    """Trains beside one-process torchao; returns the parameter gathers' wire bytes
    over their bytes in the compute dtype."""
    model, ref = converted(), converted()
    assert any(type(m).__name__ == "Float8Linear" for m in model.modules())
    config = worker.ZeroConfig(
        stage=stage, gradient_accumulation_steps=accum, gradient_clipping=clip,
        bucket_numel=500, stage3_min_unit_numel=1, stage3_gather_compression=gather,
    )  # fmt: skip
    engine = worker.initialize(model, _opt(model), config=config)
    train_beside_torch(engine, ref, _opt(ref), batch, steps=3, accum=accum, clip=clip)
    want = {n: p.detach() for n, p in ref.named_parameters(remove_duplicate=False)}
    diff, name = max_diff(engine.full_state_dict(), want)
    assert diff < 1e-5, f"{name} differs from one-process torchao by {diff:.3g} (stage {stage})"
    gathers = engine.comm_report().get("all_gather")  # none at stage 0
    engine.close()
    return 1.0 if gathers is None else gathers["wire_bytes"] / gathers["bytes"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("stage", "accum", "clip"), [(0, 1, 0.0), (1, 2, 0.5), (2, 1, 0.5), (3, 2, 0.5)]
)
def test_float8_linear_layers_train_like_torchao_at_every_stage(pools, stage, accum, clip):
    pools(2).run(float8_against_torchao, stage, accum, clip)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("stage", "accum"), [(1, 1), (3, 2)])
def test_weights_gathered_in_float8_train_like_torchao(pools, stage: int, accum: int):
    """``stage3_gather_compression="float8"`` (worker/float8.py [Note: float8 parameter
    gathers]): the blocks' Float8Linear weights travel in e4m3, a quarter of their
    fp32 bytes, and the training stays torchao's in one process."""
    for ratio in pools(2).run(float8_against_torchao, stage, accum, 0.5, "float8"):
        # the weights are most of the model's elements: well under the fp32 bytes
        assert ratio < 0.6, ratio


def cast_of_a_gathered_weight() -> tuple[float, float]:
    """A forward at stage 3 with float8 gathers, no step: torchao's cast of the weight
    the module receives against its cast of the exact whole weight (the fp32
    master); returns the share of float8 values that differ and the scales'
    relative difference."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    model = converted()
    config = worker.ZeroConfig(stage=3, stage3_min_unit_numel=1, stage3_gather_compression="float8")
    engine = worker.initialize(model, _opt(model), config=config)
    seen: list[torch.Tensor] = []
    hook = model.blocks[0].fc.register_forward_pre_hook(
        lambda m, args: seen.append(m.weight.detach().clone())
    )
    with torch.no_grad():
        engine(*batch(0, torch.distributed.get_rank()))
    hook.remove()
    exact = engine.full_state_dict()["blocks.0.fc.weight"]
    engine.close()

    def cast(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = amax_to_scale(w.abs().max(), torch.float8_e4m3fn)
        return to_fp8_saturated(w.float() * scale, torch.float8_e4m3fn), scale

    (got, got_scale), (want, want_scale) = cast(seen[0]), cast(exact)
    differ = (got.float() != want.float()).float().mean().item()
    return differ, ((got_scale - want_scale).abs() / want_scale).item()


@pytest.mark.timeout(120)
def test_a_weight_gathered_in_float8_casts_as_the_whole_weight_does(pools):
    for differ, scale in pools(2).run(cast_of_a_gathered_weight):
        assert differ == 0.0, f"{differ:.3%} of the float8 values differ from torchao's cast"
        assert scale < 1e-6, scale


def test_a_bucket_of_odd_sized_weights_and_other_parameters_round_trips() -> None:
    """A bucket whose shards cut float8 weights and fp32 parameters at odd offsets:
    every rank's payload decodes to its shard, the weights as ``q / scale`` (what
    torchao's cast makes of them) and the rest exactly."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    from coordinator.core.layout import Bucket, Slot
    from worker.float8 import BucketFloat8

    sizes = {"a.weight": 231, "a.bias": 7, "b.weight": 45, "b.bias": 5}
    slots, at = [], 0
    for name, n in sizes.items():
        slots.append(Slot(name, at, n, (n,)))
        at += n
    world = 3
    padded = -(-at // world) * world
    spec = Bucket(0, 0, "float32", 0, tuple(slots), at, padded, world)
    weights = [s for s in slots if s.name.endswith("weight")]
    codec = BucketFloat8(spec, weights, torch.float32)
    flat = torch.randn(padded, generator=torch.Generator().manual_seed(0))
    want = flat.clone()
    for i, s in enumerate(weights):
        w = flat[s.offset : s.offset + s.numel]
        codec.scales[i] = scale = amax_to_scale(w.abs().max(), torch.float8_e4m3fn)
        q = to_fp8_saturated(w * scale, torch.float8_e4m3fn)
        want[s.offset : s.offset + s.numel] = q.float() / scale
    shard = spec.shard_numel
    for r in range(world):
        payload = torch.empty(codec.wire_bytes(shard), dtype=torch.uint8)
        codec.encode_part(flat[r * shard : (r + 1) * shard], payload, r)
        got = codec.decode_part(payload, shard, r)
        assert torch.equal(got, want[r * shard : (r + 1) * shard]), r
    assert codec.wire_bytes(shard) < 2 * shard  # most elements a byte, not four


def test_float8_gathers_of_a_model_without_float8_layers_are_refused() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)  # not converted
    config = worker.ZeroConfig(stage=3, stage3_gather_compression="float8")
    with pytest.raises(ValueError, match=r"Float8Linear.*convert_to_float8_training"):
        worker.initialize(model, _opt(model), config=config)
