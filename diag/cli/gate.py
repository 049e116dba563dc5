"""`diag baseline` and `diag check`: the CI gate on numerical drift."""

from __future__ import annotations

from pathlib import Path

import typer

from diag.cli._app import app, write_after_verdict
from diag.cli.history import append_history, with_series
from diag.gate.drift import show
from diag.records.outputs import prepare_output


@app.command("baseline")
def baseline_cmd(
    run_dir: Path = typer.Argument(
        ..., help="A finished run folder (e.g. of `diag run --suite ci`)."
    ),
    out: Path = typer.Option(
        Path("baseline.json"), "--out", "-o", help="The baseline file to write (commit it)."
    ),
) -> None:
    """Save a run's verdict-relevant metrics, fingerprints and key as a CI baseline."""
    from diag import render
    from diag.gate import baseline

    data = baseline.build(run_dir)
    path = baseline.save(data, prepare_output(out, "the baseline", "-o"))
    failing = sum(r["status"] in ("fail", "error") for r in data["records"])
    render.print_line(
        f"diag: baseline of {len(data['records'])} record(s) of suite "
        f"{data['suite']!r} written to {path}"
    )
    if failing:
        render.print_error(
            f"diag: {failing} record(s) of this run failed or errored: `diag "
            "check` lists them as known failures (JUnit failures) and exits 1 "
            "when any of them changes"
        )


@app.command("check")
def check_cmd(
    run_dir: Path = typer.Argument(..., help="The run folder to check."),
    baseline_file: Path = typer.Option(..., "--baseline", help="A file `diag baseline` wrote."),
    bitwise: bool = typer.Option(
        False, "--bitwise", help="Any changed bit is drift (same hardware and versions)."
    ),
    junit: Path | None = typer.Option(
        None,
        "--junit",
        help="Also write a JUnit XML file: one testcase per (probe, case, backend).",
    ),
    html: Path | None = typer.Option(
        None,
        "--html",
        help="Also write the drift view: one self-contained HTML file, each drift under its cause.",
    ),
    history: Path | None = typer.Option(
        None,
        "--history",
        help="Also append the run to this history file (SQLite; created when missing): "
        "`diag history FILE` says since when each record moved.",
    ),
) -> None:
    """Compare a run with a baseline: exit 1 naming every drifted record, 0 when none drifted.

    Every line goes to stdout (`diag check > out.txt` keeps what drifted); each cause of drift
    is said once, with what it explains indented under it. Exits 2 when the baseline or the
    run folder cannot be used (one line says why).
    """
    from diag import render
    from diag.gate import baseline

    if junit is not None:  # a bad path is one line before the work, not after it
        prepare_output(junit, "the JUnit file", "--junit")
    data = baseline.load(baseline_file)
    result = baseline.check(run_dir, data, bitwise=bitwise)
    for line in result.key_mismatch:
        render.print_line(f"diag: key mismatch: {line}")
    for note in result.notes:
        render.print_line(f"diag: {note}")
    for cause in result.causes():
        render.print_line(f"diag: drift: {cause.text()}")
        for line in _explained(cause):
            render.print_line(f"    {line}")
    for failure in result.failures:
        known = " (known: failed in the baseline too)" if failure in result.known_failures else ""
        render.print_line(f"diag: failed: {failure}{known}")
    verdict = "drifted" if result.drifts else "no drift"
    render.print_line(
        f"diag: {verdict}: {result.compared} record(s) compared, "
        f"{len(result.causes())} cause(s) of {len(result.drifts)} drift(s), "
        f"{len(result.missing)} missing, {len(result.extra)} new, "
        f"{len(result.failures)} failed"
    )
    code = result.exit_code
    if history is not None:  # before the drift view, which plots each drifted record's series
        code = write_after_verdict(lambda: append_history(history, run_dir), "history", code)
    if junit is not None:  # after the verdict: a file that cannot be written loses nothing
        code = write_after_verdict(lambda: baseline.write_junit(result, junit), "junit", code)
    if html is not None:
        from diag.report import write_drift_view

        code = write_after_verdict(
            lambda: write_drift_view(
                with_series(result.view(), history),
                html,
                run_dir=str(run_dir),
                baseline=str(baseline_file),
            ),
            "drift view",
            code,
        )
    raise typer.Exit(code)


# Detail lines shown under a cause in the terminal; the drift view (--html) lists them all.
_SHOWN = 8


def _explained(cause) -> list[str]:
    """The indented lines under a cause: a record's own other drifts in full, else the
    arithmetic fields and the records it explains (one line per record, its drifts joined),
    at most `_SHOWN`, then how many more."""
    if cause.head.where in cause.records:  # a record nothing else explains
        return [d.text() for d in cause.records[cause.head.where]]
    lines = [d.text() for d in cause.arithmetic]
    lines += [
        f"{k}: " + ", ".join(f"{d.what} {show(d.old)} -> {show(d.new)}" for d in ds)
        for k, ds in cause.records.items()
    ]
    if len(lines) > _SHOWN:
        lines[_SHOWN:] = [f"... and {len(lines) - _SHOWN} more (--html lists them all)"]
    return lines
