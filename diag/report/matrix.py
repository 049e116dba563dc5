"""The report's matrix: what ran where, at a glance, above the verdict table.

One row per (probe, dtype, setting), one column per backend that ran; a cell is coloured by the
worst status among its records and shows the worst figure that decided them (the largest bound
ratio, else the lowest recall, else the largest ULP error), so a reader sees which op, dtype
and backend is fine before reading 170 rows. Each cell links to its records in the verdict
table (`data-cell`, which the table's rows carry too).

Agreement records (two backends compared with each other) have their own table and no cell
here: their "backend" is a pair.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from diag import numerics
from diag.status import STATUSES, worst_status

__all__ = ["SETTING_PARAMS", "cell_id", "matrix_context", "row_key"]

#: Case parameters that name the numerics setting a record ran at (beside its dtype): the
#: matrix gives each setting a row of its own, since `highest` and `default` are different
#: claims. A value of "none" (no setting applied) is left out.
SETTING_PARAMS = ("precision", "precision_via")


def row_key(rec: Mapping[str, Any]) -> tuple[str, str, str]:
    """(probe, dtype, setting) of a record: its matrix row."""
    raw = rec.get("params")
    params: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    setting = " ".join(
        f"{k}={params[k]}" for k in SETTING_PARAMS if params.get(k) not in (None, "", "none")
    )
    return str(rec.get("probe", "")), str(rec.get("dtype", "")), setting


def cell_id(rec: Mapping[str, Any], index: dict[tuple, str]) -> str:
    """A short id (`c0`, `c1`, ...) for the record's (row, backend) cell, stable within one
    report: `index` maps each cell seen so far to its id and grows as cells appear."""
    key = (*row_key(rec), str(rec.get("backend", "")))
    if key not in index:
        index[key] = f"c{len(index)}"
    return index[key]


def _num(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _figure(records: list[Mapping[str, Any]]) -> tuple[str, str]:
    """The cell's figure and what it is: the worst bound ratio, else the lowest recall, else
    the largest ULP error of its records ("" when none recorded any)."""
    metrics: list[Mapping[str, Any]] = [
        m for m in (r.get("metrics") for r in records) if isinstance(m, Mapping)
    ]
    for key, pick, what in (
        ("bound_ratio", max, "worst bound ratio"),
        ("recall_min", min, "lowest recall"),
        ("recall_mean", min, "lowest mean recall"),
        ("max_ulp", max, "largest max ULP"),
    ):
        values = [v for v in (_num(m.get(key)) for m in metrics) if v is not None]
        if values:
            nan = [v for v in values if v != v]
            worst = nan[0] if nan else pick(values)
            return numerics.fmt(worst), what
    return "", ""


def matrix_context(
    records: Iterable[Mapping[str, Any]], cells: dict[tuple, str]
) -> dict[str, Any] | None:
    """The matrix's rows and columns, or None when no probe record ran.

    Args:
      records: the run's records (agreement records are left out).
      cells: `cell_id`'s index, filled for the verdict table's rows first, so that a cell and
        its rows carry the same id.

    Returns:
      {"backends": [...], "not_run": [...], "groups": [{"probe", "rows": [{"dtype",
      "setting", "cells": [cell or None per backend]}]}]}; a cell: id, status, figure, what
      the figure is, records. A backend whose every record is a `skip` (absent, not
      installed) has no column, only a name in `not_run`: six such columns of a default run
      pushed the backends that ran out of a 1280 px window.
    """
    by_cell: dict[tuple, list[Mapping[str, Any]]] = {}
    for rec in records:
        if rec.get("kind", "probe") != "probe":
            continue
        by_cell.setdefault((*row_key(rec), str(rec.get("backend", ""))), []).append(rec)
    if not by_cell:
        return None
    every = list(dict.fromkeys(k[3] for k in by_cell))
    ran = {k[3] for k, recs in by_cell.items() if any(r.get("status") != "skip" for r in recs)}
    backends = [b for b in every if b in ran] or every
    groups: dict[str, dict[tuple[str, str], dict[str, Any]]] = {}
    for (probe, dtype, setting, backend), recs in by_cell.items():
        if backend not in backends:
            continue
        statuses = [str(r.get("status", "")) for r in recs]
        # As bad as its worst record that checked something; `skip` only when none did.
        status = worst_status(statuses)
        figure, what = _figure(recs)
        counts = {s: statuses.count(s) for s in STATUSES if s in statuses}
        row = groups.setdefault(probe, {}).setdefault((dtype, setting), {})
        row[backend] = {
            "id": cells.get((probe, dtype, setting, backend), ""),
            "status": status,
            "figure": figure,
            "what": what,
            "n": len(recs),
            "title": f"{probe} · {dtype}{' · ' + setting if setting else ''} · {backend}: "
            f"{len(recs)} record(s), "
            + ", ".join(f"{n} {s}" for s, n in counts.items())
            + (f"; {what} {figure}" if figure else ""),
        }
    return {
        "backends": backends,
        "not_run": [b for b in every if b not in backends],
        "groups": [
            {
                "probe": probe,
                "rows": [
                    {"dtype": dtype, "setting": setting, "cells": [row.get(b) for b in backends]}
                    for (dtype, setting), row in rows.items()
                ],
            }
            for probe, rows in groups.items()
        ],
    }
