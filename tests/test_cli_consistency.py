"""The command line as a whole: one name per idea, help for every option, old names
still parsing, ``--version``, and the client commands running without torch.

Walks every subcommand's argparse parser (``zeroplane <cmd> --help`` is what it
renders), so a new option that breaks a rule fails here, not in a user's script.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.cli import COMMANDS, build_parser, main
from coordinator.commands.args import PRECISIONS

ROOT = Path(__file__).resolve().parents[1]

# Retired spellings, each (command, old argv, argv with the current name): the old
# one must still parse, to the same namespace, and must not show in --help.
ALIASES = [
    ("plan", ["--params", "1B", "--dtype", "fp16"], ["--params", "1B", "--precision", "fp16"]),
    (
        "plan",
        ["--params", "1B", "--microbatches", "8"],
        ["--params", "1B", "--pipeline-microbatches", "8"],
    ),
    ("coordinator", ["--dtype", "fp32"], ["--precision", "fp32"]),
    ("demo", ["--dtype", "bf16"], ["--precision", "bf16"]),
    (
        "tune",
        ["--gpt", "2,64,2,32", "--dtype", "bf16"],
        ["--gpt", "2,64,2,32", "--precision", "bf16"],
    ),
    (
        "tune",
        ["--gpt", "2,64,2,32", "--checkpointing", "on"],
        ["--gpt", "2,64,2,32", "--activation-checkpointing", "on"],
    ),
    (
        "tune",
        ["--gpt", "2,64,2,32", "--buckets", "4096,1M"],
        ["--gpt", "2,64,2,32", "--bucket-numels", "4096,1M"],
    ),
    (
        "run",
        ["--nproc", "2", "--min-nproc", "1", "--max-nproc", "3", "x.py"],
        ["--nproc", "2", "--min-workers", "1", "--max-workers", "3", "x.py"],
    ),
    (
        "checkpoint export",
        ["ckpt", "out.safetensors", "--dtype", "bf16"],
        ["ckpt", "out.safetensors", "--precision", "bf16"],
    ),
]
RETIRED = {old for _, argv, _ in ALIASES for old in argv if old.startswith("--")} - {
    opt for _, _, argv in ALIASES for opt in argv if opt.startswith("--")
}
# reStructuredText that reads as noise in a terminal
RST = re.compile(r"``|:(?:class|func|meth|mod|attr):`")


def _parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every (sub)command's parser by its name, ``checkpoint export`` included."""
    todo = [("", build_parser())]
    while todo:
        name, parser = todo.pop(0)
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    todo.append((f"{name} {sub}".strip(), child))


def _visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help is not argparse.SUPPRESS]


def _parse(command: str, argv: list[str]) -> dict:
    return vars(build_parser().parse_args([*command.split(), *argv]))


NAMES = [name for name, _ in _parsers()]


def test_every_command_is_walked() -> None:
    assert {*COMMANDS, "checkpoint inspect", "checkpoint export"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES, ids=lambda n: n or "zeroplane")
def test_every_argument_has_help(name: str) -> None:
    parser = dict(_parsers())[name]
    missing = [
        "/".join(a.option_strings) or a.metavar or a.dest
        for a in parser._actions
        if not a.help and not isinstance(a, argparse._SubParsersAction)
    ]
    assert not missing, f"zeroplane {name}: no help text for {missing}"


@pytest.mark.parametrize("name", NAMES, ids=lambda n: n or "zeroplane")
def test_help_is_plain_text(name: str) -> None:
    text = dict(_parsers())[name].format_help()
    assert not RST.search(text), f"zeroplane {name} --help has RST markup:\n{text}"


def test_a_hidden_option_is_an_alias_of_a_shown_one() -> None:
    for name, parser in _parsers():
        shown = {a.dest for a in _visible(parser)}
        for action in parser._actions:
            if action.help is argparse.SUPPRESS and action.option_strings:
                assert action.dest in shown, (
                    f"zeroplane {name}: hidden {action.option_strings} is no alias"
                )
                # the shown option's default must win: the alias sets none
                assert action.default is argparse.SUPPRESS


def test_one_name_per_dest_and_one_dest_per_name() -> None:
    names: dict[str, set[str]] = defaultdict(set)
    dests: dict[str, set[str]] = defaultdict(set)
    for _, parser in _parsers():
        for action in _visible(parser):
            for option in action.option_strings:
                if option.startswith("--"):
                    names[action.dest].add(option)
                    dests[option].add(action.dest)
    several_names = {d: sorted(n) for d, n in names.items() if len(n) > 1}
    several_dests = {n: sorted(d) for n, d in dests.items() if len(d) > 1}
    assert not several_names, f"one idea, several option names: {several_names}"
    assert not several_dests, f"one option name, several ideas: {several_dests}"


def test_retired_names_are_not_shown() -> None:
    retired = {"--dtype", "--microbatches", "--checkpointing", "--buckets", "--min-nproc"}
    assert retired | {"--max-nproc"} == RETIRED
    for name, parser in _parsers():
        shown = {o for a in _visible(parser) for o in a.option_strings}
        assert not shown & RETIRED, f"zeroplane {name} shows {sorted(shown & RETIRED)}"
        text = parser.format_help()
        for old in RETIRED:
            assert not re.search(rf"{re.escape(old)}\b(?!-)", text), f"{name} --help: {old}"


@pytest.mark.parametrize(("command", "old", "new"), ALIASES)
def test_old_names_still_parse(command: str, old: list[str], new: list[str]) -> None:
    assert _parse(command, old) == _parse(command, new)


def test_precision_speaks_zeroconfigs_names() -> None:
    assert PRECISIONS == ("fp32", "bf16", "fp16")
    seen = []
    for name, parser in _parsers():
        for action in _visible(parser):
            if "--precision" in action.option_strings:
                assert set(action.choices) <= set(PRECISIONS), name
                seen.append(name)
    assert sorted(seen) == ["checkpoint export", "coordinator", "demo", "plan", "tune"]


def test_token_file_wherever_a_token_is_read() -> None:
    parsers = dict(_parsers())
    for name in ("run", "status", "coordinator", "submit"):
        assert "--token-file" in parsers[name]._option_string_actions, name


def test_run_token_file_is_for_a_coordinator_it_joins(tmp_path: Path, capsys) -> None:
    token = tmp_path / "token"
    token.write_text("")
    assert main(["run", "--token-file", str(token), "x.py"]) == 2
    assert "--token-file is the token for --coordinator" in capsys.readouterr().err
    argv = ["run", "--coordinator", "127.0.0.1:1", "--token-file", str(token), "x.py"]
    assert main(argv) == 2
    assert "is empty" in capsys.readouterr().err


def test_run_options_before_the_script_are_zeroplanes() -> None:
    args = build_parser().parse_args(["run", "--stage", "2", "train.py", "--stage", "3"])
    assert args.stage == "2" and args.script_args == ["--stage", "3"]


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"zeroplane {importlib.metadata.version('zeroplane')}"


# -- without torch ---------------------------------------------------------------------

# ``None`` in sys.modules is how an absent module looks to import (ModuleNotFoundError)
# and to importlib.util.find_spec (None); the child also fails if anything imported
# torch or the worker runtime anyway.
_NO_TORCH = """
import sys
sys.modules["torch"] = None
from coordinator.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
roots = ("torch", "worker")
leaked = sorted(m for m, mod in sys.modules.items() if mod and m.split(".")[0] in roots)
if leaked:
    sys.exit(f"imported without need: {leaked}")
sys.exit(code)
"""


def _without_torch(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _NO_TORCH, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("command", [*COMMANDS, "checkpoint export"])
def test_every_help_without_torch(command: str) -> None:
    result = _without_torch(*command.split(), "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: zeroplane" in result.stdout


def test_client_commands_run_without_torch(tmp_path: Path) -> None:
    result = _without_torch("plan", "--params", "7.5B", "--world-sizes", "1,8", "--seq", "2048",
                            "--layers", "32", "--hidden", "4096")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "model: 7,500,000,000 trainable parameters" in result.stdout
    result = _without_torch("submit", "--dry-run", str(ROOT / "examples" / "job.yaml"))
    assert result.returncode == 0, result.stderr
    assert "kind: Deployment" in result.stdout
    # the Secret shows a placeholder, never a real token (a dry run is pasted and logged)
    import base64

    from coordinator.commands.submit import DRY_RUN_TOKEN

    assert base64.b64encode(DRY_RUN_TOKEN.encode()).decode() in result.stdout
    # nothing listens there: the error is the connection's, not an import's
    result = _without_torch("status", "--coordinator", "127.0.0.1:1", "--timeout", "0.5")
    assert result.returncode == 1 and result.stderr.startswith("zeroplane status:"), result.stderr
    result = _without_torch("--version")
    assert result.returncode == 0 and result.stdout.startswith("zeroplane "), result.stderr


@pytest.mark.parametrize(
    "argv", [["demo"], ["tune", "--gpt", "2,64,2,32"], ["checkpoint", "export", "a", "b"]]
)
def test_a_training_command_without_torch_names_the_extra(argv: list[str]) -> None:
    result = _without_torch(*argv)
    assert result.returncode == 2
    assert "needs torch, which is not installed: pip install 'zeroplane[train]'" in result.stderr


def test_torch_is_an_extra_not_a_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = [re.split(r"[\s<>=\[;]", d, maxsplit=1)[0] for d in project["dependencies"]]
    assert "torch" not in base
    extras = project["optional-dependencies"]
    assert any(d.startswith("torch") for d in extras["train"])
    assert "zeroplane[train]" in extras["test"]
