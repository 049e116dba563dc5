"""The report's Profile section: each case's top ops, with time, dtype and shape, next to its
error figures and precision fingerprint (a run made with `diag run --trace`).

XProf and Holistic Trace Analysis show time without error; diag's verdict table shows error
without time. Here they meet per (case, backend): which compiled ops ran, in what dtype, how
long, beside how wrong the case was and what arithmetic the backend's matmul was measured to
use. For a matmul run at the default precision the same trace machinery also timed it at
`highest`: what the precise setting costs on that backend. For a traced A/B run, the first
XLA pass where the two programs differ.

Reads only the run folder's JSON (written at run time by `diag.trace`: `trace/*.json`,
`trace/passes/*.json`, the same names as `diag.trace.layout`), never a trace file, a
converter or a framework: the report stays importable anywhere.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from diag.report.fields import as_mapping, mapping_or_none
from diag.status import FAILURES_FIRST, Status

__all__ = ["trace_context"]

_OPS_SHOWN = 6
# diag.trace.layout.SUMMARY_DIR and PASSES_DIR
_SUMMARIES, _PASSES = Path("trace"), Path("trace") / "passes"


def _read(folder: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out.append(data)
    return out


def _fingerprint(
    backends: Mapping[str, Any],
    backend: str,
    params: Mapping[str, Any],
) -> str | None:
    """The recorded arithmetic of `backend`'s matmul under the case's precision setting."""
    if "precision" not in params:
        return None
    precision = str(params.get("precision", "default"))
    via = str(params.get("precision_via", "none")) if precision != "default" else "none"
    info = backends.get(backend) if isinstance(backends, Mapping) else None
    for fp in (info or {}).get("fingerprints") or []:
        if isinstance(fp, Mapping) and fp.get("precision") == precision and fp.get("via") == via:
            return str(fp.get("label") or "")
    return None


def _ops(ops: Any) -> list[dict[str, Any]]:
    return [
        {
            "name": str(o.get("name", "")),
            "per_call_us": o.get("per_call_us"),
            "count": o.get("count"),
            "dtype": str(o.get("dtype") or "—"),
            "shape": str(o.get("shape") or "—"),
        }
        for o in (ops or [])[:_OPS_SHOWN]
        if isinstance(o, Mapping)
    ]


def _highest(summary: Mapping[str, Any]) -> dict[str, Any] | None:
    high = summary.get("highest")
    if not isinstance(high, Mapping):
        return None
    base, cost = summary.get("per_call_us"), high.get("per_call_us")
    ratio = (
        cost / base
        if isinstance(base, (int, float)) and base > 0 and isinstance(cost, (int, float))
        else None
    )
    # Each side's calls, min to max: a difference inside both spreads is timing noise.
    base_range, cost_range = _spread(summary), _spread(high)
    within = (
        None
        if base_range is None or cost_range is None
        else base_range[0] <= cost_range[1] and cost_range[0] <= base_range[1]
    )
    return {
        "per_call_us": cost,
        "ratio": ratio,
        "error": high.get("summary_error"),
        "session": high.get("session"),
        "range_us": cost_range,
        "base_range_us": base_range,
        "within_spread": within,
    }


def _spread(summary: Mapping[str, Any]) -> tuple[float, float] | None:
    """The fastest and slowest call of a traced session, or None without samples."""
    samples = [x for x in summary.get("call_us_samples") or [] if isinstance(x, (int, float))]
    return (min(samples), max(samples)) if samples else None


def trace_context(
    run_dir: str | Path, records: Iterable[Mapping[str, Any]], backends: Mapping[str, Any]
) -> dict[str, Any] | None:
    """What the Profile section shows, or None for a run without traces.

    Args:
      run_dir: the run folder.
      records: its records (probe records are joined by case label and backend).
      backends: run.json's `backends` (each worker's fingerprints).

    Returns:
      {"cases": [...], "passes": [...]}; a case holds its verdict and error figures, its
      fingerprint, its top ops and, for a default-precision matmul, what `highest` costs.
    """
    run_dir = Path(run_dir)
    summaries = _read(run_dir / _SUMMARIES)
    attributions = _read(run_dir / _PASSES)
    if not summaries and not attributions:
        return None
    by_key = {
        (r.get("case"), r.get("backend")): r for r in records if r.get("kind", "probe") == "probe"
    }
    cases: list[dict[str, Any]] = []
    for i, s in enumerate(summaries):
        rec = by_key.get((s.get("case"), s.get("backend")), {})
        metrics = as_mapping(rec.get("metrics"))
        params = as_mapping(rec.get("params"))
        status = str(rec.get("status", "—"))
        cases.append(
            {
                "i": i,
                "case": s.get("case"),
                "case_id": s.get("case_id"),
                "backend": s.get("backend"),
                "op": s.get("op"),
                "status": status,
                "dtype": rec.get("dtype"),
                "reason": rec.get("reason"),
                "bound_ratio": metrics.get("bound_ratio"),
                "max_ulp": metrics.get("max_ulp"),
                "max_rel_err": metrics.get("max_rel_err"),
                "fingerprint": _fingerprint(backends, str(s.get("backend")), params),
                "precision": params.get("precision"),
                "per_call_us": s.get("per_call_us"),
                "converter": s.get("converter"),
                "ops": _ops(s.get("ops")),
                "n_ops": s.get("n_ops"),
                "error": s.get("summary_error"),
                "session": s.get("session"),
                "hlo": s.get("hlo"),
                "highest": _highest(s),
            }
        )
    rank = {s: i for i, s in enumerate(FAILURES_FIRST)}
    cases.sort(key=lambda c: (rank.get(c["status"], len(rank)), c["i"]))
    passes = []
    for a in attributions:
        first = mapping_or_none(a.get("first_difference"))
        passes.append(
            {
                "pair": a.get("pair"),
                "case": a.get("case"),
                "setting": a.get("setting"),
                "error": a.get("error"),
                "pass": first.get("pass") if first else None,
                "module": first.get("module") if first else None,
                "opcodes": dict(first.get("opcodes") or {}) if first else {},
                "added": list(first.get("added") or []) if first else [],
                "removed": list(first.get("removed") or []) if first else [],
            }
        )
    return {
        "cases": cases,
        "passes": passes,
        "problems": sum(
            1 for c in cases if c["status"] in (Status.WARN, Status.FAIL, Status.ERROR)
        ),
    }
