"""Big models from birth on a device mesh (worker/mesh.py, worker/tp.py,
worker/tp_checkpoint.py, worker/pretrained.py): a tiny Hugging Face Llama and
GPT-2, saved with ``save_pretrained``, load by range at tp=2 x dp=2, stage 3,
train equal to ``from_pretrained`` + one-process torch (1e-5) and export
files that ``from_pretrained`` loads strictly; a model built on the meta
device comes to life under the tp plan with an ordinary construction's values.

One pool of 4 ranks serves the file; the models are tiny and runs 3 steps.
AdamW with eps=1e-6, as tests/test_mesh.py says why (GPT-2's key bias has a
zero true gradient).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

import worker
from tests.reference import tiny_gpt2, tiny_llama
from worker.mesh import MeshEngine, ParallelConfig, parallelize
from worker.pretrained import WeightFiles

transformers = pytest.importorskip("transformers")

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 3, 4, 8, 64
TP = 2


MODELS = {
    "llama": lambda: tiny_llama(vocab=VOCAB, seq=SEQ),
    "gpt2": lambda: tiny_gpt2(vocab=VOCAB, seq=SEQ, heads=4),
}


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def _optimizer(groups):
    return torch.optim.AdamW(groups, lr=3e-3, eps=1e-6, weight_decay=0.01)


def _saved(tmp: Path, kind: str) -> Path:
    torch.manual_seed(7)
    out = tmp / kind
    MODELS[kind]().save_pretrained(out, max_shard_size="20KB")  # several files, an index
    return out


def _reference(path: Path, kind: str) -> dict[str, torch.Tensor]:
    model = type(MODELS[kind]()).from_pretrained(path)
    model.train()
    opt = _optimizer(model.parameters())
    for step in range(STEPS):
        ids = _batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    worst = max(want, key=lambda k: (got[k] - want[k]).abs().max().item())
    return (got[worst] - want[worst]).abs().max().item(), worst


def load_train_export(path: str, out: str, want: dict[str, torch.Tensor]) -> dict:
    """On each rank: from_pretrained at tp=2 x dp=2 stage 3 (recording what it reads),
    the loaded values, STEPS steps against ``want``, then the export reloaded."""
    reads: list[tuple[str, int, int]] = []
    flat_range = WeightFiles.flat_range

    def recorded(self: WeightFiles, name: str, start: int, stop: int) -> torch.Tensor:
        reads.append((name, start, stop))
        return flat_range(self, name, start, stop)

    WeightFiles.flat_range = recorded  # type: ignore[method-assign]
    try:
        engine = worker.from_pretrained(
            path,
            _optimizer,
            config=worker.ZeroConfig(stage=3, stage3_min_unit_numel=1, bucket_numel=500),
            parallel=ParallelConfig(tensor_parallel=TP),
        )
    finally:
        WeightFiles.flat_range = flat_range  # type: ignore[method-assign]
    assert isinstance(engine, MeshEngine)
    assert (engine.shape.tp, engine.shape.dp) == (TP, 2)
    assert engine.tp is not None and engine.tp.slices, "the plan sharded nothing"
    # the module holds local shards; their values are the saved tensors' slices
    saved = {k: v for f in Path(path).glob("*.safetensors") for k, v in load_file(f).items()}
    born = engine.full_state_dict()
    assert born.keys() >= saved.keys()
    for name, value in saved.items():
        assert torch.equal(born[name], value), f"{name} loaded with other values"

    engine.module.train()
    dp, d = engine.shape.dp, engine.coords.dp
    rows = GLOBAL_BATCH // dp
    for step in range(STEPS):
        ids = _batch(step)[rows * d : rows * (d + 1)]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    got = engine.full_state_dict()
    diff, worst = _max_diff(got, want)
    assert diff < 1e-5, f"{worst} differs from from_pretrained + torch by {diff:.3g}"

    engine.save_pretrained(out, max_shard_bytes=20_000)
    if dist.get_rank() == 0:
        files = sorted(p.name for p in Path(out).iterdir())
        assert "model.safetensors.index.json" in files and "config.json" in files, files
        reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
            out, output_loading_info=True
        )
        assert not any(info.values()), info  # nothing missing, unexpected or mismatched
        for name, value in reloaded.named_parameters():
            assert torch.equal(value.detach(), got[name]), f"{name} exported with other values"
    dist.barrier()
    # a local range's full runs hold as many elements as it does
    owned = sum(r.numel for r in engine.engine.state.owned())
    engine.close()
    return {"diff": diff, "reads": reads, "owned": owned, "tp": engine.coords.tp}


def _check_reads(results: list[dict], path: Path) -> None:
    """Every rank read only its owned elements: the tp-sharded tensors' elements once
    over the whole mesh, the replicated ones once per tp rank (split over dp)."""
    model = type(MODELS[path.name]()).from_pretrained(path)
    numel = {n: p.numel() for n, p in model.state_dict().items()}
    for r in results:
        assert sum(b - a for _, a, b in r["reads"]) == r["owned"]
    by_name: dict[str, list[tuple[int, int]]] = {}
    for r in results:
        for name, a, b in r["reads"]:
            by_name.setdefault(name, []).append((a, b))
    sharded = 0
    for name, ranges in by_name.items():
        counts = torch.zeros(numel[name], dtype=torch.int64)
        for a, b in ranges:
            counts[a:b] += 1
        assert counts.min() == counts.max() and int(counts[0]) in (1, TP), name
        sharded += int(counts[0]) == 1
    assert sharded, "no tensor was read by tp slice"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_pretrained_loads_by_range_at_tp2_dp2_and_trains_as_torch(
    pools, tmp_path: Path, kind: str
) -> None:
    path = _saved(tmp_path, kind)
    assert (path / "model.safetensors.index.json").is_file()
    want = _reference(path, kind)
    results = pools(4).run(load_train_export, str(path), str(tmp_path / "out"), want)
    assert len({r["diff"] for r in results if r["tp"] == 0}) == 1, "dp ranks disagree"
    _check_reads(results, path)


# ----------------------------------------------------------------- birth under tp


class _MLP(nn.Sequential):
    """An ordinary construction that is reset_parameters() alone, module by module."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6), nn.LayerNorm(6))


def born_on_meta_under_tp() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from worker.models import GPT, GPTConfig
    from worker.tp import gpt_plan

    config = worker.ZeroConfig(stage=3, stage3_min_unit_numel=1, bucket_numel=100)
    tp2 = ParallelConfig(tensor_parallel=TP)

    def check(engine: MeshEngine, ordinary: nn.Module) -> None:
        local = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
        for name, tp_slice in engine.tp.slices.items():
            assert local[name] == tp_slice.local_shape, name
        born = engine.full_state_dict()
        for name, value in ordinary.named_parameters(remove_duplicate=False):
            assert torch.equal(born[name], value.detach()), f"{name} came to life otherwise"

    # reset_parameters() in construction order, on the whole tensors
    torch.manual_seed(11)
    ordinary = _MLP()
    with torch.device("meta"):
        model = _MLP()
    torch.manual_seed(11)
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    engine = parallelize(model, _optimizer, config=config, parallel=tp2, plan=plan)
    check(engine, ordinary)
    engine.close()

    # init= in model.apply's order: GPT's fused q/k/v per part, its tied head
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16)
    torch.manual_seed(3)
    ordinary = GPT(cfg)
    torch.manual_seed(5)
    ordinary.apply(GPT._init)
    with worker.meta_parameters():
        model = GPT(cfg)
    torch.manual_seed(5)
    engine = parallelize(
        model, _optimizer, config=config, parallel=tp2, plan=gpt_plan, init=GPT._init
    )
    check(engine, ordinary)
    assert model.lm_head.weight is model.wte.weight
    engine.close()


@pytest.mark.timeout(120)
def test_a_meta_model_comes_to_life_under_tp_as_an_ordinary_construction(pools) -> None:
    pools(4).run(born_on_meta_under_tp)


def test_gpt2_plan_refuses_a_width_that_does_not_split_and_hf_plan_an_unknown_model() -> None:
    from types import SimpleNamespace

    from worker.tp import LocalWidth, hf_plan

    attention = nn.Module()
    attention.split_size = 15
    mesh = SimpleNamespace(size=lambda: 2)
    with pytest.raises(ValueError, match=r"split_size = 15 does not split into 2"):
        LocalWidth("split_size")._apply(attention, mesh)  # type: ignore[arg-type]
    bert = nn.Module()
    bert.config = SimpleNamespace(model_type="bert")
    with pytest.raises(ValueError, match=r"no tensor-parallel plan for model_type 'bert'"):
        hf_plan(bert)
