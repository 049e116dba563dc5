"""`diag diverge`: the ops or taps of a divergence report as a table, a curve and a verdict."""

from __future__ import annotations

import math
from typing import Any

from rich.markup import escape
from rich.table import Table

from diag import numerics

BLOCKS = "▁▂▃▄▅▆▇█"


def _num(x: Any) -> str:
    """A figure as the render package shows one (`numerics.fmt`, not compacted)."""
    return "—" if isinstance(x, bool) else numerics.fmt(x, compact=False)


def _curve(
    values: list[float],
    first: int | None,
    width: int = 64,
    what: str = "carried error along {} ops",
) -> str:
    """An error along the ops or taps as one line of blocks (log scale), the first marked.

    Finite values set the scale; an infinite one is drawn as a full block and a NaN as ``?``,
    and the label says how many there are (a large finite error is never called inf)."""
    if not values:
        return f"{what.format(0)}: nothing to draw"
    if not any(values):
        return f"{what.format(len(values))}: 0 at every one"
    fin = [math.log10(v) for v in values if 0 < v < math.inf]
    lo, hi = (min(fin), max(fin)) if fin else (0.0, 0.0)
    step = max(1, math.ceil(len(values) / width))
    cols = [_column(values[i : i + step], lo, hi) for i in range(0, len(values), step)]
    line = "".join(cols)
    if first is not None:
        k = first // step
        line = f"{line[:k]}[bold red]{line[k]}[/]{line[k + 1 :]}"
    scale = f"{_num(10**lo)} .. {_num(10**hi)}" if fin else "no finite error above 0"
    n_inf = sum(1 for v in values if v == math.inf)
    n_nan = sum(1 for v in values if v != v)
    odd = "".join(
        f", {n} {name} ({mark})"
        for n, name, mark in ((n_inf, "inf", "█"), (n_nan, "NaN", "?"))
        if n
    )
    return f"{what.format(len(values))} (log scale, {scale}{odd}): {line}"


def _column(vs: list[float], lo: float, hi: float) -> str:
    if any(v != v for v in vs):
        return "?"
    top = max(vs)
    if top == math.inf:
        return BLOCKS[-1]
    if top <= 0:
        return BLOCKS[0]
    return BLOCKS[min(7, max(0, int((math.log10(top) - lo) / ((hi - lo) or 1) * 7.999)))]


def _rows_table(
    title: str, cols: list[tuple[str, Any]], rows: list, first: Any, by_identity: bool = False
) -> Table:
    """One row per op or tap; `cols` are (header, attribute or None for the index). The row
    of `first` is marked (`by_identity`: that row only; decisions may share an op index)."""
    table = Table(title=escape(title), title_justify="left")
    for col, a in cols:  # the op and its line are kept whole; the figures fold instead
        width = None
        if a in ("primitive", "source", "name"):
            width = min(48, max([len(str(getattr(o, a))) for o in rows] + [len(col)]))
        table.add_column(col, overflow="fold", min_width=width)
    for o in rows:
        mark = o is first or (not by_identity and first is not None and o.index == first.index)
        cells = [_cell(o, a, mark) for _, a in cols]
        table.add_row(*cells, style="bold red" if mark else None)
    return table


def _cell(o: Any, a: str | None, mark: bool) -> str:
    if a is None:
        return f"{o.index} ◀" if mark else str(o.index)
    v = getattr(o, a)
    if a == "margin_ulps" and isinstance(v, float) and math.isnan(v):
        return "—"  # a decision with no operands of its own (a mask, an order read)
    if isinstance(v, float):
        return _num(v)
    return escape(str(list(v) if isinstance(v, tuple) else v) or "—")


def _tap_verdict(f: Any) -> str:
    """The verdict line for the first divergent tap; an infinite ratio said in words."""
    if math.isinf(f.ratio):
        why = f.note or (
            f"one run is non-finite (or all zero) where the other is not, so the "
            f"relative difference is {_num(f.max_rel)}"
        )
        return (
            f"diag diverge: {f.name} differs beyond any allowance: {why} (two correct "
            f"{f.dtype} implementations may differ by {_num(f.allowed)})"
        )
    return (
        f"diag diverge: {f.name} differs by {_num(f.max_rel)} (normwise), {_num(f.ratio)}x "
        f"what two correct {f.dtype} implementations may differ by "
        f"({_num(f.allowed)})"
    )


def diverge_tables(report: Any) -> list:
    """A `diag.diverge` report (shadow or compare) as tables, a curve and a verdict line."""
    if hasattr(report, "taps"):
        return _tap_parts(report)
    return _shadow_parts(report)


def _tap_parts(report: Any) -> list:
    f = report.first
    cols = [
        ("#", None),
        ("tap", "name"),
        ("dtype", "dtype"),
        ("shape", "shape"),
        ("max rel", "max_rel"),
        ("mean rel", "mean_rel"),
        ("allowed", "allowed"),
        ("ratio", "ratio"),
        ("note", "note"),
    ]
    if not any(t.note for t in report.taps):
        cols = cols[:-1]
    title = f"diag diverge: first divergent tap {f.name}" if f else "diag diverge: no divergent tap"
    parts: list = [_rows_table(title, cols, report.taps, f)]
    parts.append(
        _curve(
            [t.max_rel for t in report.taps],
            f.index if f else None,
            what="difference along {} taps",
        )
    )
    for label, names in (("only in A", report.only_a), ("only in B", report.only_b)):
        if names:
            parts.append(escape(f"{label}: {', '.join(names)}"))
    parts.append(
        escape(_tap_verdict(f))
        if f
        else f"diag diverge: {len(report.taps)} shared taps within what two correct "
        f"implementations may differ by"
    )
    return parts


_OP_COLS = [
    ("#", None),
    ("op", "primitive"),
    ("source", "source"),
    ("path", "path"),
    ("phase", "phase"),
    ("dtype", "dtype"),
    ("own ULP", "own_ulps"),
    ("own/bound", "own_ratio"),
    ("carried in", "carried_in"),
    ("carried", "carried"),
    ("amplif.", "amplification"),
]
_DECISION_COLS = [
    ("#", None),
    ("decision", "primitive"),
    ("kind", "kind"),
    ("source", "source"),
    ("library", "library"),
    ("path", "path"),
    ("phase", "phase"),
    ("dtype", "dtype"),
    ("flipped", "flipped"),
    ("of", "total"),
    ("margin ULP", "margin_ulps"),
    ("cause", "cause"),
    ("moved by", "cause_op"),
]


def _useful(cols: list, rows: list) -> list:
    """Columns that would say nothing (no path, library or cause op, no backward) left out."""
    blank = ("path", "library", "cause_op")
    return [
        c
        for c in cols
        if not (
            (c[1] in blank and not any(getattr(o, c[1]) for o in rows))
            or (c[1] == "phase" and all(o.phase == "forward" for o in rows))
        )
    ]


def _short(d: Any) -> Any:
    """A decision as its table row shows it: the cause in a word, the op that moved a value
    without the chain behind it (the verdict line has it whole)."""
    import dataclasses

    op = d.cause_op.split(", its error grown", 1)[0].split(" (", 1)[0]
    cause = "forced" if d.cause.startswith("forced") else "made"
    return dataclasses.replace(d, cause=cause, cause_op=op)


def _shadow_parts(report: Any) -> list:
    from diag.diverge.decisions import verdict

    f = report.first
    rows = list(report.ops)
    if f and all(o.index != f.index for o in rows):
        rows.append(f)
    rows.sort(key=lambda o: o.index)
    head = f"diag diverge: {report.function} ({report.framework}): "
    title = head + (
        f"first divergent op {f.primitive} at {f.source or 'an unknown line'}"
        if f
        else "no op left its bound"
        + (
            f"; {len(report.decisions)} decision(s) taken the other way than float64 (below)"
            if getattr(report, "decisions", ())
            else ""
        )
    )
    parts: list = [
        _rows_table(title, _useful(_OP_COLS, rows), rows, f),
        _curve(list(report.curve), f.index if f else None),
    ]
    decisions = list(getattr(report, "decisions", ()))
    if decisions:
        d = decisions[0]
        title = f"decisions taken the other way than float64: first {d.primitive} at " + (
            d.source or "an unknown line"
        )
        shown = [_short(x) for x in decisions]
        cols = _useful(_DECISION_COLS, shown)
        parts.append(_rows_table(title, cols, shown, shown[0], by_identity=True))
    for lit in getattr(report, "literals", ()):
        parts.append(
            escape(
                f"literal at {lit.source or 'an unknown line'}: written {lit.written}, "
                f"used {lit.used} ({lit.dtype})"
            )
        )
    if report.note:
        parts.append(f"note: {escape(report.note)}")
    code, why = verdict(report)
    if not why:
        why = (
            f"{report.n_ops} ops within their bounds, every decision as float64 takes it; "
            f"result carries {_num(report.result_error)}"
        )
    parts.append(escape(f"diag diverge: {why}"))
    return parts
