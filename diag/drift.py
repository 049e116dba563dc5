"""What `diag check` found: each drift (where, what, old -> new, and the rule it broke) and the
whole result with its exit code. Kept apart from `diag.baseline` (how a baseline is built and
compared) so that renderers and the JUnit writer read a result type, not the comparison.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Check", "Drift", "show"]


@dataclass(frozen=True)
class Drift:
    """One thing that changed: where, what, old and new value, and why it counts.

    Attributes:
      where: `probe | case | backend`, `fingerprint <backend> <precision>/<via>` or
        `setting <name>`.
      what: the metric or field (`status`, `bound_ratio`, `record`, ...).
      old: the baseline's value.
      new: this run's value.
      why: the rule it broke, in words.
    """

    where: str
    what: str
    old: Any
    new: Any
    why: str

    def text(self) -> str:
        return f"{self.where}: {self.what} {show(self.old)} -> {show(self.new)} ({self.why})"


def show(v: Any) -> str:
    """A value as a drift line shows it: 6 significant digits, a digest cut to 12 hex."""
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v):
        return v[:12]
    return json.dumps(v, default=str) if not isinstance(v, str) else v


@dataclass
class Check:
    """What `check` found.

    Attributes:
      drifts: every drift, records first.
      missing: baseline records absent from the run (also drifts).
      extra: run records the baseline does not have (also drifts).
      failures: records of the run that failed or errored; those that failed in the
        baseline too are known failures, the others also appear as status drift.
      key_mismatch: `section: name old -> new` for hardware and versions (settings are drift).
      notes: what was compared and what was skipped, and why.
      compared: records compared.
      results: per run record key: (status of the record, drift texts), for JUnit.
    """

    drifts: list[Drift] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    key_mismatch: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    compared: int = 0
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        """1 when anything drifted, else 0 (the CLI's exit code).

        A record that fails now and failed in the baseline too is a known failure: listed
        (and a JUnit failure), not drift; one that newly fails changed status, which is.
        """
        return 1 if self.drifts else 0
