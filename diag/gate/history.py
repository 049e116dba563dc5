"""A history of every check: each run's verdict-relevant numbers in one SQLite file, so that
diag can say since when a record moved, and what else changed then.

A baseline answers "did this run move?"; a history answers "in which run did it first move,
and what was different about that run?". Each appended run keeps what a baseline keeps (its
key: hardware, versions, numerics settings, the users' functions' source; per record the
status, the metrics the drift rule reads and the outputs' sha256) plus the git commit of the
folder the run was started in. The same drift rule as `diag check` decides when a record
moved (`diag.gate.record_drift`: a metric crossing its allowance, a changed count or status),
and any changed output bit counts too: a history compares a run with the run before it, and
most histories are of one machine, where bits are reproducible.

One file, standard-library `sqlite3`: write-ahead logging and `BEGIN IMMEDIATE` make two
writers (two CI jobs on one runner) take turns instead of corrupting the file, a busy timeout
makes the second wait, and an index on (record, run) keeps a record's series one lookup and
the list of records a scan of the index, not of the data (benchmarks/bench_history.py: 1,000
runs of the ci suite).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from diag.errors import UsageError
from diag.gate.baseline import FINGERPRINT_FIELDS, record_key, run_key
from diag.gate.record_drift import DIGESTS, kept_metrics
from diag.records.results import RunDir, read_results

__all__ = [
    "HISTORY_SCHEMA",
    "HistoryError",
    "append",
    "flat_key",
    "read_run",
]

HISTORY_SCHEMA = "diag.history/1"

#: Seconds a writer waits for another writer's transaction before giving up.
BUSY_TIMEOUT_S = 60.0

_TABLES = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL UNIQUE,
    suite TEXT,
    started REAL,
    appended REAL NOT NULL,
    git_commit TEXT,
    key TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS records (
    record TEXT NOT NULL,
    run INTEGER NOT NULL REFERENCES runs(id),
    status TEXT,
    data TEXT NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS records_by_record ON records (record, run);
CREATE INDEX IF NOT EXISTS records_by_run ON records (run);
"""


class HistoryError(UsageError):
    """A history file diag cannot use (not a history, damaged, unwritable): exit 2."""


@contextmanager
def connect(path: str | os.PathLike, *, create: bool) -> Iterator[sqlite3.Connection]:
    """An open history, its tables made when `create` and the file is new or an empty
    database (else it must exist and be a history).

    Raises:
      HistoryError: missing (without `create`), not a SQLite file, or another schema.
    """
    p = Path(path)
    if not create and not p.is_file():
        raise HistoryError(
            f"{p}: no such history file; write one with `diag check ... --history {p}` "
            f"or `diag run ... --history {p}`"
        )
    try:
        con = sqlite3.connect(p, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    except sqlite3.Error as e:
        raise HistoryError(f"{p}: cannot open the history ({e})") from None
    try:
        try:
            con.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
            if create:
                _create(con)
            row = con.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
        except sqlite3.DatabaseError as e:
            raise HistoryError(
                f"{p}: not a diag history ({e}); give the file `--history` wrote, or a new path"
            ) from None
        if row is None or row[0] != HISTORY_SCHEMA:
            raise HistoryError(
                f"{p}: schema is {row[0] if row else None!r}, not {HISTORY_SCHEMA}; "
                "give the file `--history` wrote, or a new path"
            )
        # Only once the file is known to be a history (another database is left untouched).
        # With WAL, NORMAL never corrupts the file; a power cut may lose the last run.
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=NORMAL")
        yield con
    finally:
        con.close()


def _create(con: sqlite3.Connection) -> None:
    """Make the tables in an empty database; another database is left as it is (the schema
    check after this refuses it)."""
    con.execute("BEGIN IMMEDIATE")
    if con.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0] == 0:
        for statement in _TABLES.split(";"):  # executescript would commit first
            con.execute(statement)
        con.execute("INSERT INTO meta (name, value) VALUES ('schema', ?)", (HISTORY_SCHEMA,))
    con.execute("COMMIT")


def read_run(run_dir: str | os.PathLike) -> tuple[dict, list[dict]]:
    """run.json and the records of a run folder.

    Raises:
      HistoryError: not a run folder, or records that cannot be read.
    """
    run = RunDir(run_dir)
    if not run.run_json.is_file():
        raise HistoryError(
            f"{run_dir}: not a diag run folder (no run.json); pass the folder `diag run` printed"
        )
    read = read_results(run.results_jsonl)
    if read.unreadable:
        raise HistoryError(f"{run.results_jsonl}: {read.problems(run.results_jsonl)[0]}")
    return run.read_meta(), read.records


def flat_key(meta: dict, records: list[dict]) -> dict[str, Any]:
    """A run's key as one flat name -> value map: `run_key`'s sections, the matmul
    fingerprints' labels and the git commit, so two runs' keys diff name by name."""
    flat: dict[str, Any] = {}
    for section, values in run_key(meta, records).items():
        for name, value in values.items():
            flat[f"{section}: {name}"] = value
    for backend, info in sorted((meta.get("backends") or {}).items()):
        for fp in info.get("fingerprints") or []:
            if isinstance(fp, dict):
                where = f"arithmetic: {backend} matmul precision={fp.get('precision')}"
                flat[f"{where} via={fp.get('via')}"] = " ".join(
                    str(fp.get(f)) for f in FINGERPRINT_FIELDS
                )
    env = meta.get("environment") or {}
    flat["code: git commit"] = env.get("git_revision")
    return flat


def _rows(run: int, records: list[dict]) -> Iterator[tuple[str, int, str | None, str]]:
    seen: set[str] = set()
    for rec in records:
        key, n = record_key(rec), 2
        while key in seen:  # the same triple twice in one run: `key #2`, as the gate names it
            key = f"{record_key(rec)} #{n}"
            n += 1
        seen.add(key)
        data = {f: rec.get(f) for f in ("kind", "op", "dtype", "params", "reason")}
        data["metrics"] = kept_metrics(rec.get("metrics") or {})
        data["digests"] = (rec.get("metrics") or {}).get(DIGESTS)
        yield key, run, rec.get("status"), json.dumps(data, sort_keys=True, default=str)


def append(path: str | os.PathLike, run_dir: str | os.PathLike) -> tuple[int, bool]:
    """Append a finished run folder to a history (created when missing).

    Appending the same run twice (`diag run --history` then `diag check --history`) keeps one
    copy.

    Args:
      path: the history file.
      run_dir: the run folder.

    Returns:
      (the run's number in the history, whether it was added now).

    Raises:
      HistoryError: an unusable run folder or history file.
    """
    meta, records = read_run(run_dir)
    run_id = meta.get("run_id") or Path(run_dir).name
    key = json.dumps(flat_key(meta, records), sort_keys=True, default=str)
    with connect(path, create=True) as con:
        try:
            con.execute("BEGIN IMMEDIATE")
            old = con.execute("SELECT id FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if old is not None:
                con.execute("ROLLBACK")
                return int(old[0]), False
            cur = con.execute(
                "INSERT INTO runs (run_id, suite, started, appended, git_commit, key) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (
                    run_id,
                    (meta.get("suite") or {}).get("name"),
                    meta.get("started"),
                    time.time(),
                    (meta.get("environment") or {}).get("git_revision"),
                    key,
                ),
            )
            number = int(cur.lastrowid or 0)
            con.executemany(
                "INSERT INTO records (record, run, status, data) VALUES (?, ?, ?, ?)",
                _rows(number, records),
            )
            con.execute("COMMIT")
        except sqlite3.Error as e:
            if con.in_transaction:
                con.execute("ROLLBACK")
            raise HistoryError(f"{path}: cannot append the run ({e})") from None
    return number, True
