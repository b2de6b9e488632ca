"""State by element range: the master values and optimizer state a rank's
optimizer holds, as entries keyed ``name[start:stop]`` (coordinator/core/ranges.py
[Note: element ranges]), exported from the optimizer's pieces and imported into
them. Checkpoints, the live exchange and the replicas move state in this form;
worker/state.py's ``export_ranges`` and ``import_ranges`` drive it."""

from __future__ import annotations

from typing import Any

import torch

from coordinator.core.ranges import Range, RangeIndex
from worker.flat import Zeros
from worker.optim import ShardOptimizer

__all__ = [
    "Entries",
    "MissingRange",
    "check_covered",
    "export_entries",
    "import_entries",
    "owned_by",
]

# ``name[start:stop]`` -> {"master": fp32 values, "state": optimizer state sliced alike}
Entries = dict[str, dict[str, Any]]


class MissingRange(KeyError):
    """State for a range this rank owns is in none of the entries offered."""


def owned_by(optimizer: ShardOptimizer) -> list[Range]:
    """The ranges ``optimizer`` owns, in the order of its pieces."""
    return [Range(p.name, p.param_start, p.param_start + p.view.numel()) for p in optimizer.pieces]


def export_entries(
    optimizer: ShardOptimizer, written: list[Range], rank: int, *, copy: bool = True
) -> Entries:
    """Master values and optimizer state of ``optimizer`` for each range of
    ``written``: copies, or (``copy=False``) views of the live state. A range it does
    not hold whole raises :class:`MissingRange` (naming ``rank``)."""
    held = RangeIndex()
    views: dict[str, tuple[torch.Tensor, dict]] = {}
    state = optimizer.inner.state
    for piece in optimizer.pieces:
        rng = Range(piece.name, piece.param_start, piece.param_start + piece.view.numel())
        held.add(rng, rng.key)
        views[rng.key] = (piece.view, state.get(piece.view, {}))
    entries: Entries = {}
    for want in written:
        for have, a, b, key in held.overlapping(want):
            if (a, b) != (want.start, want.stop):
                continue
            view, opt_state = views[key]
            lo, hi = a - have.start, b - have.start
            entries[want.key] = {
                "master": _copied(view.detach()[lo:hi], copy),
                "state": {k: _slice_state(v, lo, hi, view, copy) for k, v in opt_state.items()},
            }
            break
        else:
            raise MissingRange(f"rank {rank} does not hold {want.key}")
    return entries


def check_covered(owned: list[Range], index: RangeIndex) -> None:
    """Raise :class:`MissingRange` unless ``index`` covers every element of ``owned``."""
    for want in owned:
        covered = sum(b - a for _, a, b, _ in index.overlapping(want))
        if covered != want.numel:
            raise MissingRange(f"no state for elements of {want.key}")


def import_entries(
    optimizer: ShardOptimizer,
    owned: list[Range],
    entries: Entries,
    index: RangeIndex,
    zeros: Zeros,
) -> None:
    """Copy the master values and optimizer state of ``owned`` (``owned_by(optimizer)``,
    covered: :func:`check_covered`) from ``entries`` straight into place (one copy);
    ``zeros`` makes the optimizer state's tensors. The optimizer's state is replaced."""
    new_state: dict[torch.Tensor, dict] = {}
    with torch.no_grad():
        for want, piece in zip(owned, optimizer.pieces, strict=True):
            # the state goes where this rank's master partition lives (device or host)
            home = piece.view.device
            state: dict[str, Any] = {}
            for have, a, b, _source in index.overlapping(want):
                entry = entries[have.key]
                src, dst = (
                    slice(a - have.start, b - have.start),
                    slice(a - want.start, b - want.start),
                )
                piece.view[dst] = entry["master"][src]
                for k, v in entry["state"].items():
                    if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == have.numel:
                        if k not in state:
                            # zeros where a source has no such state (never stepped)
                            state[k] = zeros(want.numel, v.dtype, home)
                        state[k][dst] = v[src]
                    else:
                        state.setdefault(k, v.clone() if isinstance(v, torch.Tensor) else v)
            if state:
                new_state[piece.view] = state
    inner = optimizer.inner
    inner.state.clear()
    for view, state in new_state.items():
        inner.state[view] = state


def _slice_state(value: Any, lo: int, hi: int, view: torch.Tensor, copy: bool = True) -> Any:
    if isinstance(value, torch.Tensor) and value.shape == view.shape:
        return _copied(value.detach()[lo:hi], copy)
    if isinstance(value, torch.Tensor):
        return _copied(value.detach(), copy)
    return value


def _copied(t: torch.Tensor, copy: bool) -> torch.Tensor:
    return t.clone() if copy else t
