"""The CI gate's allowances (diag.gate.baseline), beside the op rows in `diag.tolerance` they read.

A metric judged against an allowance drifts when it crosses the allowance between two runs
(docs/baseline.md: inside it two correct implementations may land anywhere).
"""

from __future__ import annotations

from collections.abc import Callable

from diag.errors import UsageError
from diag.tolerance import Tolerance, tolerance

__all__ = ["RATIOS"]


def _record_tolerance(rec: dict) -> Tolerance | None:
    """The record's row of the tolerance table (None for an op or dtype without one)."""
    try:
        return tolerance(rec.get("op", ""), rec.get("dtype") or "float32")
    except (UsageError, KeyError, TypeError, ValueError):
        return None


def _record_ulp_allowance(rec: dict) -> float | None:
    """The ULPs the record's op allows for its case (train_step: the loss screen)."""
    tol = _record_tolerance(rec)
    try:
        return None if tol is None or tol.ulp is None else float(tol.ulp(rec.get("params") or {}))
    except (KeyError, TypeError, ValueError):
        return None


def _record_target(rec: dict) -> float | None:
    v = (rec.get("metrics") or {}).get("recall_target")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


#: (metric, the allowance for a record or None): bound ratios against 1 (agreement records:
#: |a - b| / (2 b), the same 1); top-k recall against its table recall (exact top-k: 1 in
#: every row) or, as a mean over rows, the recall approx_max_k's caller promised; the
#: train-step loss against its ULP screen.
RATIOS: dict[str, Callable[[dict], float | None]] = {
    "bound_ratio": lambda rec: 1.0,
    "narrow_bound_ratio": lambda rec: 1.0,
    "recall_min": lambda rec: getattr(_record_tolerance(rec), "recall", None),
    "recall_mean": _record_target,
    "loss_ulp": _record_ulp_allowance,
}
