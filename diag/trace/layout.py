"""Where a traced run keeps what it captured, and the readers of it.

The run folder is an XProf logdir (`xprof --logdir RUN` opens it): each (case, backend)
profiler session is `plugins/profile/<case id>.<backend>/`, the layout `jax.profiler.trace`
writes, named so a person finds the case in XProf's session list. Beside it:

    trace/<case id>.<backend>.json          the session's summary (`summarise`), written by
                                            the worker right after the capture
    hlo/<case id>.<backend>.hlo.txt         the optimised HLO of a JAX case
    trace/passes/<case id>.<backend>.json   the first XLA pass where an A/B pair differs

`diag.report.trace` reads the same files (the report imports no diag package but its own).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "SESSIONS_DIR",
    "SUMMARY_DIR",
    "HLO_DIR",
    "PASSES_DIR",
    "read_summaries",
    "read_passes",
    "session_name",
]

SESSIONS_DIR = Path("plugins") / "profile"
SUMMARY_DIR = Path("trace")
HLO_DIR = Path("hlo")
PASSES_DIR = SUMMARY_DIR / "passes"


def session_name(case_id: str, label: str, variant: str = "") -> str:
    """The XProf session (folder) name of one capture: `c0003.jax-cpu`, `c0003.jax-cpu.highest`."""
    return ".".join(p for p in (case_id, label, variant) if p)


def _read_folder(folder: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # a torn file from a killed worker: that case has no summary
        if isinstance(data, dict):
            out.append(data)
    return out


def read_summaries(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every capture summary of a run folder, in case order."""
    return _read_folder(Path(run_dir) / SUMMARY_DIR)


def read_passes(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every pass attribution of a run folder's A/B pairs."""
    return _read_folder(Path(run_dir) / PASSES_DIR)
