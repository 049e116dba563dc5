"""`diag preflight`'s node scan inside the probe run's JAX worker, not in the host.

JAX is already imported in the worker that runs the probes on a JAX backend; scanning the
devices there, after its cases, spares the host a second import of JAX (~1.5 CPU-s here) and
a second set of compiles. The request travels as a job field (`scan_hook`: a
`diag.worker.protocol.Hook` naming `diag.nodes.hook.scan_to`, with where to write the scan,
its repeats and injected faults), never through the workers' environment; the worker does
not import preflight. When no JAX worker wrote an answer (none ran, or it crashed, or the
scan raised), preflight scans in its own process as before, so a failure is reported as it
always was.
"""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from typing import Any

from diag.worker.protocol import Hook

__all__ = ["scan_hook", "collect"]

#: The module and function of the scan a JAX worker runs after its cases.
SCAN_MODULE, SCAN_FUNCTION = "diag.nodes.hook", "scan_to"


def scan_hook(path: Path, repeats: int, injections: tuple) -> Hook:
    """The job hook that asks the run's first JAX worker for a node scan written to `path`."""
    return Hook(
        module=SCAN_MODULE,
        function=SCAN_FUNCTION,
        args={
            "path": str(path),
            "repeats": repeats,
            "injections": [dataclasses.asdict(i) for i in injections],
        },
        framework="jax",
    )


def collect(path: Path) -> tuple[Any, float] | None:
    """(the scan a worker wrote, as attributes: ``NodeScan.to_dict()``'s keys; its seconds),
    or None when none did. The host reads it without importing `diag.nodes` (its workloads
    import numpy's and the scan's machinery, needed only where a scan runs)."""
    try:
        data = json.loads(path.read_text())
        return types.SimpleNamespace(**data["scan"]), float(data["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
