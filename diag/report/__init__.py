"""The self-contained HTML report of a run: one file that opens offline, anywhere.

A run's verdict has to reach people who will not re-run it (a reviewer, the on-call engineer
after an incident), so the report is a single HTML file with its charts (SVG), styles and a
little table script inline and no network fetch at all. ``import diag.report`` loads jinja2
but neither matplotlib (imported when a chart is drawn) nor any ML framework.
"""

from __future__ import annotations

from diag.report.damage import damage, lost_records
from diag.report.driftview import render_drift_view, write_drift_view
from diag.report.html import render_report, write_report

__all__ = [
    "damage",
    "lost_records",
    "preload",
    "render_drift_view",
    "render_report",
    "write_drift_view",
    "write_report",
]


def preload() -> None:
    """Import matplotlib for the charts in a background thread, now rather than after the run.

    `diag run` calls this before its workers start: the import (about half a second, the
    largest part of writing a report) then overlaps the time the run waits on its workers
    instead of adding to the wall time after the last one. Skipping it changes nothing but
    the timing: `write_report` imports whatever is still missing (and an import error
    surfaces there, not in the thread).
    """
    import threading

    from diag.report.charts import import_matplotlib

    threading.Thread(target=import_matplotlib, name="diag-report-preload", daemon=True).start()
