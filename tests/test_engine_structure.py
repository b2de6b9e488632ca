"""The worker package's shape: one module per concern, no import cycles between
modules or packages, nothing under the engine importing the sessions, no module or
class past its size, no reaching into the engine's private members; what a user
sees of it in a profiler."""

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


def _module_name(path: Path) -> str:
    """``path``'s module under worker/, dotted: ``engine``, ``elastic.session``, ``elastic``."""
    parts = path.relative_to(WORKER).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    path = WORKER.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: Path) -> set[str]:
    """worker modules ``path`` imports anywhere, TYPE_CHECKING blocks and functions
    included, dotted below worker (a package's own ``__init__`` by its name)."""
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
            if parts[0] == "worker" and len(parts) > 1 and _is_module(".".join(parts[1:])):
                out.add(".".join(parts[1:]))
    return out


def _worker_graph() -> dict[str, set[str]]:
    """Module -> the worker modules it imports (worker/__init__.py, the entry, aside)."""
    return {
        _module_name(p): _imports(p) - {_module_name(p)}
        for p in WORKER.rglob("*.py")
        if p != WORKER / "__init__.py"
    }


def _fail_on_cycle(graph: dict[str, set[str]], what: str) -> None:
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycle = [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
                pytest.fail(f"import cycle in {what}: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_worker_import_graph_has_no_cycle() -> None:
    graph = _worker_graph()
    _fail_on_cycle(graph, "worker/")
    # the layering docs/design.md states ("The layering the tests enforce"):
    # session -> engine -> state -> collectives
    session = "elastic.session"
    assert session not in graph["engine"] and "engine" not in graph["state"]
    assert {"engine"} <= graph[session] and {"state"} <= graph["engine"]
    assert {"engine"} <= graph["attached"] and "attached" not in graph["engine"]
    # the elastic package's parts import downwards only: its __init__ never the session
    assert not {session, "elastic.joining", "elastic.change"} & graph["elastic"]
    # the live exchange the engine uses is worker/live/, under the engine
    assert "live" in graph["engine"] and "engine" not in graph["live"]


# worker/'s subpackages; every other module of worker/ is a unit of its own
WORKER_PACKAGES = ("elastic", "live", "data", "moe", "context", "deepspeed")


def test_worker_packages_form_no_cycle_and_nothing_under_the_engine_imports_the_sessions() -> None:
    graph = _worker_graph()

    def unit(module: str) -> str:
        return module.split(".")[0]

    assert {unit(m) for m in graph if "." in m} <= set(WORKER_PACKAGES)
    units: dict[str, set[str]] = {}
    for module, imported in graph.items():
        units.setdefault(unit(module), set()).update(unit(m) for m in imported)
    _fail_on_cycle({u: deps - {u} for u, deps in units.items()}, "worker/'s packages")
    # the library under the engine imports nothing of the sessions above it
    assert "elastic" not in units["live"]
    # nor does anything the engine imports, directly or not
    under, todo = set(), ["engine"]
    while todo:
        module = todo.pop()
        if module not in under:
            under.add(module)
            todo.extend(graph.get(module, ()))
    offenders = sorted(m for m in under if unit(m) == "elastic")
    assert not offenders, offenders
    assert {"live", "state", "collectives"} <= under


def test_no_module_reaches_into_the_engines_private_members() -> None:
    private = re.compile(r"\bengine\._[a-z]")
    offenders = [
        f"{p.name}:{n}"
        for p in sorted(WORKER.rglob("*.py"))
        if p != WORKER / "engine.py"
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
    from worker.elastic.session import ElasticSession, Phase

    session = ElasticSession()
    assert session.phase is Phase.JOINING
    for phase in (Phase.MEMBER, Phase.RECOVERING, Phase.RECOVERING, Phase.MEMBER, Phase.LEAVING):
        session._to(phase)
    with pytest.raises(RuntimeError, match=r"no transition from Phase\.LEAVING to Phase\.MEMBER"):
        session._to(Phase.MEMBER)
    session._to(Phase.LEFT)
    with pytest.raises(RuntimeError, match="no transition"):
        session._to(Phase.JOINING)


# ---- the packages' boundaries (coordinator/__init__.py states them)

COORDINATOR = WORKER.parent / "coordinator"
# coordinator's subpackages in layer order: each imports only those before it
COORDINATOR_LAYERS = ("core", "control", "launchers", "tuning", "commands")


def _dotted_imports(path: Path) -> set[str]:
    """Every module name ``path`` imports, TYPE_CHECKING blocks and functions included."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _sources(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "_proto" not in p.parts)


def test_worker_imports_only_coordinators_core_and_client() -> None:
    # worker/hpo.py re-exports the search a script may start (`worker.hpo.search`)
    allowed = ("coordinator.core", "coordinator.control.client")
    offenders = []
    for path in _sources(WORKER):
        for name in _dotted_imports(path):
            if name == "coordinator" or not name.startswith("coordinator."):
                continue
            if name.startswith(allowed) or name.startswith("coordinator._proto"):
                continue
            if path.name == "hpo.py" and name.startswith("coordinator.tuning.search"):
                continue
            offenders.append(f"{path.relative_to(WORKER.parent)}: {name}")
    assert not offenders, offenders


def test_coordinator_subpackages_import_only_the_layers_before_them() -> None:
    offenders = []
    for path in _sources(COORDINATOR):
        rel = path.relative_to(COORDINATOR).parts
        if len(rel) == 1:
            continue  # coordinator/cli.py, the entry, may import anything
        layer = COORDINATOR_LAYERS.index(rel[0])
        for name in _dotted_imports(path):
            parts = name.split(".")
            # a subcommand that needs torch (checkpoint export) imports it when it runs;
            # test_coordinator_proto.py checks that the CLI itself loads none
            if parts[0] in ("worker", "torch") and rel[0] != "commands":
                offenders.append(f"{'/'.join(rel)}: {name}")
            if parts[0] != "coordinator" or len(parts) < 2 or parts[1] == "_proto":
                continue
            if parts[1] in COORDINATOR_LAYERS and COORDINATOR_LAYERS.index(parts[1]) > layer:
                offenders.append(f"{'/'.join(rel)}: {name}")
    assert not offenders, offenders
    # and every module lives in one of them
    loose = {p.name for p in COORDINATOR.glob("*.py")} - {"__init__.py", "cli.py"}
    assert not loose, loose


def test_no_module_name_is_in_both_packages() -> None:
    # coordinator/commands/ names each module for its subcommand; the rest is unique
    def names(root: Path, skip: tuple[str, ...] = ()) -> set[str]:
        # a module's name, or a package's (coordinator/control/ is named ``control``)
        return {
            p.parent.name if p.stem == "__init__" else p.stem
            for p in _sources(root)
            if p.parent != root or p.stem != "__init__"
            if not set(p.relative_to(root).parts[:-1]) & set(skip)
        }

    both = names(WORKER) & names(COORDINATOR, skip=("commands",))
    assert not both, sorted(both)


ENGINE_CLASSES = {"ZeroEngine", "MeshEngine", "PipelineEngine"}


def test_engines_are_constructed_in_the_factory_only() -> None:
    # [Note: one way in] in worker/spec.py: worker/factory.py is the one place that
    # calls an engine class (or a class handed to it as ``cls``)
    offenders = []
    for path in _sources(WORKER):
        if path == WORKER / "factory.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            called = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if called and node.func.id in ENGINE_CLASSES:  # type: ignore[attr-defined]
                offenders.append(f"{path.relative_to(WORKER)}:{node.lineno}")
    assert not offenders, offenders


# ---- size and cycles (#46): a module holds one concern, a class one role

# the packages the size limits hold in
SIZE_ROOTS = (COORDINATOR, WORKER)
MAX_MODULE_LINES = 900
MAX_CLASS_LINES = 650


def test_no_module_or_class_is_over_the_size_limits() -> None:
    offenders = []
    for root in SIZE_ROOTS:
        for path in _sources(root):  # the generated _proto aside
            text = path.read_text()
            where, lines = path.relative_to(root.parent), text.count("\n")
            if lines > MAX_MODULE_LINES:
                offenders.append(f"{where}: {lines} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef):
                    size = node.end_lineno - node.lineno + 1
                    if size > MAX_CLASS_LINES:
                        offenders.append(f"{where}: class {node.name}, {size} lines")
    assert not offenders, offenders


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import cycle in ``graph`` (module -> the modules it imports), or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_the_coordinator_import_graph_has_no_cycle() -> None:
    # coordinator/control/client.py and host_agent.py share agent_link.py, not each other
    def name(path: Path) -> str:
        parts = ("coordinator", *path.relative_to(COORDINATOR).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name(p) for p in _sources(COORDINATOR)}
    graph = {
        name(p): (_dotted_imports(p) & modules) - {name(p)}
        for p in _sources(COORDINATOR)
        if p != COORDINATOR / "__init__.py"
    }
    cycle = _cycle(graph)
    assert cycle is None, "import cycle in coordinator/: " + " -> ".join(cycle or ())
    assert "coordinator.control.host_agent" not in graph["coordinator.control.client"]


def test_import_worker_leaves_the_mesh_unloaded() -> None:
    # every worker process imports worker; tensor parallelism (torch's DTensor, which
    # brings dynamo) and pipelining load with the first mesh, not at start: they
    # cost a data-parallel process 1.5 s each time it starts on this machine
    import subprocess
    import sys

    heavy = ("torch.distributed.tensor", "torch.distributed.pipelining", "torch._dynamo")
    code = f"import sys, worker; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout
