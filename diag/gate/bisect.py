"""Bisection: the first release (or commit) at which a record's output changes.

A history says in which run a record moved; when that run's environment differs in a
framework's version, or the user's repository moved by many commits, the next question is
which release or which commit did it. This module is the search, independent of what a point
is: `observe(point, records)` runs the records at one point (a release in its own environment,
`diag.gate.releases`; a commit in its own worktree, `diag.gate.commits`) and returns each
record's status and output digests.

The search is `asv find`'s, with the exact outputs as the test: both ends are run first (every
record asked for), the records whose bits or status differ between them are the only ones run
after that, and a binary search over the points between finds the first point that differs
from the good end: 2 + ceil(log2(N - 1)) runs for N points, never more than ceil(log2 N) + 2.

Not every history has two states. A record may change at one release and again at a later
one; the binary search then names a release where it first differs from the good end (the
first one, when once changed it never returns to the good end's bits), and the result says
when the bad end differs from that release too, with the evidence of each.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from diag.errors import UsageError
from diag.gate.baseline import record_key
from diag.gate.record_drift import DIGESTS

__all__ = [
    "BisectError",
    "Bisection",
    "Observation",
    "Step",
    "bisect",
    "max_runs",
    "observation",
]


class BisectError(UsageError):
    """A bisection diag cannot do (unknown version or commit, a release that does not install,
    ends that do not differ, a dirty repository): exit 2, one line."""


@dataclass(frozen=True)
class Observation:
    """The records run at one point.

    Attributes:
      point: the release (`0.10.1`) or commit it was run at.
      outputs: record key -> (status, output sha256s): what must stay equal.
      reasons: record key -> the record's one-line reason.
      where: the run folder that holds the records (the step's evidence on disk).
    """

    point: str
    outputs: dict[str, tuple[str | None, tuple[str, ...]]]
    reasons: dict[str, str] = field(default_factory=dict)
    where: str = ""


def observation(point: str, records: Sequence[dict[str, Any]], where: str = "") -> Observation:
    """An Observation from a run's records.

    Skipped records (a backend absent from this machine, a case it does not apply to) are
    left out: they are skipped at every point.

    Raises:
      BisectError: a record errored at this point: its bits say nothing about the point, so
        the search cannot go on (the reason is in the message).
    """
    outputs: dict[str, tuple[str | None, tuple[str, ...]]] = {}
    reasons: dict[str, str] = {}
    for rec in records:
        key = record_key(rec)
        if rec.get("status") == "skip":  # a backend absent here, a case it does not apply to
            continue
        if rec.get("status") == "error":
            raise BisectError(
                f"at {point}: {key} did not run ({rec.get('reason')}); "
                "fix what stops it at that point, or leave the record out with --record"
            )
        digests = (rec.get("metrics") or {}).get(DIGESTS) or []
        outputs[key] = (rec.get("status"), tuple(digests))
        reasons[key] = str(rec.get("reason") or "")
    return Observation(point, outputs, reasons, where)


@dataclass(frozen=True)
class Step:
    """One run of the search: the point, which side it fell on, and per record the evidence."""

    point: str
    side: str
    evidence: list[str]
    where: str

    def text(self) -> str:
        return f"{self.point}: {self.side}" + (f" (run folder {self.where})" if self.where else "")


@dataclass
class Bisection:
    """What `bisect` found.

    Attributes:
      points: every point between the ends, ends included, oldest first.
      records: the records that differ between the ends (the only ones run after them).
      steps: each run, in the order run.
      last_good: the last point whose records match the good end.
      first_bad: the first point that differs from the good end.
      changed: the records that changed at `first_bad`.
      later: the records whose bad end differs from `first_bad` too (a second change).
    """

    points: list[str]
    records: list[str]
    steps: list[Step]
    last_good: str
    first_bad: str
    changed: list[str]
    later: list[str]

    @property
    def runs(self) -> int:
        return len(self.steps)

    def to_json(self) -> dict[str, Any]:
        return {
            "points": self.points,
            "records": self.records,
            "last_good": self.last_good,
            "first_bad": self.first_bad,
            "changed": self.changed,
            "changes_again_later": self.later,
            "runs": self.runs,
            "max_runs": max_runs(len(self.points)),
            "steps": [
                {"point": s.point, "side": s.side, "evidence": s.evidence, "run_dir": s.where}
                for s in self.steps
            ],
        }


def max_runs(n: int) -> int:
    """The most runs `bisect` makes over `n` points: ceil(log2 n) + 2."""
    return math.ceil(math.log2(max(n, 1))) + 2


def _short(out: tuple[str | None, tuple[str, ...]]) -> str:
    status, digests = out
    bits = ", ".join(d[:12] for d in digests) or "no outputs"
    return f"{status}, output sha256 {bits}"


def _evidence(obs: Observation, good: Observation, bad: Observation, keys: list[str]) -> list[str]:
    lines = []
    for k in keys:
        out = obs.outputs.get(k)
        if out is None:
            lines.append(f"{k}: absent")
            continue
        if obs is good or obs is bad:
            lines.append(f"{k}: {_short(out)}")
            continue
        like = [n for n, end in (("good", good), ("bad", bad)) if end.outputs.get(k) == out]
        same = f"as at the {' and '.join(like)} end" if like else "like neither end"
        lines.append(f"{k}: {_short(out)} ({same})")
    return lines


def bisect(
    points: Sequence[str],
    observe: Callable[[str, list[str] | None], Observation],
) -> Bisection:
    """Find the first point whose records differ from the good end's.

    Args:
      points: the good end, every point between, the bad end (oldest first).
      observe: runs the records at a point: every record asked for when given None, else
        only the record keys given.

    Returns:
      Bisection, with every step's evidence.

    Raises:
      BisectError: fewer than two points, or no record differs between the ends.
    """
    pts = list(points)
    if len(pts) < 2:
        raise BisectError("a bisection needs a good end and a bad end that differ")
    good = observe(pts[0], None)
    bad = observe(pts[-1], None)
    keys = sorted(
        k for k in set(good.outputs) | set(bad.outputs) if good.outputs.get(k) != bad.outputs.get(k)
    )
    steps = [
        Step(pts[0], "good end", _evidence(good, good, bad, keys), good.where),
        Step(pts[-1], "bad end", _evidence(bad, good, bad, keys), bad.where),
    ]
    if not keys:
        raise BisectError(
            f"no record differs between {pts[0]} and {pts[-1]} ({len(good.outputs)} record(s) "
            "compared, bits and status): there is no change to find; check the ends"
        )
    lo, hi, seen = 0, len(pts) - 1, {0: good, len(pts) - 1: bad}
    while hi - lo > 1:
        mid = (lo + hi) // 2
        obs = seen[mid] = observe(pts[mid], keys)
        changed = any(obs.outputs.get(k) != good.outputs.get(k) for k in keys)
        side = "differs from the good end" if changed else "as the good end"
        steps.append(Step(pts[mid], side, _evidence(obs, good, bad, keys), obs.where))
        lo, hi = (lo, mid) if changed else (mid, hi)
    first = seen[hi]
    return Bisection(
        points=pts,
        records=keys,
        steps=steps,
        last_good=pts[lo],
        first_bad=pts[hi],
        changed=[k for k in keys if first.outputs.get(k) != good.outputs.get(k)],
        later=[k for k in keys if first is not bad and bad.outputs.get(k) != first.outputs.get(k)],
    )
