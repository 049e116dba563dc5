"""A scan's run folder: run.json, one record per device, nodes.json (the report reads them)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diag.nodes.result import NodeScan
from diag.status import Status

if TYPE_CHECKING:
    from diag.records.results import Record

_STATUS = {"ok": Status.PASS, "slow": Status.WARN, "suspect": Status.FAIL}

#: The vote's per-device figures a device's record carries as metrics.
_METRICS = (
    "calls",
    "mismatched_calls",
    "nan_count",
    "inf_count",
    "intermittent_calls",
    "golden_mismatch_calls",
    "undecided_calls",
    "max_ulp",
    "injected_calls",
    "injected_caught",
    "time_ratio",
)


def _device_record(nodes: NodeScan, d: dict[str, Any], run_id: str) -> Record:
    """One device's record (``kind: "node"``) from its entry in `NodeScan.devices`."""
    from diag.records.results import Record

    return Record(
        op="nodes",
        probe="nodes.scan",
        case=f"process {d['process_index']} device {d['device_id']}",
        params={
            "device_id": d["device_id"],
            "process_index": d["process_index"],
            "host": d["host"],
            "repeats": nodes.repeats,
        },
        backend=f"{nodes.framework}-{d.get('platform', '')}",
        device={
            "platform": d.get("platform"),
            "kind": d.get("kind"),
            "id": d["device_id"],
            "host": d["host"],
            "process_index": d["process_index"],
        },
        dtype="",
        kind="node",
        status=_STATUS[d["verdict"]],
        reason=d["reason"],
        metrics={k: d.get(k) for k in _METRICS},
        timings={"run_s_median": d.get("time_median_s"), "run_s_min": d.get("time_min_s")},
        framework={"name": nodes.framework, **nodes.versions},
        run_id=run_id,
    )


def write_run(
    nodes: NodeScan, out: os.PathLike | str = "reports", argv: Sequence[str] | None = None
) -> Path:
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
    from diag.records.results import RunDir, new_run_id
    from diag.settings.environment import collect

    run_id = new_run_id()
    run = RunDir.create(out, run_id, collect(list(argv) if argv is not None else None))
    for d in nodes.devices:
        run.append(_device_record(nodes, d, run_id))
    run.write_json("nodes.json", {**nodes.to_dict(), "run_id": run_id})
    run.update_meta(
        state="finished",
        finished=time.time(),
        command="nodes",
        exit_code=nodes.exit_code,
        nodes={
            "verdict": nodes.verdict,
            "selftest": (nodes.selftest or {}).get("verdict"),
            "suspects": len(nodes.suspects),
            "misconfigured": len(nodes.misconfigured),
            "devices": len(nodes.devices),
        },
    )
    return run.path
