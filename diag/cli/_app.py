"""The typer app every `diag` command registers on, and the state the entry point shares.

Commands live in their own modules of this package (one concern each: run and reports,
devices and environment, tools, the CI gate, ...); `diag.cli` imports them all so that
each registers on `app`, then `diag.cli.main` runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from diag.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_TERMINATED

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "Terminated",
    "app",
    "cache_app",
    "on_sigterm",
    "split",
    "state",
    "unwrap_help",
    "write_after_verdict",
]

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

# Ctrl-C 130, SIGTERM 143 and a bug in diag 70 live beside the other exit codes (diag.errors).
# stdout's reader went away (`diag env | head -2`): 128 + SIGPIPE, what a shell reports for
# a program the signal ended; never 1, which means a numerical failure.
EXIT_BROKEN_PIPE = 128 + 13


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so every Ctrl-C clean-up path runs for it.

    `diag.run.runner.run` already turns a KeyboardInterrupt into a run folder marked
    `interrupted`, its worker killed and its temp folder removed; SIGTERM deserves the same.
    `exit_code` is what the process ends with, which the runner records in run.json.
    """

    exit_code = EXIT_TERMINATED


class _State:
    debug = False
    terminated = False


state = _State()


def on_sigterm(signum, frame) -> None:
    if state.terminated:  # a second SIGTERM must not cut the clean-up of the first short
        return
    state.terminated = True
    raise Terminated("terminated by SIGTERM")


def unwrap_help(typer_app: typer.Typer) -> None:
    """Join the lines of each paragraph of every command's help into one line, so the help
    pages wrap them at the terminal's width: typer's rich help keeps a docstring's own line
    breaks (the command list of `diag --help` broke `diverge`'s summary after "top-k cut,").
    A line that starts a list item (`-`, `*`) or is indented keeps its break."""
    import inspect

    for info in typer_app.registered_commands:
        text = info.help if info.help is not None else inspect.getdoc(info.callback)
        if text:
            info.help = "\n\n".join(_one_line(p) for p in inspect.cleandoc(text).split("\n\n"))
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            unwrap_help(group.typer_instance)


def _one_line(paragraph: str) -> str:
    lines = paragraph.split("\n")
    out = lines[:1]
    for line in lines[1:]:
        if line[:1] in ("-", "*", " ", "\b"):
            out.append(line)
        else:
            out[-1] = f"{out[-1].rstrip()} {line.strip()}"
    return "\n".join(out)


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
    from diag.errors import EXIT_USAGE, DiagError

    try:
        render.print_line(f"diag: {label}: {write()}", err=err)
    except DiagError as e:
        render.print_error(str(e))
        return code or EXIT_USAGE
    return code
