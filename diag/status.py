"""The one status type and its order: what a status may be, which is worse, what a verdict is.

Every part of diag that writes, lists, counts, sorts or sums statuses (the judges, the
record schema, run.json's counts and verdict, `diag preflight`'s findings, the terminal
summary and the HTML report) names them as `Status` members and takes their order from
here, so a new status or a changed severity is one edit. `Status` is a `str` enum: a member
equals its word (``Status.FAIL == "fail"``), is written to JSON as the word and formats as
it, so records read back from a file (plain strings) and records made in this process
compare, sort and serialise alike.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

__all__ = [
    "CHECKED",
    "COUNTED",
    "FAILURES_FIRST",
    "STATUSES",
    "Status",
    "severity",
    "worst_status",
]


class Status(str, enum.Enum):
    """A record's (or a finding's) status: what the check found."""

    PASS = "pass"  # within what the op and dtype promise
    WARN = "warn"  # within what two correct backends may differ, or a looser promise
    FAIL = "fail"  # a wrong number: beyond the bound
    ERROR = "error"  # the op raised or its worker crashed: nothing was checked
    SKIP = "skip"  # not run here (no such hardware, not applicable)

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:  # a message listing statuses reads ('pass', 'skip', ...)
        return repr(self.value)

    def __format__(self, spec: str) -> str:  # f"{status:>5}" pads the word, on every Python
        return format(self.value, spec)


# Display order (best to worst, a skip beside the passes). Severity is `worst_status`'s
# business: a skip checked nothing, so it never outranks a checked result.
STATUSES = (Status.PASS, Status.SKIP, Status.WARN, Status.FAIL, Status.ERROR)
#: The statuses of records that checked something, from best to worst.
CHECKED = (Status.PASS, Status.WARN, Status.FAIL, Status.ERROR)
#: The order of run.json's `counts` (checked ones best to worst, then the skips).
COUNTED = (*CHECKED, Status.SKIP)
#: The trace view's order: a wrong number first (its compiled program is what explains it),
#: then an op that raised, a warning, the passes and the skips.
FAILURES_FIRST = (Status.FAIL, Status.ERROR, Status.WARN, Status.PASS, Status.SKIP)


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
    return max(checked, key=CHECKED.index) if checked else Status.SKIP
