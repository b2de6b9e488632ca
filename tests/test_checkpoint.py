"""Checkpoints: any world size and stage to any other, integrity, atomic commit, sampler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import worker
from tests.reference import OPTIMIZERS, VOCAB, max_diff, seeded_model
from worker.checkpoint import CheckpointError
from worker.data import GlobalBatchSampler, micro_batch_counts

GLOBAL = 12  # divisible by every world size 1-4
STEPS, SAVE_AT = 10, 5


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, VOCAB, (GLOBAL, 5), generator=g)
    return idx, torch.roll(idx, 1, dims=1)


def use_extra(step: int) -> bool:
    return step % 3 == 0


def reference(steps: int) -> dict[str, torch.Tensor]:
    model = seeded_model()
    opt = OPTIMIZERS["adamw"](model)
    for step in range(steps):
        idx, tgt = global_batch(step)
        model(idx, tgt, use_extra(step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def make_engine(stage: int) -> worker.ZeroEngine:
    model = seeded_model(seed=99)  # deliberately not the reference's init: the load must set it
    config = worker.ZeroConfig(stage=stage, bucket_numel=97, stage3_min_unit_numel=1)
    return worker.initialize(model, OPTIMIZERS["adamw"](model), config=config)


def train(engine: worker.ZeroEngine, steps: range) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    per = GLOBAL // world
    for step in steps:
        idx, tgt = global_batch(step)
        sl = slice(rank * per, (rank + 1) * per)
        engine.backward(engine(idx[sl], tgt[sl], use_extra(step)))
        engine.step()


def save_phase(stage: int, path: str) -> None:
    engine = make_engine(stage)
    engine.load_checkpoint(path + "/init")
    train(engine, range(SAVE_AT))
    engine.save_checkpoint(path + "/ckpt", client_state={"next_step": SAVE_AT})


def resume_phase(stage: int, path: str) -> float:
    engine = make_engine(stage)
    state = engine.load_checkpoint(path + "/ckpt")
    assert state == {"next_step": SAVE_AT}
    assert engine.global_steps == SAVE_AT
    train(engine, range(state["next_step"], STEPS))
    diff, name = max_diff(engine.full_state_dict(), reference(STEPS))
    assert diff < 1e-5, f"{name} differs from the uninterrupted reference by {diff:.3g}"
    return diff


def write_initial(path: str) -> None:
    """A step-0 checkpoint of the reference's initial model, from one process."""
    model = seeded_model()
    engine = worker.initialize(model, OPTIMIZERS["adamw"](model))
    engine.save_checkpoint(path + "/init")


@pytest.fixture(scope="module")
def saved_at_4_stage3(pools, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ckpt"))
    write_initial(path)
    pools(4).run(save_phase, 3, path)
    return path


@pytest.mark.parametrize(("world", "stage"), [(2, 1), (3, 2), (1, 0), (4, 3)])
def test_resume_at_other_world_size_and_stage(pools, saved_at_4_stage3, world, stage) -> None:
    pools(world).run(resume_phase, stage, saved_at_4_stage3)


def test_layout_of_a_checkpoint(saved_at_4_stage3) -> None:
    step_dir = Path(saved_at_4_stage3) / "ckpt" / f"step-{SAVE_AT:08d}"
    assert (Path(saved_at_4_stage3) / "ckpt" / "latest").read_text() == step_dir.name
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["stage"]) == (4, 3)
    assert sorted(manifest["files"]) == [f"rank{r:05d}.pt" for r in range(4)]
    for name, info in manifest["files"].items():
        assert (step_dir / name).stat().st_size == info["bytes"]


def damaged_load(path: str) -> dict:
    engine = make_engine(2)
    train(engine, range(2))
    before = engine.full_state_dict()
    with pytest.raises(CheckpointError) as info:
        engine.load_checkpoint(path)
    after = engine.full_state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    train(engine, range(2, 3))  # the engine still works
    return {"message": str(info.value), "unchanged": unchanged}


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_file_is_named_and_nothing_is_loaded(pools, saved_at_4_stage3, tmp_path, damage):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(Path(saved_at_4_stage3) / "ckpt", copy)
    victim = copy / f"step-{SAVE_AT:08d}" / "rank00001.pt"
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    for case in pools(2).run(damaged_load, str(copy)):
        assert "rank00001.pt" in case["message"]
        assert case["unchanged"]


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path) -> None:
    model = seeded_model()
    engine = worker.initialize(model, OPTIMIZERS["sgd"](model))
    first = engine.save_checkpoint(tmp_path)
    # a save that died after writing some rank files: no manifest, latest untouched
    partial = tmp_path / ".tmp-step-00000007"
    partial.mkdir()
    (partial / "rank00000.pt").write_bytes(b"half a file")
    assert worker.checkpoint.resolve(tmp_path) == first
    engine.load_checkpoint(tmp_path)
    # the next save clears the debris
    idx, tgt = global_batch(0)
    engine.backward(engine(idx, tgt, False))
    engine.step()
    second = engine.save_checkpoint(tmp_path)
    assert worker.checkpoint.resolve(tmp_path) == second != first


def test_incompatible_model_is_named(tmp_path) -> None:
    model = seeded_model()
    worker.initialize(model, OPTIMIZERS["sgd"](model)).save_checkpoint(tmp_path)
    other = torch.nn.Sequential(torch.nn.Linear(3, 3))
    engine = worker.initialize(other, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match=r"'0\.weight' is not in the checkpoint"):
        engine.load_checkpoint(tmp_path)


def test_not_a_checkpoint(tmp_path) -> None:
    model = seeded_model()
    engine = worker.initialize(model, OPTIMIZERS["sgd"](model))
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        engine.load_checkpoint(tmp_path)


def test_sampler_resumes_at_the_next_sample_for_any_world_size() -> None:
    def consumed(sampler: GlobalBatchSampler, steps: int, world: int) -> list[int]:
        seen = []
        for _ in range(steps):
            batch = sampler.next_global_batch()
            for rank in range(world):
                for micro in sampler.micro_batches(batch, rank, world, 2):
                    seen += micro
        return seen

    whole = consumed(GlobalBatchSampler(50, 12, seed=3), 9, 1)
    a = GlobalBatchSampler(50, 12, seed=3)
    first = consumed(a, 4, 2)
    b = GlobalBatchSampler(50, 12, seed=3)
    b.load_state_dict(a.state_dict())
    rest = consumed(b, 5, 3)
    assert first + rest == whole
    assert a.epoch == 0 and b.epoch > 0  # the resumed part crossed an epoch boundary
    # 5 ranks do not divide 12: shares of 3, 3, 2, 2, 2 in three micro-batches each
    # (padding where a share is smaller), every sample once ([Note: uneven shares])
    shares = [b.micro_batches(list(range(12)), r, 5, 1) for r in range(5)]
    counts = [micro_batch_counts(12, r, 5, 1) for r in range(5)]
    assert counts == [[1, 1, 1]] * 2 + [[1, 1, 0]] * 3
    real = [i for s, c in zip(shares, counts, strict=True)
            for m, n in zip(s, c, strict=True) if n for i in m]  # fmt: skip
    assert real == list(range(12))


def test_cli_inspect_and_streaming_export(saved_at_4_stage3, tmp_path) -> None:
    import subprocess
    import sys

    ckpt = str(Path(saved_at_4_stage3) / "ckpt")
    cli = [sys.executable, "-m", "coordinator.cli", "checkpoint"]
    shown = subprocess.run([*cli, "inspect", ckpt], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert f"step         {SAVE_AT}" in shown.stdout
    assert "saved by     4 rank(s), stage 3, fp32, AdamW" in shown.stdout

    out = tmp_path / "model.safetensors"
    done = subprocess.run(
        [*cli, "export", ckpt, str(out)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    exported = _read_safetensors(out)
    # what the checkpoint's state is, loaded into a model the ordinary way
    model = make_engine(0)
    model.load_checkpoint(Path(ckpt))
    want = model.full_state_dict()
    assert exported.keys() == want.keys()  # tied and frozen names included
    for name, value in want.items():
        assert torch.equal(exported[name], value), name
    bad = subprocess.run(
        [*cli, "inspect", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "not a checkpoint" in bad.stderr


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A reader written from the format's spec, independent of the exporter."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    body = raw[8 + n :]
    out = {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        t = torch.frombuffer(bytearray(body[a:b]), dtype=dtypes[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    return out


def _saved_in_process(path: Path, model: torch.nn.Module | None = None) -> Path:
    model = model or seeded_model()
    engine = worker.initialize(model, OPTIMIZERS["sgd"](model))
    return engine.save_checkpoint(path)


MANIFEST_DAMAGE = {
    "a key missing": lambda m: m.write_text(
        json.dumps({k: v for k, v in json.loads(m.read_text()).items() if k != "params"})
    ),
    "not UTF-8": lambda m: m.write_bytes(b"\xff" + m.read_bytes()),
    "not JSON": lambda m: m.write_text("{'format': 1"),
    "a range shifted, no checksum": lambda m: m.write_text(json.dumps(_shifted(m))),
}


def _shifted(manifest: Path) -> dict:
    m = json.loads(manifest.read_text())
    del m["checksum"]
    rng = m["files"]["rank00000.pt"]["ranges"][0]
    rng[1:] = [rng[1] + 1, rng[2] + 1]
    return m


@pytest.mark.parametrize("damage", sorted(MANIFEST_DAMAGE))
@pytest.mark.parametrize("action", ["inspect", "inspect --json", "export"])
def test_cli_on_a_damaged_manifest_says_one_line(tmp_path, capsys, damage, action) -> None:
    from coordinator.cli import main as cli

    manifest = _saved_in_process(tmp_path / "ckpt") / "manifest.json"
    MANIFEST_DAMAGE[damage](manifest)
    args = action.split()
    out = [str(tmp_path / "model.safetensors")] if action == "export" else []
    code = cli(["checkpoint", args[0], str(tmp_path / "ckpt"), *out, *args[1:]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"zeroplane checkpoint {args[0]}: ") and err.count("\n") == 1, err
    assert str(manifest) in err
    assert not (tmp_path / "model.safetensors").exists()


def test_a_manifest_without_checksum_still_loads(tmp_path, capsys) -> None:
    from coordinator.cli import main as cli

    step_dir = _saved_in_process(tmp_path)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest.pop("checksum").startswith("sha256:")
    (step_dir / "manifest.json").write_text(json.dumps(manifest))  # as written before checksums
    model = seeded_model(seed=5)
    engine = worker.initialize(model, OPTIMIZERS["sgd"](model))
    engine.load_checkpoint(tmp_path)
    want = seeded_model().state_dict()
    assert all(torch.equal(v, want[k]) for k, v in engine.full_state_dict().items())
    assert cli(["checkpoint", "inspect", str(tmp_path)]) == 0
    assert "checksum     none" in capsys.readouterr().out


def test_only_persistent_buffers_are_saved_and_loaded(tmp_path) -> None:
    def with_buffers() -> torch.nn.Module:
        model = seeded_model()
        model.register_buffer("count", torch.tensor([3.0]))  # in state_dict()
        model.norm.register_buffer("cache", torch.arange(4.0), persistent=False)  # not
        return model

    saved = with_buffers()
    saved.count.fill_(7.0)
    saved.norm.cache.fill_(-1.0)
    step_dir = _saved_in_process(tmp_path, saved)
    payload = torch.load(step_dir / "rank00000.pt", weights_only=True)
    assert set(payload["unsharded"]["buffers"]) == {"count"}

    loaded = with_buffers()
    engine = worker.initialize(loaded, OPTIMIZERS["sgd"](loaded))
    engine.load_checkpoint(tmp_path)
    assert loaded.count.item() == 7.0
    assert torch.equal(loaded.norm.cache, torch.arange(4.0))  # the model's own, not saved

    lacking = seeded_model()  # a model without the buffer the checkpoint has
    engine = worker.initialize(lacking, OPTIMIZERS["sgd"](lacking))
    with pytest.raises(CheckpointError, match=r"rank00000\.pt holds buffers the model lacks"):
        engine.load_checkpoint(tmp_path)
