"""The report's tables: the verdict table (one row per probe record, grouped by probe), the
agreement table (one row per pair of backends), the problems table, and the formatting and
sort keys of their cells.

A cell is data for the template (`text`, the `v` it sorts by, a tooltip, whether it is an
alarm); the template and report.js decide how it looks and sorts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from diag import numerics
from diag.report.charts import to_float
from diag.report.fields import as_mapping
from diag.report.matrix import cell_id
from diag.status import STATUSES, Status, worst_status

__all__ = [
    "METRIC_COLUMNS",
    "fmt_num",
    "fmt_pct",
    "fmt_seconds",
    "problem_rows",
    "sort_key",
    "table_rows",
    "verdict_groups",
]

# A reason longer than this is folded: its first words shown, the full text on demand.
REASON_FOLD = 160

# Columns of the verdict table: (header, metric key or None, kind). `kind` picks formatting
# and sorting: "num" sorts numerically, "text" naturally ("d=64" before "d=128"). The bound
# ratio decides a verdict, so it leads; the ULP and relative figures follow as evidence (an
# element that nearly cancels can be a million ULP off in a correct float32 sum).
# "opt" columns give way below 1250 px wide (report.css), so the reason keeps 30 characters.
METRIC_COLUMNS = (
    ("bound ratio", "bound_ratio", "num"),
    ("max ULP", "max_ulp", "num"),
    ("p99 ULP", "p99_ulp", "opt"),
    ("not corr. rounded", "frac_not_correctly_rounded", "pct opt"),
    ("max rel err", "max_rel_err", "num"),
)


def fmt_num(value: Any) -> str:
    """A metric value, compact: ints as ints, floats to 3 significant digits, "—" if missing.

    Args:
      value: a number, one of the strings ``"nan"``/``"inf"``/``"-inf"`` that records use
        for non-finite floats, another string (shown as is) or None.

    Returns:
      The text for a table cell.
    """
    return numerics.fmt(value)


def fmt_pct(value: Any) -> str:
    """A fraction in [0, 1] as a percentage with 3 significant digits."""
    x = to_float(value)
    if x is None or not math.isfinite(x):
        return fmt_num(value)
    return "0%" if x == 0 else f"{fmt_num(100 * x)}%"


def fmt_seconds(value: Any) -> str:
    """A duration with a unit a person reads at a glance (ns, µs, ms, s)."""
    x = to_float(value)
    if x is None or not math.isfinite(x):
        return fmt_num(value)
    for scale, unit in ((1, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(x) >= scale:
            return f"{fmt_num(float(f'{x / scale:.3g}'))} {unit}"
    return f"{fmt_num(float(f'{x * 1e9:.3g}'))} ns"


def sort_key(value: Any) -> str:
    """The ``data-v`` a numeric cell sorts by: "" when missing, "NaN", "Infinity" or a float.

    The table script puts missing values last and NaN above +inf (a NaN metric means the
    result is garbage, the worst there is).
    """
    x = to_float(value)
    if x is None:
        return ""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return repr(x)


def _device_text(device: Any) -> tuple[str, str]:
    """Short text for a device dict (kind or platform, #id) and its full text for a tooltip."""
    if not isinstance(device, Mapping) or not device:
        return ("—" if not device else str(device)), ""
    name = device.get("kind") or device.get("device_kind") or device.get("platform") or ""
    ident = device.get("id")
    short = f"{name} #{ident}" if ident is not None and name else str(name or ident or "—")
    full = ", ".join(f"{k}={v}" for k, v in device.items())
    return short, full


def _cell(text: str, v: str, title: str = "", bad: bool = False) -> dict[str, Any]:
    return {"text": text, "v": v, "title": title, "bad": bad, "agree": False, "opt": False}


def _row_identity(rec: Mapping[str, Any], index: int) -> dict[str, Any]:
    """The columns every table row has: position, status and its severity rank, what ran."""
    status = str(rec.get("status", ""))
    return {
        "i": index,
        "status": status,
        "rank": STATUSES.index(status) if status in STATUSES else len(STATUSES),
        "op": str(rec.get("op", "")),
        "probe": str(rec.get("probe", "")),
        "case": str(rec.get("case", "")),
    }


def _verdict_row(rec: Mapping[str, Any], index: int) -> dict[str, Any]:
    metrics = as_mapping(rec.get("metrics"))
    timings = as_mapping(rec.get("timings"))
    cells = []
    for _, key, kind in METRIC_COLUMNS:
        value = metrics.get(key)
        cells.append(
            {
                **_cell(fmt_pct(value) if "pct" in kind else fmt_num(value), sort_key(value)),
                "opt": "opt" in kind,
            }
        )
    # Where the "opt" columns give way (narrow windows), the max ULP cell's tooltip has them.
    cells[1]["title"] = "; ".join(
        f"{h}: {c['text']}" for (h, _, kind), c in zip(METRIC_COLUMNS, cells) if "opt" in kind
    )
    cells.append(_nonfinite_cell(metrics))
    run_s = timings.get("run_s_median")
    compile_s = timings.get("compile_s")
    title = f"compile: {fmt_seconds(compile_s)}" if compile_s is not None else ""
    if timings.get("first_call"):
        title = "the op's first call (an eager op's warm-up that took the repeat budget)"
    cells.append(_cell(fmt_seconds(run_s), sort_key(run_s), title=title))
    device, device_full = _device_text(rec.get("device"))
    return {
        **_row_identity(rec, index),
        "backend": str(rec.get("backend", "")),
        "device": device,
        "device_full": device_full,
        "dtype": str(rec.get("dtype", "")),
        "metrics": cells,
        "reason": str(rec.get("reason", "")),
        "fold": _fold(str(rec.get("reason", ""))),
    }


def _nonfinite_cell(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """NaN + Inf in the output: an alarm only where the truth is finite.

    An element that is Inf in the truth and in the output (float16's wide-range matmul
    overflows in 16306 of 16384 elements, correctly) agrees with the truth; `unexpected_nonfinite`
    counts the others. A record without that count is judged by the total.
    """
    nan, inf = to_float(metrics.get("nan_count")), to_float(metrics.get("inf_count"))
    nonfinite = None if nan is None and inf is None else (nan or 0) + (inf or 0)
    unexpected = to_float(metrics.get("unexpected_nonfinite"))
    title = f"NaN: {fmt_num(metrics.get('nan_count'))}, Inf: {fmt_num(metrics.get('inf_count'))}"
    cell = _cell(
        fmt_num(nonfinite),
        sort_key(nonfinite),
        title=title,
        bad=bool(nonfinite) if unexpected is None else bool(unexpected),
    )
    if nonfinite and unexpected is not None:
        agree = nonfinite - unexpected
        cell["title"] += (
            f"; {fmt_num(agree)} non-finite where the truth is too (agreement), "
            f"{fmt_num(unexpected)} where the truth is finite"
        )
        cell["agree"] = not unexpected
    return cell


def _fold(reason: str) -> dict[str, str]:
    """A reason as the table shows it: whole, or its first words and the full text folded."""
    if len(reason) <= REASON_FOLD:
        return {"full": reason, "short": ""}
    cut = reason.rfind(" ", 0, REASON_FOLD - 40)
    return {"full": reason, "short": reason[: cut if cut > 40 else REASON_FOLD - 40] + " …"}


def _agreement_row(rec: Mapping[str, Any], index: int) -> dict[str, Any]:
    metrics = as_mapping(rec.get("metrics"))
    mismatched, elements = to_float(metrics.get("mismatched")), to_float(metrics.get("elements"))
    frac = mismatched / elements if mismatched is not None and elements else None
    return {
        **_row_identity(rec, index),
        "backends": str(rec.get("backend", "")).replace("|", " vs "),
        "dtype": str(rec.get("dtype", "")),
        "max_ulp": {
            "text": fmt_num(metrics.get("max_ulp_between")),
            "v": sort_key(metrics.get("max_ulp_between")),
        },
        "mismatched": {
            "text": fmt_num(metrics.get("mismatched")),
            "v": sort_key(metrics.get("mismatched")),
        },
        "elements": {
            "text": fmt_num(metrics.get("elements")),
            "v": sort_key(metrics.get("elements")),
        },
        "frac": {"text": fmt_pct(frac), "v": sort_key(frac)},
        "reason": str(rec.get("reason", "")),
        "fold": _fold(str(rec.get("reason", ""))),
    }


def table_rows(records: list[Mapping[str, Any]]) -> tuple[list, list, dict[tuple, str]]:
    """The verdict table's rows (each with its matrix cell's id), the agreement table's rows,
    and the cell index `matrix_context` reads."""
    probe_rows, agreement_rows = [], []
    cells: dict[tuple, str] = {}
    for i, rec in enumerate(records):
        kind = rec.get("kind", "probe")
        if kind == "agreement":
            agreement_rows.append(_agreement_row(rec, i))
        elif kind == "probe":
            probe_rows.append({**_verdict_row(rec, i), "cell": cell_id(rec, cells)})
    return probe_rows, agreement_rows, cells


def verdict_groups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The verdict table's rows grouped by probe (first appearance order), each group with its
    op, worst status and per-status counts for its collapsible header."""
    groups: dict[str, dict[str, Any]] = {}
    for row in rows:
        g = groups.setdefault(row["probe"], {"probe": row["probe"], "op": row["op"], "rows": []})
        g["rows"].append(row)
    for n, g in enumerate(groups.values()):
        statuses = [r["status"] for r in g["rows"]]
        g["id"] = f"g{n}"
        g["worst"] = worst_status(statuses)
        g["counts"] = [(s, statuses.count(s)) for s in STATUSES[::-1] if s in statuses]
    return list(groups.values())


def problem_rows(records: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The failed and errored records' verdict rows, worst first: the report's first table."""
    problems = [
        row
        for row in (_verdict_row(r, i) for i, r in enumerate(records))
        if row["status"] in (Status.FAIL, Status.ERROR)
    ]
    problems.sort(key=lambda row: -row["rank"])
    return problems
