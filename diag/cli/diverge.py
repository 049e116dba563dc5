"""`diag diverge`: the first op (shadow) or tap (compare) where a computation leaves the truth."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer

from diag.cli._app import app
from diag.errors import UsageError, exit_code

if TYPE_CHECKING:
    from diag.diverge import CompareReport, ShadowReport


@app.command("diverge")
def diverge_cmd(
    targets: list[str] = typer.Argument(
        ...,
        help="FILE.py:FUNCTION to shadow (FUNCTION "
        "returns (fn, args), or is run itself), or two: "
        "FILE.py:RUN_A FILE.py:RUN_B to compare by their taps.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
    modules: bool = typer.Option(
        False,
        "--modules",
        help="Compare: also tap every torch nn.Module and flax linen module output by its path.",
    ),
    timeout: float | None = typer.Option(
        None,
        "--timeout",
        min=0.1,
        help="Seconds the targets may run; past them diag stops with exit 4.",
    ),
) -> None:
    """Name the first divergent op or tap, every decision (comparison, argmax, top-k cut,
    mask) taken the other way than float64, and the cause: the op whose computation in a
    wider dtype brings the result back within its allowance, proven by a re-run (exit 1 if a
    divergent op, a decision made by the computation or a result past its threshold is found;
    0 if none, or only decisions forced by rounding, which are printed as warnings; 2 bad usage
    or nothing to compare, 4 the target raised or ran past --timeout)."""
    from diag import diverge, nan, render
    from diag.diverge import attribution
    from diag.diverge.decisions import verdict
    from diag.interp.guard import user_code
    from diag.settings.flags import validate_xla_flags

    if len(targets) > 2:
        raise UsageError(
            f"diag diverge takes one target (shadow) or two (compare), got "
            f"{len(targets)}; see 'diag diverge --help'"
        )
    validate_xla_flags()  # before a target imports jax: a bad flag would abort it (exit 2)
    with user_code(" ".join(targets), diverge.DivergeError, timeout):
        loaded = [nan.load_target(t) for t in targets]
        report: ShadowReport | CompareReport
        cause = None
        if len(loaded) == 1:
            fn, args, kwargs = loaded[0]
            report, cause = attribution.diagnose(fn, args, kwargs, _exact(fn, args, kwargs))
        else:
            runs = [(lambda f=f, a=a, k=k: f(*a, **k)) for f, a, k in loaded]
            report = diverge.compare(runs[0], runs[1], modules=modules)
    if hasattr(report, "decisions"):
        code, why = verdict(report)
    else:
        code, why = exit_code(failed=report.first is not None), ""
    if as_json:
        doc = {
            "targets": list(targets),
            "found": report.first is not None,
            "report": report.to_dict(),
        }
        if hasattr(report, "decisions"):  # a shadow report: the exit status and why
            doc["failed"], doc["verdict"] = code == 1, why
        if cause is not None:
            doc["cause"] = {**cause.fields(), "text": cause.text}
            found = doc["report"]
            if isinstance(found, dict) and isinstance(found.get("first"), dict):
                found["first"].update(cause.fields())  # the finding carries its cause
            for d in _made(found) if cause.decided else []:
                d.update(_decision_fields(cause))
        render.out.print_json(json.dumps(doc))
    else:
        for part in render.diverge_tables(report):
            render.out.print(part)
        if cause is not None:
            render.print_line(f"diag diverge: {_said(report, cause)}{cause.text}")
    raise typer.Exit(code)


def _exact(fn, args, kwargs):
    """The float64 reference's integer outputs (`diag.diverge.attribution.Exact`), computed
    only when the cause search asks: a flipped decision's tokens are held to them."""

    def exact():
        from diag.interp import framework_of
        from diag.userfn import reference
        from diag.userfn.host import integer_references

        return integer_references(reference(fn, args, kwargs, framework_of(fn, args, kwargs)))

    return exact


def _made(found) -> list[dict]:
    """The decisions in a report's dict made by the computation (failures)."""
    from diag.status import Status

    got = found.get("decisions", []) if isinstance(found, dict) else []
    return [d for d in got if isinstance(d, dict) and d.get("verdict") == Status.FAIL]


def _decision_fields(cause) -> dict:
    """The cause's fields on a decision finding: its line is `cause_line` there (the
    decision's own `cause` says whether it was forced by rounding or made by the
    computation)."""
    fields = cause.fields()
    return {"cause_line": fields.pop("cause"), **fields}


def _said(report, cause) -> str:
    """``the flipped argmax at s.py:12 (sample): `` before the cause of a decision's outputs."""
    from diag.status import Status

    made = [d for d in report.decisions if d.verdict == Status.FAIL]
    if not cause.decided or not made:
        return ""
    d = made[0]
    return f"the flipped {d.primitive} at {d.source or 'an unknown line'}: "
