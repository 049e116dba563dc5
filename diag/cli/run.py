"""`diag run`, `diag report` and `diag cache`: run a suite, render a run folder, manage the
ground-truth cache."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from diag.cli._app import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    app,
    cache_app,
    split,
    state,
    write_after_verdict,
)
from diag.errors import EXIT_USAGE, DiagError, UsageError

# The options of `diag run` (module-level so that the command reads as one short signature).
_FUNCTION = typer.Argument(
    None,
    metavar="FILE.py:FUNCTION",
    help="Your own function instead of a suite: FILE.py:FUNCTION or package.module:function, "
    "where FUNCTION returns (fn, args) or (fn, args, kwargs); fn runs on every backend of "
    "its framework and is judged against its float64 evaluation on this machine.",
)
_REFERENCE = typer.Option(
    None,
    "--reference",
    metavar="FILE.py:REF",
    help="With FILE.py:FUNCTION: judge it against your own reference function REF (called "
    "with the same arguments, taken as evaluated) instead of its float64 evaluation.",
)
_SUITE = typer.Option(
    "matmul",
    "--suite",
    "-s",
    help="A shipped suite name (e.g. matmul) or a path to a .toml file.",
)
_BACKEND = typer.Option(
    None,
    "--backend",
    "-b",
    help="Backend(s) to run, repeatable or comma-separated (jax-cpu, jax-gpu, jax-tpu, "
    "torch-cpu, torch-cuda, torch-xla-cpu, torch-xla-tpu, torch-xla-cuda; numpy "
    "emulations of accelerator matmul arithmetic, never "
    "run by default: emu-bf16x1, emu-bf16x3, emu-bf16x6, emu-tf32, emu-tf32x3, "
    "emu-f16). Default: every hardware backend present.",
)
_OUT = typer.Option(Path("reports"), "--out", "-o", help="Folder the run folder is created in.")
_AS_JSON = typer.Option(
    False, "--json", help="Print the run summary and records as JSON on stdout."
)
_REPORT = typer.Option(True, "--report/--no-report", help="Write report.html into the run folder.")
_REPEATS = typer.Option(
    3, "--repeats", min=1, help="Timed runs per case, at most (the median is reported)."
)
_REPEAT_BUDGET = typer.Option(
    0.25,
    "--repeat-budget",
    min=0.0,  # runner.DEFAULT_REPEAT_BUDGET (not imported at start-up)
    help="Seconds of timed runs after which a case stops repeating (at least one run): "
    "a slow case is timed once. 'inf' runs every case --repeats times.",
)
_TIMEOUT = typer.Option(
    600.0, "--timeout", min=0.1, help="Seconds one case may take before its worker is killed."
)
_CACHE_DIR = typer.Option(None, "--cache-dir", help="Ground-truth cache folder.")
_AB = typer.Option(
    None,
    "--ab",
    help="A/B experiment: run every backend again with this setting (NAME=VALUE: an "
    "environment variable, an XLA_FLAGS addition such as "
    "'XLA_FLAGS=--xla_allow_excess_precision=false', or a JAX config option) and "
    "report what it changes. Repeatable.",
)
_PYTHON = typer.Option(
    None,
    "--python",
    help="Run a framework's workers under another Python, FRAMEWORK=PATH (e.g. "
    "torch-xla=/venv/bin/python, since torch_xla needs its own torch; create one with "
    "scripts/torch-xla-env.sh DEST). Same as setting DIAG_PYTHON_TORCH_XLA=PATH. "
    "Repeatable.",
)
_MAX_MEMORY = typer.Option(
    None,
    "--max-memory",
    min=0.001,
    help="Host memory one case may need, in GiB; a suite with a larger case is refused "
    "before anything runs. Default: half of this machine's physical memory.",
)
_TRACE = typer.Option(
    False,
    "--trace",
    help="Profile each case on each backend into the run folder (an XProf logdir) with "
    "per-op summaries and the optimised HLO; see `diag trace RUN_DIR`.",
)
_HISTORY = typer.Option(
    None,
    "--history",
    help="Append the run to this history file (SQLite; created when missing): `diag "
    "history FILE` says since when each record moved; the report plots each moved record.",
)


@app.command()
def run(
    function: str | None = _FUNCTION,
    reference: str | None = _REFERENCE,
    suite: str = _SUITE,
    backend: list[str] | None = _BACKEND,
    out: Path = _OUT,
    as_json: bool = _AS_JSON,
    report: bool = _REPORT,
    repeats: int = _REPEATS,
    repeat_budget: float = _REPEAT_BUDGET,
    timeout: float = _TIMEOUT,
    cache_dir: Path | None = _CACHE_DIR,
    ab: list[str] | None = _AB,
    python: list[str] | None = _PYTHON,
    max_memory: float | None = _MAX_MEMORY,
    trace: bool = _TRACE,
    history: Path | None = _HISTORY,
) -> None:
    """Run a probe suite (or your own function) on every backend present and judge each
    result against exact math (a function: against its float64 evaluation)."""
    from diag import render
    from diag.run import runner
    from diag.worker.host import parse_python

    pythons = parse_python(split(python))  # bad usage exits 2 before anything starts
    _check_backend_names(split(backend))
    loaded = _load(function, reference, suite, timeout, max_memory)
    progress = render.RunProgress(enabled=not as_json)
    if report:
        from diag.report import preload

        preload()  # matplotlib's import overlaps the run instead of following it
    try:
        result = runner.run(
            loaded,
            split(backend),
            out=out,
            repeats=repeats,
            repeat_budget=repeat_budget,
            env=pythons or None,
            case_timeout=timeout,
            cache_dir=str(cache_dir) if cache_dir else None,
            ab=ab,
            max_memory=max_memory,
            argv=["diag"] + sys.argv[1:],
            trace=trace,
            on_start=progress.start,
            on_record=progress.record,
        )
    except runner.Interrupted as e:
        progress.stop()
        n = len(e.result.records)
        why = "terminated (SIGTERM)" if state.terminated else "interrupted"
        render.print_error(f"diag: {why}; {n} finished record(s) kept in {e.result.run_dir}")
        if report:  # what finished, in a report that says the run was cut short
            _report(e.result.run_dir, render)
        raise typer.Exit(EXIT_TERMINATED if state.terminated else EXIT_INTERRUPTED) from None
    finally:
        progress.stop()
    code = result.exit_code
    if history is not None:  # before the report, which plots the records that moved
        from diag.cli.history import append_history, history_for_report

        code = write_after_verdict(
            lambda: append_history(history, result.run_dir), "history", code, err=as_json
        )
        history_for_report(history, result.run_dir)
    report_path = _report(result.run_dir, render) if report else None
    # A report that cannot be written is 2 when every check passed; a 1 or 4 is kept.
    code = EXIT_USAGE if report and report_path is None and not code else code
    _show(result, code, report_path, as_json=as_json, trace=trace)
    raise typer.Exit(code)


def _load(function, reference, suite: str, timeout: float, max_memory):
    """The suite to run: the user's function's, or the suite file's (the code it names
    listed on stderr before any of it is imported)."""
    if reference is not None and function is None:
        raise UsageError("--reference needs FILE.py:FUNCTION, the function it is the reference of")
    if function is not None:
        from diag.plan.suite_fn import function_suite

        return function_suite(function, timeout=timeout, reference=reference or "")
    from diag.plan.suite import load_suite

    return load_suite(suite, max_memory=max_memory, timeout=timeout, announce=_announce_code(suite))


def _announce_code(suite: str):
    """What `load_suite` calls before it imports the code a suite file names: one line on
    stderr per file or module, so that a suite someone handed over never runs code unseen."""
    from diag import render

    def announce(named: list[str]) -> None:
        render.print_line(
            f"diag: suite {suite} imports and runs this Python code on this host (a suite "
            "file is code: run only suites you trust):",
            err=True,
        )
        for spec in named:
            render.print_line(f"    {spec}", err=True)

    return announce


def _check_backend_names(names: list[str] | None) -> None:
    """An unknown backend name is a usage error of `diag run`: its line lists the known ones
    and points to the help that says what each is."""
    from diag.backends import get_spec

    for name in names or []:
        try:
            get_spec(name)
        except UsageError as e:
            raise UsageError(f"{e}; see 'diag run --help'") from None


def _show(result, code: int, report_path: Path | None, *, as_json: bool, trace: bool) -> None:
    """The run's summary on stdout: JSON, or the tables and where the run folder is."""
    from diag import render

    if as_json:
        render.out.print_json(
            json.dumps(
                {
                    "run_dir": str(result.run_dir),
                    "state": result.state,
                    "counts": result.counts,
                    "exit_code": code,
                    "report": str(report_path) if report_path else None,
                    "records": result.records,
                },
                default=str,
            )
        )
        return
    render.out.print(render.summary_table(result.records))
    problems = render.problems_table(result.records)
    if problems is not None:
        render.out.print(problems)
    counts = ", ".join(f"{v} {k}" for k, v in result.counts.items() if v)
    if (line := render.phases_line(result.phases)) is not None:
        render.print_line(line)
    render.print_line(f"diag: {counts or 'no records'}; run folder: {result.run_dir}")
    if report_path:
        render.print_line(f"diag: report: {report_path}")
    if trace:
        render.print_line(f"diag: traces: diag trace {result.run_dir} (--serve for XProf)")


def _report(run_dir: Path, render) -> Path | None:
    """Write a run folder's report.html; when it cannot be written (a full disk), one error
    line and None, so the run's summary and verdict still follow."""
    from diag.report import write_report

    try:
        return write_report(run_dir)
    except DiagError as e:
        render.print_error(str(e))
        return None


@app.command("report")
def report_cmd(
    run_dir: Path = typer.Argument(..., help="A run folder (holding run.json and results.jsonl)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Where to write the HTML file."),
) -> None:
    """Write a self-contained HTML report for a run folder.

    Exits 2 when the folder is damaged: results.jsonl has lines that cannot be read (other
    than a torn last line), or holds fewer records than run.json counts (cut short or
    deleted). The report is still written, and its banner says what is missing.
    """
    from diag import render
    from diag.records.results import read_results
    from diag.report import damage, lost_records, write_report

    if not (run_dir / "run.json").is_file():
        raise DiagError(
            f"{run_dir}: not a diag run folder (no run.json); pass the folder "
            f"that `diag run` printed"
        )
    path = write_report(run_dir, out)
    render.print_line(f"diag: report: {path}")
    for problem in damage(run_dir):
        render.print_error(f"diag: {problem}")
    if read_results(run_dir).unreadable or lost_records(run_dir):
        raise typer.Exit(EXIT_USAGE)


@cache_app.command("info")
def cache_info(
    cache_dir: Path | None = typer.Option(None, "--cache-dir"),
    as_json: bool = typer.Option(False, "--json", help="Print it as JSON (bytes)."),
) -> None:
    """Show where the ground-truth cache is and how big it is."""
    from diag import render
    from diag.oracle.cache import GroundTruthCache, default_cache_dir
    from diag.records.outputs import human_bytes

    info = GroundTruthCache(cache_dir or default_cache_dir()).info()
    if as_json:
        render.out.print_json(json.dumps(info, default=str))
        return
    marked = "" if info["marked"] else " (not marked as diag's cache: `clear` leaves it)"
    render.print_line(
        f"diag: ground-truth cache {info['path']}{marked}: {info['entries']} "
        f"entries, {human_bytes(info['bytes'])}"
    )
    jc = info.get("jax_compilation_cache")
    if jc:
        yours = (
            " (set by JAX_COMPILATION_CACHE_DIR: yours, `clear` leaves it)"
            if jc["set_by"] != "diag"
            else ""
        )
        render.print_line(
            f"diag: JAX compilation cache {jc['path']}{yours}: {jc['files']} file(s), "
            f"{human_bytes(jc['bytes'])}"
        )


@cache_app.command("clear")
def cache_clear(cache_dir: Path | None = typer.Option(None, "--cache-dir")) -> None:
    """Delete diag's cached ground-truth results and JAX programs (only files diag wrote, only
    in a folder diag marked as its cache)."""
    from diag import render
    from diag.oracle.cache import GroundTruthCache, default_cache_dir

    cache = GroundTruthCache(cache_dir or default_cache_dir())
    removed = cache.clear()
    render.print_line(f"diag: removed {removed} cached file(s) from {cache.root}")
