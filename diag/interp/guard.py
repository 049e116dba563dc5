"""Running a user's function from the command line: a time limit, and no borrowed exit code.

`diag nan` and `diag diverge` run the user's own code in diag's process. Two things must not
leak out of it: a function that never returns (the command would hang with no verdict), and
a `sys.exit(3)` inside it (diag would exit 3, which the README reserves for a bad host).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

from diag.errors import EXIT_WORKER_CRASH, DiagError


@contextlib.contextmanager
def user_code(label: str, error: type[DiagError], timeout: float | None = None) -> Iterator[None]:
    """Run the block as the user's code.

    Args:
        label: what runs, for the messages (``funcs.py:step``).
        error: the error a `SystemExit` inside the block becomes (the command's own).
        timeout: seconds; past it the process prints one ``diag:`` line on stderr and ends
            with exit code 4 (`EXIT_WORKER_CRASH`: the code under test did not finish). A
            thread cannot be stopped from outside, and XLA or BLAS code ignores Python's
            signals, so the process ends itself. None: no limit.

    Raises:
        error: the block called `sys.exit` (or raised `SystemExit`).
    """
    timer = None
    if timeout is not None:
        timer = threading.Timer(timeout, _expire, args=(label, timeout))
        timer.daemon = True
        timer.start()
    try:
        yield
    except SystemExit as e:
        raise error(
            f"{label} called sys.exit({e.code!r}); diag stopped there, with no verdict"
        ) from e
    finally:
        if timer is not None:
            timer.cancel()


def _expire(label: str, timeout: float) -> None:
    sys.stderr.write(
        f"diag: {label} did not finish within --timeout {timeout:g} s; stopped "
        f"(exit {EXIT_WORKER_CRASH})\n"
    )
    sys.stderr.flush()
    os._exit(EXIT_WORKER_CRASH)
