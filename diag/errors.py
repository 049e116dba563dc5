"""One error root for everything diag raises on purpose.

The CLI turns a `DiagError` into one line prefixed with ``diag:`` and the exit code the
subclass carries; tracebacks appear only with ``--debug``. Library callers catch the typed
subclasses.
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
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
]

# Stable exit codes (documented in the README).
EXIT_OK = 0
EXIT_NUMERICAL_FAILURE = 1
EXIT_USAGE = 2
EXIT_BAD_NODE = 3
EXIT_WORKER_CRASH = 4
# A process cut short (a run folder records it in run.json's `exit_code`): Ctrl-C; SIGTERM
# (a CI job cancelled, a scheduler's preemption), 128 + 15 as a shell reports it.
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
# diag itself failed (a bug, not the user's input nor the device): sysexits' EX_SOFTWARE,
# apart from 1 (a numerical failure, which a CI gate must be able to trust) and from 2-4.
EXIT_INTERNAL = 70


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
