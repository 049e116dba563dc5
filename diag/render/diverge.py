"""`diag diverge`: the ops or taps of a divergence report as a table, a curve and a verdict."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table

from diag import numerics


def _num(x: Any) -> str:
    """A figure as the render package shows one (`numerics.fmt`, not compacted)."""
    return "—" if isinstance(x, bool) else numerics.fmt(x, compact=False)


def _curve(values: list[float], first: int | None, width: int = 64,
           what: str = "carried error along {} ops") -> str:
    """An error along the ops or taps as one line of blocks (log scale), the first marked."""
    import math

    if not values:
        return f"{what.format(0)}: nothing to draw"
    if not any(values):
        return f"{what.format(len(values))}: 0 at every one"
    logs = [math.log10(v) if 0 < v < math.inf else (3.0 if v else -17.0) for v in values]
    step = max(1, math.ceil(len(logs) / width))
    cols = [max(logs[i:i + step]) for i in range(0, len(logs), step)] or [0.0]
    lo, hi = min(cols), max(cols)
    line = "".join("▁▂▃▄▅▆▇█"[min(7, int((c - lo) / ((hi - lo) or 1) * 7.999))] for c in cols)
    if first is not None:
        k = first // step
        line = f"{line[:k]}[bold red]{line[k]}[/]{line[k + 1:]}"
    top = _num(10 ** hi) if hi < 3 else "inf"
    return f"{what.format(len(values))} (log scale, {_num(10 ** lo)} .. {top}): {line}"


def _rows_table(title: str, cols: list[tuple[str, Any]], rows: list, first: Any) -> Table:
    """One row per op or tap; `cols` are (header, attribute or None for the index)."""
    table = Table(title=escape(title), title_justify="left")
    for col, a in cols:  # the op and its line are kept whole; the figures fold instead
        keep = a in ("primitive", "source", "name")
        table.add_column(col, overflow="fold", min_width=min(48, max(
            [len(str(getattr(o, a))) for o in rows] + [len(col)])) if keep else None)
    for o in rows:
        mark = first is not None and o.index == first.index
        table.add_row(*[(f"{o.index} ◀" if mark else str(o.index)) if a is None else
                        _num(v) if isinstance(v := getattr(o, a), float) else
                        escape(str(list(v) if isinstance(v, tuple) else v) or "—")
                        for _, a in cols], style="bold red" if mark else None)
    return table


def _tap_verdict(f: Any) -> str:
    """The verdict line for the first divergent tap; an infinite ratio said in words."""
    import math

    if math.isinf(f.ratio):
        why = f.note or (f"one run is non-finite (or all zero) where the other is not, so the "
                         f"relative difference is {_num(f.max_rel)}")
        return (f"diag diverge: {f.name} differs beyond any allowance: {why} (two correct "
                f"{f.dtype} implementations may differ by {_num(f.allowed)})")
    return (f"diag diverge: {f.name} differs by {_num(f.max_rel)} (normwise), {_num(f.ratio)}x "
            f"what two correct {f.dtype} implementations may differ by "
            f"({_num(f.allowed)})")


def diverge_tables(report: Any) -> list:
    """A `diag.diverge` report (shadow or compare) as a table, a curve and a verdict line."""
    f = report.first
    if hasattr(report, "taps"):
        cols = [("#", None), ("tap", "name"), ("dtype", "dtype"), ("shape", "shape"),
                ("max rel", "max_rel"), ("mean rel", "mean_rel"), ("allowed", "allowed"),
                ("ratio", "ratio"), ("note", "note")][:None if any(t.note for t in report.taps)
                                                       else -1]
        parts: list = [_rows_table(f"diag diverge: first divergent tap {f.name}" if f else
                                   "diag diverge: no divergent tap", cols, report.taps, f)]
        parts.append(_curve([t.max_rel for t in report.taps], f.index if f else None,
                            what="difference along {} taps"))
        parts += [escape(f"{label}: {', '.join(names)}") for label, names in
                  (("only in A", report.only_a), ("only in B", report.only_b)) if names]
        parts.append(escape(_tap_verdict(f)) if f else
                     f"diag diverge: {len(report.taps)} shared taps within what two correct "
                     f"implementations may differ by")
        return parts
    rows = sorted(list(report.ops) + ([f] if f and all(o.index != f.index for o in report.ops)
                                      else []), key=lambda o: o.index)
    cols = [("#", None), ("op", "primitive"), ("source", "source"), ("path", "path"),
            ("phase", "phase"), ("dtype", "dtype"), ("own ULP", "own_ulps"),
            ("own/bound", "own_ratio"), ("carried in", "carried_in"), ("carried", "carried"),
            ("amplif.", "amplification")]
    # Columns that would say nothing (no jit/scan/module path, no backward op) are left out.
    cols = [c for c in cols if not ((c[1] == "path" and not any(o.path for o in rows)) or
                                    (c[1] == "phase" and all(o.phase == "forward" for o in rows)))]
    head = f"diag diverge: {report.function} ({report.framework}): "
    parts = [_rows_table(head + (f"first divergent op {f.primitive} at "
                                 f"{f.source or 'an unknown line'}" if f else "no divergent op"),
                         cols, rows, f),
             _curve(list(report.curve), f.index if f else None)]
    if report.note:
        parts.append(f"note: {escape(report.note)}")
    parts.append(escape(f"diag diverge: {f.reason}" if f else
                        f"diag diverge: {report.n_ops} ops within their bounds; result carries "
                        f"{_num(report.result_error)}"))
    return parts
