"""The state file's format 3 (coordinator/control/statefile.py [Note: state file format]):
a base record and appended deltas, compaction, older formats, torn and damaged files.

Behaviour only (no timing: speed is measured in bench/coordinator_load.py --scale-only).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from google.protobuf import json_format

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator.control import statefile
from coordinator.control.membership import Membership, Snapshot
from coordinator.control.published import Published
from coordinator.control.statefile import (
    MAGIC,
    StateLog,
    inventory_path,
    load_snapshot,
    save_snapshot,
)
from coordinator.core.conversions import (
    inventory_digest,
    inventory_wire,
    param_to_proto,
    worker_to_proto,
)
from coordinator.core.generation_codec import generation_to_proto
from coordinator.core.messages import Generation, WorkerInfo
from tests.coordinator_util import HOSTS, formed_on_hosts, inventory

pytestmark = pytest.mark.timeout(60)


def published(m: Membership, previous: Generation | None) -> Snapshot:
    """What the server saves after a formation: the snapshot with its wire forms."""
    assert m.generation is not None
    return Published.of(m.generation, previous).for_state_file(m.snapshot())


def reform(m: Membership) -> Snapshot:
    previous = m.generation
    assert m.maybe_form() is not None
    return published(m, previous)


def assert_holds(path: Path, m: Membership) -> Snapshot:
    want = m.snapshot()
    got = load_snapshot(path)
    assert got is not None
    assert got.generation == want.generation
    assert got.members == want.members
    assert sorted(got.left) == sorted(want.left)
    assert (got.epoch, got.finished_by, got.stopping) == (
        want.epoch,
        want.finished_by,
        want.stopping,
    )
    assert got.inventory == want.inventory
    return got


def test_generations_are_appended_as_deltas_and_load_to_the_whole(tmp_path) -> None:
    path = tmp_path / "state.json"
    m = formed_on_hosts()
    log = StateLog(path)
    log.save(published(m, None))
    assert log.last_write == "base" and path.read_bytes().startswith(MAGIC)
    assert_holds(path, m)
    base_size = path.stat().st_size

    # a host lost: its ranks leave in one generation, written as a members delta
    for wid in HOSTS["h1"]:
        m.process_exited(wid, "was lost with its host")
    log.save(reform(m))
    assert log.last_write == "delta"
    assert path.stat().st_size - base_size < base_size  # not the members again
    got = assert_holds(path, m)
    assert got.generation is not None and got.generation.id == 2
    assert got.generation.reshard is not None and not got.generation.reshard.partial

    # a member leaves (the server saves before it exits), then one joins
    m.leave("h2-1", "done")
    log.save(m.snapshot())
    assert log.last_write == "delta"
    assert assert_holds(path, m).left == ("h2-1",)
    m.register(WorkerInfo(worker_id="late", host="h9", free_ports=(3001,)), inventory())
    log.save(reform(m))  # without the leaver
    log.save(reform(m))  # with the joiner: its WorkerInfo in the record
    assert log.last_write == "delta"
    got = assert_holds(path, m)
    assert "late" in [w.worker_id for w in got.members] and got.left == ()

    # a restarted coordinator takes it over, and its first save rewrites the file
    restored = Membership(m.config, m.plan)
    restored.restore(got)
    assert restored.generation == m.generation
    fresh = StateLog(path)
    fresh.save(restored.snapshot())
    assert fresh.last_write == "base"
    assert load_snapshot(path).generation == m.generation


def test_deltas_without_the_wire_forms_load_too(tmp_path) -> None:
    path = tmp_path / "state.json"
    m = formed_on_hosts()
    log = StateLog(path)
    log.save(m.snapshot())
    m.leave("h0-0", "done")
    log.save(m.snapshot())
    assert m.maybe_form() is not None
    log.save(m.snapshot())  # the generation whole in the record
    assert log.last_write == "delta"
    assert_holds(path, m)


def test_the_log_is_compacted(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(statefile, "MAX_GENERATION_RECORDS", 2)
    path = tmp_path / "state.json"
    m = formed_on_hosts()
    log = StateLog(path)
    log.save(published(m, None))
    writes = []
    for wid in ("h0-1", "h1-1", "h2-1"):
        m.leave(wid, "done")
        log.save(reform(m))
        writes.append(log.last_write)
        assert_holds(path, m)
    assert writes == ["delta", "delta", "base"]
    # a file replaced under the writer is rewritten, not appended to
    save_snapshot(path, m.snapshot())
    m.leave("h0-2", "done")
    log.save(m.snapshot())
    assert log.last_write == "base"
    assert_holds(path, m)


def appended(tmp_path: Path) -> tuple[Path, Membership, Generation, int]:
    """A state file of a base and one generation appended; the first generation and
    where the appended record begins."""
    path = tmp_path / "state.json"
    m = formed_on_hosts()
    first = m.generation
    assert first is not None
    log = StateLog(path)
    log.save(published(m, None))
    size = path.stat().st_size
    for wid in HOSTS["h1"]:
        m.process_exited(wid, "was lost with its host")
    log.save(reform(m))
    assert log.last_write == "delta"
    return path, m, first, size


@pytest.mark.parametrize("how", ["cut", "header cut", "zeros", "garbled end"])
def test_a_torn_last_record_loads_the_state_before_it(tmp_path, caplog, how) -> None:
    """What a crash in the middle of an append leaves: the generation it was writing
    was never announced, so the one before is what the workers hold."""
    path, m, first, size = appended(tmp_path)
    data = path.read_bytes()
    if how == "cut":
        path.write_bytes(data[:-3])
    elif how == "header cut":
        path.write_bytes(data[: size + 5])
    elif how == "zeros":  # the file grew, its data never reached the disk
        path.write_bytes(data[:size] + bytes(len(data) - size))
    else:
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with caplog.at_level(logging.WARNING, logger="coordinator.control.statefile"):
        got = load_snapshot(path)
    assert got is not None and got.generation == first
    assert [w.worker_id for w in got.members] == [x for r in HOSTS.values() for x in r]
    assert "state.json" in caplog.text and "ignored" in caplog.text
    # the next writer rewrites it whole
    log = StateLog(path)
    log.save(m.snapshot())
    assert log.last_write == "base"
    assert_holds(path, m)


@pytest.mark.parametrize(
    "damage",
    ["base cut", "base byte", "middle byte", "middle length", "magic only", "old magic"],
)
def test_a_damaged_state_file_is_an_error_naming_it(tmp_path, damage) -> None:
    path, _, _, size = appended(tmp_path)
    data = path.read_bytes()
    header = len(MAGIC)
    if damage == "base cut":
        data = data[: size - 10]
    elif damage == "base byte":
        data = data[: header + 20] + bytes([data[header + 20] ^ 0x01]) + data[header + 21 :]
    elif damage == "middle byte":  # a record that is not the last: not a crash's doing
        data += data[size:]  # the same record again after it, so it is not the last
        at = size + 30
        data = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]
    elif damage == "middle length":
        data += data[size:]
        data = data[:size] + bytes([data[size] ^ 0x40]) + data[size + 1 :]
    elif damage == "magic only":
        data = MAGIC
    else:
        data = MAGIC.replace(b"3", b"9") + data[header:]
    path.write_bytes(data)
    why = {
        "base cut": "record 0 at byte 19 is cut short",
        "base byte": "record 0 at byte 19 is damaged",
        "middle byte": "record 1 at byte [0-9]+ is damaged .it fails its checksum",
        "middle length": "record 1 at byte [0-9]+ is damaged .its length fails its checksum",
        "magic only": "it holds no record",
        "old magic": "unreadable",  # not format 3, and not JSON
    }[damage]
    with pytest.raises(ValueError, match=rf"state file '.*state\.json'.*{why}"):
        load_snapshot(path)


def test_a_record_out_of_sequence_is_refused(tmp_path) -> None:
    """A generation record appended twice does not follow from the state before it."""
    path, _, _, size = appended(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data + data[size:])
    with pytest.raises(ValueError, match=r"state\.json.*(delta from generation 1|generation 2)"):
        load_snapshot(path)


def test_a_format_2_state_file_still_loads_and_is_rewritten_as_format_3(tmp_path) -> None:
    m = formed_on_hosts()
    m.leave("h0-1", "done")
    gen = m.maybe_form()
    assert gen is not None and gen.reshard is not None
    m.leave("h1-0", "bye")
    snapshot = m.snapshot()
    path = tmp_path / "state.json"
    wire = inventory_wire([param_to_proto(p) for p in inventory()])
    digest = inventory_digest(wire)
    inventory_path(path, digest).write_bytes(wire)
    old = pb.PersistedState(
        format_version=2,
        members=[worker_to_proto(w) for w in snapshot.members],
        epoch=snapshot.epoch,
        inventory_digest=digest,
        left=snapshot.left,
    )
    old.generation.CopyFrom(generation_to_proto(statefile._without_derived(gen)))
    path.write_text(json_format.MessageToJson(old, preserving_proto_field_name=True, indent=1))
    got = assert_holds(path, m)
    assert got.left == ("h1-0",)
    save_snapshot(path, got)
    assert path.read_bytes().startswith(MAGIC)
    assert_holds(path, m)


def test_a_json_state_file_of_an_unknown_format_is_refused(tmp_path) -> None:
    path = tmp_path / "state.json"
    path.write_text('{"format_version": 3}')
    with pytest.raises(ValueError, match=r"state\.json.*format_version 3"):
        load_snapshot(path)


def test_a_snapshot_without_a_generation_round_trips(tmp_path) -> None:
    path = tmp_path / "state.json"
    snapshot = Snapshot(inventory=(), generation=None, members=(), epoch="e1", stopping="why")
    log = StateLog(path)
    log.save(snapshot)
    log.save(dataclasses.replace(snapshot, finished_by="a"))
    got = load_snapshot(path)
    assert got is not None and got.generation is None
    assert (got.epoch, got.stopping, got.finished_by) == ("e1", "why", "a")
