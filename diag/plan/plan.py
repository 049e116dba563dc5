"""The plan as a value: which case runs on which backend, decided once.

A suite's cases times the chosen backends, with each pair's reason for not applying
(`diag.backends.not_applicable`: torch has no per-op matmul precision, a JAX user's function
does not run on torch) or None where the case runs. The runner (which inputs to write, which
backends to start, each worker's cases), the progress count (`records`) and the agreement
records owed at the end (`pairs`) all read this one value, so they cannot disagree about
what was planned.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from diag.backends import BackendSpec, not_applicable
from diag.errors import UsageError
from diag.plan.cases import Case, Suite

__all__ = ["Plan"]


@dataclass(frozen=True)
class Plan:
    """A suite's cases x backends, each pair's not-applicable reason computed once.

    Attributes:
      suite: the suite.
      specs: the backends, in run order (an A/B run's B sides included, `with_specs`).
      why_not: (case id, backend name) -> why the case does not apply to the backend, or None
        where it runs. Keyed by name: a B side runs what its A side runs.
    """

    suite: Suite
    specs: tuple[BackendSpec, ...]
    why_not: Mapping[tuple[str, str], str | None]

    @classmethod
    def of(cls, suite: Suite, specs: list[BackendSpec]) -> Plan:
        """The plan of `suite` on `specs`: every (case, backend) pair asked once."""
        why_not = {
            (c.id, s.name): not_applicable(s, c.op, c.params) for s in specs for c in suite.cases
        }
        return cls(suite, tuple(specs), MappingProxyType(why_not))

    def with_specs(self, specs: list[BackendSpec]) -> Plan:
        """The same plan over other backends of those it was made for (the ones that can run,
        an A/B run's B sides): their reasons are read, not asked again."""
        unknown = {s.name for s in specs} - {name for _, name in self.why_not}
        if unknown and self.suite.cases:
            raise ValueError(f"backends not in the plan: {', '.join(sorted(unknown))}")
        return Plan(self.suite, tuple(specs), self.why_not)

    def applies(self, case: Case, spec: BackendSpec) -> bool:
        """Whether `case` runs on `spec`."""
        return self.why_not[case.id, spec.name] is None

    def cases(self, spec: BackendSpec) -> list[Case]:
        """The cases `spec` runs, in suite order."""
        return [c for c in self.suite.cases if self.applies(c, spec)]

    def runs_anything(self, name: str) -> bool:
        """Whether any case applies to the backend `name` (a JAX user's function does not to
        torch backends)."""
        return any(self.why_not[c.id, name] is None for c in self.suite.cases)

    def cases_run(self) -> list[Case]:
        """The cases some backend runs: those whose inputs are written."""
        return [c for c in self.suite.cases if any(self.applies(c, s) for s in self.specs)]

    def backends_run(self) -> list[BackendSpec]:
        """The backends with a case to run (one with none would start a worker for nothing)."""
        return [s for s in self.specs if self.runs_anything(s.name)]

    def probe_records(self) -> int:
        """How many (case, backend) `probe` records the plan writes."""
        return sum(self.applies(c, s) for s in self.specs for c in self.suite.cases)

    def pairs(self, case: Case) -> list[tuple[str, str, str]]:
        """The records comparing two backends' outputs of `case`, as (kind, label, label): an
        `agreement` per pair of plain backends that run it (labels sorted), and with `--ab` an
        `ab` per B side, against its own backend's A side."""
        ran = [s for s in self.specs if self.applies(case, s)]
        plain = [s for s in ran if not s.variant]
        pairs = [
            ("agreement", min(a.label, b.label), max(a.label, b.label))
            for a, b in itertools.combinations(plain, 2)
        ]
        pairs += [
            ("ab", a.label, b.label) for b in ran if b.variant for a in plain if a.name == b.name
        ]
        return pairs

    def records(self) -> int:
        """How many records a run of the plan writes: a `probe` record per (case, backend)
        and one per pair `pairs` names. Every one is written, finished or not: a pair that
        could not be compared (a side errored or timed out) is an `error` record saying why."""
        return self.probe_records() + sum(len(self.pairs(c)) for c in self.suite.cases)

    def check(self) -> None:
        """Refuse a plan in which no case applies to any backend.

        Such a run would check nothing and say so only as "no records"; a CI gate would go
        green.

        Raises:
          UsageError: naming the suite's ops and, per backend, why its cases do not apply.
        """
        if not self.specs or self.probe_records():
            return
        cases = self.suite.cases
        ops = ", ".join(dict.fromkeys(c.op for c in cases))
        why = "; ".join(
            f"{s.name}: "
            + ", ".join(dict.fromkeys(r for c in cases if (r := self.why_not[c.id, s.name])))
            for s in self.specs
        )
        raise UsageError(
            f"suite '{self.suite.name}' has no case that runs on "
            f"{', '.join(s.name for s in self.specs)} (the suite's ops: {ops}; {why}); "
            f"choose other backends with --backend or another suite"
        )
