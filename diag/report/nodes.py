"""The report's nodes section, from a run folder's nodes.json alone (a copy of
`diag.nodes.report_context`, which the nodes package drops)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diag.numerics import NAN_ULP

__all__ = ["report_context"]


def _ulp_text(ulps: float | None) -> str:
    """A ULP distance for people: `NAN_ULP` (a NaN against a number) reads "NaN"."""
    if ulps is None:
        return "—"
    return "NaN" if ulps >= NAN_ULP else f"{ulps:.6g}"


def report_context(nodes: Mapping[str, Any]) -> dict[str, Any]:
    """What the HTML report's nodes section shows, from a run folder's nodes.json.

    Returns:
      {"verdict", "suspects", "slow", "rows", "hosts", "detection", "notes", "injections",
      "summary"}; every value is plain data (the template escapes it).
    """

    def ms(x):
        return f"{1e3 * x:.3g} ms" if isinstance(x, (int, float)) else "—"

    rows = []
    for d in nodes.get("devices", []):
        nonfinite = (d.get("nan_count") or 0) + (d.get("inf_count") or 0)
        rows.append(
            {
                "verdict": d.get("verdict", ""),
                "process_index": d.get("process_index"),
                "host": d.get("host", ""),
                "device_id": d.get("device_id"),
                "kind": d.get("kind", ""),
                "mismatched": d.get("mismatched_calls", 0),
                "calls": d.get("calls", 0),
                "nonfinite": nonfinite,
                "max_ulp": _ulp_text(d.get("max_ulp")),
                "time": ms(d.get("time_median_s")),
                "ratio": f"{d.get('time_ratio', 1.0):.2f}",
                "reason": d.get("reason", ""),
            }
        )
    det = nodes.get("detection") or {}
    detection = [
        {
            "rate": f"{row['rate']:g}",
            "p": f"{100 * row['p_detect']:.4g}%",
            "r99": row["repeats_for_99"],
        }
        for row in det.get("rows", [])
    ]
    n_dev = len(rows)
    summary = (
        f"{n_dev} device(s) on {len(nodes.get('hosts', []))} host(s), "
        f"{nodes.get('repeats')} repeat(s) x {len(nodes.get('workloads', []))} "
        f"workload(s); {len(nodes.get('suspects', []))} suspect(s), "
        f"{len(nodes.get('slow', []))} slow, "
        f"{len(nodes.get('misconfigured') or [])} misconfigured process(es)"
    )
    return {
        "verdict": nodes.get("verdict", "ok"),
        "summary": summary,
        "suspects": list(nodes.get("suspects", [])),
        "slow": list(nodes.get("slow", [])),
        "rows": rows,
        "hosts": list(nodes.get("hosts", [])),
        "detection": detection,
        "detection_formula": det.get("formula", ""),
        # A self-test's outcome is the first thing to read when faults were injected; then
        # the processes whose configuration differs (apart from the hardware suspects).
        "notes": [o.get("text", "") for o in (nodes.get("selftest") or {}).get("injections", [])]
        + [
            f"process {proc.get('process_index')} ({proc.get('host')}) misconfigured: "
            f"{proc.get('reason', '')}"
            for proc in nodes.get("misconfigured") or []
        ]
        + list(nodes.get("notes", [])),
        "injections": [i.get("text", "") for i in nodes.get("injections", [])],
    }
