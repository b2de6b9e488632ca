"""The worker package's shape: one module per concern, no import cycles, no reaching
into the engine's private members; what a user sees of it in a profiler."""

from __future__ import annotations

import ast
import gc
import re
import weakref
from pathlib import Path

import pytest
import torch

import worker
from tests.reference import OPTIMIZERS, VOCAB, seeded_model

WORKER = Path(worker.__file__).parent


def _imports(path: Path) -> set[str]:
    """worker modules ``path`` imports anywhere, TYPE_CHECKING blocks and functions included."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "worker" and len(parts) > 1 and (WORKER / f"{parts[1]}.py").exists():
                out.add(parts[1])
    return out


def test_the_worker_import_graph_has_no_cycle() -> None:
    graph = {p.stem: _imports(p) - {p.stem} for p in WORKER.glob("*.py") if p.stem != "__init__"}
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycle = [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
                pytest.fail("import cycle in worker/: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # the layering DESIGN.md states: session -> engine -> state -> collectives
    assert "session" not in graph["engine"] and "engine" not in graph["state"]
    assert {"engine"} <= graph["session"] and {"state"} <= graph["engine"]


def test_no_module_reaches_into_the_engines_private_members() -> None:
    private = re.compile(r"\bengine\._[a-z]")
    offenders = [
        f"{p.name}:{n}"
        for p in sorted(WORKER.glob("*.py"))
        if p.name != "engine.py"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert not offenders, offenders


def test_a_dropped_engine_is_freed() -> None:
    # the gradient hooks live in autograd, out of the garbage collector's sight
    model = seeded_model()
    engine = worker.initialize(model, OPTIMIZERS["adamw"](model), config=worker.ZeroConfig())
    idx = torch.randint(0, VOCAB, (2, 8))
    engine.backward(engine(idx, idx, True))
    engine.step()
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None
    # the model trains on without it, as a plain torch module
    model(idx, idx, True).backward()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_profiler_traces_name_zeroplanes_phases(stage: int) -> None:
    model = seeded_model()
    engine = worker.initialize(
        model,
        OPTIMIZERS["adamw"](model),
        config=worker.ZeroConfig(stage=stage, bucket_numel=97, stage3_min_unit_numel=1),
    )
    idx = torch.randint(0, VOCAB, (2, 8))
    engine.backward(engine(idx, idx, True))
    engine.step()  # the first step records stage 3's forward order
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.backward(engine(idx, idx, True))
        engine.step()
    names = {e.name for e in prof.events()}
    want = {"zeroplane.reduce", "zeroplane.optimizer_step", "zeroplane.publish"}
    if stage == 3:
        want.add("zeroplane.gather")
    assert want <= names, sorted(want - names)


def test_stage2_staging_buffers_come_from_a_pool_of_two() -> None:
    model = seeded_model()
    engine = worker.initialize(
        model,
        OPTIMIZERS["adamw"](model),
        config=worker.ZeroConfig(stage=2, bucket_numel=97),
    )
    assert len(engine.buckets) > 2
    idx = torch.randint(0, VOCAB, (2, 8))
    for _ in range(3):
        engine.backward(engine(idx, idx, True))
        engine.step()
    assert engine.state.pool.allocated <= 2


def test_session_phases_move_only_as_documented() -> None:
    from worker.session import ElasticSession, Phase

    session = ElasticSession()
    assert session.phase is Phase.JOINING
    for phase in (Phase.MEMBER, Phase.RECOVERING, Phase.RECOVERING, Phase.MEMBER, Phase.LEAVING):
        session._to(phase)
    with pytest.raises(RuntimeError, match=r"no transition from Phase\.LEAVING to Phase\.MEMBER"):
        session._to(Phase.MEMBER)
    session._to(Phase.LEFT)
    with pytest.raises(RuntimeError, match="no transition"):
        session._to(Phase.JOINING)
