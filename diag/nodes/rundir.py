"""A scan's run folder (run.json, one record per device, nodes.json) and its report section.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from diag.nodes.result import NodeScan
from diag.nodes.vote import ulp_text


_STATUS = {"ok": "pass", "slow": "warn", "suspect": "fail"}


def write_run(nodes: NodeScan, out: os.PathLike | str = "reports",
              argv: Optional[Sequence[str]] = None) -> Path:
    """Write a run folder: run.json, one record per device in results.jsonl, and nodes.json.

    The per-device records (``kind: "node"``, status pass / warn for slow / fail for a suspect)
    let the ordinary report and tools read a scan like any run; nodes.json
    (``nodes.to_dict()`` plus ``run_id``) keeps everything.

    Args:
      nodes: what `scan` returned.
      out: the folder the run folder is created in.
      argv: the command line to record in run.json.

    Returns:
      The run folder.
    """
    from diag.environment import collect
    from diag.results import Record, RunDir, new_run_id

    run_id = new_run_id()
    run = RunDir.create(out, run_id, collect(list(argv) if argv is not None else None))
    for d in nodes.devices:
        run.append(Record(
            op="nodes", probe="nodes.scan",
            case=f"process {d['process_index']} device {d['device_id']}",
            params={"device_id": d["device_id"], "process_index": d["process_index"],
                    "host": d["host"], "repeats": nodes.repeats},
            backend=f"jax-{d.get('platform', '')}",
            device={"platform": d.get("platform"), "kind": d.get("kind"), "id": d["device_id"],
                    "host": d["host"], "process_index": d["process_index"]},
            dtype="", kind="node", status=_STATUS[d["verdict"]], reason=d["reason"],
            metrics={k: d.get(k) for k in ("calls", "mismatched_calls", "nan_count",
                                           "inf_count", "intermittent_calls",
                                           "golden_mismatch_calls", "undecided_calls",
                                           "max_ulp", "injected_calls", "injected_caught",
                                           "time_ratio")},
            timings={"run_s_median": d.get("time_median_s"), "run_s_min": d.get("time_min_s")},
            framework={"name": "jax", **nodes.versions}, run_id=run_id))
    run.write_json("nodes.json", {**nodes.to_dict(), "run_id": run_id})
    run.update_meta(state="finished", finished=time.time(), command="nodes",
                    exit_code=nodes.exit_code,
                    nodes={"verdict": nodes.verdict,
                           "selftest": (nodes.selftest or {}).get("verdict"),
                           "suspects": len(nodes.suspects),
                           "devices": len(nodes.devices)})
    return run.path


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

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
        rows.append({
            "verdict": d.get("verdict", ""), "process_index": d.get("process_index"),
            "host": d.get("host", ""), "device_id": d.get("device_id"),
            "kind": d.get("kind", ""), "mismatched": d.get("mismatched_calls", 0),
            "calls": d.get("calls", 0), "nonfinite": nonfinite,
            "max_ulp": ulp_text(d.get("max_ulp")),
            "time": ms(d.get("time_median_s")), "ratio": f"{d.get('time_ratio', 1.0):.2f}",
            "reason": d.get("reason", ""),
        })
    det = nodes.get("detection") or {}
    detection = [{"rate": f"{row['rate']:g}", "p": f"{100 * row['p_detect']:.4g}%",
                  "r99": row["repeats_for_99"]} for row in det.get("rows", [])]
    n_dev = len(rows)
    summary = (f"{n_dev} device(s) on {len(nodes.get('hosts', []))} host(s), "
               f"{nodes.get('repeats')} repeat(s) x {len(nodes.get('workloads', []))} "
               f"workload(s); {len(nodes.get('suspects', []))} suspect(s), "
               f"{len(nodes.get('slow', []))} slow")
    return {
        "verdict": nodes.get("verdict", "ok"), "summary": summary,
        "suspects": list(nodes.get("suspects", [])), "slow": list(nodes.get("slow", [])),
        "rows": rows, "hosts": list(nodes.get("hosts", [])), "detection": detection,
        "detection_formula": det.get("formula", ""),
        # A self-test's outcome is the first thing to read when faults were injected.
        "notes": [o.get("text", "") for o in (nodes.get("selftest") or {}).get("injections", [])]
        + list(nodes.get("notes", [])),
        "injections": [i.get("text", "") for i in nodes.get("injections", [])],
    }
