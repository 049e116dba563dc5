"""The `diag` command line: parse, call the library, render, set the exit code.

Exit codes (stable, documented in the README): 0 all good; 1 a numerical check failed;
2 bad usage or bad input file; 3 a bad device or host was found; 4 a worker crashed or an op
raised; 70 diag itself failed (a bug: one line, the traceback with --debug); 130 interrupted
(Ctrl-C) and 143 terminated (SIGTERM), the run folder keeps every finished record; 141 the
reader of stdout went away (a broken pipe, `diag env | head -2`), as a shell reports SIGPIPE.

What the user sees on an error is always one line starting ``diag:`` on stderr: usage
errors are caught through typer's own exception (`typer.TyperException`, the root of the
click that typer vendors; the `click` package itself may not be installed).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NoReturn, cast

import typer

from diag.cli import bisect, devices, diverge, gate, history, run, tools, trace  # noqa: F401 - each registers its commands  # noqa: F401 - `diag diverge`, `diag trace`
from diag.cli._app import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    app,
    on_sigterm,
    state,
    unwrap_help,
)
from diag.errors import EXIT_USAGE, DiagError

unwrap_help(app)  # after every command module registered its commands


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors.")) -> None:
    state.debug = debug


#: How close an unknown option must be to a known one (difflib's ratio of the names without
#: dashes) for the usage line to suggest it: `--outt` -> `--out` (0.86), but not `--bogus`
#: -> `--out` (0.5), which click's own cut-off (0.6 with the dashes) suggests.
_SUGGEST = 0.8


def _message(e: Exception) -> str:
    """A usage error's text; an unknown option's suggestions kept only when they are close."""
    name, possible = getattr(e, "option_name", None), getattr(e, "possibilities", None)
    if name is None or possible is None:
        return e.format_message() if hasattr(e, "format_message") else str(e)
    import difflib

    close = [
        p
        for p in sorted(possible)
        if difflib.SequenceMatcher(None, name.lstrip("-"), p.lstrip("-")).ratio() >= _SUGGEST
    ]
    return f"no such option: {name}" + (f" (did you mean {' or '.join(close)}?)" if close else "")


def _usage_line(e: Exception) -> str:
    """A typer/click usage error as one `diag:` line that says where help is."""
    ctx = getattr(e, "ctx", None)
    if ctx is not None and ctx.command_path:
        where = ctx.command_path
    else:  # the parser raised before it made a context: the command is the first known word
        # (typer's command decorator always sets the callback)
        names: list[str | None] = [
            c.name or cast(Callable[..., Any], c.callback).__name__ for c in app.registered_commands
        ]
        names += [g.name for g in app.registered_groups]
        word = next((a for a in sys.argv[1:] if a in names), None)
        where = f"diag {word}" if word else "diag"
    text = _message(e).strip()
    text = " ".join(text.split()).rstrip(".")
    if not text:
        text = "missing command"
    text = text[0].lower() + text[1:]
    return f"diag: {text}; see '{where} --help'"


def _exit_code(code: int) -> int:
    return EXIT_TERMINATED if state.terminated else code


def main() -> None:
    """Console-script entry point: every outcome is an exit code, every error one line.

    DiagError -> its message and exit code; a usage error -> one line naming it and where
    help is, exit 2; Ctrl-C -> 130, SIGTERM -> 143; anything else is a bug in diag -> one line
    and exit 70. `--debug` adds the traceback (the exit code stays the same).
    """
    import signal
    import traceback

    debug = "--debug" in sys.argv[1 : sys.argv.index("--") if "--" in sys.argv else None]
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        # With standalone_mode=False typer returns the code a command exits with and lets
        # usage errors through to us; a KeyboardInterrupt comes back as 130.
        code = app(standalone_mode=False, prog_name="diag")
    except DiagError as e:
        if state.debug or debug:
            traceback.print_exc()
        _fail(str(e))
        sys.exit(_exit_code(e.exit_code))
    except typer.Exit as e:
        sys.exit(_exit_code(e.exit_code))
    except BrokenPipeError:  # the reader went away (`diag env | head -2`): as a shell says
        _quiet_stdout()
        sys.exit(_exit_code(EXIT_BROKEN_PIPE))
    except (typer.Abort, KeyboardInterrupt) as e:
        # click turns an EOFError into Abort as it does Ctrl-C: an EOFError is a bug to
        # report (e.g. a file cut short), never a fake interruption.
        if isinstance(e.__cause__, EOFError):
            _internal(e.__cause__, state.debug or debug)
        sys.exit(_exit_code(EXIT_INTERRUPTED))
    except typer.TyperException as e:  # bad usage: unknown option/command, bad value
        if state.debug or debug:
            traceback.print_exc()
        _fail(_usage_line(e))
        sys.exit(_exit_code(EXIT_USAGE))
    except Exception as e:  # a bug in diag: say so in one line, keep the traceback for --debug
        _internal(e, state.debug or debug)
    sys.exit(_exit_code(code if isinstance(code, int) else 0))


def _internal(e: BaseException, debug: bool) -> NoReturn:
    """A bug in diag: one line naming the exception, the traceback with --debug, exit 70."""
    import traceback

    if debug:
        traceback.print_exception(e)
    first = " ".join(str(e).split())[:300]
    _fail(
        f"diag: internal error: {type(e).__name__}{': ' + first if first else ''}; "
        "rerun with --debug for the traceback and report it"
    )
    sys.exit(_exit_code(EXIT_INTERNAL))


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush raises nothing more."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _fail(line: str) -> None:
    """Print one error line on stderr; plain text if rich itself is what failed."""
    try:
        from diag import render

        render.print_error(line)
    except Exception:  # noqa: BLE001 - the last resort must not raise
        print(line, file=sys.stderr)


if __name__ == "__main__":
    main()
