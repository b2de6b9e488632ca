"""Tensor/pipeline-parallel workers inside the coordinator's job (worker/attached.py
[Note: mesh jobs in the coordinator's job]): the generation carries the mesh and every
rank's coordinates, the coordinator plans a mesh left to it, ``zeroplane status`` lists
the coordinates, and a job under ``zeroplane run --tp 2`` trains to the one-process
reference."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from coordinator.control.membership import InventoryMismatch, Membership
from coordinator.control.statefile import load_snapshot, save_snapshot
from coordinator.core.generation_codec import generation_from_proto, generation_to_proto
from coordinator.core.layout import ParamSpec
from coordinator.core.meshplan import MeshCoords, MeshShape, mesh_candidates, tp_sharded_numel
from coordinator.core.planner import ActivationShape
from coordinator.core.settings import MembershipConfig, PlanConfig
from coordinator.launchers.local import find_free_port
from tests.coordinator_util import Clock, worker

ROOT = Path(__file__).resolve().parent.parent


def _membership(world: int, stage: int | None = 1) -> Membership:
    clock = Clock()
    return Membership(
        MembershipConfig(min_workers=1, max_workers=world, join_window_s=0.0),
        PlanConfig(stage=stage, bucket_numel=1 << 16, align=2),
        clock=clock,
        wall_clock=clock,
    )


def _gpt_inventory(layers: int, width: int) -> list[ParamSpec]:
    """A GPT's parameters as worker/models.py names them (what TP_PATTERNS plans)."""
    shapes = {"tok.weight": (256, width)}
    for i in range(layers):
        b = f"blocks.{i}"
        shapes |= {
            f"{b}.attn.weight": (3 * width, width),
            f"{b}.proj.weight": (width, width),
            f"{b}.fc.weight": (4 * width, width),
            f"{b}.fc_out.weight": (width, 4 * width),
        }
    return [ParamSpec(name=n, shape=s, dtype="float32") for n, s in shapes.items()]


def _join(m: Membership, world: int, mesh: tuple[int, int], inv: list[ParamSpec], **info):
    # registration order is not rank order: ranks are the script's
    for rank in reversed(range(world)):
        w = dataclasses.replace(
            worker(f"w{rank}"), fixed_rank=rank, fixed_world_size=world, mesh=mesh, **info
        )
        m.register(w, inv)
    gen = m.maybe_form()
    assert gen is not None
    return gen


def test_the_generation_carries_the_mesh_and_every_ranks_coordinates(tmp_path) -> None:
    m = _membership(8)
    gen = _join(m, 8, (2, 2), _gpt_inventory(2, 32))
    assert gen.mesh == MeshShape(pp=2, dp=2, tp=2)
    assert [gen.coords(r) for r in range(8)] == [
        MeshCoords(pp=r // 4, dp=(r // 2) % 2, tp=r % 2) for r in range(8)
    ]
    # over the wire: the shape and each member's coordinates, checked on arrival
    msg = generation_to_proto(gen)
    assert [(x.mesh.pp, x.mesh.dp, x.mesh.tp) for x in msg.members][:3] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0),
    ]  # fmt: skip
    back = generation_from_proto(msg)
    assert back.mesh == gen.mesh and back.mesh_reason == gen.mesh_reason
    msg.members[3].mesh.tp = 0
    with pytest.raises(ValueError, match="rank 3's mesh coordinates"):
        generation_from_proto(msg)
    status = m.status()
    assert status.mesh == gen.mesh and status.coords(5) == MeshCoords(pp=1, dp=0, tp=1)
    # a coordinator restarted from its state file keeps the mesh
    save_snapshot(tmp_path / "state", m.snapshot())
    restored = load_snapshot(tmp_path / "state")
    assert restored is not None and restored.generation is not None
    assert restored.generation.mesh == gen.mesh
    assert restored.generation.mesh_reason == gen.mesh_reason
    # a data-parallel job has none
    plain = _membership(2)
    for rank in range(2):
        plain.register(
            dataclasses.replace(worker(f"d{rank}"), fixed_rank=rank, fixed_world_size=2),
            _gpt_inventory(1, 8),
        )
    dp = plain.maybe_form()
    assert dp is not None and dp.mesh is None and dp.coords(0) is None
    assert not generation_to_proto(dp).members[0].HasField("mesh")


def test_a_worker_asking_for_another_mesh_is_refused() -> None:
    m = _membership(4)
    inv = _gpt_inventory(1, 8)
    m.register(dataclasses.replace(worker("a"), fixed_rank=0, fixed_world_size=4, mesh=(2, 1)), inv)
    for mesh, words in (((1, 2), "tp=1, pp=2"), (None, "no mesh"), ((0, 0), "tp=auto, pp=auto")):
        other = dataclasses.replace(worker("b"), fixed_rank=1, fixed_world_size=4, mesh=mesh)
        with pytest.raises(InventoryMismatch, match=f"asks for {words}.*tp=2, pp=1"):
            m.register(other, inv)


def test_a_mesh_left_to_the_coordinator_is_the_smallest_group_that_fits() -> None:
    """``--mesh auto``: ZeRO alone where it fits; where activations do not fit beside
    it, the smallest tensor-parallel group that does, at its lowest stage that fits
    (choose_mesh's order), with the stage when none was configured."""
    inv = _gpt_inventory(4, 256)
    acts = ActivationShape(layers=4, hidden=256, seq=1024, micro_batch=4)

    def planned(memory: int, mesh: tuple[int, int] = (0, 0), stage: int | None = None):
        m = _membership(4, stage=stage)
        m.plan = dataclasses.replace(m.plan, activations=acts)
        return _join(m, 4, mesh, inv, device_memory_bytes=memory)

    numel = sum(p.numel for p in inv)
    sharded = tp_sharded_numel((p.name, p.numel) for p in inv)
    candidates = mesh_candidates(
        numel, sharded_numel=sharded, world_size=4, config=PlanConfig(activations=acts)
    )
    alone = min(c.total for c in candidates if c.shape.group_size == 1 and not c.checkpointing)
    tp2 = min(c.total for c in candidates if c.shape == MeshShape(dp=2, tp=2))
    assert tp2 < alone
    roomy = planned(1 << 34)
    assert roomy.mesh == MeshShape(dp=4) and roomy.stage == 0
    assert "chosen by the coordinator" in roomy.mesh_reason
    usable = (alone + tp2) / 2
    tight = planned(int(usable / (1 - PlanConfig().headroom)))
    assert tight.mesh == MeshShape(dp=2, tp=2), tight.mesh_reason
    assert "ZeRO alone needs" in tight.mesh_reason
    assert tight.stage == min(
        c.stage for c in candidates if c.shape == tight.mesh and c.total < usable
    )
    # a configured stage stands; a degree the workers fixed stands
    fixed = planned(1 << 34, mesh=(0, 2), stage=1)
    assert fixed.mesh is not None and fixed.mesh.pp == 2 and fixed.stage == 1
    # memory unknown: no model parallelism that was not asked for
    unknown = planned(0)
    assert unknown.mesh == MeshShape(dp=4) and "device memory unknown" in unknown.mesh_reason


SCRIPT = """
import sys, time
from pathlib import Path
import torch, torch.distributed as dist
import worker
from worker.models import GPT, GPTConfig
from worker.pipeline import lm_loss

out, ready, go = map(Path, sys.argv[1:4])
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32,
                      tie_weights=False))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
engine = worker.initialize(model, opt, config=worker.ZeroConfig(stage=1), loss_fn=lm_loss)
g = torch.Generator().manual_seed(1)
data = torch.randint(0, 64, (3, 8, 17), generator=g)
dp, rank = engine.world_size, engine.rank
for step in range(3):
    x = data[step][rank * 8 // dp:(rank + 1) * 8 // dp]
    engine.train_batch([(x[:, :-1], x[:, 1:])])
full = engine.full_state_dict()
if dist.get_rank() == 0:
    torch.save(full, out)
    ready.touch()
deadline = time.monotonic() + 120
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
engine.close()
"""


@pytest.mark.timeout(240)
def test_a_tp_job_under_zeroplane_run_is_listed_with_its_mesh(tmp_path) -> None:
    script, out = tmp_path / "mesh_job.py", tmp_path / "final.pt"
    ready, go = tmp_path / "ready", tmp_path / "go"
    script.write_text(SCRIPT)
    port = find_free_port()
    cmd = [
        sys.executable, "-m", "coordinator.cli", "run", "--tp", "2", "--nproc", "4",
        "--http-port", str(port), str(script), str(out), str(ready), str(go),
    ]  # fmt: skip
    job = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 180
        while not ready.exists():
            assert job.poll() is None, job.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "the job never finished its steps"
            time.sleep(0.1)
        status = [sys.executable, "-m", "coordinator.cli", "status", "--http", f"127.0.0.1:{port}"]
        text = subprocess.run(
            [*status, "--window", "0"], capture_output=True, text=True, timeout=60
        )
        api = subprocess.run(
            [*status, "--window", "0", "--json"], capture_output=True, text=True, timeout=60
        )
        go.touch()
        output, _ = job.communicate(timeout=120)
    finally:
        go.touch()
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, output[-4000:]
    assert text.returncode == 0, text.stderr
    assert "mesh: pp=1 x dp=2 x tp=2" in text.stdout, text.stdout
    doc = json.loads(api.stdout)
    assert doc["mesh"] == {"pp": 1, "dp": 2, "tp": 2}
    coords = {w["rank"]: w["mesh"] for w in doc["workers"]}
    assert coords == {r: {"pp": 0, "dp": r // 2, "tp": r % 2} for r in range(4)}
    for r in range(4):
        assert f"0/{r // 2}/{r % 2}" in text.stdout, text.stdout

    from worker.models import GPT, GPTConfig
    from worker.pipeline import lm_loss

    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, tie_weights=False)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 64, (3, 8, 17), generator=g)
    for step in range(3):
        lm_loss(model(data[step][:, :-1]), data[step][:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    got = torch.load(out, weights_only=True)
    worst = max((got[n] - p.detach()).abs().max().item() for n, p in model.named_parameters())
    assert worst < 1e-5, f"differs from the one-process reference by {worst:.3g}"


def test_the_plans_activation_flags(tmp_path) -> None:
    """zeroplane run and zeroplane coordinator take the model's shape as zeroplane plan
    does (for --mesh auto and --stage auto), and say what is missing."""
    from coordinator.control.embedded import EmbeddedCoordinator

    acts = ActivationShape(layers=2, hidden=64, seq=128)
    embedded = EmbeddedCoordinator.for_local_job(2, "auto", activations=acts)
    assert embedded.config.plan.activations == acts
    cli = [sys.executable, "-m", "coordinator.cli"]
    bad = [
        (["coordinator", "--port", "0", "--seq", "128"], "--seq needs --layers and --hidden"),
        (["coordinator", "--port", "0", "--layers", "2"], "--layers need --seq"),
        (
            ["run", "--nproc", "2", "--coordinator", "127.0.0.1:9", "--seq", "8", "x.py"],
            "--seq and the model's shape are the embedded coordinator's plan",
        ),
    ]
    for argv, message in bad:
        run = subprocess.run([*cli, *argv], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and message in run.stderr, (argv, run.stderr)


def test_mesh_auto_leaves_open_only_what_the_script_can_build() -> None:
    """A --mesh auto worker asks the coordinator to choose tp only with a plan it has
    (given, the built-in GPT's, a known Hugging Face family's) and pp only with a split
    (given, or a built-in one: the untied GPT's, an untied Llama-like decoder's); the
    rest it fixes at 1."""
    from tests.reference import tiny_gpt2, tiny_llama
    from worker.models import GPT, GPTConfig
    from worker.spec import EngineSpec

    def _open_degrees(model: torch.nn.Module, plan: object, split: object) -> tuple[int, int]:
        spec = EngineSpec(model=model, optimizer=None, plan=plan, split=split, mesh_auto=True)
        return spec.asked_degrees()

    def gpt(tie: bool) -> GPT:
        return GPT(
            GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, tie_weights=tie)
        )

    assert _open_degrees(gpt(False), None, None) == (0, 0)
    assert _open_degrees(gpt(True), None, None) == (0, 1)
    assert _open_degrees(torch.nn.Linear(4, 4), None, None) == (1, 1)
    assert _open_degrees(torch.nn.Linear(4, 4), {"x": None}, lambda *a: None) == (0, 0)
    assert _open_degrees(tiny_llama(vocab=32, seq=8), None, None) == (0, 0)
    assert _open_degrees(tiny_llama(vocab=32, seq=8, tie=True), None, None) == (0, 1)
    # a GPT-2 has a known plan but no built-in split
    assert _open_degrees(tiny_gpt2(vocab=32, seq=8), None, None) == (0, 1)
