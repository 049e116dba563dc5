"""The self-contained HTML report of a run: one file that opens offline, anywhere.

A run's verdict has to reach people who will not re-run it (a reviewer, the on-call engineer
after an incident), so the report is a single HTML file with its charts (SVG), styles and a
little table script inline and no network fetch at all. ``import diag.report`` loads jinja2
but neither matplotlib (imported when a chart is drawn) nor any ML framework.
"""

from __future__ import annotations

from diag.report.html import render_report, write_report

__all__ = [
    "render_report",
    "write_report",
]
