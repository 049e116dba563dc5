"""`diag trace`: a traced run's per-op summary in the terminal, or XProf's UI on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import typer

from diag.cli._app import app
from diag.errors import UsageError


@app.command("trace")
def trace_cmd(
    run_dir: Path = typer.Argument(..., help="A run folder written by `diag run --trace`."),
    serve: bool = typer.Option(
        False,
        "--serve",
        help="Start XProf's web UI over the folder, bound to 127.0.0.1 "
        "only, print its URL and serve until Ctrl-C.",
    ),
    port: int = typer.Option(
        8791, "--port", min=0, max=65535, help="Port for --serve (0: any free port)."
    ),
    top: int = typer.Option(5, "--top", min=1, help="Ops shown per case."),
) -> None:
    """Show each traced case's top ops (time, dtype, shape) beside its error figures.

    Exits 2 when the folder is not a run folder or holds no traces.
    """
    from diag import render
    from diag.records.results import RunDir
    from diag.report.trace import trace_context

    run = RunDir(run_dir)
    if not run.run_json.is_file():
        raise UsageError(
            f"{run_dir}: not a diag run folder (no run.json); pass the folder "
            f"that `diag run --trace` printed"
        )
    context = trace_context(run.path, run.read_results().records, run.read_run().backends)
    if context is None:
        raise UsageError(
            f"{run_dir}: the run has no traces; run the suite again with `diag run --trace`"
        )
    if serve:
        from diag.trace import serve as xprof

        xprof.serve(
            run.path,
            port,
            on_ready=lambda url: render.print_line(
                f"diag: XProf on {url} (this machine only; Ctrl-C stops it)"
            ),
        )
        return
    for item in render.trace_tables(context, top=top):
        render.out.print(item)
    render.print_line(
        f"diag: {len(context['cases'])} traced case(s) in {run.path}; "
        f"timelines: diag trace {run.path} --serve"
    )
