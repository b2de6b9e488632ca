"""The walk of ``model`` through the construction of an engine (issue #46, "one way in").

    python bench/construction_walk.py                        # this checkout, alone
    python bench/construction_walk.py --root /tmp/old-tree   # another checkout
    python bench/construction_walk.py --list --holders --placement group

Runs ``worker.initialize(model, optimizer, config=ZeroConfig(stage=3))`` once, in
this one process, on a tiny ``worker.models.GPT`` (1 layer, d=8), with
``sys.setprofile`` watching every Python function call while it runs.

The rule. A *stop* is a call (a ``"call"`` event: a function's frame starting, a
generator's resumption included) of code in a file under ``ROOT/worker/`` or
``ROOT/coordinator/`` one of whose arguments (positional, keyword-only, or an
element of ``*args`` / a value of ``**kwargs``) ``is`` the model, at call time.
With ``--holders`` an argument also counts when one of its attributes (its
``vars()``: ``self.module`` of a method, ``spec.model`` of an EngineSpec) ``is``
the model: the model carried one level deep. Nothing deeper (no lists of modules,
no closures). The table gives the stops, the distinct files they are in, and the
*returns*: stops in a file visited earlier in the walk that is not the file of
the stop just before; the *route*: the stops before the first engine
``__init__`` (the way to the constructor), and their files. ``--list`` prints
the walk, one ``file:function`` a stop.

``--placement``: ``alone`` (default; no process group, no launcher or coordinator
environment); ``group`` (a one-rank gloo group the script forms first, as under a
launcher); ``elastic`` (a coordinator served from threads of this process, one
worker, zeroplane forms the group); ``attached`` (that coordinator and the
script's own one-rank group). Only the calling thread is profiled. ``mesh``
needs several processes and is not measured here.

``--root DIR`` goes first on ``sys.path`` and is the working directory, so the same
script measures any checkout (``git worktree add /tmp/old-tree <commit>``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

PLACEMENTS = ("alone", "group", "elastic", "attached")
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _arguments(frame) -> list:
    code, loc = frame.f_code, frame.f_locals
    n = code.co_argcount + code.co_kwonlyargcount
    names = list(code.co_varnames[:n])
    values = [loc[name] for name in names if name in loc]
    if code.co_flags & 0x04:  # CO_VARARGS
        values.extend(loc.get(code.co_varnames[n], ()))
        n += 1
    if code.co_flags & 0x08:  # CO_VARKEYWORDS
        values.extend(loc.get(code.co_varnames[n], {}).values())
    return values


def _carries(value, model, holders: bool) -> bool:
    if value is model:
        return True
    attrs = getattr(value, "__dict__", None) if holders else None
    return isinstance(attrs, dict) and any(v is model for v in list(attrs.values()))


def walk(root: Path, placement: str, holders: bool) -> list[tuple[str, str]]:
    """The stops of ``model`` through ``initialize``: (file under root, function)."""
    sys.path.insert(0, str(root))
    os.chdir(root)
    for name in (*LAUNCH_ENV, *[k for k in os.environ if k.startswith("ZEROPLANE_")]):
        os.environ.pop(name, None)
    import torch

    import worker
    from worker.models import GPT, GPTConfig

    assert Path(worker.__file__).resolve().is_relative_to(root), worker.__file__
    server = _coordinator() if placement in ("elastic", "attached") else None
    if placement in ("group", "attached"):
        import torch.distributed as dist

        store = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=1, n_embd=8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prefixes = tuple(f"{root / pkg}{os.sep}" for pkg in ("worker", "coordinator"))
    stops: list[tuple[str, str]] = []

    def profile(frame, event, _arg) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(prefixes):
            return
        if any(_carries(v, model, holders) for v in _arguments(frame)):
            rel = os.path.relpath(frame.f_code.co_filename, root)
            stops.append((rel, frame.f_code.co_qualname))

    address = None if server is None else server.address
    sys.setprofile(profile)
    try:
        engine = worker.initialize(
            model, optimizer, config=worker.ZeroConfig(stage=3), coordinator=address
        )
    finally:
        sys.setprofile(None)
    if server is not None:
        engine.close()
        server.stop(grace=0.2)
    return stops


def _coordinator():
    """A one-worker coordinator in this process's threads (elastic, attached)."""
    from coordinator.control.server import create_server
    from coordinator.core import settings as s

    token = "construction-walk-token-0123"
    os.environ.update(ZEROPLANE_TOKEN=token, ZEROPLANE_WORKER_ID="walk-0")
    membership = s.MembershipConfig(min_workers=1, max_workers=1, join_window_s=0.0)
    server, _ = create_server(
        s.CoordinatorConfig(
            server=s.ServerConfig(host="127.0.0.1", port=0, token=token),
            membership=membership,
            plan=s.PlanConfig(stage=3, precision="fp32"),
        )
    )
    server.start()
    return server


def summary(stops: list[tuple[str, str]]) -> dict[str, int]:
    files = [file for file, _ in stops]
    returns = sum(f in files[:i] and f != files[i - 1] for i, f in enumerate(files) if i)
    route = next((i for i, (_, f) in enumerate(stops) if f.endswith("Engine.__init__")), len(stops))
    return {
        "stops": len(stops),
        "files": len(set(files)),
        "returns": returns,
        "route": route,
        "route files": len(set(files[:route])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--placement", choices=PLACEMENTS, default="alone")
    parser.add_argument("--holders", action="store_true", help="count one attribute deep")
    parser.add_argument("--list", action="store_true", help="print the walk")
    args = parser.parse_args()
    root = args.root.resolve()
    stops = walk(root, args.placement, args.holders)
    if args.list:
        for i, (file, function) in enumerate(stops, 1):
            print(f"{i:4d}  {file}:{function}")
        print()
    numbers = summary(stops)
    rule = "argument or one attribute deep" if args.holders else "argument"
    print(f"root {root}  placement {args.placement}  rule: model is an {rule}")
    print(" ".join(f"{k:>12}" for k in numbers))
    print(" ".join(f"{v:>12}" for v in numbers.values()))
    per_file = Counter(file for file, _ in stops)
    print("files (stops):", ", ".join(f"{f} ({n})" for f, n in per_file.items()))


if __name__ == "__main__":
    main()
