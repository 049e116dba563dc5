"""`diag accuracy`: every elementwise function, every 16-bit input, every backend."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from diag.cli._app import app, split

_FUNCTION = typer.Option(
    None,
    "--function",
    "-f",
    help="Functions to measure (repeatable or comma-separated; "
    "default: all of exp, log, log1p, expm1, tanh, sin, cos, sqrt, erf, sigmoid, rsqrt, "
    "reciprocal, gelu, gelu_tanh, silu, softplus).",
)

_DTYPE = typer.Option(
    None, "--dtype", "-d", help="bfloat16, float16, float32 (default: all three)."
)

_BACKEND = typer.Option(
    None,
    "--backend",
    "-b",
    help="Backends (default: jax-cpu and torch-cpu where "
    "installed, torch-xla-cpu where --python names its Python).",
)

_AS_JSON = typer.Option(False, "--json", help="Print the rows as a JSON list.")

_OUT = typer.Option(
    None,
    "--out",
    help="Also write accuracy.json and accuracy.html (click a cell for "
    "its histogram and worst inputs) in this folder.",
)

_SAMPLES = typer.Option(
    1_000_000, "--samples", min=1, help="float32 samples per function, beside the hard cases."
)

_PYTHON = typer.Option(
    None,
    "--python",
    help="FRAMEWORK=PATH: the Python a framework's worker runs under, "
    "e.g. torch-xla=/venv/bin/python.",
)

_NO_SETTINGS = typer.Option(
    False, "--no-settings", help="Leave out the rows of JAX's accuracy= settings."
)

_BASELINE_FILE = typer.Option(
    None, "--baseline", help="Write the rows' figures to this baseline file."
)

_CHECK_FILE = typer.Option(
    None, "--check", help="Compare with a baseline file: exit 1 naming each changed row."
)


@app.command("accuracy")
def accuracy_cmd(
    function: list[str] | None = _FUNCTION,
    dtype: list[str] | None = _DTYPE,
    backend: list[str] | None = _BACKEND,
    as_json: bool = _AS_JSON,
    out: Path | None = _OUT,
    samples: int = _SAMPLES,
    python: list[str] | None = _PYTHON,
    no_settings: bool = _NO_SETTINGS,
    baseline_file: Path | None = _BASELINE_FILE,
    check_file: Path | None = _CHECK_FILE,
) -> None:
    """Measure each backend x function x dtype against the correctly rounded value.

    bfloat16 and float16 at every finite input in the function's domain, float32 at
    --samples samples plus hard cases. A cell is `max ULP / not correctly rounded %`.
    Exits 0; 1 when --check finds a changed row; 2 on a bad name or file; 4 when a
    backend's worker crashed.
    """
    from diag import render
    from diag.accuracy import baseline as accuracy_baseline
    from diag.accuracy.tables import tables
    from diag.records.outputs import prepare_output
    from diag.worker.interpreter import parse_python

    env = parse_python(split(python))
    data = accuracy_baseline.load(check_file) if check_file is not None else None
    if baseline_file is not None:
        prepare_output(baseline_file, "the baseline", "--baseline")
    result = tables(
        split(function),
        split(dtype),
        split(backend),
        samples=samples,
        env=env,
        settings=not no_settings,
        on_progress=lambda line: render.print_line(f"diag accuracy: {line}", err=True),
    )
    rows = _show(result, as_json)
    if out is not None:
        _write_out(out, rows, result)
    if baseline_file is not None:
        accuracy_baseline.save(accuracy_baseline.baseline(result.rows), baseline_file)
        render.print_line(
            f"diag: baseline of {len(rows)} row(s) written to {baseline_file}", err=as_json
        )
    code = 0
    if data is not None:
        code = _report_check(accuracy_baseline.check(result.rows, data), as_json)
    raise typer.Exit(code)


def _show(result, as_json: bool) -> list[dict]:
    """Print the rows (JSON or one table per dtype) and each failed call; return the rows."""
    from diag import render
    from diag.render.accuracy import accuracy_tables

    rows = [r.to_json() for r in result.rows]
    for key, error in result.errors.items():
        render.print_error(f"diag: {key}: the call failed: {error}")
    if as_json:
        render.out.print_json(json.dumps(rows))
    else:
        for table in accuracy_tables(rows, result.errors):
            render.out.print(table)
    return rows


def _write_out(out: Path, rows: list[dict], result) -> None:
    from diag import render
    from diag.records.outputs import prepare_output
    from diag.report.accuracy import write_accuracy

    page = prepare_output(out / "accuracy.html", "the accuracy page", "--out")
    (out / "accuracy.json").write_text(json.dumps(rows, indent=1) + "\n")
    meta = {b: ", ".join(f"{k} {v}" for k, v in vs.items()) for b, vs in result.versions.items()}
    write_accuracy(rows, page, result.errors, meta)
    render.print_line(f"diag: accuracy tables written to {page}", err=True)


def _report_check(found, as_json: bool) -> int:
    from diag import render

    for key, diffs in found.changed.items():
        render.print_line(f"diag: changed: {key}: {'; '.join(diffs)}", err=as_json)
    for key in found.missing:
        render.print_line(f"diag: not measured this time: {key}", err=as_json)
    for key in found.new:
        render.print_line(f"diag: new row (not in the baseline): {key}", err=as_json)
    render.print_line(
        f"diag: {'changed' if found.changed else 'no change'}: {found.compared} row(s) "
        f"compared, {len(found.changed)} changed, {len(found.missing)} not measured, "
        f"{len(found.new)} new",
        err=as_json,
    )
    return found.exit_code
