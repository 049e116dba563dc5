"""JUnit XML for CI systems: `diag check`'s result as one testcase per (probe, case, backend).

Written with junitparser (the XML is a library's business); the tests validate the file against
the Jenkins/Ant JUnit schema.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from diag.status import Status

if TYPE_CHECKING:
    from diag.gate.drift import Check

__all__ = ["save", "write"]


def write(result: Check, path: str | os.PathLike, *, name: str = "diag check") -> Path:
    """One testcase per (probe, case, backend): drift and fail/error records are failures.

    Settings, fingerprint, feature and backend drift, which belong to no record, are one testcase
    per cause (`diag.gate.drift.causes`) in a `settings` class. Written with junitparser (the
    XML is a library's business).

    Args:
      result: what `check` found.
      path: the file to write.
      name: the test suite's name.

    Returns:
      The file written.
    """
    from junitparser import Failure, Skipped, TestCase, TestSuite

    suite = TestSuite(name)
    for k, r in result.results.items():
        probe, case, backend = (k.split(" | ") + ["", ""])[:3]
        tc = TestCase(f"{case} [{backend}]", classname=probe)
        problems = list(r["drifts"])
        if r["status"] in (Status.FAIL, Status.ERROR):
            problems.insert(0, f"{r['status']}: {r['reason']}")
        if problems:
            tc.result = [Failure(problems[0][:500], "drift" if r["drifts"] else r["status"])]
            tc.system_out = "\n".join(problems)
        elif r["status"] == Status.SKIP:
            tc.result = [Skipped(str(r.get("reason") or "skipped")[:500])]
        suite.add_testcase(tc)
    # A setting, a backend's arithmetic or a backend: one testcase per cause, its message the
    # cause's one line (the same change elsewhere and what it explains folded in).
    from diag.gate.drift import CAUSE_KINDS

    for cause in result.causes():
        if cause.head.where.startswith(CAUSE_KINDS):
            tc = TestCase(cause.head.where, classname="settings")
            tc.result = [Failure(cause.text()[:500], "drift")]
            tc.system_out = "\n".join(
                d.text() for d in [cause.head, *cause.same, *cause.arithmetic]
            )
            suite.add_testcase(tc)
    return save(suite, path)


def save(suite, path: str | os.PathLike) -> Path:
    """Write one junitparser `TestSuite` as a JUnit XML file (what CI systems read)."""
    from junitparser import JUnitXml

    from diag.records.outputs import output_errors

    xml = JUnitXml()
    xml.add_testsuite(suite)
    with output_errors(path, "the JUnit file", "--junit") as path:
        xml.write(str(path), pretty=True)
    return path
