"""`diag history`: since when each record moved, read from the file `--history` appends to."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

import typer

from diag.cli._app import app


def append_history(history: Path, run_dir: Path) -> str:
    """Append a run folder to a history file (`--history` of `diag run` and `diag check`).

    Returns:
      The line that says where it went.
    """
    from diag.gate.history import append

    number, added = append(history, run_dir)
    return (
        f"run #{number} appended to {history}"
        if added
        else f"run #{number} was already in {history}"
    )


def series_of(history: Path | None, keys: list[str]) -> list[dict[str, Any]]:
    """The series of the records `keys` in a history, as the drift view and report plot
    them: metric, (run, value) points and the runs where the record moved."""
    if history is None or not keys or not history.is_file():
        return []
    from diag.gate.series import read

    wanted = set(keys)
    found = read(history)
    out = []
    for s in found.series:
        metric = s.default_metric()
        if s.record not in wanted or metric is None:
            continue
        out.append(
            {
                "key": s.record,
                "metric": metric,
                "points": [[n, v] for n, v in s.values(metric)],
                "changes": [c.after.run for c in s.changes],
                "runs": len(s.points),
            }
        )
    return out


def history_for_report(history: Path, run_dir: Path) -> None:
    """Leave in the run folder the series of its records that moved in the history
    (``history.json``), for the report to plot; nothing when the history cannot be read."""
    from diag.errors import DiagError
    from diag.gate.history import read_run
    from diag.gate.series import read
    from diag.records.results import RunDir

    try:
        _, records = read_run(run_dir)
        found = read(history)
    except DiagError:
        return
    from diag.gate.baseline import record_key

    keys = [record_key(r) for r in records]
    moved = [s.record for s in found.moved]
    data = series_of(history, [k for k in keys if k in moved])
    if data:
        RunDir(run_dir).history_json.write_text(json.dumps(data, default=str), encoding="utf-8")


def with_series(view: dict[str, Any], history: Path | None) -> dict[str, Any]:
    """A drift view's data with each drifted record's series from the history (if any)."""
    keys = [r["key"] for c in view.get("causes", []) for r in c.get("records", [])]
    keys += [c["head"]["where"] for c in view.get("causes", [])]
    return {**view, "series": series_of(history, keys)}


# Values of a series shown in the terminal: the latest ones (--json has every run).
_SHOWN = 10


def _when(t: float | None) -> str:
    return _dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M") if t else "?"


@app.command("history")
def history_cmd(
    file: Path = typer.Argument(..., help="A history file (`--history` of run or check)."),
    record: str | None = typer.Option(
        None, "--record", "-r", help="Only records whose `probe | case | backend` contains this."
    ),
    metric: str | None = typer.Option(
        None,
        "--metric",
        "-m",
        help="The metric whose series to show (default: each record's bound ratio, "
        "recall or loss ULPs, the one the gate judges against an allowance).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the history as JSON."),
) -> None:
    """Say since when each record moved: the first run where it crossed its allowance or its
    output bits changed, and what differed in the environment from the run before.

    Exits 1 when a record moved, 0 when none did, 2 when the file is not a history.
    """
    from diag import render
    from diag.gate.series import describe, read

    found = read(file, record=record, metric=metric)
    if as_json:
        render.out.print_json(json.dumps(found.to_json(), default=str))
        raise typer.Exit(found.exit_code)
    render.print_line(
        f"diag: history {file}: {len(found.runs)} run(s), {len(found.series)} record(s)"
    )
    for s in found.series:
        m = metric or s.default_metric()
        if s.changes or metric is not None:
            shown = s.values(m) if m else []
            values = ", ".join(f"#{n} {_value(v)}" for n, v in shown[-_SHOWN:])
            if len(shown) > _SHOWN:
                values = f"({len(shown) - _SHOWN} earlier: --json lists them) ... " + values
            state = "moved" if s.changes else "steady"
            render.print_line(f"diag: {state}: {s.record} ({len(s.points)} run(s))")
            if values:
                render.print_line(f"    {m}: {values}")
        for i, c in enumerate(s.changes):
            run = found.runs[c.after.run]
            first = "first moved" if i == 0 else "moved again"
            render.print_line(
                f"    {first} in run #{c.after.run} ({c.after.run_id}, {_when(run['started'])}); "
                f"last good run #{c.before.run} ({c.before.run_id})"
            )
            for line in describe(c):
                render.print_line(f"        {line}")
    steady = len(found.series) - len(found.moved)
    render.print_line(
        f"diag: {len(found.moved)} record(s) moved, {steady} steady over {len(found.runs)} run(s)"
    )
    raise typer.Exit(found.exit_code)


def _value(v: Any) -> str:
    from diag.gate.drift import show

    return show(v)
