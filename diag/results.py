"""Record schema, run directory and the append-only JSONL store.

A run directory holds ``run.json`` (environment and run state) and ``results.jsonl`` (one
record per line, appended and flushed as each record arrives). Nothing is rewritten in place
except ``run.json``, which is replaced atomically, so an interrupted or crashed run keeps
every record finished before it stopped.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

__all__ = [
    "SCHEMA",
    "STATUSES",
    "Record",
    "RunDir",
    "new_run_id",
    "read_records",
    "worst_status",
]

SCHEMA = "diag.record/1"
RUN_SCHEMA = "diag.run/1"

# Ordered from best to worst; `worst_status` relies on this order.
STATUSES = ("pass", "skip", "warn", "fail", "error")


@dataclass
class Record:
    """One result: a (probe, case, backend) triple and its verdict.

    Attributes:
      op: the op name (`matmul`, ...), the same name in backends and oracle.
      probe: the probe's name in its suite (e.g. `matmul.sweep_d4`).
      case: a stable, human-readable case id (e.g. `m=64 k=4 n=64 float32 precision=default`).
      params: the case parameters as data (shape, dtype, precision setting, sweep value).
      backend: `jax-cpu`, `torch-cpu`, ... or `a|b` for a cross-backend agreement record.
      device: what the worker reported (platform, kind, id), empty for skips.
      dtype: the input/output dtype name.
      metrics: numbers against the oracle (ULPs, relative error, bound ratio, NaN/Inf counts).
      status: one of STATUSES.
      reason: one line a person can act on.
      kind: `probe` for a backend result, `agreement` for a cross-backend comparison.
      timings: compile and run times with their raw samples.
      framework: framework name and version the worker ran.
      oracle: how ground truth was obtained (method, fallbacks, cache hit).
      settings: the numerics settings in effect in the worker (XLA_FLAGS, LIBTPU_INIT_ARGS,
        JAX config, torch precision flags), so one record says what it was computed under.
    """

    op: str
    probe: str
    case: str
    params: dict[str, Any]
    backend: str
    device: dict[str, Any]
    dtype: str
    metrics: dict[str, Any]
    status: str
    reason: str
    kind: str = "probe"
    timings: dict[str, Any] = field(default_factory=dict)
    framework: dict[str, Any] = field(default_factory=dict)
    oracle: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    run_id: str = ""
    schema: str = SCHEMA

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def to_json(self) -> dict[str, Any]:
        return _finite(asdict(self))


def _finite(obj: Any) -> Any:
    """JSON has no NaN/Inf: encode them as strings so every line stays valid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def worst_status(statuses) -> str:
    """The worst of the given statuses (`pass` for none)."""
    return max(statuses, key=STATUSES.index, default="pass")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def read_records(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Yield records from a ``results.jsonl`` file (or a run directory containing one).

    A torn last line (the process was killed mid-write) is skipped, never fatal.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "results.jsonl"
    if not p.exists():
        return
    with p.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


class RunDir:
    """A run folder: ``run.json`` + ``results.jsonl`` (+ ``traces/``, ``report.html``)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    @property
    def run_json(self) -> Path:
        return self.path / "run.json"

    @property
    def results_jsonl(self) -> Path:
        return self.path / "results.jsonl"

    @classmethod
    def create(cls, root: str | os.PathLike, run_id: str, env: dict[str, Any]) -> "RunDir":
        run = cls(Path(root) / run_id)
        run.path.mkdir(parents=True, exist_ok=False)
        run.write_meta({"schema": RUN_SCHEMA, "run_id": run_id, "state": "running",
                        "started": time.time(), "environment": env})
        run.results_jsonl.touch()
        return run

    def read_meta(self) -> dict[str, Any]:
        with self.run_json.open() as f:
            return json.load(f)

    def write_meta(self, meta: dict[str, Any]) -> None:
        """Replace run.json atomically (write a temp file, then rename)."""
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".run.json.")
        with os.fdopen(fd, "w") as f:
            json.dump(_finite(meta), f, indent=2, default=str)
        os.replace(tmp, self.run_json)

    def update_meta(self, **fields: Any) -> None:
        meta = self.read_meta()
        meta.update(fields)
        self.write_meta(meta)

    def append(self, record: Record | dict[str, Any]) -> None:
        """Append one record and flush it to disk before returning."""
        data = record.to_json() if isinstance(record, Record) else _finite(record)
        line = json.dumps(data, default=str)
        with self.results_jsonl.open("a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def records(self) -> list[dict[str, Any]]:
        return list(read_records(self.results_jsonl))
