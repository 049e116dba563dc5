"""A ``results.jsonl`` file read back: its records, and every line that could not be read.

Records are appended whole and fsynced (`diag.records.results.RunDir.append`), so the one damage an
append-only file expects is a torn last line; any other unreadable line means the file was
damaged or edited, and is counted so that the verdict never hides it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RecordsRead", "read_records", "read_results"]


@dataclass
class RecordsRead:
    """What reading a ``results.jsonl`` found: the records, and every line it could not read.

    Attributes:
      records: the records, in file order.
      unreadable: 1-based numbers of lines that are not a JSON object, except a torn last
        line. Records are appended whole and fsynced, so such a line means the file was
        damaged or edited: a report that left them out silently could lose a `fail`.
      torn_last_line: the number of the last line when it is not a JSON object (the host was
        killed mid-write, the one damage an append-only file expects), else None.
    """

    records: list[dict[str, Any]]
    unreadable: list[int] = field(default_factory=list)
    torn_last_line: int | None = None

    def problems(self, path: str | os.PathLike = "results.jsonl") -> list[str]:
        """One sentence per kind of damage, for the terminal and the report (none if clean)."""
        out = []
        if self.unreadable:
            shown = ", ".join(map(str, self.unreadable[:10]))
            more = f", ... ({len(self.unreadable) - 10} more)" if len(self.unreadable) > 10 else ""
            out.append(
                f"{len(self.unreadable)} line(s) of {path} could not be read (line "
                f"{shown}{more}); the verdict leaves them out, so it may hide a failure"
            )
        if self.torn_last_line is not None:
            out.append(
                f"the last line of {path} (line {self.torn_last_line}) is torn, as a "
                "write cut short leaves it; it is left out"
            )
        return out


def read_results(path: str | os.PathLike) -> RecordsRead:
    """Read a ``results.jsonl`` file (or a run directory holding one), counting bad lines.

    Args:
      path: the file, or a run folder.

    Returns:
      RecordsRead: the records, the unreadable lines and a torn last line, if any. A missing
      file reads as no records.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "results.jsonl"
    if not p.exists():
        return RecordsRead([])
    records: list[dict[str, Any]] = []
    bad: list[int] = []
    last = 0
    with p.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            last = number
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                rec = None
            if isinstance(rec, dict):
                records.append(rec)
            else:
                bad.append(number)
    torn = bad.pop() if bad and bad[-1] == last else None
    return RecordsRead(records, bad, torn)


def read_records(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Yield the readable records of a ``results.jsonl`` file (or a run directory).

    Unreadable lines are left out; call `read_results` to learn how many there were.
    """
    yield from read_results(path).records
