"""Render a run folder into one self-contained HTML file.

The report is read after an incident, attached to a CI job, mailed to a colleague: it has to
open from disk, offline, years later. So it is ONE file with its CSS, JS and SVG charts
inline and nothing fetched: a Content-Security-Policy with ``default-src 'none'`` makes the
browser refuse any fetch, and allows only the one inline script whose hash it carries.
Everything that comes from a record or the environment (case names, reasons, flags, host
names) is data, never markup: jinja2 autoescapes it, and the only markup inserted unescaped
is our own script/style and the SVG that matplotlib wrote (which escapes its text).
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from diag.errors import UsageError
from diag.records.results import INCOMPLETE, RunDir, RunMeta, output_errors
from diag.report.charts import sweep_groups, sweep_svg, to_float
from diag.report.damage import damage
from diag.report.matrix import matrix_context
from diag.report.nodes import report_context as nodes_context
from diag.report.sections import ab_context, sampling_context
from diag.report.seriesplot import series_charts
from diag.report.settings import report_context as settings_context
from diag.report.tables import (
    METRIC_COLUMNS,
    fmt_num,
    problem_rows,
    table_rows,
    verdict_groups,
)
from diag.report.trace import trace_context
from diag.report.training import train_context
from diag.status import CHECKED, STATUSES, worst_status

__all__ = ["asset", "environment", "render_report", "write_report"]

# Environment keys shown first when present (matched case-insensitively); the rest follow
# in the order run.json has them.
ENV_FIRST = (
    "host",
    "hostname",
    "platform",
    "machine",
    "cpu_count",
    "python",
    "devices",
    "packages",
    "frameworks",
    "versions",
    "env",
    "xla_flags",
    "libtpu_init_args",
    "numerics",
    "jax",
    "torch",
    "command",
    "cwd",
    "git_revision",
    "git",
)

# What a worker reported that the Precision fingerprints and Arithmetic features sections show
# (as compact tables): left out of the Environment's backend tables, where they were a raw
# nested dump tens of thousands of pixels tall.
EVIDENCE_KEYS = ("fingerprints", "features")

# How a verdict reads at the top of the report.
VERDICT_TEXT = {
    "pass": "PASS: every check agrees with the ground truth within tolerance",
    "skip": "SKIPPED: nothing was checked",
    "warn": "WARN: all checks passed, some with warnings",
    "fail": "FAIL: a numerical check failed",
    "error": "ERROR: a backend or check could not run",
    INCOMPLETE: "INCOMPLETE: the run stopped before every check ran",
}

STATE_NOTE = {
    "running": "This run is still in progress; the report shows the records written so far.",
    "interrupted": "This run was interrupted; the results below are incomplete.",
    "aborted": "This run was aborted (see `error` in run.json); the results below are incomplete.",
}

#: Above this many rows the verdict table starts with its passing rows hidden (the matrix
#: and the counts still show them; one choice shows them): a 325-record run's report was
#: 40,000 px tall at 1000 px with every row shown.
HIDE_PASSING_ABOVE = 60

#: Run states whose verdict is `incomplete`, whatever the records written say (run.json's
#: `verdict` says the same: `diag.records.run_meta.run_verdict`).
STOPPED = ("interrupted", "aborted")


def _verdict_text(verdict: str | None, state: str, worst: str | None) -> str:
    if verdict == INCOMPLETE:
        seen = f"; the worst of the records written: {worst}" if worst else "; no records written"
        return f"{VERDICT_TEXT[INCOMPLETE]} (the run was {state}{seen})"
    if verdict is None:
        return "no results recorded"
    text = VERDICT_TEXT.get(verdict, verdict)
    return f"{text} (so far: the run is {state})" if state in STATE_NOTE else text


def _fmt_time(ts: Any) -> str:
    x = to_float(ts)
    if x is None or not math.isfinite(x):
        return "—" if ts in (None, "") else str(ts)
    t = _dt.datetime.fromtimestamp(x, tz=_dt.timezone.utc).astimezone()
    return t.strftime("%Y-%m-%d %H:%M:%S %z")


def _env_items(env: Mapping[str, Any]) -> list[tuple[str, Any]]:
    first = {k: i for i, k in enumerate(ENV_FIRST)}
    keys = list(env)
    keys.sort(key=lambda k: (first.get(str(k).lower(), len(first)),))
    return [(str(k), env[k]) for k in keys]


def asset(name: str) -> str:
    """A file of the report's templates folder (its CSS, its script), as text."""
    return resources.files("diag.report").joinpath("templates", name).read_text("utf-8")


def environment() -> jinja2.Environment:
    """The jinja2 environment of the report's templates (autoescaping, diag's filters)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("diag.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["fmt_num"] = fmt_num
    env.tests["mapping"] = lambda v: isinstance(v, Mapping)
    env.tests["sequence_of_mappings"] = lambda v: (
        isinstance(v, (list, tuple)) and bool(v) and all(isinstance(x, Mapping) for x in v)
    )
    env.tests["scalar_sequence"] = lambda v: isinstance(v, (list, tuple))
    return env


def render_report(
    meta: RunMeta | Mapping[str, Any],
    records: Iterable[Mapping[str, Any]],
    nodes: Mapping[str, Any] | None = None,
    damage: Iterable[str] = (),
    trace: Mapping[str, Any] | None = None,
    history: list[Mapping[str, Any]] | None = None,
) -> str:
    """Render the HTML report for a run's metadata and records.

    Args:
      meta: ``run.json`` as a `RunMeta`, or its contents (read with `RunMeta.from_dict`);
        missing fields render as "—".
      records: record dicts as read from ``results.jsonl``.
      nodes: the contents of ``nodes.json`` of a `diag nodes` scan, or None (no section).
      damage: sentences saying what could not be read (`RecordsRead.problems`), shown above
        the verdict, which then says it covers the readable records only.
      trace: the Profile section of a traced run (`diag.report.trace.trace_context`).
      history: the series of the records that moved in the run's history (``history.json``).

    Returns:
      The complete HTML document as a string.
    """
    from diag import __version__

    run = meta if isinstance(meta, RunMeta) else RunMeta.from_dict(meta)
    records = [r for r in records if isinstance(r, Mapping)]
    damage = list(damage)
    probe_rows, agreement_rows, cells = table_rows(records)
    script = asset("report.js")
    script_hash = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode()
    suite = run.suite
    return (
        environment()
        .get_template("report.html.j2")
        .render(
            run_id=run.run_id or "—",
            state=run.state,
            state_note=STATE_NOTE.get(run.state),
            started=_fmt_time(run.started),
            finished=_fmt_time(run.finished) if run.finished is not None else None,
            command_line=run.command_line,
            **_verdict_context(run, records, damage),
            problems=problem_rows(records),
            suite=suite.get("name") or suite.get("path"),
            suite_path=suite.get("path") if suite.get("name") else None,
            environment=_env_items(run.environment),
            backends=_backends(run),
            backends_skipped=list(run.backends_skipped.items()),
            metric_columns=METRIC_COLUMNS,
            rows=probe_rows,
            hide_passing=len(probe_rows) > HIDE_PASSING_ABOVE,
            groups=verdict_groups(probe_rows),
            matrix=matrix_context(records, cells),
            agreement_rows=agreement_rows,
            hide_passing_agreement=len(agreement_rows) > HIDE_PASSING_ABOVE,
            sweeps=_sweeps(records),
            # Settings findings and precision fingerprints (diag.settings.flags; _settings.html.j2).
            settings=settings_context(run),
            style=Markup(asset("report.css")),
            script=Markup(script),
            script_hash=script_hash,
            version=__version__,
            generated=_fmt_time(_dt.datetime.now().timestamp()),
            nodes=_nodes_context(nodes),
            sampling=sampling_context(records, run.report_sections),
            ab=ab_context(records, run.ab),
            trace=trace,
            train=_train_context(records, run.report_sections),
            history_series=series_charts(history or []),
        )
    )


def _verdict_context(
    run: RunMeta, records: list[Mapping[str, Any]], damage: list[str]
) -> dict[str, Any]:
    """The report's head: counts per status, the worst one and how it reads, what was lost.

    A damaged folder's verdict is the worst of its readable records and of what run.json
    counted: a torn or deleted line that held the run's one `fail` must not leave a PASS.
    A run that stopped early reads `incomplete`, never a pass.
    """
    counts = Counter(str(r.get("status", "")) for r in records)
    statuses = [s for s in counts if s in STATUSES]
    worst = worst_status(statuses) if records else None
    unseen = [
        s
        for s, n in run.counts.items()
        if damage and s in CHECKED and isinstance(n, int) and n > counts.get(s, 0)
    ]
    if unseen:
        worst = worst_status([*statuses, *unseen])
    verdict = INCOMPLETE if run.state in STOPPED else worst
    verdict_text = _verdict_text(verdict, run.state, worst)
    if unseen:
        verdict_text += (
            f" (readable records only, and the {', '.join(unseen)} record(s) run.json counts "
            "beyond them: see the warning above)"
        )
    elif damage:
        verdict_text += " (readable records only: see the warning above)"
    return {
        "statuses": STATUSES[::-1],
        "counts": {s: counts.get(s, 0) for s in STATUSES},
        "n_records": len(records),
        "verdict": verdict,
        "verdict_text": verdict_text,
        "damage": damage,
    }


def _backends(run: RunMeta) -> list[tuple[str, Any]]:
    """What each worker reported at start-up: device, framework version, numerics settings
    (their fingerprints and features have sections of their own)."""
    return [
        (
            name,
            {k: v for k, v in info.items() if k not in EVIDENCE_KEYS}
            if isinstance(info, Mapping)
            else info,
        )
        for name, info in run.backends.items()
    ]


def _sweeps(records: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The sweep charts: one per probe and swept parameter, its SVG inline."""
    return [
        {
            "probe": sweep.probe,
            "op": sweep.op,
            "param": sweep.param,
            "n_series": len(sweep.series),
            "omitted": sweep.omitted,
            "svg": Markup(sweep_svg(sweep, f"sweep-{n}")),
        }
        for n, sweep in enumerate(sweep_groups(records))
    ]


def _train_context(records, sections) -> dict[str, Any] | None:
    ctx = train_context(records, sections or {})
    if ctx:
        for case in ctx["cases"]:
            case["svg"] = Markup(case["svg"])
    return ctx


def _nodes_context(nodes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not isinstance(nodes, Mapping):
        return None
    return nodes_context(nodes)


def _history(run: RunDir) -> list[Mapping[str, Any]]:
    """The moved records' series `diag run --history` left in the run folder (none when the
    file is absent or unreadable: the report shows the run either way)."""
    try:
        data = json.loads(run.history_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [s for s in data if isinstance(s, dict)] if isinstance(data, list) else []


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write the self-contained HTML report of a run folder.

    Works on finished, running and interrupted runs alike: it reads whatever records are in
    ``results.jsonl`` (a torn last line is skipped) and says how complete they are.

    Args:
      run_dir: a run folder holding ``run.json`` and ``results.jsonl``.
      out: where to write the HTML; defaults to ``run_dir/report.html``.

    Returns:
      The path of the written report.

    Raises:
      UsageError: `run_dir` has no ``run.json`` (it is not a run folder), its run.json or
        nodes.json is not valid JSON, or the report cannot be written to `out`.
    """
    run = RunDir(run_dir)
    if not run.run_json.is_file():
        raise UsageError(
            f"{run.path}: not a run folder (no run.json); pass a folder that "
            "`diag run` created, e.g. reports/<run id>"
        )
    nodes_json = run.path / "nodes.json"
    nodes = None
    if nodes_json.is_file():
        try:
            nodes = json.loads(nodes_json.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UsageError(
                f"{nodes_json}: not valid JSON ({e}); the run folder is damaged, rerun `diag nodes`"
            ) from None
    read = run.read_results()
    meta = run.read_run()
    html = render_report(
        meta,
        read.records,
        nodes=nodes,
        damage=damage(run_dir),
        trace=trace_context(run.path, read.records, meta.backends),
        history=_history(run),
    )
    path = Path(out) if out is not None else run.path / "report.html"
    # diag.records.outputs: parents created, a bad path or a full disk one line (exit 2)
    with output_errors(path, "the report", "--out", needed=len(html.encode())) as path:
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(html, encoding="utf-8")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path
