"""One error root for everything diag raises on purpose, and the one exit-code policy.

The CLI turns a `DiagError` into one line prefixed with ``diag:`` and the exit code the
subclass carries; tracebacks appear only with ``--debug``. Library callers catch the typed
subclasses.

Every command's exit code is computed here (`exit_code`, `worst`, `final`): a result type
(`RunResult`, `Preflight`, a drift check, a node scan) and each CLI command say what they
found, this module says what code that is, so two commands never disagree on what 1 or 3
means.
"""

from __future__ import annotations

__all__ = [
    "DiagError",
    "UsageError",
    "SuiteError",
    "EXIT_OK",
    "EXIT_NUMERICAL_FAILURE",
    "EXIT_USAGE",
    "EXIT_BAD_NODE",
    "EXIT_WORKER_CRASH",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "EXIT_INTERNAL",
    "EXIT_BROKEN_PIPE",
    "PRECEDENCE",
    "ended_by",
    "exit_code",
    "final",
    "worst",
]

# Stable exit codes (documented in the README).
EXIT_OK = 0
EXIT_NUMERICAL_FAILURE = 1
EXIT_USAGE = 2
EXIT_BAD_NODE = 3
EXIT_WORKER_CRASH = 4
# A process cut short (a run folder records it in run.json's `exit_code`): Ctrl-C, 128 + 2;
# SIGTERM (a CI job cancelled, a scheduler's preemption), 128 + 15, as a shell reports them.
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + 15
# diag itself failed (a bug, not the user's input nor the device): sysexits' EX_SOFTWARE,
# apart from 1 (a numerical failure, which a CI gate must be able to trust) and from 2-4.
EXIT_INTERNAL = 70
# stdout's reader went away (`diag env | head -2`): 128 + SIGPIPE, what a shell reports for
# a program the signal ended; never 1, which means a numerical failure.
EXIT_BROKEN_PIPE = 128 + 13

#: What a command found, worst first; a command that found several things exits with the
#: first. A bad device or host (3) outranks everything it may have caused (a crashed worker,
#: a wrong number); a crash (4) outranks a failed check (1), since the checks that did not
#: run may have failed too; any finding outranks a file the command could not read or write
#: after its verdict (2: a report, a JUnit file), which never hides a 1, 3 or 4.
PRECEDENCE = (EXIT_BAD_NODE, EXIT_WORKER_CRASH, EXIT_NUMERICAL_FAILURE, EXIT_USAGE, EXIT_OK)


def worst(*codes: int) -> int:
    """The exit code of several findings: the first of them in `PRECEDENCE` (0 for none)."""
    return min(codes, key=PRECEDENCE.index, default=EXIT_OK)


def exit_code(
    *, bad_node: bool = False, crashed: bool = False, failed: bool = False, bad_file: bool = False
) -> int:
    """The exit code of what a command found.

    Args:
      bad_node: a bad device or host (a suspect device, a misconfigured process).
      crashed: a worker crashed or an op raised: something was not checked.
      failed: a numerical check failed or drifted (or an injected fault went unseen).
      bad_file: a file the command was given or asked to write was unreadable or unwritable.

    Returns:
      3, 4, 1, 2 or 0: the worst finding (`PRECEDENCE`).
    """
    found = (
        (EXIT_BAD_NODE, bad_node),
        (EXIT_WORKER_CRASH, crashed),
        (EXIT_NUMERICAL_FAILURE, failed),
        (EXIT_USAGE, bad_file),
    )
    return worst(*(code for code, yes in found if yes))


def final(code: int, *, terminated: bool) -> int:
    """The code the process exits with: a command SIGTERM cut short exits 143, whatever it
    had found (the job was cancelled; what it found is incomplete)."""
    return EXIT_TERMINATED if terminated else code


def ended_by(e: BaseException) -> int:
    """The code a command ends with when `e` stops it (what run.json records for a run cut
    short): a `DiagError`'s own; Ctrl-C 130, or the code a signal's interrupt carries
    (SIGTERM's 143, `diag.cli`); anything else is a bug in diag, 70."""
    if isinstance(e, DiagError):
        return e.exit_code
    if isinstance(e, KeyboardInterrupt):
        return getattr(e, "exit_code", EXIT_INTERRUPTED)
    return EXIT_INTERNAL


class DiagError(Exception):
    """Root of diag's errors. `exit_code` is what the CLI exits with."""

    exit_code = EXIT_USAGE

    def __str__(self) -> str:
        msg = super().__str__()
        return msg if msg.startswith("diag:") else f"diag: {msg}"


class UsageError(DiagError):
    """Bad command-line usage or arguments (unknown backend, bad option value)."""


class SuiteError(DiagError):
    """A suite file is missing, malformed or has a field of the wrong type.

    The message names the file, the field and what was expected.
    """

    def __init__(self, path: str, field: str, expected: str):
        self.path, self.field, self.expected = str(path), field, expected
        super().__init__(f"{self.path}: field '{field}': {expected}")
