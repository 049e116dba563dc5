"""`diag baseline` and `diag check`: the CI gate on numerical drift."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from diag.cli._app import app, write_after_verdict
from diag.outputs import prepare_output


@app.command("baseline")
def baseline_cmd(
    run_dir: Path = typer.Argument(..., help="A finished run folder (e.g. of `diag run "
                                             "--suite ci`)."),
    out: Path = typer.Option(Path("baseline.json"), "--out", "-o",
                             help="The baseline file to write (commit it)."),
) -> None:
    """Save a run's verdict-relevant metrics, fingerprints and key as a CI baseline."""
    from diag import baseline, render

    data = baseline.build(run_dir)
    path = baseline.save(data, prepare_output(out, "the baseline", "-o"))
    failing = sum(r["status"] in ("fail", "error") for r in data["records"])
    render.print_line(f"diag: baseline of {len(data['records'])} record(s) of suite "
                      f"{data['suite']!r} written to {path}")
    if failing:
        render.print_error(f"diag: {failing} record(s) of this run failed or errored: `diag "
                           "check` lists them as known failures (JUnit failures) and exits 1 "
                           "when any of them changes")


@app.command("check")
def check_cmd(
    run_dir: Path = typer.Argument(..., help="The run folder to check."),
    baseline_file: Path = typer.Option(..., "--baseline", help="A file `diag baseline` wrote."),
    bitwise: bool = typer.Option(False, "--bitwise",
                                 help="Any changed bit is drift (same hardware and versions)."),
    junit: Optional[Path] = typer.Option(None, "--junit",
                                         help="Also write a JUnit XML file: one testcase per "
                                              "(probe, case, backend)."),
) -> None:
    """Compare a run with a baseline: exit 1 naming every drifted record, 0 when none drifted.

    Exits 2 when the baseline or the run folder cannot be used (one line says why).
    """
    from diag import baseline, render

    if junit is not None:  # a bad path is one line before the work, not after it
        prepare_output(junit, "the JUnit file", "--junit")
    data = baseline.load(baseline_file)
    result = baseline.check(run_dir, data, bitwise=bitwise)
    for line in result.key_mismatch:
        render.print_error(f"diag: key mismatch: {line}")
    for note in result.notes:
        render.print_line(f"diag: {note}")
    for drift in result.drifts:
        render.print_error(f"diag: drift: {drift.text()}")
    for failure in result.failures:
        render.print_line(f"diag: failed: {failure}")
    verdict = "drifted" if result.drifts else "no drift"
    render.print_line(f"diag: {verdict}: {result.compared} record(s) compared, "
                      f"{len(result.drifts)} drift(s), {len(result.missing)} missing, "
                      f"{len(result.extra)} new, {len(result.failures)} failed")
    code = result.exit_code
    if junit is not None:  # after the verdict: a file that cannot be written loses nothing
        code = write_after_verdict(lambda: baseline.write_junit(result, junit), "junit", code)
    raise typer.Exit(code)
