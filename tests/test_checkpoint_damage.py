"""Randomized damage to a saved checkpoint, loaded on two ranks.

Each case copies an intact checkpoint, damages it one way and loads it. A load
either fails on every rank with the same :class:`CheckpointError`, naming the
manifest or the file, and leaves the engine exactly as it was; or, for damage
that cannot matter (whitespace, key order, a field the loader does not read),
loads exactly what the intact checkpoint holds. A hang or a rank that loads
while another raises is a failure.

Seeded and replayable: every seed runs every kind of damage once with its own
random choices (which byte, which range, which file); a failure names the
seed and the kind. ``ZEROPLANE_DAMAGE_SEEDS=4,9`` reruns chosen seeds.
Bounded: cases run in chunks and no new chunk starts after ``BUDGET_S``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import pytest
import torch

from tests.test_checkpoint import make_engine, train
from worker.checkpoint import CheckpointError

SEEDS = [int(s) for s in os.environ.get("ZEROPLANE_DAMAGE_SEEDS", "0,1,2").split(",")]
BUDGET_S = 60.0
CHUNK = 24
STEP = 2  # the saved checkpoint's step
STEP_DIR = f"step-{STEP:08d}"

Expect = Literal["error", "harmless", "either"]
Damage = Callable[[Path, random.Random], None]
KINDS: dict[str, tuple[Damage, Expect]] = {}


def kind(name: str, expect: Expect) -> Callable[[Damage], Damage]:
    def register(fn: Damage) -> Damage:
        KINDS[name] = (fn, expect)
        return fn

    return register


# ---------------------------------------------------------------------------- helpers


def checksum(manifest: dict) -> str:
    """The manifest's checksum, from the format's definition (worker/checkpoint.py
    [Note: checkpoint format]): SHA-256 of the canonical JSON of every other field."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def manifest_path(root: Path) -> Path:
    return root / STEP_DIR / "manifest.json"


def read(root: Path) -> dict:
    return json.loads(manifest_path(root).read_text())


def write(root: Path, manifest: dict, sign: Literal["stale", "unsigned", "forged"]) -> None:
    """Write an edited manifest: with its old checksum, with none (as written before
    manifests carried one) or with a checksum recomputed by the editor."""
    if sign == "unsigned":
        manifest.pop("checksum", None)
    elif sign == "forged":
        manifest["checksum"] = checksum(manifest)
    manifest_path(root).write_text(json.dumps(manifest, indent=1))


def flip(path: Path, at: int, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= rng.randrange(1, 256)
    path.write_bytes(bytes(data))


def rank_file(root: Path, rng: random.Random) -> Path:
    return root / STEP_DIR / f"rank{rng.randrange(2):05d}.pt"


def any_range(manifest: dict, rng: random.Random) -> tuple[str, list]:
    file = rng.choice(sorted(manifest["files"]))
    return file, rng.choice(manifest["files"][file]["ranges"])


# ---------------------------------------------------------------------------- manifest bytes


@kind("manifest: truncated", "error")
def _(root, rng):
    p = manifest_path(root)
    p.write_bytes(p.read_bytes()[: rng.randrange(p.stat().st_size)])


@kind("manifest: a random byte flipped", "either")
def _(root, rng):
    p = manifest_path(root)
    flip(p, rng.randrange(p.stat().st_size), rng)


@kind("manifest: a digit of a range number changed", "error")
def _(root, rng):
    p = manifest_path(root)
    text = p.read_text()
    ranges = text.index('"ranges"')
    digits = [m.start() for m in re.finditer(r"\d", text[ranges:])]
    at = ranges + rng.choice(digits)
    new = rng.choice([d for d in "0123456789" if d != text[at]])
    p.write_text(text[:at] + new + text[at + 1 :])


@kind("manifest: a digit of global_steps changed", "error")
def _(root, rng):
    p = manifest_path(root)
    text = p.read_text()
    text = text.replace(f'"global_steps": {STEP}', f'"global_steps": {rng.choice([3, 12, 0])}')
    p.write_text(text)


@kind("manifest: not UTF-8", "error")
def _(root, rng):
    p = manifest_path(root)
    data = p.read_bytes()
    at = rng.randrange(len(data))
    p.write_bytes(data[:at] + b"\xff\xfe" + data[at:])


@kind("manifest: random junk", "error")
def _(root, rng):
    manifest_path(root).write_bytes(rng.randbytes(rng.randrange(1, 400)))


@kind("manifest: empty", "error")
def _(root, rng):
    manifest_path(root).write_bytes(b"")


@kind("manifest: deleted", "error")
def _(root, rng):
    manifest_path(root).unlink()


@kind("manifest: a JSON array", "error")
def _(root, rng):
    manifest_path(root).write_text("[]")


@kind("manifest: a duplicated key", "error")
def _(root, rng):
    p = manifest_path(root)
    p.write_text(p.read_text().replace("{", '{\n "global_steps": 7,', 1))


@kind("manifest: NaN for a number", "error")
def _(root, rng):
    p = manifest_path(root)
    key = rng.choice(["global_steps", "loss_scale"])
    p.write_text(re.sub(rf'"{key}": [^,\n]+', f'"{key}": NaN', p.read_text()))


@kind("manifest: re-indented", "harmless")
def _(root, rng):
    manifest_path(root).write_text(json.dumps(read(root), indent=rng.choice([None, 2, 4])))


@kind("manifest: keys reordered", "harmless")
def _(root, rng):
    m = read(root)
    keys = list(m)
    rng.shuffle(keys)
    manifest_path(root).write_text(json.dumps({k: m[k] for k in keys}))


# ---------------------------------------------------------------------------- manifest edits
# Each edit runs three ways: with the manifest's old checksum (always refused),
# without a checksum (as an old manifest) and with a recomputed checksum (an
# editor who knows the format). The last two must still be refused by the
# structural checks when ``structural``; otherwise they may load, identically.

EDITS: dict[str, tuple[Callable[[dict, random.Random], None], bool]] = {}


def edit(name: str, structural: bool = True):
    def register(fn):
        EDITS[name] = (fn, structural)
        return fn

    return register


@edit("global_steps changed")
def _(m, rng):
    m["global_steps"] += rng.choice([-1, 1, 1000])


@edit("global_steps a string")
def _(m, rng):
    m["global_steps"] = str(m["global_steps"])


@edit("global_steps negative")
def _(m, rng):
    m["global_steps"] = -1


@edit("a range shifted by one")
def _(m, rng):
    _, r = any_range(m, rng)
    r[1] += 1
    r[2] += 1


@edit("a range's stop one short")
def _(m, rng):
    _, r = any_range(m, rng)
    r[2] -= 1


@edit("a range's stop one long")
def _(m, rng):
    _, r = any_range(m, rng)
    r[2] += 1


@edit("a range's start beyond its stop")
def _(m, rng):
    _, r = any_range(m, rng)
    r[1] = r[2] + rng.randrange(1, 5)


@edit("a range's number a string")
def _(m, rng):
    _, r = any_range(m, rng)
    r[rng.choice([1, 2])] = str(r[2])


@edit("a range of two numbers")
def _(m, rng):
    _, r = any_range(m, rng)
    r.pop()


@edit("a range of an unknown parameter")
def _(m, rng):
    _, r = any_range(m, rng)
    r[0] = "no.such.param"


@edit("a range duplicated")
def _(m, rng):
    _, r = any_range(m, rng)
    m["files"][rng.choice(sorted(m["files"]))]["ranges"].append(list(r))


@edit("a range removed")
def _(m, rng):
    file, r = any_range(m, rng)
    m["files"][file]["ranges"].remove(r)


@edit("a range moved to another file")
def _(m, rng):
    file, r = any_range(m, rng)
    m["files"][file]["ranges"].remove(r)
    other = next(f for f in sorted(m["files"]) if f != file)
    m["files"][other]["ranges"].append(r)


@edit("two ranges' names swapped")
def _(m, rng):
    # two ranges of different spans: swapping equal spans changes nothing
    file = rng.choice(sorted(m["files"]))
    ranges = m["files"][file]["ranges"]
    pairs = [(a, b) for a in ranges for b in ranges if a[1:] != b[1:]]
    a, b = rng.choice(pairs)
    a[0], b[0] = b[0], a[0]


@edit("a parameter's entry removed")
def _(m, rng):
    del m["params"][rng.choice(sorted(m["params"]))]


@edit("a parameter's entry duplicated")
def _(m, rng):
    name = rng.choice(sorted(m["params"]))
    m["params"][name + ".copy"] = dict(m["params"][name])


@edit("a parameter's shape changed")
def _(m, rng):
    info = m["params"][rng.choice(sorted(m["params"]))]
    info["shape"] = [*info["shape"][:-1], info["shape"][-1] + 1]


@edit("a trainable parameter's dtype swapped", structural=False)
def _(m, rng):
    info = m["params"][rng.choice(sorted(n for n, i in m["params"].items() if i["requires_grad"]))]
    info["dtype"] = rng.choice(["float16", "bfloat16"])


@edit("a frozen parameter's dtype swapped")
def _(m, rng):
    frozen = sorted(n for n, i in m["params"].items() if not i["requires_grad"])
    m["params"][rng.choice(frozen)]["dtype"] = rng.choice(["float16", "int64"])


@edit("a parameter's dtype unknown")
def _(m, rng):
    m["params"][rng.choice(sorted(m["params"]))]["dtype"] = "float17"


@edit("requires_grad flipped")
def _(m, rng):
    info = m["params"][rng.choice(sorted(m["params"]))]
    info["requires_grad"] = not info["requires_grad"]


@edit("a parameter's group changed")
def _(m, rng):
    info = m["params"][rng.choice(sorted(n for n, i in m["params"].items() if i["requires_grad"]))]
    info["group"] = 1 - info["group"]


@edit("a file's entry removed")
def _(m, rng):
    del m["files"][rng.choice(sorted(m["files"]))]


@edit("a file's entry duplicated under another name")
def _(m, rng):
    m["files"]["rank00002.pt"] = dict(m["files"][rng.choice(sorted(m["files"]))])


@edit("a file's name outside the folder")
def _(m, rng):
    m["files"]["../rank00000.pt"] = m["files"].pop(rng.choice(sorted(m["files"])))


@edit("a file's size changed")
def _(m, rng):
    m["files"][rng.choice(sorted(m["files"]))]["bytes"] += rng.choice([-1, 1])


@edit("a file's SHA-256 changed")
def _(m, rng):
    info = m["files"][rng.choice(sorted(m["files"]))]
    info["sha256"] = "0" * 64


@edit("world_size changed")
def _(m, rng):
    m["world_size"] = rng.choice([1, 3])


@edit("stage out of range")
def _(m, rng):
    m["stage"] = rng.choice([-1, 4, "3"])


@edit("loss_scale not positive")
def _(m, rng):
    m["loss_scale"] = rng.choice([0, -1.0, "1.0"])


@edit("loss_scale changed", structural=False)
def _(m, rng):
    m["loss_scale"] = 2.0 ** rng.randrange(1, 16)


@edit("optimizer changed")
def _(m, rng):
    m["optimizer"] = "SGD"


@edit("format changed")
def _(m, rng):
    m["format"] = "zeroplane-checkpoint/9"


@edit("a required key removed")
def _(m, rng):
    del m[rng.choice(["params", "files", "global_steps", "world_size", "loss_scale"])]


@edit("params not an object")
def _(m, rng):
    m["params"] = rng.choice([[], "x", None])


@edit("an alias of an unknown parameter")
def _(m, rng):
    m["aliases"]["head.weight"] = "no.such.param"


@edit("an alias removed", structural=False)
def _(m, rng):
    m["aliases"].clear()


@edit("an unknown key added", structural=False)
def _(m, rng):
    m["note"] = rng.random()


for _name, (_fn, _structural) in EDITS.items():
    for _sign in ("stale", "unsigned", "forged"):
        _expect: Expect = "error" if _sign == "stale" or _structural else "either"

        def _apply(root, rng, fn=_fn, sign=_sign):
            m = read(root)
            fn(m, rng)
            write(root, m, sign)

        KINDS[f"manifest edit, {_sign} checksum: {_name}"] = (_apply, _expect)


@kind("manifest: checksum not hex", "error")
def _(root, rng):
    m = read(root)
    m["checksum"] = rng.choice(["sha256:xyz", "", 5, "md5:00"])
    manifest_path(root).write_text(json.dumps(m))


# ---------------------------------------------------------------------------- rank files


@kind("rank file: truncated", "error")
def _(root, rng):
    p = rank_file(root, rng)
    p.write_bytes(p.read_bytes()[: rng.randrange(p.stat().st_size)])


@kind("rank file: a byte flipped", "error")
def _(root, rng):
    p = rank_file(root, rng)
    flip(p, rng.randrange(p.stat().st_size), rng)


@kind("rank file: deleted", "error")
def _(root, rng):
    rank_file(root, rng).unlink()


@kind("rank file: empty", "error")
def _(root, rng):
    rank_file(root, rng).write_bytes(b"")


@kind("rank file: junk appended", "error")
def _(root, rng):
    p = rank_file(root, rng)
    p.write_bytes(p.read_bytes() + rng.randbytes(rng.randrange(1, 64)))


@kind("rank files: swapped", "error")
def _(root, rng):
    a, b = root / STEP_DIR / "rank00000.pt", root / STEP_DIR / "rank00001.pt"
    a.rename(root / "tmp")
    b.rename(a)
    (root / "tmp").rename(b)


# A rank file rewritten by someone who also updates its size, SHA-256 and the
# manifest's checksum: only checking the file's entries against the manifest
# finds these.


def forge(root: Path, rng: random.Random, change: Callable[[dict, random.Random], object]) -> None:
    unsharded = change is _unsharded_change
    p = root / STEP_DIR / "rank00000.pt" if unsharded else rank_file(root, rng)
    payload = torch.load(p, weights_only=True)
    payload = change(payload, rng) or payload
    buf = io.BytesIO()
    torch.save(payload, buf)
    p.write_bytes(buf.getvalue())
    m = read(root)
    m["files"][p.name]["bytes"] = len(buf.getvalue())
    m["files"][p.name]["sha256"] = hashlib.sha256(buf.getvalue()).hexdigest()
    write(root, m, "forged")


def _entry(payload: dict, rng: random.Random) -> tuple[str, dict]:
    key = rng.choice(sorted(payload["entries"]))
    return key, payload["entries"][key]


def _entry_removed(payload, rng):
    del payload["entries"][_entry(payload, rng)[0]]


def _master_fp16(payload, rng):
    entry = _entry(payload, rng)[1]
    entry["master"] = entry["master"].half()


def _master_short(payload, rng):
    entry = _entry(payload, rng)[1]
    entry["master"] = entry["master"][:-1].clone()


def _key_shifted(payload, rng):
    key, entry = _entry(payload, rng)
    del payload["entries"][key]
    shifted = re.sub(r"\[(\d+):(\d+)\]$", lambda g: f"[{int(g[1]) + 1}:{int(g[2]) + 1}]", key)
    payload["entries"][shifted] = entry


def _state_too_long(payload, rng):
    _entry(payload, rng)[1]["state"]["exp_avg"] = torch.zeros(10_000)


def _not_a_dict(payload, rng):
    return [1, 2, 3]


def _unsharded_change(payload, rng):
    u = payload["unsharded"]
    which = rng.choice(["frozen dtype", "frozen removed", "buffer unknown", "counter", "groups"])
    if which == "frozen dtype":
        name = rng.choice(sorted(u["frozen"]))
        u["frozen"][name] = u["frozen"][name].double()
    elif which == "frozen removed":
        u["frozen"].pop(rng.choice(sorted(u["frozen"])))
    elif which == "buffer unknown":
        u["buffers"]["norm.no_such_buffer"] = torch.zeros(3)
    elif which == "counter":
        u["micro_steps"] = "many"
    else:
        u["param_groups"] = u["param_groups"][:1]


FORGED: dict[str, Callable[[dict, random.Random], object]] = {
    "an entry removed": _entry_removed,
    "master values in fp16": _master_fp16,
    "master values one short": _master_short,
    "an entry under a shifted key": _key_shifted,
    "optimizer state of the wrong length": _state_too_long,
    "not a dict": _not_a_dict,
    "unsharded state": _unsharded_change,
}

for _name, _change in FORGED.items():

    def _forge(root, rng, change=_change):
        forge(root, rng, change)

    KINDS[f"rank file rewritten, manifest updated: {_name}"] = (_forge, "error")


# ---------------------------------------------------------------------------- latest


@kind("latest: junk", "error")
def _(root, rng):
    (root / "latest").write_bytes(rng.choice([b"", b"step-99999999", b"\xff\xfe", b"../.."]))


# ---------------------------------------------------------------------------- the test


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("damage") / "ckpt"
    pools(2).run(save_phase, str(path))
    return path


def save_phase(path: str) -> None:
    engine = make_engine(3)
    train(engine, range(STEP))
    engine.save_checkpoint(path, client_state={"next_step": STEP})


def snapshot(engine) -> dict:
    inner = engine.state.optimizer.inner.state
    return {
        "params": engine.full_state_dict(),
        "steps": engine.global_steps,
        "optimizer": [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for s in (inner.get(p.view, {}) for p in engine.state.optimizer.pieces)
        ],
    }


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def load_cases(pristine: str, cases: list[tuple[str, str]]) -> list[dict]:
    """On every rank: load each damaged copy into a trained engine and say what happened."""
    engine = make_engine(2)
    engine.load_checkpoint(pristine)
    clean = snapshot(engine)
    out = []
    for case, path in cases:
        train(engine, range(1))  # the engine now differs from every checkpoint
        before = snapshot(engine)
        try:
            state = engine.load_checkpoint(path)
        except CheckpointError as exc:
            after = snapshot(engine)
            out.append({"case": case, "error": str(exc), "unchanged": same(before, after)})
        except Exception as exc:  # reported as the failure it is
            out.append({"case": case, "crash": f"{type(exc).__name__}: {exc}"})
        else:
            identical = same(snapshot(engine), clean) and state == {"next_step": STEP}
            out.append({"case": case, "loaded": True, "identical": identical})
    return out


def judge(case: str, expect: Expect, ranks: list[dict], root: Path) -> str | None:
    """What is wrong with one case's outcome on every rank, or None."""
    first = ranks[0]
    if any(r.get("crash") for r in ranks):
        return f"crashed: {[r.get('crash') for r in ranks]}"
    if any(r.keys() != first.keys() for r in ranks):
        return f"ranks disagree: {ranks}"
    if "error" in first:
        if expect == "harmless":
            return f"refused harmless damage: {first['error']}"
        if len({r["error"] for r in ranks}) != 1:
            return f"ranks raised different errors: {[r['error'] for r in ranks]}"
        if not all(r["unchanged"] for r in ranks):
            return f"a failed load changed the engine: {first['error']}"
        named = ("manifest.json", "rank0", "latest", str(root))
        if not any(n in first["error"] for n in named):
            return f"the error names neither the manifest nor a file: {first['error']}"
        if "\n" in first["error"] or len(first["error"]) > 600:
            return f"the error is not one short line: {first['error']!r}"
        return None
    if expect == "error":
        return "loaded"
    if not all(r["identical"] for r in ranks):
        return "loaded different values"
    return None


@pytest.mark.timeout(240)
def test_damaged_checkpoints_fail_alike_or_load_identically(pools, saved, tmp_path) -> None:
    started = time.monotonic()
    cases: list[tuple[str, str, Expect, Path]] = []
    for seed in SEEDS:
        for name, (damage, expect) in KINDS.items():
            case = f"seed {seed}, {name}"
            root = tmp_path / f"case{len(cases)}"
            shutil.copytree(saved, root)
            damage(root, random.Random(f"{seed}/{name}"))
            cases.append((case, str(root), expect, root))
    failures, done = [], 0
    for lo in range(0, len(cases), CHUNK):
        if time.monotonic() - started > BUDGET_S:
            break
        chunk = cases[lo : lo + CHUNK]
        results = pools(2).run(load_cases, str(saved), [(c, p) for c, p, _, _ in chunk])
        for i, (case, _, expect, root) in enumerate(chunk):
            problem = judge(case, expect, [r[i] for r in results], root)
            if problem:
                failures.append(f"{case}: {problem}")
        done += len(chunk)
    assert not failures, f"{len(failures)} of {done} cases:\n" + "\n".join(failures)
    assert done >= len(KINDS), f"only {done} cases ran within {BUDGET_S:.0f}s"


def test_the_seed_set_covers_forty_kinds() -> None:
    assert len(KINDS) >= 40


def load_own_copy(dirs: list[str]) -> str:
    """Load ``ckpt`` relative to this rank's own folder, as from node-local storage."""
    import torch.distributed as dist

    engine = make_engine(2)
    train(engine, range(1))
    before = snapshot(engine)
    cwd = os.getcwd()
    os.chdir(dirs[dist.get_rank()])
    try:
        with pytest.raises(CheckpointError) as info:
            engine.load_checkpoint("ckpt")
    finally:
        os.chdir(cwd)
    assert same(before, snapshot(engine))
    return str(info.value)


def test_ranks_that_read_different_manifests_all_refuse(pools, saved, tmp_path) -> None:
    """Each rank's manifest is whole, but they differ (node-local copies that
    diverged, or a checkpoint rewritten while ranks read it): no rank loads."""
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for d in dirs:
        shutil.copytree(saved, d / "ckpt")
    m = read(dirs[1] / "ckpt")
    m["loss_scale"] = 4.0
    write(dirs[1] / "ckpt", m, "forged")
    messages = pools(2).run(load_own_copy, [str(d) for d in dirs])
    assert messages[0] == messages[1]
    assert "the ranks read different manifests from ckpt" in messages[0]
