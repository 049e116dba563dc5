"""The `diag` command line: parse, call the library, render, set the exit code.

Exit codes (stable, documented in the README): 0 all good; 1 a numerical check failed;
2 bad usage or bad input file; 3 a bad device or host was found; 4 a worker crashed or an op
raised; 130 interrupted (Ctrl-C), the run folder keeps every finished record.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from diag.errors import DiagError, EXIT_USAGE

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="diag: do these devices, frameworks and compiler flags compute what "
                       "the math says?")
cache_app = typer.Typer(no_args_is_help=True, help="Inspect or clear the ground-truth cache.")
app.add_typer(cache_app, name="cache")

EXIT_INTERRUPTED = 130
_debug = False


def _split(values: Optional[List[str]]) -> Optional[List[str]]:
    if not values:
        return None
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


@app.command()
def run(
    suite: str = typer.Option("matmul", "--suite", "-s",
                              help="A shipped suite name (e.g. matmul) or a path to a .toml file."),
    backend: Optional[List[str]] = typer.Option(
        None, "--backend", "-b",
        help="Backend(s) to run, repeatable or comma-separated (jax-cpu, jax-gpu, jax-tpu, "
             "torch-cpu, torch-cuda). Default: every backend present."),
    out: Path = typer.Option(Path("reports"), "--out", "-o",
                             help="Folder the run folder is created in."),
    as_json: bool = typer.Option(False, "--json",
                                 help="Print the run summary and records as JSON on stdout."),
    report: bool = typer.Option(True, "--report/--no-report",
                                help="Write report.html into the run folder."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Timed repeats per case."),
    timeout: float = typer.Option(600.0, "--timeout", min=0.1,
                                  help="Seconds one case may take before its worker is killed."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir",
                                             help="Ground-truth cache folder."),
) -> None:
    """Run a probe suite on every backend present and judge each result against exact math."""
    from diag import render, runner

    progress = render.RunProgress(enabled=not as_json)
    try:
        result = runner.run(suite, _split(backend), out=out, repeats=repeats,
                            case_timeout=timeout, cache_dir=str(cache_dir) if cache_dir else None,
                            argv=["diag"] + sys.argv[1:], on_start=progress.start,
                            on_record=progress.record)
    except runner.Interrupted as e:
        progress.stop()
        n = len(e.result.records)
        render.print_error(f"diag: interrupted; {n} finished record(s) kept in {e.result.run_dir}")
        raise typer.Exit(EXIT_INTERRUPTED)
    finally:
        progress.stop()
    report_path = None
    if report:
        from diag.report import write_report

        report_path = write_report(result.run_dir)
    if as_json:
        render.out.print_json(json.dumps({
            "run_dir": str(result.run_dir), "state": result.state, "counts": result.counts,
            "exit_code": result.exit_code, "report": str(report_path) if report_path else None,
            "records": result.records}, default=str))
    else:
        render.console.print(render.summary_table(result.records))
        problems = render.problems_table(result.records)
        if problems is not None:
            render.console.print(problems)
        counts = ", ".join(f"{v} {k}" for k, v in result.counts.items() if v)
        render.console.print(f"diag: {counts or 'no records'}; run folder: {result.run_dir}")
        if report_path:
            render.console.print(f"diag: report: {report_path}")
    raise typer.Exit(result.exit_code)


@app.command("report")
def report_cmd(
    run_dir: Path = typer.Argument(..., help="A run folder (holding run.json and results.jsonl)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Where to write the HTML file."),
) -> None:
    """Write a self-contained HTML report for a run folder."""
    from diag import render
    from diag.report import write_report

    if not (run_dir / "run.json").is_file():
        raise DiagError(f"{run_dir}: not a diag run folder (no run.json); pass the folder "
                        f"that `diag run` printed")
    path = write_report(run_dir, out)
    render.console.print(f"diag: report: {path}")


@cache_app.command("info")
def cache_info(cache_dir: Optional[Path] = typer.Option(None, "--cache-dir")) -> None:
    """Show where the ground-truth cache is and how big it is."""
    from diag import render
    from diag.oracle.cache import GroundTruthCache, default_cache_dir

    info = GroundTruthCache(cache_dir or default_cache_dir()).info()
    render.out.print_json(json.dumps(info, default=str))


@cache_app.command("clear")
def cache_clear(cache_dir: Optional[Path] = typer.Option(None, "--cache-dir")) -> None:
    """Delete every cached ground-truth result."""
    from diag import render
    from diag.oracle.cache import GroundTruthCache, default_cache_dir

    cache = GroundTruthCache(cache_dir or default_cache_dir())
    removed = cache.clear()
    render.console.print(f"diag: removed {removed} cached file(s) from {cache.root}")


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors.")) -> None:
    global _debug
    _debug = debug


def main() -> None:
    """Console-script entry point: DiagError -> one `diag:` line and its exit code."""
    try:
        # With standalone_mode=False click returns the code a command exits with.
        code = app(standalone_mode=False)
    except DiagError as e:
        if _debug:
            raise
        from diag import render

        render.print_error(str(e))
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(EXIT_INTERRUPTED)
    except Exception as e:  # click usage errors arrive here in standalone_mode=False
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(e.exit_code if e.exit_code else EXIT_USAGE)
        raise
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
