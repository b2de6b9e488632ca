"""What ``torch.compile`` made of a model: its graphs and its graph breaks, and why.

[Note: the compile report]
A graph break splits a compiled forward where dynamo cannot trace: the code
around it runs eager, and each break costs a return to Python and a smaller
graph. Dynamo counts them process-wide (``torch._dynamo.utils.counters``:
``stats.unique_graphs``, and ``graph_break`` by reason). An engine takes a
snapshot of those counts when it is built (:class:`CompileWatch`), so
``engine.compile_report()`` tells what was compiled since, however the model
was compiled: before ``initialize``, block by block after it, or by
``ZeroConfig(compile=True)``. At each optimizer step the watch looks for
reasons it has not seen yet and logs each one once, with how often it broke.

The counts are the process's: two engines compiling in one process see each
other's graphs. ``torch._dynamo.reset()`` or a clear of the counters after the
engine was built starts them from zero again (the report then counts from
there). Dynamo is read only once something imported it: a process that never
compiled reports nothing, and importing dynamo is never the engine's doing.

The built-in GPT has no break at any stage (tests/test_compile.py): at stage 3
a unit's gather and release run in its forward hooks, outside its graph
(worker/factory.py [Note: compiling at stage 3]), not as breaks inside it.
"""

from __future__ import annotations

import logging
import re
import sys
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["CompileReport", "CompileWatch"]

logger = logging.getLogger(__name__)

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@dataclass(frozen=True)
class CompileReport:
    """Since the engine was built: ``graphs`` dynamo captured (recompilations
    included), ``graph_breaks`` in them, and ``reasons``: each break's reason (its
    summary line and dynamo's explanation) and how often it broke there."""

    graphs: int = 0
    graph_breaks: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"{self.graphs} graph(s), {self.graph_breaks} graph break(s)"]
        lines += [f"  {n} x {reason}" for reason, n in self.reasons.items()]
        return "\n".join(lines)


def _summary(reason: str) -> str:
    """A break's reason in one line: its first line, and dynamo's explanation (objects'
    addresses left out: one hook on many modules is one reason)."""
    reason = _ADDRESS.sub("", reason)
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    if not lines:
        return "(no reason given)"
    tag = "Explanation:"
    explained = next((line[len(tag) :].strip() for line in lines if line.startswith(tag)), None)
    return lines[0] if explained is None else f"{lines[0]}: {explained}"


def _counts() -> tuple[int, Counter[str]]:
    """Dynamo's process-wide graphs and breaks by reason (nothing before dynamo is used)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0, Counter()
    counters = utils.counters
    breaks: Counter[str] = Counter()
    for reason, n in counters.get("graph_break", {}).items():
        breaks[_summary(str(reason))] += n
    return int(counters.get("stats", {}).get("unique_graphs", 0)), breaks


class CompileWatch:
    """An engine's view of dynamo's counts from its build on ([Note: the compile report])."""

    def __init__(self) -> None:
        self._graphs, self._breaks = _counts()
        self._logged: set[str] = set()
        self._polled: tuple[int, int] | None = None  # dynamo's raw break counts, last poll

    def report(self) -> CompileReport:
        graphs, breaks = _counts()
        if graphs < self._graphs or any(breaks[r] < n for r, n in self._breaks.items()):
            self._graphs, self._breaks = 0, Counter()  # the counters were reset since
        new = breaks - self._breaks
        return CompileReport(
            graphs=graphs - self._graphs,
            graph_breaks=sum(new.values()),
            reasons=dict(new.most_common()),
        )

    def poll(self) -> None:
        """Log each reason for a graph break not logged yet (once per reason). Runs at
        every optimizer step: it summarizes the reasons only when dynamo's counts moved."""
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is None:
            return
        raw = utils.counters.get("graph_break", {})
        counts = (sum(raw.values()), len(raw))
        if counts == self._polled:
            return
        self._polled = counts
        report = self.report()
        fresh = [r for r in report.reasons if r not in self._logged]
        for reason in fresh:
            self._logged.add(reason)
            logger.warning(
                "torch.compile: graph break (%d so far): %s; the code around it runs "
                "eager (engine.compile_report() lists every break)",
                report.reasons[reason],
                reason,
            )
