"""The golden store: digests a healthy fleet gave, per device kind and jax/jaxlib version.

With two devices that disagree there is no majority; a stored golden digest breaks the tie,
and a whole fleet that drifted from it is noticed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from diag.nodes.workloads import INPUTS_PER_WORKLOAD

GOLDEN_SCHEMA = "diag.golden/1"


def default_golden_dir() -> Path:
    """``$DIAG_GOLDEN_DIR``, else ``$DIAG_CACHE_DIR/golden``, else ``~/.cache/diag/golden``.

    Entries live two folders deep (``<kind>/<versions>.json``), where ``diag cache clear``,
    which clears the ground-truth cache, does not reach.
    """
    if os.environ.get("DIAG_GOLDEN_DIR"):
        return Path(os.environ["DIAG_GOLDEN_DIR"]).expanduser()
    if os.environ.get("DIAG_CACHE_DIR"):
        return Path(os.environ["DIAG_CACHE_DIR"]).expanduser() / "golden"
    return Path.home() / ".cache" / "diag" / "golden"


def mark_cache_folder(gdir: Path) -> None:
    """When the golden store lives in diag's cache folder (``$DIAG_CACHE_DIR/golden``), mark
    that folder as diag's, so `diag cache clear` accepts the folder diag created."""
    from diag.oracle.cache import GroundTruthCache, default_cache_dir

    if Path(gdir) == default_cache_dir() / "golden":
        try:
            GroundTruthCache(default_cache_dir()).mark()
        except OSError:  # saving the golden digests reports any real write problem
            pass


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text) or "unknown"


def golden_path(root: Path, platform: str, kind: str, versions: Mapping[str, str]) -> Path:
    """Where the golden digests of one device kind and jax/jaxlib version live."""
    tag = "-".join(f"{k}{v}" for k, v in sorted(versions.items()))
    return Path(root) / _safe(f"{platform}-{kind}") / f"{_safe(tag)}.json"


def load_golden(path: Path, keys: Mapping[str, str]) -> dict[str, list[str]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    stored = data.get("workloads", {}) if isinstance(data, dict) else {}
    out = {}
    for name, key in keys.items():
        entry = stored.get(key)
        if isinstance(entry, list) and len(entry) == INPUTS_PER_WORKLOAD:
            out[name] = [str(x) for x in entry]
    return out


def save_golden(
    path: Path, keys: Mapping[str, str], digests: np.ndarray, meta: Mapping[str, Any]
) -> int:
    """Store the unanimous digest per (workload, input); returns the entries written."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    stored = data.get("workloads", {}) if isinstance(data, dict) else {}
    n = 0
    for w, key in enumerate(keys.values()):
        per_input = []
        for k in range(INPUTS_PER_WORKLOAD):
            values = np.unique(digests[:, w, k::INPUTS_PER_WORKLOAD])
            per_input.append(str(values[0]) if len(values) == 1 else None)
        if all(per_input):
            stored[key] = per_input
            n += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(
        json.dumps(
            {"schema": GOLDEN_SCHEMA, **meta, "saved": time.time(), "workloads": stored},
            indent=2,
            sort_keys=True,
        )
    )
    os.replace(tmp, path)
    return n
