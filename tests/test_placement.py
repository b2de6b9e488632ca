"""Where an engine runs: worker/placement.py ``place`` as a table of every
situation, the one line a worker logs, and the spec the entry reads
([Note: one way in] in worker/spec.py)."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

import worker
from tests.reference import seeded_model
from worker.placement import Placement, Situation, place
from worker.spec import EngineSpec

P = Placement


def _expected(
    coordinator: bool,
    group_given: bool,
    group_formed: bool,
    launcher: bool,
    model_parallel: bool,
    mesh_auto: bool,
) -> Placement | None:
    """The placement table of worker/placement.py's docstring, written out as
    rows (None: refused), independently of ``place``'s own branches."""
    rows: list[tuple[tuple[bool | None, ...], Placement | None]] = [
        # coordinator, group given, model parallel, mesh auto -> placement
        ((True, False, None, True), P.MESH_AUTO),
        ((True, False, True, False), P.ELASTIC_MESH),
        ((False, None, None, True), None),
        ((True, True, None, True), None),
        ((None, None, True, False), P.MESH),
    ]
    key = (coordinator, group_given, model_parallel, mesh_auto)
    for pattern, placement in rows:
        if all(p is None or p == k for p, k in zip(pattern, key, strict=True)):
            return placement
    owned = group_given or group_formed
    if coordinator:
        return P.ATTACHED if owned else P.ELASTIC
    return P.GROUP if owned or launcher else P.ALONE


CASES = list(itertools.product((False, True), repeat=6))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "".join("01"[b] for b in c))
def test_every_situation_has_one_placement(case: tuple[bool, ...]) -> None:
    situation = Situation(
        coordinator=case[0],
        group_given=case[1],
        group_formed=case[2],
        launcher=case[3],
        model_parallel=case[4],
        mesh_auto=case[5],
    )
    want = _expected(*case)
    if want is None:
        with pytest.raises(ValueError, match="leaves the mesh to a coordinator"):
            place(situation)
    else:
        assert place(situation) is want


def test_the_table_names_each_placement() -> None:
    reached = {_expected(*case) for case in CASES} - {None}
    assert reached == set(Placement)


def test_initialize_logs_its_placement_in_one_line(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("ZEROPLANE_COORDINATOR", "ZEROPLANE_TP", "ZEROPLANE_PP", "ZEROPLANE_MESH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = seeded_model()
    with caplog.at_level(logging.INFO, logger="worker.entry"):
        engine = worker.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), config=worker.ZeroConfig(stage=1)
        )
    try:
        lines = [r.getMessage() for r in caplog.records if "placement" in r.getMessage()]
        assert lines == ["zeroplane engine: placement alone (data parallel, stage 1, cpu)"]
    finally:
        engine.close()


def test_the_spec_reads_the_launchers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEROPLANE_TP", "2")
    monkeypatch.delenv("ZEROPLANE_PP", raising=False)
    monkeypatch.delenv("ZEROPLANE_MESH", raising=False)
    monkeypatch.setenv("ZEROPLANE_COORDINATOR", "127.0.0.1:1")
    model = seeded_model()
    spec = EngineSpec.of(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert spec.model_parallel and spec.coordinator == "127.0.0.1:1"
    assert spec.parallel is not None and spec.parallel.tensor_parallel == 2
    assert place(Situation.of(spec)) is Placement.ELASTIC_MESH
    assert spec.asked_degrees() == (2, 1)


def test_mesh_auto_without_a_coordinator_is_refused_before_the_model_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ZEROPLANE_MESH", "auto")
    for name in ("ZEROPLANE_COORDINATOR", "ZEROPLANE_TP", "ZEROPLANE_PP"):
        monkeypatch.delenv(name, raising=False)
    model = seeded_model()
    with pytest.raises(ValueError, match="ZEROPLANE_MESH=auto leaves the mesh"):
        worker.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
