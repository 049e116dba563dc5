"""`diag nan` and `diag preflight`: find the op that makes a NaN; is this machine fit for a job."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from diag.cli._app import app, write_after_verdict
from diag.errors import exit_code


@app.command("nan")
def nan_cmd(
    target: str = typer.Argument(
        ...,
        help="FILE.py:FUNCTION; FUNCTION returns (fn, args) to "
        "hunt, or is hunted itself with no arguments.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
    timeout: float | None = typer.Option(
        None,
        "--timeout",
        min=0.1,
        help="Seconds the target may run (loading and hunt); past them diag stops with exit 4.",
    ),
) -> None:
    """Find the op that first produced a NaN/Inf reaching FUNCTION's results, and its cause
    where a wider dtype prevents it, proven by a re-run (exit 1 if any)."""
    from diag import nan, render
    from diag.interp.guard import user_code
    from diag.settings.flags import validate_xla_flags

    validate_xla_flags()  # before the target imports jax: a bad flag would abort it (exit 2)
    cause = None
    with user_code(target, nan.NanHuntError, timeout):
        fn, args, kwargs = nan.load_target(target)
        pristine = _copied((fn, args, kwargs))  # a training step updates its model
        report = nan.hunt(fn, args, kwargs)
        if report is not None and pristine is not None:
            cause = _nan_cause(*pristine)
    if as_json:
        doc = {
            "target": target,
            "found": report is not None,
            "reason": nan.reason(report),
            "report": report.to_dict() if report is not None else None,
        }
        if cause is not None:
            doc["cause"] = {**cause.fields(), "text": cause.text}
        render.out.print_json(json.dumps(doc))
    elif report is None:
        render.out.print(f"diag nan: {target}: no NaN/Inf produced", soft_wrap=True, markup=False)
    else:
        render.out.print(render.nan_report_table(report))
        render.out.print(f"diag nan: {nan.reason(report)}", soft_wrap=True, markup=False)
        if cause is not None:
            render.print_line(f"diag nan: {cause.text}")
    raise typer.Exit(exit_code(failed=report is not None))


def _copied(target: tuple):
    """A deep copy of what the hunt will run, or None where it cannot be copied (then the
    hunt runs as before, without a cause)."""
    import copy

    try:
        return copy.deepcopy(target)
    except Exception:  # noqa: BLE001 - any object a user's FUNCTION returns
        return None


def _nan_cause(fn, args, kwargs):
    """The cause of a NaN/Inf the float64 shadow does not make (`diag.diverge.diagnose`: the
    op whose computation in a wider dtype keeps the outputs finite and within their allowance),
    or None: the NaN is the math's own (a log of a negative number), or the shadow cannot run."""
    from diag import diverge

    try:
        return diverge.diagnose(fn, *args, **kwargs)[1]
    except Exception:  # noqa: BLE001 - the hunt's finding stands without a cause
        return None


@app.command("preflight")
def preflight_cmd(
    budget: float = typer.Option(
        60.0,
        "--budget",
        min=0.001,
        help="Seconds it may take: steps that do not fit (by measured cost) are skipped, named.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the verdict as JSON on stdout."),
    junit: Path | None = typer.Option(
        None, "--junit", help="Also write JUnit XML: one testcase per finding."
    ),
    inject: list[str] | None = typer.Option(
        None, "--inject", help="A fault for the node scan to find, as `diag nodes --inject`."
    ),
    probe: list[str] | None = typer.Option(
        None,
        "--probe",
        help="Your own function to check with the probes (FILE.py:FUNCTION or "
        "package.module:function, as `diag run` takes it), judged against its float64 "
        "evaluation. Repeatable.",
    ),
    reference: list[str] | None = typer.Option(
        None,
        "--reference",
        help="Judge the --probe of the same place against your own reference function REF "
        "(FILE.py:REF, called with its arguments; compute it in float64 yourself), as "
        "`diag run --reference`. Repeatable: one per --probe, in order.",
    ),
) -> None:
    """Fit to run a job? Settings, fingerprints, quick probes, a node scan: one verdict.

    Exits 0 fit, 1 numerical problem, 3 bad device, 4 a step crashed, 2 bad usage/flag."""
    from diag import preflight, render
    from diag.records.outputs import prepare_output

    if junit is not None:  # a bad path is one line now, not after the work
        prepare_output(junit, "the JUnit file", "--junit")
    injections: tuple = ()
    if inject:  # diag.nodes is imported where a scan runs (preflight's JAX worker), else not
        from diag import nodes

        injections = tuple(nodes.parse_injection(i) for i in inject)
    result = preflight.preflight(
        budget,
        injections=injections,
        on_step=lambda *a: render.print_line(preflight.progress_line(*a), err=True),
        probes=_paired(probe or [], reference or []),
    )
    if as_json:
        render.out.print_json(json.dumps(result.to_dict(), default=str))
    else:
        render.out.print(render.preflight_table(result))
        render.print_line(result.summary())
    code = result.exit_code
    if junit is not None:  # after the verdict, which a file that cannot be written must not lose
        code = write_after_verdict(
            lambda: preflight.write_junit(result, junit), "junit", code, err=as_json
        )
    raise typer.Exit(code)


def _paired(probes: list[str], references: list[str]) -> tuple:
    """``--probe`` specs, each paired with the ``--reference`` of the same place when given.

    Raises:
        UsageError: references given, but not one per probe.
    """
    from diag.errors import UsageError

    if not references:
        return tuple(probes)
    if len(references) != len(probes):
        raise UsageError(
            f"--reference given {len(references)} time(s) for {len(probes)} --probe: give one "
            "--reference per --probe, in the same order"
        )
    return tuple(zip(probes, references))
