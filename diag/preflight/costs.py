"""What each preflight step measured last time, so the next run trims its plan to the budget."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["load_timings", "save_timings", "timings_path"]


def timings_path() -> Path:
    """Where each step's last measured duration is kept: beside the golden digests.

    ``$DIAG_CACHE_DIR/preflight/timings.json``, else ``~/.cache/diag/preflight/timings.json``
    (outside the ground-truth entries, which `diag cache clear` removes).
    """
    root = os.environ.get("DIAG_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "diag"
    return base / "preflight" / "timings.json"


def load_timings() -> dict[str, float]:
    try:
        data = json.loads(timings_path().read_text())
        return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}
    except (OSError, ValueError, AttributeError):
        return {}  # none yet, or unreadable: the built-in estimates stand


def save_timings(measured: dict[str, float]) -> None:
    path = timings_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**load_timings(), **measured}, indent=1))
        os.replace(tmp, path)  # atomic: a concurrent preflight reads the old or the new file
    except OSError:
        pass  # a read-only home: the next run uses the estimates again
