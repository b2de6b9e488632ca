"""Pretrained Hugging Face weights into a sharded model, each rank reading its ranges
(worker/pretrained.py, worker/hf.py), against ``from_pretrained`` + one-process torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import worker
from tests.reference import tiny_gpt2, tiny_llama
from worker.pretrained import WeightFiles, WeightsError

transformers = pytest.importorskip("transformers")

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 4, 4, 8, 61


def _llama(tie: bool) -> transformers.PreTrainedModel:
    return tiny_llama(vocab=VOCAB, seq=SEQ, intermediate=40, tie=tie)


def _gpt2() -> transformers.PreTrainedModel:
    # bos/eos 0: within the vocabulary of 61 (generation config only)
    return tiny_gpt2(vocab=VOCAB, seq=SEQ)


MODELS = {"llama": lambda: _llama(tie=False), "llama-tied": lambda: _llama(tie=True), "gpt2": _gpt2}


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def _optimizer(groups):
    return torch.optim.AdamW(groups, lr=3e-3, weight_decay=0.01)


def _saved(tmp: Path, kind: str, shard: bool = False) -> Path:
    torch.manual_seed(7)
    model = MODELS[kind]()
    out = tmp / kind
    model.save_pretrained(out, max_shard_size="20KB" if shard else "5GB")
    return out


def _reference(path: Path, kind: str) -> dict[str, torch.Tensor]:
    cls = type(MODELS[kind]())
    model = cls.from_pretrained(path)
    model.train()
    opt = _optimizer(model.parameters())
    for step in range(STEPS):
        ids = _batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_from_pretrained(path: str, stage: int, want: dict[str, torch.Tensor]) -> float:
    world, rank = dist.get_world_size(), dist.get_rank()
    saved = {k: v for f in Path(path).glob("*.safetensors") for k, v in load_file(f).items()}
    engine = worker.from_pretrained(
        path,
        _optimizer,
        config=worker.ZeroConfig(stage=stage, stage3_min_unit_numel=1, bucket_numel=500),
    )
    born = engine.full_state_dict()
    for name, value in saved.items():
        assert torch.equal(born[name], value), f"{name} loaded with other values"
    engine.module.train()
    per_rank = GLOBAL_BATCH // world
    for step in range(STEPS):
        ids = _batch(step)[rank * per_rank : (rank + 1) * per_rank]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    got = engine.full_state_dict()
    worst = max(want, key=lambda k: (got[k] - want[k]).abs().max().item())
    diff = (got[worst] - want[worst]).abs().max().item()
    assert diff < 1e-5, f"{worst} differs from from_pretrained + torch by {diff:.3g}"
    return diff


@pytest.mark.parametrize(
    ("kind", "stage", "world", "shard"),
    [
        ("llama", 3, 2, True),
        ("llama-tied", 3, 2, False),
        ("gpt2", 3, 2, False),
        ("llama", 1, 2, False),
    ],
)
def test_from_pretrained_trains_as_hugging_face_and_torch(
    pools, tmp_path: Path, kind: str, stage: int, world: int, shard: bool
) -> None:
    path = _saved(tmp_path, kind, shard=shard)
    if shard:
        assert (path / "model.safetensors.index.json").is_file()
    want = _reference(path, kind)
    diffs = pools(world).run(train_from_pretrained, str(path), stage, want)
    assert len(set(diffs)) == 1, f"ranks disagree: {diffs}"


def test_a_flat_range_reads_the_same_elements_from_either_format(tmp_path: Path) -> None:
    t = torch.arange(5 * 7 * 3, dtype=torch.float32).reshape(5, 7, 3)
    save_file({"w": t, "v": t[0, 0].clone()}, tmp_path / "x.safetensors")
    torch.save({"w": t, "v": t[0, 0].clone()}, tmp_path / "x.bin")
    flat = t.reshape(-1)
    for file in ("x.safetensors", "x.bin"):
        with WeightFiles(tmp_path / file) as files:
            for a, b in [(0, 1), (0, flat.numel()), (20, 21), (19, 43), (62, 105), (5, 6)]:
                assert torch.equal(files.flat_range("w", a, b), flat[a:b]), (file, a, b)
            assert torch.equal(files.flat_range("v", 1, 3), t[0, 0, 1:3])


def _engine(kind: str) -> worker.ZeroEngine:
    torch.manual_seed(1)
    model = MODELS[kind]()
    return worker.initialize(model, _optimizer(model.parameters()), config=worker.ZeroConfig())


def test_names_that_do_not_fit_are_named_and_nothing_changes(tmp_path: Path) -> None:
    path = _saved(tmp_path, "llama")
    weights = load_file(path / "model.safetensors")
    engine = _engine("llama")
    before = engine.full_state_dict()

    def refused(tensors: dict[str, torch.Tensor], match: str) -> None:
        bad = tmp_path / "bad.safetensors"
        save_file(tensors, bad)
        with pytest.raises(WeightsError, match=match):
            engine.load_weights(bad)
        after = engine.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "the model changed"

    missing = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    refused(missing, r"missing \['model\.norm\.weight'\]")
    refused({**weights, "model.extra.weight": torch.zeros(2)}, r"unexpected \['model\.extra")
    wrong = {**weights, "lm_head.weight": torch.zeros(3, 16)}
    refused(wrong, r"'lm_head\.weight'.*shape \[3, 16\].*\[61, 16\]")


def test_weights_saved_without_the_models_prefix_load_into_it(tmp_path: Path) -> None:
    # a LlamaModel's state dict (no "model." prefix, no head) into a tied LlamaForCausalLM
    torch.manual_seed(3)
    source = _llama(tie=True)
    torch.save(source.model.state_dict(), tmp_path / "base.bin")
    engine = _engine("llama-tied")
    engine.load_weights(tmp_path / "base.bin")
    got = engine.full_state_dict()
    for name, value in source.named_parameters(remove_duplicate=False):
        assert torch.equal(got[name], value.detach()), name


def test_load_weights_is_refused_once_training_started(tmp_path: Path) -> None:
    path = _saved(tmp_path, "llama")
    engine = _engine("llama")
    ids = _batch(0)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    with pytest.raises(RuntimeError, match="load_checkpoint resumes"):
        engine.load_weights(path)


def export_and_reload(path: str, out: str, stage: int) -> None:
    engine = worker.from_pretrained(
        path, _optimizer, config=worker.ZeroConfig(stage=stage, stage3_min_unit_numel=1)
    )
    ids = _batch(0)[dist.get_rank() :: dist.get_world_size()]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    trained = engine.full_state_dict()
    engine.save_pretrained(out, max_shard_bytes=20_000)  # several files and their index
    if dist.get_rank() == 0:
        files = sorted(p.name for p in Path(out).iterdir())
        assert "model.safetensors.index.json" in files and "config.json" in files, files
        reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
            out, output_loading_info=True
        )
        assert not any(info.values()), info  # nothing missing, unexpected or mismatched
        for name, value in reloaded.named_parameters():
            assert torch.equal(value.detach(), trained[name]), name
    dist.barrier()


@pytest.mark.parametrize("kind", ["llama-tied", "gpt2"])
def test_an_exported_model_loads_strictly_with_from_pretrained(
    pools, tmp_path: Path, kind: str
) -> None:
    path = _saved(tmp_path, kind)
    pools(2).run(export_and_reload, str(path), str(tmp_path / "out"), 3)
