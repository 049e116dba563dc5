"""The CI gate's rule for one record: how a record's metrics and output bits compare with the
copy a baseline holds (`diag.gate.baseline` explains why, and applies it to a whole run).

One function per kind of drift: a metric judged against an allowance that crosses it
(`ratio_drifts`), a count of rule-breaking elements that changes (`count_drifts`), and, for a
bitwise check, any metric or output bit that changes (`bitwise_drifts`).
"""

from __future__ import annotations

import math
from typing import Any

from diag.gate.drift import Drift
from diag.tolerance.gate import RATIOS as GATE_RATIOS

__all__ = [
    "COUNTS",
    "DIGESTS",
    "RATIOS",
    "bad_values",
    "kept_metrics",
    "metric_drifts",
]

#: Metrics judged against an allowance (`diag.tolerance.gate.RATIOS`, where every allowance lives).
RATIOS = GATE_RATIOS

#: Counts of elements or rows that break a rule, zero on every correct implementation: any
#: change is drift.
COUNTS = (
    "nan_count",
    "inf_count",
    "unexpected_nonfinite",
    "reference_nonfinite",
    "bound_exceeded",
    "narrow_bound_exceeded",
    "invalid_rows",
    "wrong_rows",
    "rows_below_target",
    "nan_rows",
    "disagreeing_paths",
)

#: What a bitwise check compares besides the metrics: the sha256 of each output's bits.
DIGESTS = "output_digests"


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if v in ("nan", "inf", "-inf"):
        return float(v)
    return None


def kept_metrics(metrics: dict) -> dict[str, Any]:
    """The scalar metrics (and the counted lists) of a record: what the drift rule reads."""
    kept: dict[str, Any] = {}
    for name, value in (metrics or {}).items():
        if name == DIGESTS or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) or value in ("nan", "inf", "-inf"):
            kept[name] = value
        elif name in COUNTS and isinstance(value, list):
            kept[name] = value
    return kept


def bad_values(rec: dict) -> str | None:
    """What is wrong with a baseline record's metrics and digests (as `diag.gate.baseline.load`
    reads it), or None.

    A value of the wrong type would otherwise be compared as if it were a number (a count
    `"huge"` reads as drift, exit 1) or crash the bitwise comparison: the file is unusable.
    """
    for name, value in (rec.get("metrics") or {}).items():
        if kept_metrics({name: value}) != {name: value}:
            return (
                f"metric {name!r} is {value!r}: must be a number"
                + (" or a list" if name in COUNTS else "")
                + " ('nan', 'inf' and '-inf' stand for those numbers)"
            )
    digests = rec.get("digests")
    if digests is not None and not (
        isinstance(digests, list) and all(isinstance(d, str) for d in digests)
    ):
        return f"field 'digests' is {digests!r}: must be null or a list of sha256 strings"
    return None


def _keeps(name: str, value: float, limit: float) -> bool:
    """Whether `value` of metric `name` keeps its allowance `limit`.

    Recall must stay AT OR ABOVE its target, errors AT OR BELOW their allowance.
    """
    return value >= limit if name.startswith("recall") else value <= limit


def ratio_drifts(where: str, om: dict, nm: dict, new: dict) -> list[Drift]:
    """Metrics judged against an allowance whose side of it changed (or that (dis)appeared)."""
    out = []
    for name, limit_of in RATIOS.items():
        a, b = _num(om.get(name)), _num(nm.get(name))
        if a is None and b is None:
            continue
        limit = limit_of(new)
        if limit is None:
            continue
        if a is None or b is None:
            out.append(
                Drift(where, name, om.get(name), nm.get(name), "the metric appeared or disappeared")
            )
            continue
        if _keeps(name, a, limit) != _keeps(name, b, limit) or (math.isnan(a) != math.isnan(b)):
            out.append(
                Drift(
                    where,
                    name,
                    a,
                    b,
                    f"crossed its allowance {limit:g}: only one of "
                    "the two runs keeps the bound every correct implementation keeps",
                )
            )
    return out


def count_drifts(where: str, om: dict, nm: dict) -> list[Drift]:
    """Counts of rule-breaking elements or rows (`COUNTS`) that changed."""
    out = []
    for name in COUNTS:
        if name in om or name in nm:
            a, b = om.get(name), nm.get(name)
            if a != b:
                out.append(
                    Drift(
                        where,
                        name,
                        a,
                        b,
                        "a count that is zero on every correct implementation changed",
                    )
                )
    return out


def bitwise_drifts(
    where: str, old: dict, new: dict, om: dict, nm: dict, reported: set[str], likely: str = ""
) -> list[Drift]:
    """Every metric not already `reported` that changed at all, and the outputs whose bits did
    (`likely`: the key difference named as their likely cause, e.g. a version change)."""
    out = []
    for name in sorted(set(om) | set(nm)):
        if name not in reported and om.get(name) != nm.get(name):
            out.append(
                Drift(
                    where,
                    name,
                    om.get(name),
                    nm.get(name),
                    "bitwise: the metric changed" + (f"; likely cause: {likely}" if likely else ""),
                )
            )
    od, nd = old.get("digests"), (new.get("metrics") or {}).get(DIGESTS)
    if od is not None and od != nd:
        changed = [i for i, (x, y) in enumerate(zip(od, nd or [])) if x != y]
        first = changed[0] if changed else 0
        out.append(
            Drift(
                where,
                f"output {first} sha256",
                od[first] if first < len(od) else None,
                (nd or [None])[first] if nd and first < len(nd) else None,
                f"bitwise: {len(changed) or len(od)} output(s) differ in their bits"
                + (f"; likely cause: {likely}" if likely else ""),
            )
        )
    return out


def metric_drifts(where: str, old: dict, new: dict, bitwise: bool, likely: str = "") -> list[Drift]:
    """The drifts of one record: `new` (a run's record) against `old` (the baseline's copy).

    Args:
      where: the record's key (`probe | case | backend`), shown with each drift.
      old: the baseline's record (kept metrics and digests).
      new: the run's record.
      bitwise: also compare every metric and output bit exactly.
      likely: with `bitwise` across a version or hardware change, that change in words: each
        bitwise drift names it as its likely cause.

    Returns:
      The drifts, in the order status, ratios, counts, bitwise.
    """
    out = []
    om, nm = old.get("metrics") or {}, kept_metrics(new.get("metrics") or {})
    if old.get("status") != new.get("status"):
        out.append(
            Drift(where, "status", old.get("status"), new.get("status"), "the verdict changed")
        )
    out.extend(ratio_drifts(where, om, nm, new))
    out.extend(count_drifts(where, om, nm))
    if bitwise:
        out.extend(bitwise_drifts(where, old, new, om, nm, {d.what for d in out}, likely))
    return out
