"""The documentation site (mkdocs.yml, docs/): it builds with strict link checking,
its generated reference pages match the code, its Python code blocks run, and every
example script is exercised by some test.

Code blocks: every fence whose info string is exactly ``python`` in a page of the
site runs, in page order, in one namespace per page (so a later block may use what
an earlier one defined), in a fresh temporary directory, in this process, on the
CPU, alone (no coordinator, no process group). A block that cannot run so (it needs
several processes, a cluster, a GPU, or is a fragment of a larger script) is marked
on the line just above its fence with ``<!-- no-run: why -->``; the reason is
required. The pages written before the site (design, Lightning, HF Trainer) are
exempt: their blocks are fragments by design.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"

# pages whose python blocks are not run (see the module docstring)
EXEMPT = {"design.md", "lightning.md", "hf_trainer.md"}
NO_RUN = re.compile(r"^<!--\s*no-run:\s*(\S.*?)\s*-->$")
FENCE = re.compile(r"^(`{3,}|~{3,})\s*(.*)$")
# what a block may not inherit from the environment this test runs in
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# a page's blocks together: a few seconds each on a loaded 2-core machine
PAGE_BUDGET_S = 30.0


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ZEROPLANE_") or name in LAUNCH_ENV:
            monkeypatch.delenv(name)


# ---------------------------------------------------------------- the site


def test_site_builds_with_strict_link_checking(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="mkdocs-material is not installed")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    site = tmp_path / "site"
    for page in ("index.html", "reference/config/index.html", "design/index.html"):
        assert (site / page).is_file(), page
    # offline: the theme must not ask for web fonts
    assert "fonts.googleapis.com" not in (site / "index.html").read_text(encoding="utf-8")


def test_every_page_is_in_the_nav_or_excluded():
    """A page left out of mkdocs.yml's nav would be built but unreachable."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    # mkdocs.yml's slugify is a python tag: any value does here
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *a: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)

    def paths(nav):
        for item in nav:
            for value in item.values() if isinstance(item, dict) else [item]:
                yield from paths(value) if isinstance(value, list) else [value]

    in_nav = set(paths(config["nav"]))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages - in_nav == set()
    assert in_nav - pages == set()


# ---------------------------------------------------------------- generated reference


def test_reference_pages_match_the_code():
    generator = _load_generator()
    stale = []
    for rel, text in generator.pages().items():
        path = DOCS / rel
        committed = path.read_text(encoding="utf-8") if path.is_file() else ""
        if committed != text:
            diff = difflib.unified_diff(
                committed.splitlines(), text.splitlines(), f"committed {rel}", "from the code", n=0
            )
            stale.append("\n".join(list(diff)[:20]))
    assert not stale, (
        "reference pages drifted from the code; run `python docs/gen_reference.py` and "
        "commit the result:\n" + "\n\n".join(stale)
    )


def test_the_cli_reference_leaves_hidden_aliases_out():
    text = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    assert "`--precision" in text
    for retired in ("--dtype", "--min-nproc", "--microbatches", "--checkpointing "):
        assert retired not in text, retired


# ---------------------------------------------------------------- code blocks


def _python_blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """(line, source, reason not to run or None) of each ``python`` fence of ``page``."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info = match.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence)), len(lines))
        if info.strip() == "python":
            above = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            marker = NO_RUN.match(above.strip())
            assert marker or "no-run" not in above, (
                f"{page.name}:{i}: write the marker as <!-- no-run: why -->"
            )
            blocks.append((i + 1, "\n".join(lines[i + 1 : end]), marker and marker.group(1)))
        i = end + 1
    return blocks


def _runnable_pages() -> list[Path]:
    """The pages with at least one python block to run (the markers are checked for
    every page that is not exempt, while collecting)."""
    return sorted(
        p
        for p in DOCS.rglob("*.md")
        if str(p.relative_to(DOCS)) not in EXEMPT
        and any(reason is None for *_, reason in _python_blocks(p))
    )


def test_some_pages_have_runnable_blocks():
    names = {str(p.relative_to(DOCS)) for p in _runnable_pages()}
    assert {"quickstart/port-a-script.md", "migration/deepspeed.md"} <= names, names


@pytest.mark.parametrize("page", _runnable_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_python_blocks_run(page, tmp_path, monkeypatch):
    import torch.distributed as dist

    _clean_env(monkeypatch)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    start = time.monotonic()
    for line, source, reason in _python_blocks(page):
        if reason is not None:
            continue
        code = compile(source, f"{page.relative_to(ROOT)}:{line}", "exec")
        exec(code, namespace)
        ran += 1
    elapsed = time.monotonic() - start
    for value in list(namespace.values()):
        close = getattr(value, "close", None)
        if callable(close) and type(value).__module__.startswith("worker"):
            close()
    if dist.is_available():
        assert not dist.is_initialized(), f"{page.name}: a block left a process group behind"
    assert ran > 0
    assert elapsed < PAGE_BUDGET_S, f"{page.name}: its blocks took {elapsed:.1f}s"


# ---------------------------------------------------------------- examples

# examples exercised by this file; the others by the test files that name them
SMOKED_HERE = {"tune_model.py", "hpo_train.py"}


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.iterdir() if p.is_file()))
def test_every_example_is_exercised_by_a_test(example):
    if example in SMOKED_HERE:
        return
    others = [p for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_docs.py"]
    users = [p.name for p in others if example in p.read_text(encoding="utf-8")]
    assert users, f"examples/{example} is run by no test: add one (or a smoke test here)"


def test_tune_model_example_builds_and_steps():
    """examples/tune_model.py as `zeroplane tune --script` imports it: build() and
    batch(micro_batch, step, rank), whose forward returns a loss."""
    import torch

    module = runpy.run_path(str(EXAMPLES / "tune_model.py"))
    torch.manual_seed(0)
    model = module["build"]()
    first = module["batch"](2, 0, 0)
    assert all(t.shape == (2, module["CONFIG"].block_size) for t in first)
    assert torch.equal(first[0], module["batch"](2, 0, 0)[0])  # a function of (step, rank)
    assert not torch.equal(first[0], module["batch"](2, 0, 1)[0])
    loss = model(*first)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_hpo_train_example_runs_outside_a_search(tmp_path, monkeypatch):
    """examples/hpo_train.py, alone (its defaults where no search set a trial), for
    two steps in one process."""
    import torch

    _clean_env(monkeypatch)
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    argv = ["hpo_train.py", "--steps", "2", "--global-batch", "4", "--save-every", "100"]
    monkeypatch.setattr(sys, "argv", argv)
    try:
        runpy.run_path(str(EXAMPLES / "hpo_train.py"), run_name="__main__")
    finally:
        torch.set_num_threads(threads)  # the script sets one thread for its process
