"""Record schema, run directory and the append-only JSONL store.

A run directory holds ``run.json`` (environment and run state) and ``results.jsonl`` (one
record per line, appended and flushed as each record arrives). Nothing is rewritten in place
except ``run.json``, which is replaced atomically, so an interrupted or crashed run keeps
every record finished before it stopped.

The names a reader of a run folder needs are all importable from here: run.json's schema
(`RunMeta`) lives in `diag.records.run_meta`, reading results.jsonl back (`read_results`) in
`diag.records.results_file`, and the status order (`STATUSES`, `worst_status`) in `diag.status`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from diag.errors import EXIT_NUMERICAL_FAILURE, EXIT_OK, EXIT_WORKER_CRASH, UsageError

# Where an output file is prepared and its errors worded (diag.records.outputs), for the report too.
from diag.records.outputs import output_errors, prepare_output
from diag.records.results_file import RecordsRead, read_records, read_results
from diag.records.run_meta import INCOMPLETE, RUN_FIELDS, RunMeta

# The status order's home (diag.status), named here beside the records that carry one.
from diag.status import CHECKED, COUNTED, STATUSES, worst_status

__all__ = [
    "CHECKED",
    "COUNTED",
    "INCOMPLETE",
    "SCHEMA",
    "STATUSES",
    "Record",
    "RecordsRead",
    "Interrupted",
    "RunDir",
    "RunMeta",
    "RunResult",
    "new_run_id",
    "output_errors",
    "prepare_output",
    "read_records",
    "read_results",
    "worst_status",
]

SCHEMA = "diag.record/1"


@dataclass
class Record:
    """One result: a (probe, case, backend) triple and its verdict.

    Attributes:
      op: the op name (`matmul`, ...), the same name in backends and oracle.
      probe: the probe's name in its suite (e.g. `matmul.sweep_d4`).
      case: a stable, human-readable case id (e.g. `m=64 k=4 n=64 float32 precision=default`).
      params: the case parameters as data (shape, dtype, precision setting, sweep value).
      backend: `jax-cpu`, `torch-cpu`, ... or `a|b` for a cross-backend agreement record;
        the B side of an A/B run reads `jax-cpu+B` (for people: code reads `variant`).
      variant: '' for a plain run and an A/B run's A side, 'B' for its B side (`diag.run.ab`).
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
    variant: str = ""
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


def _rewrite_in_place(path: Path, data: dict[str, Any]) -> bool:
    """On a full disk, write a JSON file over itself, compact, when it fits in the blocks
    the file already holds (no new block is needed, so the write cannot run out of space).

    Returns:
      Whether it was written; False leaves the file as it was.
    """
    # All of it if it fits, else without the workers' measured arithmetic (the bulk).
    fits = [
        json.dumps(_finite(d), separators=(",", ":"), default=str).encode("utf-8")
        for d in (
            data,
            {
                **{k: v for k, v in data.items() if k != "backends"},
                "error": (
                    f"{data.get('error') or 'no space left on device'}; "
                    "run.json kept without the backends' arithmetic"
                ),
            },
        )
    ]
    try:
        room = path.stat().st_blocks * 512 if path.is_file() else 0
        text = next((t for t in fits if len(t) <= room), None)
        if text is None:
            return False
        with path.open("r+b") as f:
            f.write(text)
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        return False
    return True


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


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

    @property
    def history_json(self) -> Path:
        """The series of the records that moved in the history the run was appended to
        (`diag run --history`), which the report plots."""
        return self.path / "history.json"

    @classmethod
    def create(cls, root: str | os.PathLike, run_id: str, env: dict[str, Any]) -> RunDir:
        run = cls(Path(root) / run_id)
        run.path.mkdir(parents=True, exist_ok=False)
        run.write_meta(
            RunMeta(run_id=run_id, state="running", started=time.time(), environment=env).to_dict()
        )
        run.results_jsonl.touch()
        return run

    def read_meta(self) -> dict[str, Any]:
        """The contents of run.json.

        Raises:
          UsageError: run.json is not a JSON object (truncated or edited by hand); the
            message names the file and where the JSON breaks.
        """
        try:
            with self.run_json.open(encoding="utf-8") as f:
                meta = json.load(f)
        except json.JSONDecodeError as e:
            raise UsageError(
                f"{self.run_json}: not valid JSON ({e.msg} at line {e.lineno}, "
                f"column {e.colno}); the run folder is damaged, rerun the "
                "suite or restore run.json"
            ) from None
        except UnicodeDecodeError:
            raise UsageError(
                f"{self.run_json}: not UTF-8 text; the run folder is damaged, "
                "rerun the suite or restore run.json"
            ) from None
        if not isinstance(meta, dict):
            raise UsageError(
                f"{self.run_json}: holds a JSON {type(meta).__name__}, not the "
                "object diag writes; rerun the suite or restore run.json"
            )
        return meta

    def write_meta(self, meta: dict[str, Any]) -> None:
        """Replace run.json atomically (see `write_json`)."""
        self.write_json(self.run_json.name, meta)

    def write_json(self, name: str, data: dict[str, Any]) -> Path:
        """Replace one JSON file of the run folder (run.json, nodes.json) atomically: write a
        temp file, then rename, so a reader never sees half a file.

        The temp file is created with mode 0666 less the umask, as every other file diag
        writes (`tempfile.mkstemp` would make it 0600, unreadable to a CI artefact uploader
        running as another user).

        Returns:
          The file written.
        """
        path = self.path / name
        tmp = self.path / f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            with tmp.open("x", encoding="utf-8") as f:
                json.dump(_finite(data), f, indent=2, default=str)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not _rewrite_in_place(path, data):
                raise
        finally:
            tmp.unlink(missing_ok=True)
        return path

    def read_run(self) -> RunMeta:
        """run.json as a `RunMeta` (raises as `read_meta`)."""
        return RunMeta.from_dict(self.read_meta())

    def update_meta(self, **changes: Any) -> None:
        """Set run.json fields (names from `RunMeta`) and replace the file atomically.

        Raises:
          TypeError: a name that is not a run.json field (a typo would silently add a key
            the report never reads).
        """
        unknown = set(changes) - set(RUN_FIELDS)
        if unknown:
            raise TypeError(
                f"not run.json fields (diag.records.results.RunMeta): {sorted(unknown)}"
            )
        meta = self.read_meta()
        meta.update(changes)
        self.write_meta(meta)

    def append(self, record: Record | dict[str, Any]) -> None:
        """Append one record and flush it to disk before returning."""
        data = record.to_json() if isinstance(record, Record) else _finite(record)
        line = (json.dumps(data, default=str) + "\n").encode("utf-8")
        fd = os.open(self.results_jsonl, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                view = memoryview(line)
                while view:  # a write may be partial; the next one then says why
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            except OSError:
                # A write cut short (a full disk) leaves no torn line: the file ends with the
                # last whole record, and the space the part took is given back.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)
                raise
        finally:
            os.close(fd)

    def records(self) -> list[dict[str, Any]]:
        """The readable records (see `read_results` for the unreadable lines)."""
        return self.read_results().records

    def read_results(self) -> RecordsRead:
        """The records and any line of results.jsonl that could not be read."""
        return read_results(self.results_jsonl)


# The outcome of `diag.run` (kept here, beside the records it holds).


@dataclass
class RunResult:
    run_dir: Path
    records: list[dict[str, Any]]
    state: str  # finished | interrupted
    counts: dict[str, int] = field(default_factory=dict)
    #: backend label -> seconds per phase (`PHASES`): where the run's time went.
    phases: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        """4 when a worker crashed or an op raised, else 1 when a check failed, else 0."""
        if any(r["status"] == "error" for r in self.records):
            return EXIT_WORKER_CRASH
        if any(r["status"] == "fail" for r in self.records):
            return EXIT_NUMERICAL_FAILURE
        return EXIT_OK


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run; the run folder is marked `interrupted` and keeps its records."""

    def __init__(self, result: RunResult):
        super().__init__("interrupted")
        self.result = result
