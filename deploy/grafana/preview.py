"""Render the dashboard's panels as one static HTML page, from a live Prometheus.

    python deploy/grafana/preview.py --prometheus http://127.0.0.1:9090 --out preview.html

Not Grafana: a stand-in for a quick look (and the README's picture) where no
Grafana runs. It reads deploy/grafana/zeroplane.json, runs every panel's own
queries (variables: ``$job`` as given, all stages and ranks) over the last
``--minutes``, and draws time series as SVG lines, bar gauges as bars, stats as
numbers and the table as a table. No external assets. A panel whose queries
return nothing says "no data".
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).with_name("zeroplane.json")
COLORS = ("#3b82f6", "#f59e0b", "#ef4444", "#10b981", "#8b5cf6", "#ec4899", "#14b8a6", "#64748b")


def fmt(value: float, unit: str) -> str:
    if value is None or math.isnan(value):
        return "–"
    if unit in ("decbytes", "Bps"):
        suffix = "/s" if unit == "Bps" else ""
        for name, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
            if abs(value) >= scale:
                return f"{value / scale:.3g} {name}{suffix}"
        return f"{value:.0f} B{suffix}"
    if unit == "percentunit":
        return f"{round(100 * value, 1) + 0.0:.1f}%"  # + 0.0: no "-0.0%"
    if unit == "s":
        return f"{1000 * value:.1f} ms" if abs(value) < 1 else f"{value:.2f} s"
    if unit == "reqps":
        return f"{value:.2g}/s"
    return f"{value:.4g}"


def legend(template: str, labels: dict[str, str]) -> str:
    if template in ("", "__auto"):
        return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__")
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def _get(self, path: str, **params: Any) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise RuntimeError(f"{url}: {body}")
        return body["data"]["result"]

    def instant(self, expr: str) -> list[dict[str, Any]]:
        return self._get("/api/v1/query", query=expr)

    def range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self._get("/api/v1/query_range", query=expr, start=start, end=end, step=step)


def svg_lines(series: list[tuple[str, list[tuple[float, float]]]], unit: str) -> str:
    points = [(t, v) for _, vs in series for t, v in vs if math.isfinite(v)]
    if not points:
        return '<p class="empty">no data</p>'
    t0, t1 = min(t for t, _ in points), max(t for t, _ in points)
    lo = min(0.0, min(v for _, v in points))
    hi = max(v for _, v in points)
    hi = hi if hi > lo else lo + 1
    w, h = 520, 150

    def xy(t: float, v: float) -> str:
        x = 40 + (w - 50) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.5)
        return f"{x:.1f},{h - 10 - (h - 20) * (v - lo) / (hi - lo):.1f}"

    out = [f'<svg viewBox="0 0 {w} {h}" class="chart">']
    for frac in (0, 0.5, 1):
        y = h - 10 - (h - 20) * frac
        out.append(f'<line x1="40" x2="{w - 10}" y1="{y}" y2="{y}" class="grid"/>')
        out.append(
            f'<text x="36" y="{y + 3}" class="axis">{fmt(lo + frac * (hi - lo), unit)}</text>'
        )
    for i, (_, vs) in enumerate(series):
        pts = " ".join(xy(t, v) for t, v in vs if math.isfinite(v))
        color = COLORS[i % len(COLORS)]
        out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.6"/>')
    out.append("</svg>")
    keys = []
    for i, (name, vs) in enumerate(series[:8]):
        last = next((v for _, v in reversed(vs) if math.isfinite(v)), float("nan"))
        keys.append(
            f'<li><i style="background:{COLORS[i % len(COLORS)]}"></i>{html.escape(name)}'
            f" <b>{fmt(last, unit)}</b></li>"
        )
    more = f"<li>+{len(series) - 8} more</li>" if len(series) > 8 else ""
    return "".join(out) + f'<ul class="keys">{"".join(keys)}{more}</ul>'


def render_panel(panel: dict[str, Any], prom: Prometheus, subs: dict[str, str],
                 window: tuple[float, float, float]) -> tuple[str, int]:  # fmt: skip
    """The panel's HTML and how many series its queries returned."""
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "none")
    rows: list[tuple[str, Any]] = []
    for t in panel.get("targets", []):
        expr = t["expr"]
        for name, value in subs.items():
            expr = expr.replace(name, value)
        if panel["type"] == "timeseries":
            for r in prom.range(expr, *window):
                values = [(float(ts), float(v)) for ts, v in r["values"]]
                rows.append((legend(t.get("legendFormat", ""), r["metric"]), values))
        else:
            for r in prom.instant(expr):
                rows.append((legend(t.get("legendFormat", ""), r["metric"]), r))
    if panel["type"] == "timeseries":
        body = svg_lines(rows, unit)
    elif not rows:
        body = '<p class="empty">no data</p>'
    elif panel["type"] == "bargauge":
        top = max(float(r["value"][1]) for _, r in rows) or 1.0
        body = "".join(
            f'<div class="bg"><span>{html.escape(name)}</span><div><div style="width:'
            f'{100 * float(r["value"][1]) / top:.1f}%"></div></div>'
            f"<b>{fmt(float(r['value'][1]), unit)}</b></div>"
            for name, r in rows
        )
    elif panel["type"] == "stat":
        body = '<div class="stats">' + "".join(
            f"<div><b>{fmt(float(r['value'][1]), unit)}</b><span>{html.escape(name)}</span></div>"
            for name, r in rows
        ) + "</div>"  # fmt: skip
    else:  # table: one row per series, its labels as columns
        hidden = {"__name__", "job", "instance", "worker_id"}
        cols = sorted({k for _, r in rows for k in r["metric"]} - hidden)
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body_rows = "".join(
            "<tr>" + "".join(f"<td>{html.escape(r['metric'].get(c, ''))}</td>" for c in cols)
            + "</tr>"
            for _, r in rows
        )  # fmt: skip
        body = f"<table><tr>{head}</tr>{body_rows}</table>"
    title = html.escape(panel["title"])
    span = panel.get("gridPos", {}).get("w", 12)
    return (
        f'<section class="panel" style="grid-column: span {span}" data-series="{len(rows)}">'
        f"<h3>{title}</h3>{body}</section>",
        len(rows),
    )


STYLE = """
body { margin: 0; padding: 14px 18px; background: #111217; color: #d8d9da;
       font: 12px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
header { display: flex; gap: 16px; align-items: baseline; margin-bottom: 8px; }
header h1 { font-size: 17px; margin: 0; color: #fff; } header span { color: #8e8e8e; }
.grid { display: grid; grid-template-columns: repeat(24, 1fr); gap: 8px; }
h2 { grid-column: span 24; font-size: 14px; margin: 10px 0 0; color: #fff; }
.panel { background: #181b1f; border: 1px solid #2a2d33; border-radius: 3px; padding: 6px 10px;
         min-width: 0; }
.panel h3 { font-size: 12px; margin: 0 0 4px; color: #ccccdc; font-weight: 500; }
.chart { width: 100%; height: 150px; } .chart .grid { stroke: #2a2d33; }
.chart .axis { fill: #8e8e8e; font-size: 9px; text-anchor: end; }
.keys { list-style: none; padding: 0; margin: 2px 0 0; columns: 2; font-size: 11px; }
.keys i { display: inline-block; width: 10px; height: 3px; margin-right: 4px; vertical-align: 3px; }
.keys b { color: #fff; font-weight: 500; }
.bg { display: grid; grid-template-columns: 38% 1fr 70px; gap: 6px; align-items: center;
      margin: 3px 0; } .bg span { white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.bg > div { background: #22252b; height: 12px; }
.bg > div > div { height: 12px; background: linear-gradient(90deg, #1f60c4, #5794f2); }
.bg b { text-align: right; color: #fff; font-weight: 500; }
.stats { display: flex; gap: 24px; flex-wrap: wrap; padding: 8px 0; }
.stats b { display: block; font-size: 26px; color: #73bf69; } .stats span { color: #8e8e8e; }
table { border-collapse: collapse; width: 100%; } th, td { text-align: left; padding: 3px 8px; }
th { color: #8e8e8e; font-weight: 500; border-bottom: 1px solid #2a2d33; }
.empty { color: #8e8e8e; }
"""


def render(prom: Prometheus, job: str, minutes: float, dashboard: dict[str, Any]) -> tuple[str, list[str]]:  # fmt: skip  # noqa: E501
    """The page, and the titles of panels with no data."""
    end = time.time()
    step = max(1.0, minutes * 60 / 150)
    rate = f"{max(15, int(4 * step))}s"
    subs = {"$job": job, "$stage": ".*", "$rank": ".*", "$__rate_interval": rate}
    parts, empty = [], []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            parts.append(f"<h2>{html.escape(panel['title'])}</h2>")
            continue
        text, count = render_panel(panel, prom, subs, (end - 60 * minutes, end, step))
        parts.append(text)
        if not count:
            empty.append(panel["title"])
    page = (
        '<!doctype html><html><head><meta charset="utf-8"><title>zeroplane dashboard preview'
        f"</title><style>{STYLE}</style></head><body><header><h1>{html.escape(dashboard['title'])}"
        f"</h1><span>job {html.escape(job)} · last {minutes:g} min · a static preview drawn "
        "from the dashboard's own queries (deploy/grafana/preview.py), not Grafana</span>"
        f'</header><div class="grid">{"".join(parts)}</div></body></html>'
    )
    return page, empty


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--job", default="zeroplane")
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    parser.add_argument("--out", type=Path, default=Path("dashboard-preview.html"))
    args = parser.parse_args()
    dashboard = json.loads(args.dashboard.read_text())
    page, empty = render(Prometheus(args.prometheus), args.job, args.minutes, dashboard)
    args.out.write_text(page)
    if empty:
        print(f"panels with no data: {', '.join(empty)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
