"""One engine surface for every layout (worker/surface.py).

The same training loop (``worker.initialize(..., parallel=...)``, a loader
attached, ``engine.train_batch(loader.current())``) runs data parallel, tensor
parallel and pipeline parallel, at a global batch that the data-parallel ranks
do not divide, and ends at the one-process torch reference, with the loss it
returns equal to the reference's on every rank.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import worker
from worker.data import LoaderConfig, StepLoader
from worker.engine import ZeroEngine
from worker.mesh import MeshEngine, ParallelConfig
from worker.pipeline import PipelineEngine, lm_loss
from worker.surface import Engine

STEPS, VOCAB, SEQ = 4, 32, 8


@pytest.mark.parametrize("cls", [ZeroEngine, MeshEngine, PipelineEngine])
def test_every_engine_offers_the_whole_surface(cls: type) -> None:
    """Each member of the Protocol, with ZeroEngine's signature (no engine forwards
    by hand, so none can fall behind)."""
    members = [m for m in Engine.__dict__ if not m.startswith("_") or m == "__call__"]
    members += list(Engine.__annotations__)
    for name in dict.fromkeys(members):
        assert hasattr(cls, name) or name in ("module", "device"), f"{cls.__name__}.{name}"
        mine, base = getattr(cls, name, None), getattr(ZeroEngine, name, None)
        if callable(mine) and callable(base):
            assert inspect.signature(mine) == inspect.signature(base), f"{cls.__name__}.{name}"
    assert issubclass(cls, ZeroEngine)


def _gpt() -> torch.nn.Module:
    from worker.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16, tie_weights=False
        )
    )


def _data() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (40, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(idx[:, :-1], idx[:, 1:])


def _opt(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)


@functools.cache
def reference(
    global_batch: int, steps: int = STEPS
) -> tuple[dict[str, torch.Tensor], tuple[float, ...]]:
    """One process, fp32, the loader's global batch of each step as one batch: the
    final parameters and each step's loss."""
    model, data = _gpt(), _data()
    opt = _opt(model)
    loader = StepLoader(data, LoaderConfig(global_batch=global_batch, num_workers=0, prefetch=0))
    losses = []
    for step in range(steps):
        ((x, y),) = loader.batches(step, 0, 1)
        loss = lm_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, tuple(losses)


def train_under(tp: int, pp: int, global_batch: int, micro: int | None, stage: int, **config: Any):
    """The loop every layout runs, unchanged."""
    parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, microbatches=2)
    model = _gpt()
    engine = worker.initialize(
        model,
        _opt(model),
        config=worker.ZeroConfig(stage=stage, **config),
        parallel=parallel,
        loss_fn=lm_loss,
    )
    assert isinstance(engine, Engine)
    loader = StepLoader(
        _data(),
        LoaderConfig(global_batch=global_batch, micro_batch=micro, num_workers=0, prefetch=0),
    ).attach(engine)
    losses = []
    while engine.global_steps < STEPS:
        losses.append(engine.train_batch(loader.current()))
    state = engine.full_state_dict()
    loader.close()
    engine.close()
    return state if dist.get_rank() == 0 else None, losses


@pytest.mark.parametrize(
    ("tp", "pp", "global_batch", "micro", "stage", "config"),
    [
        (1, 1, 6, 1, 3, {}),  # dp=4: shares 2, 2, 1, 1 (padding on the last two)
        (2, 1, 7, None, 3, {}),  # tp=2 x dp=2: shares of 4 and 3
        (1, 2, 7, 2, 1, {}),  # pp=2 x dp=2: 4 and 3 samples cut into 2 pipeline micro-batches
        (1, 2, 7, 2, 2, {}),  # the same at stage 2: one reduce-scatter per bucket and step
        # each stage's optimizer on the CPU, at stages 1 and 2
        (1, 2, 7, 2, 1, {"offload_optimizer": "cpu"}),
        (1, 2, 6, 1, 2, {"offload_optimizer": "cpu"}),
    ],
)
def test_one_loop_trains_every_layout_to_the_reference(
    pools, tp: int, pp: int, global_batch: int, micro: int | None, stage: int, config: dict
) -> None:
    results = pools(4).run(train_under, tp, pp, global_batch, micro, stage, **config)
    want, want_losses = reference(global_batch)
    got = results[0][0]
    assert got is not None and got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-5, f"differs from the one-process reference by {worst:.3g}"
    for _, losses in results:  # the global batch's mean loss, on every rank
        assert losses == pytest.approx(list(want_losses), rel=1e-5)


def test_plan_or_split_without_a_mesh_is_refused() -> None:
    model = _gpt()
    with pytest.raises(ValueError, match=r"plan=.*parallel=ParallelConfig"):
        worker.initialize(model, _opt(model), plan={})
    with pytest.raises(ValueError, match=r"split=.*parallel=ParallelConfig"):
        worker.initialize(model, _opt(model), split=lambda m, s, n: m)


def resume_across(saved: tuple[int, int], loaded: tuple[int, int], path: str):
    """Two steps at mesh ``saved`` (tp, pp), a checkpoint, then the rest at mesh
    ``loaded`` from a model built otherwise: the checkpoint brings everything."""

    def engine_at(mesh: tuple[int, int], fresh: bool) -> tuple[Engine, StepLoader]:
        model = _gpt() if fresh else _perturbed()
        parallel = ParallelConfig(tensor_parallel=mesh[0], pipeline_parallel=mesh[1])
        engine = worker.initialize(
            model, _opt(model), config=worker.ZeroConfig(stage=1), parallel=parallel,
            loss_fn=lm_loss,
        )  # fmt: skip
        config = LoaderConfig(global_batch=7, micro_batch=2, num_workers=0, prefetch=0)
        return engine, StepLoader(_data(), config).attach(engine)

    engine, loader = engine_at(saved, fresh=True)
    while engine.global_steps < 2:
        engine.train_batch(loader.current())
    engine.save_checkpoint(path)
    engine.close()
    engine, loader = engine_at(loaded, fresh=False)
    engine.load_checkpoint(path)
    assert engine.global_steps == 2
    while engine.global_steps < STEPS:
        engine.train_batch(loader.current())
    state = engine.full_state_dict()
    engine.close()
    return state if dist.get_rank() == 0 else None


def _perturbed() -> torch.nn.Module:
    model = _gpt()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return model


@pytest.mark.parametrize(("saved", "loaded"), [((1, 2), (1, 1)), ((2, 1), (1, 2))])
def test_pipeline_checkpoints_reshard_across_layouts(pools, tmp_path, saved, loaded) -> None:
    """[Note: pipeline checkpoints]: pp=2 x dp=2 saved, dp=4 loaded; tp=2 x dp=2
    saved, pp=2 x dp=2 loaded; each ends at the uninterrupted reference."""
    got = pools(4).run(resume_across, saved, loaded, str(tmp_path / "ckpt"))[0]
    want, _ = reference(7)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-5, f"differs from the one-process reference by {worst:.3g}"


@pytest.mark.timeout(240)
def test_the_mesh_template_runs_under_zeroplane_run(tmp_path) -> None:
    """examples/train_mesh.py, the loop that does not know its layout, at pp=2 x dp=2
    under the launcher, at a global batch the dp ranks do not divide: the one-process
    reference of the same samples."""
    import subprocess
    import sys
    from pathlib import Path

    from worker.data import byte_tokenizer, pack_text_files
    from worker.demo import corpus_path

    root = Path(__file__).resolve().parent.parent
    out, cache = tmp_path / "final.pt", tmp_path / "cache"
    cmd = [
        sys.executable, "-m", "coordinator.cli", "run", "--pp", "2", "--nproc", "4", "--no-http",
        str(root / "examples" / "train_mesh.py"), "--steps", "3", "--global-batch", "7",
        "--micro-batch", "2", "--out", str(out), "--data-cache", str(cache),
    ]  # fmt: skip
    run = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    from worker.models import GPT, GPTConfig

    spec = GPTConfig(
        vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=64, tie_weights=False
    )
    data = pack_text_files([corpus_path()], byte_tokenizer(), seq_len=32, cache_dir=cache)
    torch.manual_seed(0)
    model = GPT(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = StepLoader(data, LoaderConfig(global_batch=7, num_workers=0, prefetch=0))
    for step in range(3):
        ((x, y),) = loader.batches(step, 0, 1)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    got = torch.load(out, weights_only=True)
    worst = max((got[n] - p.detach()).abs().max().item() for n, p in model.named_parameters())
    assert worst < 1e-5, f"differs from the one-process reference by {worst:.3g}"


def precision_curve(tp: int, pp: int, dtype: str, offload: bool) -> list[float]:
    parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, microbatches=2)
    model = _gpt()
    config = worker.ZeroConfig(stage=1, dtype=dtype, offload_optimizer="cpu" if offload else "none")
    engine = worker.initialize(
        model, _opt(model), config=config, parallel=parallel, loss_fn=lm_loss
    )
    loader = StepLoader(_data(), LoaderConfig(global_batch=8, num_workers=0, prefetch=0))
    loader.attach(engine)
    losses = [engine.train_batch(loader.current()) for _ in range(CURVE)]
    engine.close()
    return losses


CURVE = 12


@pytest.mark.parametrize(
    ("tp", "pp", "dtype", "offload"),
    [(2, 1, "bf16", False), (2, 1, "fp16", True), (1, 2, "bf16", False), (1, 2, "fp16", False)],
)
def test_mixed_precision_and_offload_on_a_mesh(pools, tp, pp, dtype, offload) -> None:
    """bf16 and fp16 (loss scaling: the overflow check spans the mesh, the pipeline's
    loss is scaled as the engine's) with tp and pp, and the optimizer offloaded with
    tp: the loss curve of the fp32 one-process reference within 2%."""
    _, want = reference(8, CURVE)
    for got in pools(4).run(precision_curve, tp, pp, dtype, offload):
        assert len(got) == CURVE and all(g is not None for g in got)
        late = sum(got[-4:]) / 4
        assert late == pytest.approx(sum(want[-4:]) / 4, rel=0.02), (got, want)


def _is_block(module: torch.nn.Module) -> bool:
    from worker.models import Block

    return isinstance(module, Block)


def checkpointed_under(tp: int, pp: int, stage: int, policy) -> dict | None:
    parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, microbatches=2)
    model = _gpt()
    config = worker.ZeroConfig(stage=stage, activation_checkpointing=policy)
    engine = worker.initialize(
        model, _opt(model), config=config, parallel=parallel, loss_fn=lm_loss
    )
    assert engine.checkpointed, "the policy chose no module"
    loader = StepLoader(_data(), LoaderConfig(global_batch=8, num_workers=0, prefetch=0))
    loader.attach(engine)
    while engine.global_steps < STEPS:
        engine.train_batch(loader.current())
    state = engine.full_state_dict()
    engine.close()
    return state if dist.get_rank() == 0 else None


@pytest.mark.parametrize(
    ("tp", "pp", "stage", "policy"),
    [(2, 1, 3, "units"), (2, 2, 1, _is_block)],
)
def test_activation_checkpointing_on_a_mesh(pools, tp, pp, stage, policy) -> None:
    """Recomputed blocks under tensor parallelism (their planned layers' DTensor
    hooks run again in the recomputation) and inside a pipeline stage's backward:
    the one-process reference."""
    got = pools(4).run(checkpointed_under, tp, pp, stage, policy)[0]
    want, _ = reference(8)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-5, f"differs from the one-process reference by {worst:.3g}"


def pipeline_weights_case(src: str, out: str) -> dict:
    """A pipeline (pp=2 x dp=2) loads pretrained weights by range, trains, and writes
    its whole model as save_pretrained does."""
    model = _gpt()  # seed 0; the file holds other values
    engine = worker.initialize(
        model,
        _opt(model),
        config=worker.ZeroConfig(stage=1),
        parallel=ParallelConfig(pipeline_parallel=2, microbatches=2),
        loss_fn=lm_loss,
    )
    from worker.pretrained import WeightsError

    bad = Path(src).with_name("bad.safetensors")
    refused = ""
    try:
        engine.load_weights(bad)
    except WeightsError as exc:
        refused = str(exc)
    engine.load_weights(src)
    loaded = engine.full_state_dict()
    loader = StepLoader(_data(), LoaderConfig(global_batch=6, num_workers=0, prefetch=0))
    loader.attach(engine)
    while engine.global_steps < STEPS:
        engine.train_batch(loader.current())
    files = engine.save_pretrained(out)
    trained = engine.full_state_dict()
    loader.close()
    engine.close()
    return {
        "loaded": loaded,
        "trained": trained,
        "files": [str(f) for f in files],
        "refused": refused,
    }


def test_a_pipeline_loads_and_saves_pretrained_weights(pools, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from worker.models import GPT, GPTConfig

    torch.manual_seed(7)
    pretrained = GPT(
        GPTConfig(
            vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16, tie_weights=False
        )
    )
    weights = {k: v.detach().clone().contiguous() for k, v in pretrained.state_dict().items()}
    src = tmp_path / "model.safetensors"
    save_file(weights, src)
    save_file(
        {k: v for k, v in weights.items() if k != "lm_head.weight"}, tmp_path / "bad.safetensors"
    )
    out = tmp_path / "out"
    results = pools(4).run(pipeline_weights_case, str(src), str(out))
    # the reference: the same weights, trained by one process on the same global batches
    opt = _opt(pretrained)
    loader = StepLoader(_data(), LoaderConfig(global_batch=6, num_workers=0, prefetch=0))
    for step in range(STEPS):
        ((x, y),) = loader.batches(step, 0, 1)
        lm_loss(pretrained(x), y).backward()
        opt.step()
        opt.zero_grad()
    for rank in results:
        assert "missing ['lm_head.weight']" in rank["refused"], rank["refused"]
        for name, want in weights.items():
            assert torch.equal(rank["loaded"][name], want), name
        worst = max(
            (rank["trained"][n] - p.detach()).abs().max().item()
            for n, p in pretrained.named_parameters()
        )
        assert worst < 1e-5, f"differs from the one-process reference by {worst:.3g}"
    written = load_file(out / "model.safetensors")
    assert written.keys() == weights.keys()
    for name, t in written.items():
        assert torch.equal(t, results[0]["trained"][name]), name
