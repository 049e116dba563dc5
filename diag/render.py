"""Terminal rendering: the only module that imports rich.

The CLI calls the library and hands what it returns here; nothing here computes a verdict.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from diag.results import STATUSES, worst_status

__all__ = ["console", "RunProgress", "summary_table", "problems_table", "print_error"]

console = Console(stderr=True, highlight=False)
out = Console(highlight=False)

_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "error": "bold magenta",
          "skip": "dim"}


def badge(status: str) -> str:
    return f"[{_STYLE.get(status, '')}]{status}[/]"


def print_error(message: str) -> None:
    console.print(f"[bold red]{message}[/]", markup=True, soft_wrap=True, highlight=False)


class RunProgress:
    """A progress bar over planned records, on stderr; a no-op when disabled."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task = None
        self._counts: dict[str, int] = defaultdict(int)

    def start(self, total: int, backends: list[str]) -> None:
        if not self.enabled:
            return
        self._progress = Progress(TextColumn("[bold]diag run[/]"), BarColumn(),
                                  MofNCompleteColumn(), TextColumn("{task.description}"),
                                  TimeElapsedColumn(), console=console, transient=False)
        self._progress.start()
        self._task = self._progress.add_task(f"backends: {', '.join(backends) or 'none'}",
                                             total=total)

    def record(self, rec: dict[str, Any]) -> None:
        self._counts[rec["status"]] += 1
        if not self._progress:
            return
        counts = " ".join(f"{badge(s)} {self._counts[s]}" for s in STATUSES if self._counts[s])
        advance = 0 if rec.get("kind") == "agreement" else 1
        self._progress.update(self._task, advance=advance,
                              description=f"{rec['backend']} {rec['case']}  {counts}")

    def stop(self) -> None:
        if self._progress:
            self._progress.stop()
            self._progress = None


def _num(x: Any) -> str:
    if isinstance(x, bool) or x is None:
        return "—"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def summary_table(records: Iterable[dict[str, Any]]) -> Table:
    """One row per (probe, backend, dtype): verdict, counts, worst bound ratio and ULP.

    Skips are listed with the problems, not here: they have no probe or dtype.
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if r["status"] != "skip":
            groups[(r["probe"].split(".", 1)[-1], r["backend"], r["dtype"])].append(r)
    table = Table(title="diag: results")
    for col, justify in (("probe", "left"), ("backend", "left"), ("dtype", "left"),
                         ("verdict", "left"), ("records", "left"), ("bound ratio", "right"),
                         ("max ULP", "right")):
        table.add_column(col, justify=justify)
    for (probe, backend, dtype), rs in groups.items():
        statuses = [r["status"] for r in rs]
        counts = ", ".join(f"{statuses.count(s)} {s}" for s in STATUSES if s in statuses)
        ratios = [r["metrics"].get("bound_ratio") for r in rs
                  if isinstance(r["metrics"].get("bound_ratio"), (int, float))]
        ulps = [r["metrics"].get(k) for r in rs for k in ("max_ulp", "max_ulp_between")
                if isinstance(r["metrics"].get(k), int)]
        table.add_row(probe, backend, dtype, badge(worst_status(statuses)), counts,
                      _num(max(ratios)) if ratios else "—", _num(max(ulps)) if ulps else "—")
    return table


def problems_table(records: Iterable[dict[str, Any]], limit: int = 20) -> Table | None:
    """The error/fail/warn/skip records with their reasons, worst first (first `limit`)."""
    order = ("error", "fail", "warn", "skip")
    bad = sorted((r for r in records if r["status"] in order),
                 key=lambda r: order.index(r["status"]))
    if not bad:
        return None
    table = Table(title=f"diag: {len(bad)} record(s) to look at", show_lines=False)
    for col in ("status", "backend", "probe", "case", "reason"):
        table.add_column(col, overflow="fold")
    for r in bad[:limit]:
        table.add_row(badge(r["status"]), r["backend"], r["probe"], r["case"], r["reason"])
    if len(bad) > limit:
        table.caption = f"... and {len(bad) - limit} more in results.jsonl"
    return table
