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

from diag import numerics
from diag.errors import UsageError
from diag.report.charts import sweep_groups, sweep_svg, to_float
from diag.report.damage import damage
from diag.report.fields import as_mapping
from diag.report.matrix import cell_id, matrix_context
from diag.report.nodes import report_context as nodes_context
from diag.report.sections import ab_context, sampling_context
from diag.report.settings import report_context as settings_context
from diag.report.trace import trace_context
from diag.report.training import train_context
from diag.results import STATUSES, RunDir, RunMeta, worst_status

__all__ = ["asset", "environment", "render_report", "write_report"]

# A reason longer than this is folded: its first words shown, the full text on demand.
REASON_FOLD = 160

# Columns of the verdict table: (header, metric key or None, kind). `kind` picks formatting
# and sorting: "num" sorts numerically, "text" naturally ("d=64" before "d=128"). The bound
# ratio decides a verdict, so it leads; the ULP and relative figures follow as evidence (an
# element that nearly cancels can be a million ULP off in a correct float32 sum).
# "opt" columns give way below 1250 px wide (report.css), so the reason keeps 30 characters.
METRIC_COLUMNS = (
    ("bound ratio", "bound_ratio", "num"),
    ("max ULP", "max_ulp", "num"),
    ("p99 ULP", "p99_ulp", "opt"),
    ("not corr. rounded", "frac_not_correctly_rounded", "pct opt"),
    ("max rel err", "max_rel_err", "num"),
)

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
}

STATE_NOTE = {
    "running": "This run is still in progress; the report shows the records written so far.",
    "interrupted": "This run was interrupted; the results below are incomplete.",
}


def fmt_num(value: Any) -> str:
    """A metric value, compact: ints as ints, floats to 3 significant digits, "—" if missing.

    Args:
      value: a number, one of the strings ``"nan"``/``"inf"``/``"-inf"`` that records use
        for non-finite floats, another string (shown as is) or None.

    Returns:
      The text for a table cell.
    """
    return numerics.fmt(value)


def fmt_pct(value: Any) -> str:
    """A fraction in [0, 1] as a percentage with 3 significant digits."""
    x = to_float(value)
    if x is None or not math.isfinite(x):
        return fmt_num(value)
    return "0%" if x == 0 else f"{fmt_num(100 * x)}%"


def fmt_seconds(value: Any) -> str:
    """A duration with a unit a person reads at a glance (ns, µs, ms, s)."""
    x = to_float(value)
    if x is None or not math.isfinite(x):
        return fmt_num(value)
    for scale, unit in ((1, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(x) >= scale:
            return f"{fmt_num(float(f'{x / scale:.3g}'))} {unit}"
    return f"{fmt_num(float(f'{x * 1e9:.3g}'))} ns"


def sort_key(value: Any) -> str:
    """The ``data-v`` a numeric cell sorts by: "" when missing, "NaN", "Infinity" or a float.

    The table script puts missing values last and NaN above +inf (a NaN metric means the
    result is garbage, the worst there is).
    """
    x = to_float(value)
    if x is None:
        return ""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return repr(x)


def _verdict_text(verdict: str | None, state: str) -> str:
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


def _device_text(device: Any) -> tuple[str, str]:
    """Short text for a device dict (kind or platform, #id) and its full text for a tooltip."""
    if not isinstance(device, Mapping) or not device:
        return ("—" if not device else str(device)), ""
    name = device.get("kind") or device.get("device_kind") or device.get("platform") or ""
    ident = device.get("id")
    short = f"{name} #{ident}" if ident is not None and name else str(name or ident or "—")
    full = ", ".join(f"{k}={v}" for k, v in device.items())
    return short, full


def _env_items(env: Mapping[str, Any]) -> list[tuple[str, Any]]:
    first = {k: i for i, k in enumerate(ENV_FIRST)}
    keys = list(env)
    keys.sort(key=lambda k: (first.get(str(k).lower(), len(first)),))
    return [(str(k), env[k]) for k in keys]


def _cell(text: str, v: str, title: str = "", bad: bool = False) -> dict[str, Any]:
    return {"text": text, "v": v, "title": title, "bad": bad, "agree": False, "opt": False}


def _row_identity(rec: Mapping[str, Any], index: int) -> dict[str, Any]:
    """The columns every table row has: position, status and its severity rank, what ran."""
    status = str(rec.get("status", ""))
    return {
        "i": index,
        "status": status,
        "rank": STATUSES.index(status) if status in STATUSES else len(STATUSES),
        "op": str(rec.get("op", "")),
        "probe": str(rec.get("probe", "")),
        "case": str(rec.get("case", "")),
    }


def _verdict_row(rec: Mapping[str, Any], index: int) -> dict[str, Any]:
    metrics = as_mapping(rec.get("metrics"))
    timings = as_mapping(rec.get("timings"))
    cells = []
    for _, key, kind in METRIC_COLUMNS:
        value = metrics.get(key)
        cells.append(
            {
                **_cell(fmt_pct(value) if "pct" in kind else fmt_num(value), sort_key(value)),
                "opt": "opt" in kind,
            }
        )
    # Where the "opt" columns give way (narrow windows), the max ULP cell's tooltip has them.
    cells[1]["title"] = "; ".join(
        f"{h}: {c['text']}" for (h, _, kind), c in zip(METRIC_COLUMNS, cells) if "opt" in kind
    )
    cells.append(_nonfinite_cell(metrics))
    run_s = timings.get("run_s_median")
    compile_s = timings.get("compile_s")
    title = f"compile: {fmt_seconds(compile_s)}" if compile_s is not None else ""
    if timings.get("first_call"):
        title = "the op's first call (an eager op's warm-up that took the repeat budget)"
    cells.append(_cell(fmt_seconds(run_s), sort_key(run_s), title=title))
    device, device_full = _device_text(rec.get("device"))
    return {
        **_row_identity(rec, index),
        "backend": str(rec.get("backend", "")),
        "device": device,
        "device_full": device_full,
        "dtype": str(rec.get("dtype", "")),
        "metrics": cells,
        "reason": str(rec.get("reason", "")),
        "fold": _fold(str(rec.get("reason", ""))),
    }


def _nonfinite_cell(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """NaN + Inf in the output: an alarm only where the truth is finite.

    An element that is Inf in the truth and in the output (float16's wide-range matmul
    overflows in 16306 of 16384 elements, correctly) agrees with the truth; `unexpected_nonfinite`
    counts the others. A record without that count is judged by the total.
    """
    nan, inf = to_float(metrics.get("nan_count")), to_float(metrics.get("inf_count"))
    nonfinite = None if nan is None and inf is None else (nan or 0) + (inf or 0)
    unexpected = to_float(metrics.get("unexpected_nonfinite"))
    title = f"NaN: {fmt_num(metrics.get('nan_count'))}, Inf: {fmt_num(metrics.get('inf_count'))}"
    cell = _cell(
        fmt_num(nonfinite),
        sort_key(nonfinite),
        title=title,
        bad=bool(nonfinite) if unexpected is None else bool(unexpected),
    )
    if nonfinite and unexpected is not None:
        agree = nonfinite - unexpected
        cell["title"] += (
            f"; {fmt_num(agree)} non-finite where the truth is too (agreement), "
            f"{fmt_num(unexpected)} where the truth is finite"
        )
        cell["agree"] = not unexpected
    return cell


def _fold(reason: str) -> dict[str, str]:
    """A reason as the table shows it: whole, or its first words and the full text folded."""
    if len(reason) <= REASON_FOLD:
        return {"full": reason, "short": ""}
    cut = reason.rfind(" ", 0, REASON_FOLD - 40)
    return {"full": reason, "short": reason[: cut if cut > 40 else REASON_FOLD - 40] + " …"}


def _agreement_row(rec: Mapping[str, Any], index: int) -> dict[str, Any]:
    metrics = as_mapping(rec.get("metrics"))
    mismatched, elements = to_float(metrics.get("mismatched")), to_float(metrics.get("elements"))
    frac = mismatched / elements if mismatched is not None and elements else None
    return {
        **_row_identity(rec, index),
        "backends": str(rec.get("backend", "")).replace("|", " vs "),
        "dtype": str(rec.get("dtype", "")),
        "max_ulp": {
            "text": fmt_num(metrics.get("max_ulp_between")),
            "v": sort_key(metrics.get("max_ulp_between")),
        },
        "mismatched": {
            "text": fmt_num(metrics.get("mismatched")),
            "v": sort_key(metrics.get("mismatched")),
        },
        "elements": {
            "text": fmt_num(metrics.get("elements")),
            "v": sort_key(metrics.get("elements")),
        },
        "frac": {"text": fmt_pct(frac), "v": sort_key(frac)},
        "reason": str(rec.get("reason", "")),
        "fold": _fold(str(rec.get("reason", ""))),
    }


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

    Returns:
      The complete HTML document as a string.
    """
    from diag import __version__

    run = meta if isinstance(meta, RunMeta) else RunMeta.from_dict(meta)
    records = [r for r in records if isinstance(r, Mapping)]
    counts = Counter(str(r.get("status", "")) for r in records)
    statuses = [s for s in counts if s in STATUSES]
    verdict = worst_status(statuses) if records else None
    state = run.state
    damage = list(damage)
    verdict_text = _verdict_text(verdict, state)
    if damage:
        verdict_text += " (readable records only: see the warning above)"

    probe_rows, agreement_rows, cells = _table_rows(records)
    problems = [
        row
        for row in (_verdict_row(r, i) for i, r in enumerate(records))
        if row["status"] in ("fail", "error")
    ]
    problems.sort(key=lambda row: -row["rank"])

    sweeps = []
    for n, sweep in enumerate(sweep_groups(records)):
        sweeps.append(
            {
                "probe": sweep.probe,
                "op": sweep.op,
                "param": sweep.param,
                "n_series": len(sweep.series),
                "omitted": sweep.omitted,
                "svg": Markup(sweep_svg(sweep, f"sweep-{n}")),
            }
        )

    script = asset("report.js")
    script_hash = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode()
    suite = run.suite
    return (
        environment()
        .get_template("report.html.j2")
        .render(
            run_id=run.run_id or "—",
            state=state,
            state_note=STATE_NOTE.get(state),
            started=_fmt_time(run.started),
            finished=_fmt_time(run.finished) if run.finished is not None else None,
            command_line=run.command_line,
            statuses=STATUSES[::-1],
            counts={s: counts.get(s, 0) for s in STATUSES},
            n_records=len(records),
            verdict=verdict,
            verdict_text=verdict_text,
            damage=damage,
            problems=problems,
            suite=suite.get("name") or suite.get("path"),
            suite_path=suite.get("path") if suite.get("name") else None,
            environment=_env_items(run.environment),
            # What each worker reported at start-up: device, framework version, numerics settings.
            # (their fingerprints and features have sections of their own).
            backends=[
                (
                    name,
                    {k: v for k, v in info.items() if k not in EVIDENCE_KEYS}
                    if isinstance(info, Mapping)
                    else info,
                )
                for name, info in run.backends.items()
            ],
            backends_skipped=list(run.backends_skipped.items()),
            metric_columns=METRIC_COLUMNS,
            rows=probe_rows,
            groups=_groups(probe_rows),
            matrix=matrix_context(records, cells),
            agreement_rows=agreement_rows,
            sweeps=sweeps,
            # Settings findings and precision fingerprints (diag.flags; _settings.html.j2).
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
        )
    )


def _table_rows(records: list[Mapping[str, Any]]) -> tuple[list, list, dict[tuple, str]]:
    """The verdict table's rows (each with its matrix cell's id), the agreement table's rows,
    and the cell index `matrix_context` reads."""
    probe_rows, agreement_rows = [], []
    cells: dict[tuple, str] = {}
    for i, rec in enumerate(records):
        kind = rec.get("kind", "probe")
        if kind == "agreement":
            agreement_rows.append(_agreement_row(rec, i))
        elif kind == "probe":
            probe_rows.append({**_verdict_row(rec, i), "cell": cell_id(rec, cells)})
    return probe_rows, agreement_rows, cells


def _groups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The verdict table's rows grouped by probe (first appearance order), each group with its
    op, worst status and per-status counts for its collapsible header."""
    groups: dict[str, dict[str, Any]] = {}
    for row in rows:
        g = groups.setdefault(row["probe"], {"probe": row["probe"], "op": row["op"], "rows": []})
        g["rows"].append(row)
    for n, g in enumerate(groups.values()):
        statuses = [r["status"] for r in g["rows"]]
        g["id"] = f"g{n}"
        g["worst"] = worst_status(statuses)
        g["counts"] = [(s, statuses.count(s)) for s in STATUSES[::-1] if s in statuses]
    return list(groups.values())


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
    )
    path = Path(out) if out is not None else run.path / "report.html"
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(html, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)
        raise UsageError(
            f"cannot write the report to '{path}': {e.strerror or e}; pass "
            "--out with a writable path"
        ) from None
    return path
