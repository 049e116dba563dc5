"""Terminal rendering: the only package that imports rich (single commands' renderers in
submodules).

The CLI calls the library and hands what it returns here; nothing here computes a verdict.

Two streams, so a person and a CI log both read it right: `out` (stdout) carries what a
command found (tables, the summary line, where the report is), `console` (stderr) carries
progress, logs and errors; `diag run > summary.txt` keeps the verdict and drops the progress.
Every string that comes from a user, a suite or a record (probe and case names, reasons,
paths) is escaped before rich sees it: `attn[heads]` is a name, not a style tag.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from diag.records.results import Record
from diag.render.cells import badge, num
from diag.status import STATUSES, Status, severity, worst_status

if TYPE_CHECKING:
    from rich.console import JustifyMethod
    from rich.progress import TaskID


__all__ = [
    "console",
    "out",
    "RunProgress",
    "summary_table",
    "problems_table",
    "print_error",
    "print_line",
    "nan_report_table",
    "preflight_table",
]

# Width for a stream that is not a terminal (a CI log, a file): wide enough that no table
# of diag's is wrapped or folded; rich only pads a table to its content's width.
PLAIN_WIDTH = 10_000


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader went away: raise it (rich would exit 1, diag's numerical failure);
        the CLI exits 141 as a shell reports SIGPIPE."""
        self.quiet = True
        raise BrokenPipeError("the reader of diag's output went away")


def _console(stderr: bool) -> Console:
    """A rich console; off a terminal, lines are never wrapped (COLUMNS still wins if set)."""
    c = _Console(stderr=stderr, highlight=False)
    if not c.is_terminal and not os.environ.get("COLUMNS"):
        c = _Console(stderr=stderr, highlight=False, width=PLAIN_WIDTH, soft_wrap=True)
    return c


console = _console(stderr=True)
out = _console(stderr=False)


def print_error(message: str) -> None:
    """One error line on stderr, exactly as given (no markup is read from it)."""
    console.print(message, style="bold red", markup=False, soft_wrap=True, highlight=False)


def print_line(message: str, *, err: bool = False) -> None:
    """One plain line (no markup read from it, never wrapped) on stdout, or stderr."""
    (console if err else out).print(message, markup=False, soft_wrap=True, highlight=False)


class RunProgress:
    """Progress over the planned records (`diag.plan.plan.Plan.records`: each backend's
    record per case, agreements between backends, A/B records, skips), on stderr; a no-op
    when disabled.

    On a terminal it is a live bar. Elsewhere (a CI log, a file) a live bar would print
    nothing until the end, so each record is one plain line as it arrives:
    ``diag run: [12/130] jax-cpu matmul.sweep_d4 64x4x64 float32: pass (2.1 s)``.
    """

    def __init__(self, enabled: bool = True, live: bool | None = None):
        self.enabled = enabled
        self.live = console.is_terminal if live is None else live
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._counts: dict[str, int] = defaultdict(int)
        self._total = 0
        self._done = 0
        self._t0 = time.monotonic()

    def start(self, total: int, backends: list[str]) -> None:
        if not self.enabled:
            return
        self._total, self._t0 = total, time.monotonic()
        if not self.live:
            print_line(
                f"diag run: {total} record(s) planned on backends: {', '.join(backends) or 'none'}",
                err=True,
            )
            return
        self._progress = Progress(
            TextColumn("[bold]diag run[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task(
            escape(f"backends: {', '.join(backends) or 'none'}"), total=total
        )

    def record(self, data: dict[str, Any]) -> None:
        rec = Record.from_json(data)
        self._counts[rec.status] += 1
        advance = 1  # the plan counts every record: probes, agreements, A/B, skips
        self._done += advance
        if not self.enabled:
            return
        if not self.live:
            kind = "" if rec.kind == "probe" else f" ({rec.kind})"
            print_line(
                f"diag run: [{self._done}/{self._total}] {rec.backend} "
                f"{rec.probe} {rec.case}{kind}: {rec.status} "
                f"({time.monotonic() - self._t0:.1f} s)",
                err=True,
            )
            sys.stderr.flush()
            return
        if not self._progress or self._task is None:  # both are set in start()
            return
        counts = " ".join(f"{badge(s)} {self._counts[s]}" for s in STATUSES if self._counts[s])
        self._progress.update(
            self._task,
            advance=advance,
            description=f"{escape(str(rec.backend))} {escape(str(rec.case))}  {counts}",
        )

    def stop(self) -> None:
        if self._progress:
            self._progress.stop()
            self._progress = None


# ULP metrics the summary shows where no error bound applies (see `summary_table`).
_ULP_KEYS = ("max_ulp", "max_ulp_between", "loss_ulp")


def summary_table(records: Iterable[dict[str, Any]]) -> Table:
    """One row per (probe, backend, dtype): verdict, counts, and the measure that decided.

    The bound ratio (worst error over the error bound of the arithmetic the backend claims)
    decides wherever a bound applies, so it leads. A ULP figure is shown only for rows with
    no bound ratio, where ULPs are what the verdict compared (two backends' agreement in ULP,
    a training step's loss): next to a bound ratio a max ULP misleads, because an element
    that nearly cancels to zero is millions of ULP off in a perfectly good float32 sum.
    Skips are listed with the problems, not here: they have no probe or dtype. Each record
    is read as a `Record` (`Record.from_json`): a line that is not one fails here, by name.
    """
    groups: dict[tuple, list[Record]] = defaultdict(list)
    for r in map(Record.from_json, records):
        if r.status != Status.SKIP:
            groups[(r.probe.split(".", 1)[-1], r.backend, shown_dtype(r))].append(r)
    table = Table(
        title="diag: results",
        caption="bound ratio: worst error / the error bound of the claimed "
        "arithmetic (above 1: less precision than claimed); ULP only where "
        "no bound applies",
    )
    for col, justify in (
        ("probe", "left"),
        ("backend", "left"),
        ("dtype", "left"),
        ("verdict", "left"),
        ("bound ratio", "right"),
        ("ULP", "right"),
        ("records", "left"),
    ):
        # Wrap rather than cut: `softmax_vocab` and `softmax_hazards` must stay apart.
        table.add_column(col, justify=cast("JustifyMethod", justify), overflow="fold")
    for (probe, backend, dtype), rs in groups.items():
        statuses = [r.status for r in rs]
        counts = ", ".join(f"{statuses.count(s)} {s}" for s in STATUSES if s in statuses)
        ratios = [
            r.metrics["bound_ratio"]
            for r in rs
            if isinstance(r.metrics.get("bound_ratio"), (int, float))
        ]
        ulps = (
            []
            if ratios
            else [r.metrics[k] for r in rs for k in _ULP_KEYS if isinstance(r.metrics.get(k), int)]
        )
        table.add_row(
            escape(probe),
            escape(str(backend)),
            escape(str(dtype)),
            badge(worst_status(statuses)),
            num(max(ratios)) if ratios else "—",
            num(max(ulps)) if ulps else "—",
            counts,
        )
    return table


def shown_dtype(record: Record) -> str:
    """A record's dtype as the summary shows it: its inputs' dtype, and the arithmetic's when
    a mixed-precision case computes in another (`float32, bfloat16 compute`: float32 master
    weights, bf16 arithmetic), so the two runs of a training suite are two rows."""
    dtype = str(record.dtype)
    compute = (record.params or {}).get("compute")
    return f"{dtype}, {compute} compute" if compute and compute != dtype else dtype


def phases_line(phases: dict[str, dict[str, float]]) -> str | None:
    """Where a run's time went, per backend, in one line (run.json's `phases`), or None."""
    parts = []
    for label, p in phases.items():
        # The NaN hunt shows only where one ran.
        split = ", ".join(
            f"{k} {p[k]:.1f}"
            for k in ("start", "compile", "run", "transfer", "hunt", "truth", "judge", "write")
            if k in p and (k != "hunt" or p[k])
        )
        parts.append(f"{label} {p.get('wall', 0.0):.1f} s ({split})")
    return "diag: time: " + "; ".join(parts) if parts else None


def problems_table(records: Iterable[dict[str, Any]], limit: int = 20) -> Table | None:
    """The error/fail/warn/skip records with their reasons, worst first (first `limit`)."""
    bad = sorted(
        (r for r in map(Record.from_json, records) if r.status != Status.PASS),
        key=lambda r: -severity(r.status),
    )
    if not bad:
        return None
    # A backend that is absent is said apart: a clean run has nothing to look at.
    skips = sum(1 for r in bad if r.status == Status.SKIP)
    title = [f"{len(bad) - skips} record(s) to look at"] if len(bad) > skips else []
    title += [f"{skips} backend(s) not run"] if skips else []
    table = Table(title="diag: " + "; ".join(title), show_lines=False)
    for col in ("status", "backend", "probe", "case", "reason"):
        table.add_column(col, overflow="fold")
    for r in bad[:limit]:
        table.add_row(
            badge(r.status),
            escape(str(r.backend)),
            escape(str(r.probe)),
            escape(str(r.case)),
            escape(str(r.reason)),
        )
    if len(bad) > limit:
        table.caption = f"... and {len(bad) - limit} more in results.jsonl"
    return table


def preflight_table(result: Any) -> Table:
    """`diag preflight`: one row per finding (step, status, check, what, what to do)."""
    verdict_style = "green" if result.exit_code == 0 else "bold red"
    table = Table(
        title=f"diag preflight: [{verdict_style}]{escape(result.verdict)}[/] "
        f"(exit {result.exit_code}, {result.elapsed_s:.1f} s of a "
        f"{result.budget_s:g} s budget)",
        show_lines=True,
    )
    for col in ("step", "status", "check", "finding", "what to do"):
        table.add_column(col, overflow="fold")
    for f in result.findings:
        table.add_row(
            escape(f.step), badge(f.status), escape(f.check), escape(f.what), escape(f.todo or "—")
        )
    return table


def nan_report_table(report: Any) -> Table:
    """A `diag.nan.NanReport` as a two-column table: the op, its line, its phase, its inputs."""
    from rich.markup import escape

    passed_in = report.phase == "input"
    title = (
        f"diag nan: {report.kind} passed in"
        if passed_in
        else f"diag nan: {report.kind} born in {report.primitive}"
    )
    table = Table(title=escape(title), show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    rows = [
        (
            "op",
            f"none: the {report.kind} was passed in ({report.framework})"
            if passed_in
            else f"[bold red]{escape(report.primitive)}[/] ({report.framework}) produced "
            f"{report.kind}",
        ),
        ("source", report.source or "—"),
        ("file", f"{report.file}:{report.line}" if report.file else "—"),
        ("path", report.path or "(top level)"),
        ("phase", report.phase),
    ]
    for i, s in enumerate(report.inputs):
        rows.append((f"input {i}", s.short()))
    if report.output is not None:
        rows.append(("output", report.output.short()))
    if report.bad_index is not None:
        at = (
            ", ".join(num(v) for v in report.inputs_at_index)
            if report.inputs_at_index is not None
            else "—"
        )
        rows.append(("first bad element", f"index {list(report.bad_index)}; inputs there: {at}"))
    rows.append(("births seen", str(report.births)))
    if getattr(report, "raised", ""):
        rows.append(("then", report.raised))
    given = getattr(report, "arrived", ())
    for fact in given[:5]:
        rows.append(("given", fact))
    if len(given) > 5:
        rows.append(("given", f"... and {len(given) - 5} more (--json lists all)"))
    if report.note:
        rows.append(("note", report.note))
    for i, (name, value) in enumerate(rows):
        table.add_row(name, value if i == 0 else escape(value))
    return table


# Renderers of single commands, in their own modules (they use the helpers above).
from diag.render.diverge import diverge_tables  # noqa: E402,F401
from diag.render.trace import trace_tables  # noqa: E402,F401
