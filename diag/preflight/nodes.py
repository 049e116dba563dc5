"""`diag preflight`'s node scan inside the probe run's JAX worker, not in the host.

JAX is already imported in the worker that runs the probes on a JAX backend; scanning the
devices there, after its cases, spares the host a second import of JAX (~1.5 CPU-s here) and
a second set of compiles. The request travels in the workers' environment
(`NODE_SCAN_VAR`, JSON: where to write the scan, its repeats and injected faults); the first
JAX worker of the run to reach the end of its job claims it (an exclusive file beside the
answer), scans with `diag.nodes.scan`, and writes ``NodeScan.to_dict()`` there. When no JAX
worker wrote an answer (none ran, or it crashed, or the scan raised), preflight scans in its
own process as before, so a failure is reported as it always was.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import types
from pathlib import Path
from typing import Any

__all__ = [
    "NODE_SCAN_VAR",
    "NO_FEATURES_VAR",
    "request_env",
    "scan_in_worker",
    "collect",
    "features_wanted",
]

NODE_SCAN_VAR = "DIAG_PREFLIGHT_NODE_SCAN"
#: Set in the probe workers' environment: they measure the fingerprints preflight judges but
#: not the matmul's arithmetic features (`diag.arith.precision.features`, for `diag check`'s
#: baselines; ~0.2 CPU-s per backend here), which nothing in preflight reads.
NO_FEATURES_VAR = "DIAG_PREFLIGHT_NO_FEATURES"


def features_wanted() -> bool:
    """In a worker: whether to measure the arithmetic features after the fingerprints."""
    return not os.environ.get(NO_FEATURES_VAR)


def request_env(path: Path, repeats: int, injections: tuple) -> dict[str, str]:
    """The worker environment that asks the run's first JAX worker for a node scan."""
    return {
        NODE_SCAN_VAR: json.dumps(
            {
                "path": str(path),
                "repeats": repeats,
                "injections": [dataclasses.asdict(i) for i in injections],
            }
        )
    }


def _claim(path: Path) -> bool:
    try:
        os.close(os.open(f"{path}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except OSError:  # another worker of the run has it, or the folder is gone
        return False


def scan_in_worker(framework: str) -> None:
    """In a worker, after its job's cases: the node scan the environment asks for, if this is
    a JAX worker and no other worker of the run claimed it. Never raises: a scan that fails
    here is left for the host to run again (and report)."""
    raw = os.environ.get(NODE_SCAN_VAR)
    if framework != "jax" or not raw:
        return
    try:
        request = json.loads(raw)
        path = Path(request["path"])
    except (ValueError, KeyError, TypeError):
        return
    if not _claim(path):
        return
    try:
        from diag.nodes import Injection, scan

        t0 = time.perf_counter()
        result = scan(
            repeats=int(request["repeats"]),
            injections=tuple(Injection(**i) for i in request["injections"]),
        )
        data = {"scan": result.to_dict(), "seconds": time.perf_counter() - t0}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, default=str))
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - the host scans again and reports what fails
        return


def collect(path: Path) -> tuple[Any, float] | None:
    """(the scan a worker wrote, as attributes: ``NodeScan.to_dict()``'s keys; its seconds),
    or None when none did. The host reads it without importing `diag.nodes` (its workloads
    import numpy's and the scan's machinery, needed only where a scan runs)."""
    try:
        data = json.loads(path.read_text())
        return types.SimpleNamespace(**data["scan"]), float(data["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
