"""`diag bisect`: the first release of a framework, or the first commit of the user's
repository, at which records' outputs change."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from diag.cli._app import app, split

_FUNCTION = typer.Argument(
    None,
    metavar="[FILE.py:FUNCTION]",
    help="Your own function instead of a suite (needed with --git).",
)


@app.command("bisect")
def bisect_cmd(
    function: str | None = _FUNCTION,
    package: str | None = typer.Option(
        None, "--package", help="The framework whose releases to bisect: jax, torch, torch-xla."
    ),
    good: str | None = typer.Option(None, "--good", help="A release whose records are right."),
    bad: str | None = typer.Option(None, "--bad", help="A release whose records changed."),
    git: str | None = typer.Option(
        None, "--git", metavar="GOOD..BAD", help="Bisect your repository's commits instead."
    ),
    suite: str = typer.Option(
        "ci", "--suite", "-s", help="The suite to run (not with a function)."
    ),
    record: list[str] | None = typer.Option(
        None,
        "--record",
        "-r",
        help="Only records whose `probe | case | backend` contains this (repeatable).",
    ),
    backend: list[str] | None = typer.Option(
        None, "--backend", "-b", help="Backend(s) to run (default: the package's CPU backend)."
    ),
    out: Path = typer.Option(
        Path("reports"), "--out", "-o", help="Folder each step's run folder is created in."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Name the first release (--package P --good V --bad W) or commit (--git GOOD..BAD) at
    which the records that differ between the two ends change, with each step's evidence.

    Both ends run first; after them only the records that differ, in at most
    ceil(log2 N) + 2 runs for N releases or commits. Each release gets its own environment,
    kept in diag's cache folder. Exits 0 when it named the change, 2 on bad input (an unknown
    version or commit, a release that does not install, ends that do not differ, a dirty
    repository).
    """
    from diag import render
    from diag.errors import UsageError
    from diag.gate.bisect import bisect

    log = (lambda line: render.print_error(line)) if as_json else render.print_line
    out.mkdir(parents=True, exist_ok=True)
    if git is not None:
        if function is None or package is not None:
            raise UsageError("--git needs FILE.py:FUNCTION and no --package")
        from diag.gate import commits

        repo, rel = commits.repository(function.rpartition(":")[0])
        points = commits.commit_range(repo, git)
        what = "commit"
        observe = commits.observer(repo, rel, function.rpartition(":")[2], split(backend), out, log)
    else:
        if package is None or good is None or bad is None:
            raise UsageError("diag bisect needs --package P --good V --bad W, or --git GOOD..BAD")
        from diag.gate import releases

        if package not in releases.FRAMEWORKS:
            raise UsageError(f"--package {package}: diag bisects {', '.join(releases.FRAMEWORKS)}")
        points = releases.between(package, releases.released_versions(package), good, bad)
        what = f"{package} release"
        observe = releases.observer(
            package, _suite(function, suite), split(backend), out, split(record), log=log
        )
    log(f"diag bisect: {len(points)} {what}(s) from {points[0]} to {points[-1]}")
    found = bisect(points, observe)
    if as_json:
        render.out.print_json(json.dumps(found.to_json(), default=str))
        raise typer.Exit(0)
    _show(found, what)
    if git is not None:
        render.print_line(f"diag: {found.first_bad}: {commits.subject(repo, found.first_bad)}")
    raise typer.Exit(0)


def _show(found, what: str) -> None:
    """Each step with its evidence, the first change, and a second change when there is one."""
    from diag import render

    for step in found.steps:
        render.print_line(f"diag: step: {step.text()}")
        for line in step.evidence:
            render.print_line(f"    {line}")
    render.print_line(
        f"diag: first {what} that changes: {found.first_bad} (last like the good end: "
        f"{found.last_good}); {len(found.changed)} record(s) changed there, "
        f"{found.runs} run(s) for {len(found.points)} {what}(s)"
    )
    for key in found.changed:
        render.print_line(f"    {key}")
    if found.later:
        render.print_line(
            f"diag: the bad end {found.points[-1]} differs from {found.first_bad} too: "
            f"{len(found.later)} record(s) changed again after it (the bad end's step above "
            "holds their evidence)"
        )
        for key in found.later:
            render.print_line(f"    {key}")


def _suite(function: str | None, suite: str):
    from diag.plan.suite import load_suite

    if function is None:
        return load_suite(suite)
    from diag.plan.suite_fn import function_suite

    return function_suite(function)
