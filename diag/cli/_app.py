"""The typer app every `diag` command registers on, and the state the entry point shares.

Commands live in their own modules of this package (one concern each: run and reports,
devices and environment, tools, the CI gate, ...); `diag.cli` imports them all so that
each registers on `app`, then `diag.cli.main` runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

# no_args_is_help is off: a bare `diag` is a usage error (one line, exit 2), not a help page
# printed by the parser before diag can say anything.
app = typer.Typer(
    add_completion=False,
    no_args_is_help=False,
    pretty_exceptions_enable=False,
    help="diag: do these devices, frameworks and compiler flags compute what the math says?",
)
cache_app = typer.Typer(no_args_is_help=False, help="Inspect or clear the ground-truth cache.")
app.add_typer(cache_app, name="cache")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so every Ctrl-C clean-up path runs for it.

    `diag.run.runner.run` already turns a KeyboardInterrupt into a run folder marked
    `interrupted`, its worker killed and its temp folder removed; SIGTERM deserves the same.
    """


class _State:
    debug = False
    terminated = False


state = _State()


def on_sigterm(signum, frame) -> None:
    if state.terminated:  # a second SIGTERM must not cut the clean-up of the first short
        return
    state.terminated = True
    raise Terminated("terminated by SIGTERM")


def split(values: list[str] | None) -> list[str] | None:
    """Repeatable, comma-separated option values as one list (None when none were given)."""
    if not values:
        return None
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def write_after_verdict(
    write: Callable[[], Any], label: str, code: int, *, err: bool = False
) -> int:
    """Write a file (`--junit`) after the verdict was printed, so that it cannot lose it.

    Returns:
      The exit code: the verdict's, or 2 when the verdict was 0 and the file could not be
      written (its one `diag:` line says why); a 1, 3 or 4 is never hidden behind a 2.
    """
    from diag import render
    from diag.errors import DiagError, exit_code, worst

    try:
        render.print_line(f"diag: {label}: {write()}", err=err)
    except DiagError as e:
        render.print_error(str(e))
        return worst(code, exit_code(bad_file=True))
    return code
