"""The generated protobuf modules are current, and the coordinator package stays torch-free."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "coordinator" / "_proto"

pytestmark = pytest.mark.timeout(120)


def test_generated_modules_are_not_stale(tmp_path: Path) -> None:
    # Regenerate into a temp dir with the pinned grpcio-tools and compare byte for byte.
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.fail("grpcio-tools is missing: install the test extra (pip install -e '.[test]')")
    subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=100,
    )
    fresh_root = tmp_path / "coordinator" / "_proto"

    def files(root: Path) -> dict[str, bytes]:
        return {
            str(p.relative_to(root)): p.read_bytes()
            for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        }

    fresh, checked_in = files(fresh_root), files(GENERATED)
    assert sorted(fresh) == sorted(checked_in), "generated file set differs"
    stale = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not stale, f"stale generated code {stale}: run `python proto/generate.py`"


def test_coordinator_never_imports_torch() -> None:
    code = """
import sys
import coordinator.cli, coordinator.control.client, coordinator.control.server
import coordinator.core.planner
import coordinator.core.reshard, coordinator.control.membership
import coordinator.control.statefile
import coordinator.commands.plan, coordinator.commands.status, coordinator.commands.coordinator
coordinator.cli.build_parser()
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, loaded
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=100)
