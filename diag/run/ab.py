"""A/B setting experiments: the B side, what a setting changed, the compiled-HLO difference.

`diag run --ab NAME=VALUE` runs each backend twice, as is (A) and with the setting (B), each
in its own worker (XLA reads its flags once, at start-up). The B side is a backend spec with
`variant="B"` (records carry it in their `variant` field; people read the backend as
`<backend>+B`, `BackendSpec.label`); the runner compares a B side with its own A side only,
and this module turns that comparison into an `ab` record: which outputs changed, how the
verdict moved, and, for JAX, which compiled-HLO instructions the setting added or removed.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diag import numerics
from diag.backends import BackendSpec
from diag.compare.verdict import Verdict
from diag.errors import UsageError
from diag.status import Status

__all__ = ["B", "Experiment", "parse_ab", "with_b_sides"]

# The variant name of the side that runs with the setting.
B = "B"
HLO_EXCERPT_LINES = 40
# An HLO instruction: `[ROOT] [%]name = type opcode(operands), ...`.
_HLO_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")


def _hlo_ops(lines: list[str]) -> dict[str, int]:
    """Instruction counts by opcode in HLO text."""
    counts: dict[str, int] = {}
    for line in lines:
        m = _HLO_OP.match(line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def parse_ab(
    assignments: list[str] | None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of an A/B experiment's B side from `NAME=VALUE` assignments.

    `XLA_FLAGS` and `LIBTPU_INIT_ARGS` values are appended to the flags in effect on the A
    side (`base`: the environment the A worker gets, a library caller's `env=` included);
    a JAX config name (`jax_default_matmul_precision=highest`) becomes the environment
    variable JAX reads it from at start-up (`JAX_DEFAULT_MATMUL_PRECISION`).

    Args:
      assignments: `NAME=VALUE` strings.
      base: the A side's environment (default: this process's).

    Raises:
      UsageError: an assignment that is not NAME=VALUE.
    """
    base = os.environ if base is None else base
    env: dict[str, str] = {}
    for item in assignments or []:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UsageError(
                f"--ab expects NAME=VALUE (an environment variable or a JAX "
                f"config option), got {item!r}"
            )
        if name.lower().startswith("jax_"):
            name = name.upper()
        if name in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"):
            current = env.get(name, base.get(name, ""))
            value = f"{current} {value}".strip()
        env[name] = value
    return env


def with_b_sides(specs: list[BackendSpec]) -> list[BackendSpec]:
    """Each backend, then the same backend under the setting (its B side)."""
    return [v for s in specs for v in (s, dataclasses.replace(s, variant=B))]


@dataclass
class Experiment:
    """One run's A/B experiment: the B side's environment and what each side compiled.

    Attributes:
      env: the variables the B side's workers get on top of the A side's.
      folder: the run folder (HLO diffs go to its `ab/`).
      hlo: (case id, backend label) -> the compiled HLO text a worker wrote.
    """

    env: dict[str, str]
    folder: Path
    hlo: dict[tuple[str, str], str] = field(default_factory=dict)

    @property
    def setting(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.env.items())

    def worker_env(self, spec: BackendSpec, env: Mapping[str, str]) -> dict[str, str]:
        """The environment of `spec`'s worker: the B side gets the setting on top."""
        return {**env, **self.env} if spec.variant == B else dict(env)

    def b_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """The environment of a B side's worker started on top of `env` (the A side's), for
        a caller that starts one itself (`diag.trace.passes`)."""
        return {**env, **self.env}

    def attribute(
        self,
        case_id: str,
        a: str,
        x,
        b: str,
        y,
        verdicts: tuple[Mapping, Mapping],
        agree: Callable[..., Verdict],
        context: Any,
    ) -> tuple[str, str, dict]:
        """What the setting changed in one case on one backend: an `ab` record's
        (status, reason, metrics).

        Args:
          case_id: the case (HLO diffs are named after it).
          a, b: the A and B sides' backend labels.
          x, y: their outcomes (`diag.probes.Outcome`).
          verdicts: the A and B sides' records for the case.
          agree: the probe's agreement check, for the size of the difference.
          context: what the B side's output was judged by (its bound).
        """
        changed = [
            n
            for n, u, v in zip(x.names, x.outputs, y.outputs)
            if numerics.bits_digest(u) != numerics.bits_digest(v)
        ]
        difference = agree(x, y, (a, b), context).metrics
        va, vb = verdicts
        metrics: dict[str, Any] = {
            "changed_outputs": changed,
            "difference": difference,
            "status": [va["status"], vb["status"]],
            "max_ulp": [va["metrics"].get("max_ulp"), vb["metrics"].get("max_ulp")],
        }
        if not changed:
            return (
                Status.PASS,
                f"{self.setting} changes nothing in {a}'s results (bit for bit)",
                metrics,
            )
        what = ", ".join(changed)
        n, k = difference.get("elements"), difference.get("mismatched")
        amount = f"{k} / {n} elements, " if n and k is not None else ""
        reason = (
            f"{self.setting} changes {a}'s {what} ({amount}verdict {va['status']} -> "
            f"{vb['status']}): drift attributed to this setting"
        )
        hlo = self.hlo_diff(case_id, a, b)
        if hlo:
            metrics["hlo_diff"] = hlo
            ops = ", ".join(f"{op} {n1}->{n2}" for op, (n1, n2) in hlo["ops"].items())
            reason += f"; compiled HLO differs ({ops or 'no op count changes'})"
        return Status.WARN, reason, metrics

    def hlo_diff(self, case_id: str, a: str, b: str) -> dict | None:
        """The compiled-HLO difference between the two sides of a case, written to the run
        folder (`ab/<case>.<backend>.hlo.diff`), with the op counts that changed."""
        if (case_id, a) not in self.hlo or (case_id, b) not in self.hlo:
            return None
        text_a, text_b = (Path(self.hlo[case_id, n]).read_text().splitlines() for n in (a, b))
        diff = list(difflib.unified_diff(text_a, text_b, f"{a}.hlo", f"{b}.hlo", lineterm=""))
        folder = self.folder / "ab"
        folder.mkdir(exist_ok=True)
        path = folder / f"{case_id}.{a}.hlo.diff"
        path.write_text("\n".join(diff) + "\n")
        count_a, count_b = _hlo_ops(text_a), _hlo_ops(text_b)
        ops = {
            op: (count_a.get(op, 0), count_b.get(op, 0))
            for op in sorted(set(count_a) | set(count_b))
            if count_a.get(op, 0) != count_b.get(op, 0)
        }
        changed = sum(1 for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---"))
        # The changed lines without their context, for the record and the report.
        excerpt = [line for line in diff[2:] if line[:1] in "+-@"][:HLO_EXCERPT_LINES]
        return {
            "path": str(path.relative_to(self.folder)),
            "changed_lines": changed,
            "ops": ops,
            "excerpt": excerpt,
        }
