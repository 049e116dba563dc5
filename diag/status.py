"""The one order of record statuses: what a status may be, which is worse, what a verdict is.

Every part of diag that lists, counts, sorts or sums statuses (the record schema, run.json's
counts and verdict, `diag preflight`'s findings, the terminal summary and the HTML report)
takes its order from here, so a new status or a changed severity is one edit.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CHECKED",
    "COUNTED",
    "FAILURES_FIRST",
    "STATUSES",
    "severity",
    "worst_status",
]

# Display order (best to worst, a skip beside the passes). Severity is `worst_status`'s
# business: a skip checked nothing, so it never outranks a checked result.
STATUSES = ("pass", "skip", "warn", "fail", "error")
#: The statuses of records that checked something, from best to worst.
CHECKED = ("pass", "warn", "fail", "error")
#: The order of run.json's `counts` (checked ones best to worst, then the skips).
COUNTED = (*CHECKED, "skip")
#: The trace view's order: a wrong number first (its compiled program is what explains it),
#: then an op that raised, a warning, the passes and the skips.
FAILURES_FIRST = ("fail", "error", "warn", "pass", "skip")


def severity(status: str) -> int:
    """A status's place in `STATUSES` (0 for `pass`, higher is worse), 0 for an unknown one:
    the key that sorts records worst first (`sorted(..., key=lambda r: -severity(...))`)."""
    return STATUSES.index(status) if status in STATUSES else 0


def worst_status(statuses: Iterable[str]) -> str:
    """The verdict of a set of records: the worst status among those that checked something.

    The one verdict function of diag: run.json's `verdict`, the terminal summary and the HTML
    report all use it. A `skip` checked nothing, so it never outranks a checked result (130
    passes and 3 skipped backends are a pass); the verdict is `skip` ("nothing was checked")
    only when no record checked anything, including when there are no records at all.

    Args:
      statuses: status strings (members of STATUSES).

    Returns:
      One of STATUSES.
    """
    checked = [s for s in statuses if s in CHECKED]
    return max(checked, key=CHECKED.index) if checked else "skip"
