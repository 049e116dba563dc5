"""What `diag preflight` found: findings, what each step did, the one verdict and exit code."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from diag.errors import (
    EXIT_BAD_NODE,
    EXIT_NUMERICAL_FAILURE,
    EXIT_OK,
    EXIT_WORKER_CRASH,
    exit_code,
)
from diag.status import Status

__all__ = ["Finding", "StepResult", "Preflight"]


@dataclass
class Finding:
    """One thing preflight found: a row of the verdict table and a JUnit testcase.

    Attributes:
      step: the step that found it.
      check: what was checked (a rule, a backend's fingerprint, a probe record, a device).
      status: pass, warn, fail, error or skip.
      what: what was found, one line.
      todo: what to do about it ("" when nothing).
    """

    step: str
    check: str
    status: str
    what: str
    todo: str = ""


@dataclass
class StepResult:
    """How a step went, its cost and why.

    `state` is `ran`, `skipped` (budget), `crashed`, or `with probes` (fingerprints
    measured by the probe step's workers, whose cost includes them).
    """

    name: str
    state: str
    seconds: float = 0.0
    expected_s: float = 0.0
    note: str = ""


@dataclass
class Preflight:
    """The result of `preflight`: findings, what each step did, and the one verdict."""

    budget_s: float
    steps: list[StepResult] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    fingerprints: dict[str, list[dict]] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def skipped(self) -> list[str]:
        return [s.name for s in self.steps if s.state == "skipped"]

    @property
    def exit_code(self) -> int:
        """3 bad device, else 4 crash, else 1 numerical failure, else 0 (module docstring)."""
        statuses = {(f.step, f.status) for f in self.findings}
        return exit_code(
            bad_node=("nodes", Status.FAIL) in statuses,
            crashed=any(s == Status.ERROR for _, s in statuses),
            failed=any(s == Status.FAIL for _, s in statuses),
        )

    @property
    def verdict(self) -> str:
        fit = f"fit ({len(self.skipped)} step(s) skipped)" if self.skipped else "fit"
        return {
            EXIT_OK: fit,
            EXIT_NUMERICAL_FAILURE: "numerical problem",
            EXIT_BAD_NODE: "bad device",
            EXIT_WORKER_CRASH: "crashed",
        }[self.exit_code]

    def summary(self) -> str:
        """The last line a person reads: the verdict, the time it took, what was skipped."""
        skipped = f"; skipped: {', '.join(self.skipped)}" if self.skipped else ""
        return (
            f"diag preflight: {self.verdict} ({self.elapsed_s:.1f} s of "
            f"{self.budget_s:g} s){skipped}"
        )

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.findings:
            out[f.status] = out.get(f.status, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "budget_s": self.budget_s,
            "elapsed_s": round(self.elapsed_s, 3),
            "skipped": self.skipped,
            "counts": self.counts(),
            "steps": [asdict(s) for s in self.steps],
            "findings": [asdict(f) for f in self.findings],
            "fingerprints": self.fingerprints,
        }
