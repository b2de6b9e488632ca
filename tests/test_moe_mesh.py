"""Expert parallelism on a mesh (worker/moe/dispatch.py [Note: experts on a mesh]): the
dense layers split over tp, or the layers over pipeline stages, the experts whole on
every tp rank and split over ep groups inside dp at each tp and pp position. Each case
trains against one-process torch on the union of the dp ranks' batches (the tp ranks
of a dp rank see the same batch), under routing skewed so that a rank has no token for
some experts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import worker
from tests.reference import max_diff, train_beside_torch
from tests.test_moe_ep import EXPERTS, MoENet, skewed_batch
from worker.parallel import ParallelConfig

# the router and the head split over tp (column-wise, their outputs made whole)
PLAN = {
    "blocks.*.gate": ColwiseParallel(output_layouts=Replicate()),
    "head": ColwiseParallel(output_layouts=Replicate()),
}
STEPS = 3


def _opt(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def _engine(ep: int, tp: int, stage: int, accum: int = 1, clip: float = 0.0, **options):
    torch.manual_seed(0)
    model = MoENet()
    config = worker.ZeroConfig(
        stage=stage, gradient_accumulation_steps=accum, gradient_clipping=clip,
        bucket_numel=97, stage3_min_unit_numel=1, **options,
    )  # fmt: skip
    parallel = ParallelConfig(expert_parallel=ep, tensor_parallel=tp)
    return model, worker.initialize(model, _opt(model), config=config, parallel=parallel, plan=PLAN)


def ep_tp_against_torch(ep: int, tp: int, stage: int, accum: int, clip: float) -> None:
    model, engine = _engine(ep, tp, stage, accum, clip)
    assert (engine.shape.tp, engine.shape.dp) == (tp, dist.get_world_size() // tp)
    # whole experts of this rank's ep place, the same on every tp rank of its dp rank
    held = {n.split(".")[3] for n, _ in model.named_parameters() if ".experts." in n}
    place = engine.coords.dp % ep
    assert held == {str(e) for e in range(place * EXPERTS // ep, (place + 1) * EXPERTS // ep)}
    assert engine.tp.slices["head.weight"].dim == 0, "the plan did not split the head"
    torch.manual_seed(0)
    ref = MoENet()
    ref_opt = _opt(ref)
    train_beside_torch(engine, ref, ref_opt, skewed_batch, steps=STEPS, accum=accum, clip=clip)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    diff, name = max_diff(engine.full_state_dict(), want)
    assert diff < 1e-5, f"{name} differs from torch by {diff:.3g}"
    engine.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "accum", "clip"), [(1, 2, 0.05), (3, 2, 0.05), (0, 1, 0.05)])
def test_experts_beside_tensor_parallel_dense_layers_train_like_torch(pools, stage, accum, clip):
    # 4 ranks: tp=2 x dp=2, one ep group of the two dp ranks at each tp position;
    # clipping counts each expert once, not once per tp rank
    pools(4).run(ep_tp_against_torch, 2, 2, stage, accum, clip)


def save_then_resume(tmp: str, phase: str) -> None:
    """Saved at ep=2 x tp=2 (4 ranks); resumed at ep=2 without tp (2 ranks)."""
    if phase == "save":
        _, engine = _engine(2, 2, 3, clip=0.05)
    else:
        torch.manual_seed(0)
        model = MoENet()
        config = worker.ZeroConfig(stage=2, bucket_numel=97, gradient_clipping=0.05)
        engine = worker.initialize(
            model, _opt(model), config=config, parallel=ParallelConfig(expert_parallel=2)
        )
    torch.manual_seed(0)
    ref = MoENet()
    ref_opt = _opt(ref)
    dp = 2
    for step in range(2 * STEPS):
        mine = (step < STEPS) == (phase == "save")
        if mine:
            d = engine.coords.dp if phase == "save" else dist.get_rank()
            engine.backward(engine(*skewed_batch(step, d)))
            engine.step()
        for r in range(dp):
            (ref(*skewed_batch(step, r)) / dp).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        if phase == "save" and step == STEPS - 1:
            engine.save_checkpoint(tmp)
            engine.close()
            return
        if phase == "load" and step == STEPS - 1:
            engine.load_checkpoint(tmp)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    diff, name = max_diff(engine.full_state_dict(), want)
    assert diff < 1e-5, f"{name} differs from torch by {diff:.3g}"
    engine.close()


@pytest.mark.timeout(300)
def test_a_checkpoint_of_ep_by_tp_resumes_without_tp(pools, tmp_path):
    """Each expert written once (by tp rank 0's ep places), the dense layers by full
    parameter: the checkpoint is the whole model's, and a job at another layout and
    stage continues it equal to one uninterrupted torch run."""
    pools(4).run(save_then_resume, str(tmp_path), "save")
    pools(2).run(save_then_resume, str(tmp_path), "load")


def plan_splitting_an_expert() -> str:
    torch.manual_seed(0)
    model = MoENet()
    plan = {**PLAN, "blocks.*.experts.*.up": RowwiseParallel()}
    try:
        worker.initialize(
            model, _opt(model), config=worker.ZeroConfig(stage=1),
            parallel=ParallelConfig(expert_parallel=2, tensor_parallel=2), plan=plan,
        )  # fmt: skip
    except ValueError as exc:
        return str(exc)
    raise AssertionError("a plan splitting an expert was accepted")


@pytest.mark.timeout(120)
def test_a_plan_that_splits_an_expert_is_refused_naming_it(pools):
    for message in pools(4).run(plan_splitting_an_expert):
        assert "splits 'blocks.0.experts." in message, message
        assert "inside the experts module 'blocks.0.experts'" in message, message


def ep_pp_against_torch(
    stage: int, clip: float, save: str | None = None
) -> dict[str, torch.Tensor]:
    """A transformers Mixtral cut into two stages by the built-in decoder split, each
    stage's experts split over the ep group of the two dp ranks at its stage."""
    from tests.test_moe_ep import tiny_mixtral
    from worker.pipeline import lm_loss

    model = tiny_mixtral()
    engine = worker.initialize(
        model, _opt(model),
        config=worker.ZeroConfig(stage=stage, bucket_numel=300, gradient_clipping=clip),
        parallel=ParallelConfig(expert_parallel=2, pipeline_parallel=2, microbatches=4),
        loss_fn=lm_loss,
    )  # fmt: skip
    assert (engine.shape.pp, engine.shape.dp) == (2, 2)
    # the stage's layers, each holding 2 of its 4 experts (a fused module's rows)
    held = [p.shape[0] for n, p in engine.module.named_parameters() if ".experts." in n]
    assert held and set(held) == {2}, held
    dp, d = engine.shape.dp, engine.coords.dp
    for step in range(STEPS):
        idx, tgt = _lm_batch(step, 8)
        rows = slice(8 // dp * d, 8 // dp * (d + 1))
        engine.train_batch([(idx[rows], tgt[rows])])
    full = engine.full_state_dict()
    if save is not None:
        engine.save_checkpoint(save)
    engine.close()
    return full


def resume_without_pp(path: str) -> dict[str, torch.Tensor]:
    """The pipeline's checkpoint at ep=2 over two ranks (no pp), stage 2, trained on."""
    from tests.test_moe_ep import tiny_mixtral
    from worker.pipeline import lm_loss

    model = tiny_mixtral()
    engine = worker.initialize(
        model, _opt(model), config=worker.ZeroConfig(stage=2, bucket_numel=300),
        parallel=ParallelConfig(expert_parallel=2),
    )  # fmt: skip
    engine.load_checkpoint(path)
    d = dist.get_rank()
    for step in range(STEPS, 2 * STEPS):
        idx, tgt = _lm_batch(step, 8)
        rows = slice(4 * d, 4 * (d + 1))
        engine.backward(lm_loss(engine(input_ids=idx[rows]).logits, tgt[rows]))
        engine.step()
    full = engine.full_state_dict()
    engine.close()
    return full


def _lm_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 64, (rows, 8), generator=g)
    return idx, torch.roll(idx, 1, 1)


def _mixtral_reference(steps: int, clip: float) -> list[dict[str, torch.Tensor]]:
    """One-process torch on the whole batch of each step: the parameters after
    ``STEPS`` steps and after ``steps``."""
    from tests.test_moe_ep import tiny_mixtral
    from worker.pipeline import lm_loss

    ref = tiny_mixtral()
    opt = _opt(ref)
    out = []
    for step in range(steps):
        idx, tgt = _lm_batch(step, 8)
        lm_loss(ref(input_ids=idx).logits, tgt).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if step + 1 in (STEPS, steps):
            out.append({n: p.detach().clone() for n, p in ref.named_parameters()})
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "clip"), [(1, 0.05), (2, 0.0)])
def test_experts_in_pipeline_stages_train_like_torch(pools, tmp_path, stage: int, clip: float):
    """pp=2 x dp=2, ep=2: clipping spans the stages and counts each expert once;
    at stage 2 the checkpoint it saves resumes at ep=2 without pp (the whole model's,
    each expert written once) and trains on equal to the same torch run."""
    after, later = _mixtral_reference(2 * STEPS, clip)
    save = str(tmp_path) if not clip else None
    for got in pools(4).run(ep_pp_against_torch, stage, clip, save):
        diff, name = max_diff(got, after)
        assert diff < 1e-5, f"{name} differs from torch by {diff:.3g}"
    if save is not None:
        for got in pools(2).run(resume_without_pp, save):
            diff, name = max_diff(got, later)
            assert diff < 1e-5, f"{name} differs from torch by {diff:.3g} after the resume"
