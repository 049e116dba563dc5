"""Reading a history (`diag.gate.history`): each record's series over runs, the runs where it
moved, and what differed in the environment between the last good run and the first bad one.

A record moves between two consecutive runs when the gate's rule says it drifted (its status,
a metric crossing its allowance, a count that is zero on every correct implementation:
`diag.gate.record_drift.metric_drifts`) or when any output bit changed. Comparing with the run
before (not with the first run) finds every change, so a record that changed twice (a
regression, then a fix) shows both.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from diag.gate.drift import Drift, show
from diag.gate.history import HistoryError, connect
from diag.gate.record_drift import DIGESTS, RATIOS, metric_drifts

__all__ = ["Change", "History", "Point", "Series", "describe", "key_difference", "moved", "read"]


@dataclass(frozen=True)
class Point:
    """One record in one run.

    Attributes:
      run: the run's number in the history (1, 2, ...: the order they were appended).
      run_id: the run folder's name.
      status: the record's status.
      data: kind, op, dtype, params, reason, the kept metrics and the output digests.
    """

    run: int
    run_id: str
    status: str | None
    data: dict[str, Any]

    @property
    def metrics(self) -> dict[str, Any]:
        return self.data.get("metrics") or {}

    @property
    def digests(self) -> list[str] | None:
        return self.data.get("digests")


@dataclass(frozen=True)
class Change:
    """A record that moved between two consecutive runs of its series.

    Attributes:
      before: the last run before the change (the last good one, for the first change).
      after: the first run with the change.
      drifts: what moved (the gate's drifts, and `output bits` when any bit changed).
      environment: `(name, before, after)` for each key entry that differs between the two
        runs (hardware, versions, settings, code, arithmetic, git commit): the likely causes.
    """

    before: Point
    after: Point
    drifts: list[Drift]
    environment: list[tuple[str, Any, Any]]


@dataclass
class Series:
    """One record over the runs of a history that hold it."""

    record: str
    points: list[Point]
    changes: list[Change] = field(default_factory=list)

    def values(self, metric: str) -> list[tuple[int, Any]]:
        """(run number, value) of `metric` in each run that has it."""
        return [(p.run, p.metrics[metric]) for p in self.points if metric in p.metrics]

    def default_metric(self) -> str | None:
        """The first metric the gate judges against an allowance that this record has."""
        return next((m for m in RATIOS if any(m in p.metrics for p in self.points)), None)


@dataclass
class History:
    """What `read` found: every run (number -> run id, started, git commit) and the series."""

    path: str
    runs: dict[int, dict[str, Any]]
    series: list[Series]
    metric: str | None = None

    @property
    def moved(self) -> list[Series]:
        return [s for s in self.series if s.changes]

    @property
    def exit_code(self) -> int:
        """1 when a record moved (the CLI's exit code), else 0."""
        return 1 if self.moved else 0

    def to_json(self) -> dict[str, Any]:
        """The history as plain data (`diag history --json`)."""
        return {
            "path": self.path,
            "runs": [{"run": n, **info} for n, info in self.runs.items()],
            "metric": self.metric,
            "records": [
                {
                    "record": s.record,
                    "runs": [p.run for p in s.points],
                    "statuses": [p.status for p in s.points],
                    "metric": (m := self.metric or s.default_metric()),
                    "series": [[n, v] for n, v in s.values(m)] if m else [],
                    "changes": [_change_json(c) for c in s.changes],
                }
                for s in self.series
            ],
            "exit_code": self.exit_code,
        }


def _change_json(c: Change) -> dict[str, Any]:
    return {
        "last_good_run": c.before.run,
        "last_good_run_id": c.before.run_id,
        "first_bad_run": c.after.run,
        "first_bad_run_id": c.after.run_id,
        "drifts": [
            {"what": d.what, "old": d.old, "new": d.new, "why": d.why, "text": d.text()}
            for d in c.drifts
        ],
        "environment": [{"name": n, "before": a, "after": b} for n, a, b in c.environment],
    }


def key_difference(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """`(name, a's value, b's value)` for each entry of two flat keys that differs."""
    return [(n, a.get(n), b.get(n)) for n in sorted(set(a) | set(b)) if a.get(n) != b.get(n)]


def _bits(where: str, old: list[str] | None, new: list[str] | None) -> list[Drift]:
    if old == new:
        return []
    a, b = old or [], new or []
    n = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return [
        Drift(
            where,
            "output bits",
            a[first] if first < len(a) else None,
            b[first] if first < len(b) else None,
            f"{n} of {max(len(a), len(b))} output(s) changed bits (first: output {first})",
        )
    ]


def moved(record: str, before: Point, after: Point) -> list[Drift]:
    """What moved in `record` from run `before` to run `after` (empty: nothing)."""
    old = {"status": before.status, "metrics": before.metrics, "digests": before.digests}
    new = {**after.data, "status": after.status}
    new["metrics"] = {**after.metrics, DIGESTS: after.digests}
    return metric_drifts(record, old, new, bitwise=False) + _bits(
        record, before.digests, after.digests
    )


def read(
    path: str | os.PathLike, *, record: str | None = None, metric: str | None = None
) -> History:
    """Each record's series in a history file, with the runs where it moved.

    Args:
      path: the history file.
      record: only records whose key (`probe | case | backend`) contains this text.
      metric: the metric whose values the series show (default: per record, the first metric
        the gate judges against an allowance).

    Returns:
      History.

    Raises:
      HistoryError: not a history file, no record matches `record`, or no matched record has
        `metric`.
    """
    with connect(path, create=False) as con:
        runs: dict[int, dict[str, Any]] = {
            n: {"run_id": run_id, "started": started, "git_commit": commit}
            for n, run_id, started, commit in con.execute(
                "SELECT id, run_id, started, git_commit FROM runs ORDER BY id"
            )
        }
        names = [r for (r,) in con.execute("SELECT DISTINCT record FROM records ORDER BY record")]
        if record is not None:
            names = [r for r in names if record in r]
            if not names:
                raise HistoryError(
                    f"{path}: no record's key contains {record!r}; `diag history {path}` lists them"
                )
        rows = []
        for name in names:  # each one lookup in the (record, run) index
            rows += con.execute(
                "SELECT record, run, status, data FROM records WHERE record = ? ORDER BY run",
                (name,),
            ).fetchall()
        series = _series(names, rows, runs)
        if metric is not None and not any(s.values(metric) for s in series):
            have = sorted({m for s in series for p in s.points for m in p.metrics})
            raise HistoryError(
                f"{path}: no record here has metric {metric!r}; metrics: {', '.join(have)}"
            )
        keys: dict[int, dict[str, Any]] = {}

        def key(n: int) -> dict[str, Any]:  # read only for the runs around a change
            if n not in keys:
                (text,) = con.execute("SELECT key FROM runs WHERE id = ?", (n,)).fetchone()
                keys[n] = json.loads(text)
            return keys[n]

        for s in series:
            for before, after in zip(s.points, s.points[1:]):
                drifts = moved(s.record, before, after)
                if drifts:
                    env = key_difference(key(before.run), key(after.run))
                    s.changes.append(Change(before, after, drifts, env))
    return History(str(path), runs, series, metric)


def _series(names: list[str], rows: list, runs: dict[int, dict[str, Any]]) -> list[Series]:
    points: dict[str, list[Point]] = {n: [] for n in names}
    for rec, run, status, data in rows:
        points[rec].append(Point(run, runs[run]["run_id"], status, json.loads(data)))
    return [Series(n, ps) for n, ps in points.items()]


def describe(c: Change) -> list[str]:
    """A change in lines: what moved, then the environment difference (or that none showed)."""
    lines = [f"{d.what} {show(d.old)} -> {show(d.new)} ({d.why})" for d in c.drifts]
    if c.environment:
        lines += [
            f"environment: {n}: {show(a) if a else 'unset'} -> {show(b) if b else 'unset'}"
            for n, a, b in c.environment
        ]
    else:
        lines.append(
            "environment: no difference in hardware, versions, settings, code or git commit"
        )
    return lines
