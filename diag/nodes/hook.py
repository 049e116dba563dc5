"""The node scan as a worker's hook: `diag preflight`'s scan run in the probes' JAX worker.

JAX is already imported in the worker that runs the probes on a JAX backend; scanning the
devices there, after its cases, spares the host a second import of JAX (~1.5 CPU-s here) and
a second set of compiles. The host names `scan_to` in the job (`diag.worker.protocol.Hook`,
built by `diag.preflight.nodes.scan_hook`); the first JAX worker of the run to reach it
claims the answer's file (an exclusive file beside it), scans with `diag.nodes.scan` and
writes ``NodeScan.to_dict()`` there. When no worker wrote an answer (none ran, it crashed, or
the scan raised), preflight scans in its own process, so a failure is reported as always.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["scan_to"]


def _claim(path: Path) -> bool:
    try:
        os.close(os.open(f"{path}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except OSError:  # another worker of the run has it, or the folder is gone
        return False


def scan_to(path: str, repeats: int, injections: list[dict[str, Any]]) -> None:
    """Scan this process's devices into `path`, unless another worker of the run claimed it.

    Never raises: a scan that fails here is left for the host to run again (and report).

    Args:
      path: where to write ``{"scan": NodeScan.to_dict(), "seconds": ...}``.
      repeats: the scan's repeats (`diag.nodes.scan`).
      injections: faults to inject, as `diag.nodes.Injection` fields.
    """
    answer = Path(path)
    if not _claim(answer):
        return
    try:
        from diag.nodes import Injection, scan

        t0 = time.perf_counter()
        result = scan(repeats=int(repeats), injections=tuple(Injection(**i) for i in injections))
        data = {"scan": result.to_dict(), "seconds": time.perf_counter() - t0}
        tmp = answer.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, default=str))
        os.replace(tmp, answer)
    except Exception:  # noqa: BLE001 - the host scans again and reports what fails
        return
