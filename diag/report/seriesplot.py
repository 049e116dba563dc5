"""A record's series over the runs of a history, as a small inline SVG: where a metric stood
in each run and the runs where the record moved (`diag history`; the drift view and the report
show one per moved record).

Hand-written SVG, not matplotlib: a few dozen points per chart, one per record, and the drift
view must stay quick to write when a CI gate fails.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from markupsafe import Markup, escape

__all__ = ["series_charts", "series_svg"]

_W, _H, _PAD = 480, 120, 28


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


def series_svg(points: Sequence[Sequence[Any]], changes: Sequence[int], metric: str) -> Markup:
    """One chart: `metric` per run number (points `[run, value]`), a dashed line at each run in
    `changes`. Values that are not finite numbers are left out (and said so in the title)."""
    xs = [(int(r), _number(v)) for r, v in points]
    shown = [(r, v) for r, v in xs if v is not None]
    runs = [r for r, _ in xs] + list(changes)
    lo_r, hi_r = (min(runs), max(runs)) if runs else (0, 1)
    vals = [v for _, v in shown] or [0.0]
    lo_v, hi_v = min(vals), max(vals)
    if hi_v == lo_v:
        lo_v, hi_v = lo_v - 1, hi_v + 1

    def x(r: float) -> float:
        return _PAD + (r - lo_r) / max(hi_r - lo_r, 1) * (_W - 2 * _PAD)

    def y(v: float) -> float:
        return _H - _PAD + (lo_v - v) / (hi_v - lo_v) * (_H - 2 * _PAD)

    left_out = len(xs) - len(shown)
    title = f"{metric} per run" + (
        f" ({left_out} value(s) not finite, left out)" if left_out else ""
    )
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="series" width="{_W}" height="{_H}" '
        f'viewBox="0 0 {_W} {_H}" role="img"><title>{escape(title)}</title>',
        f'<line x1="{_PAD}" y1="{_H - _PAD}" x2="{_W - _PAD}" y2="{_H - _PAD}" stroke="#999"/>',
    ]
    for r in changes:
        parts.append(
            f'<line class="change" x1="{x(r):.1f}" y1="{_PAD / 2}" x2="{x(r):.1f}" '
            f'y2="{_H - _PAD}" stroke="#c0392b" stroke-dasharray="4 3"/>'
        )
    if shown:
        path = " ".join(f"{x(r):.1f},{y(v):.1f}" for r, v in shown)
        parts.append(f'<polyline points="{path}" fill="none" stroke="#2c6fbb"/>')
        parts += [
            f'<circle cx="{x(r):.1f}" cy="{y(v):.1f}" r="2.5" fill="#2c6fbb"/>' for r, v in shown
        ]
    parts += [
        f'<text x="{_PAD}" y="{_H - 8}" font-size="10">run #{lo_r}</text>',
        f'<text x="{_W - _PAD}" y="{_H - 8}" font-size="10" text-anchor="end">run #{hi_r}</text>',
        f'<text x="2" y="{_PAD - 4}" font-size="10">{escape(metric)} {hi_v:.4g}</text>',
        f'<text x="2" y="{_H - _PAD + 12}" font-size="10">{lo_v:.4g}</text>',
        "</svg>",
    ]
    return Markup("".join(parts))


def series_charts(series: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each moved record's series (`diag.cli.history.series_of` data) with its chart."""
    return [
        {**s, "svg": series_svg(s.get("points") or [], s.get("changes") or [], s["metric"])}
        for s in series
        if s.get("metric")
    ]
