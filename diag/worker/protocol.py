"""The worker protocol, typed: the job the host writes and the events a worker streams back.

Both ends use these types: the host builds a `Job` (`diag.run.runner`, `diag.trace.passes`) and
reads each event with `Event.from_json` (`diag.worker.host`: the runner, discovery and `diag
env` see `Ready`, `Result`, ... values, never raw dicts); the worker (`diag.worker.main`) reads
the job with `Job.from_json` and writes each event with `Event.to_json`. On the wire they stay
one JSON object per line (a job is one JSON file), so a worker under another Python
(torch-xla) needs nothing but this module. An event's JSON keeps the keys the runner has
always read (`event`, `case`, `outputs`, ...); `parse_event` refuses an unknown `event` kind.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "CaseJob",
    "Hook",
    "Job",
    "Output",
    "Event",
    "Ready",
    "Result",
    "CaseError",
    "Arithmetic",
    "Platforms",
    "BackendInfo",
    "Done",
    "EVENTS",
    "parse_event",
]


@dataclass(frozen=True)
class CaseJob:
    """One case as the worker runs it.

    Attributes:
      id: the case id (`c0007`), echoed by its events.
      op: the op, whose implementation the worker builds (`diag.plan.registry`).
      op_args: the op's arguments, its row's fixed ones included (a sampler's batch sizes).
      inputs: paths of the input .npy files (raw bits for floats).
      input_dtypes: each input's dtype name.
      hunt_nans: a non-finite output is hunted to the op that produced it (`diag.nan`).
    """

    id: str
    op: str
    inputs: list[str]
    input_dtypes: list[str]
    op_args: dict[str, Any] = field(default_factory=dict)
    hunt_nans: bool = False

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Hook:
    """A function the worker calls after its job's cases, named by the host: how a caller
    (`diag preflight`'s node scan) asks a worker for more work without the worker importing
    the caller, and without a side channel in the workers' environment.

    Attributes:
      module, function: what to call (`diag.nodes.hook`, `scan_to`), as
        ``function(**args)``; imported in the worker only when it runs there.
      args: its keyword arguments (JSON values).
      framework: call it only in a worker of this framework (`jax`); None for every worker.
    """

    module: str
    function: str
    args: dict[str, Any] = field(default_factory=dict)
    framework: str | None = None


@dataclass(frozen=True)
class Job:
    """All of one backend's cases for one worker.

    Attributes:
      backend: the backend's name (`jax-cpu`); label: what its records say (`jax-cpu+B`).
      out_dir: where the worker writes outputs (and HLO).
      cases: the cases, in order.
      repeats, repeat_budget_s: timed runs per case, and the seconds after which a case stops
        repeating.
      hlo: write each case's compiled HLO (an A/B run).
      trace: `--trace`'s field (`diag.trace.capture.job_field`), or None.
      fingerprint: the (precision, via) settings whose arithmetic the worker measures after
        the cases; empty for none.
      features: with `fingerprint`, also measure the unit's arithmetic features
        (`diag.arith.precision.features`, for `diag check`'s baselines; `diag preflight`
        reads none, ~0.2 CPU-s per backend).
      hooks: functions to call after the cases and the arithmetic (`Hook`).
    """

    backend: str
    label: str
    out_dir: str
    cases: list[CaseJob]
    repeats: int = 3
    repeat_budget_s: float = float("inf")
    hlo: bool = False
    trace: Any = None
    fingerprint: list[tuple[str, str]] = field(default_factory=list)
    features: bool = True
    hooks: list[Hook] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["fingerprint"] = [list(p) for p in self.fingerprint]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Job:
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in known}
        fields["cases"] = [CaseJob(**c) for c in data.get("cases", [])]
        fields["fingerprint"] = [tuple(p) for p in data.get("fingerprint") or []]
        fields["hooks"] = [Hook(**h) for h in data.get("hooks") or []]
        fields.setdefault("label", data["backend"])
        return cls(**fields)


@dataclass(frozen=True)
class Output:
    """One output file: its name (`output`, `values`, a sampler path), path, dtype, shape."""

    name: str
    path: str
    dtype: str
    shape: list[int]


class Event:
    """A worker event; `kind` is its `event` key on the wire."""

    kind: ClassVar[str] = ""

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)  # type: ignore[call-overload]
        return {"event": self.kind, **data}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Event:
        """The typed event of one protocol line's JSON object (`parse_event`); called on a
        kind (`Result.from_json`), an event of another kind is refused.

        Raises:
          ValueError: an unknown `event` kind, or not one of `cls`.
          TypeError: fields that kind does not have, or lacks.
        """
        event = parse_event(data)
        if not isinstance(event, cls):
            raise ValueError(f"expected a {cls.kind or 'worker'} event, got {data.get('event')!r}")
        return event


@dataclass(frozen=True)
class Ready(Event):
    """The backend is set up: its device, framework and settings (run.json's `backends`)."""

    kind: ClassVar[str] = "ready"
    device: dict[str, Any]
    framework: dict[str, Any]
    settings: dict[str, Any]


@dataclass(frozen=True)
class Result(Event):
    """A case ran: its outputs, timings and the digests of the inputs as the device held them."""

    kind: ClassVar[str] = "result"
    case: str
    outputs: list[dict[str, Any]]
    timings: dict[str, Any]
    input_digests: list[str]
    hlo: str | None = None
    nan_report: dict[str, Any] | None = None


@dataclass(frozen=True)
class CaseError(Event):
    """A case raised: the error's first line and the traceback's tail."""

    kind: ClassVar[str] = "case_error"
    case: str
    error: str
    traceback: str = ""


@dataclass(frozen=True)
class Arithmetic(Event):
    """The arithmetic measured after the cases: fingerprints per setting and features."""

    kind: ClassVar[str] = "arithmetic"
    seconds: float
    fingerprints: list[dict[str, Any]] = field(default_factory=list)
    features: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Platforms(Event):
    """Discovery: the platforms a framework sees."""

    kind: ClassVar[str] = "platforms"
    platforms: list[str]


@dataclass(frozen=True)
class BackendInfo(Event):
    """`diag env`: one present backend's device, framework, settings and fingerprints."""

    kind: ClassVar[str] = "backend"
    backend: str
    fingerprints: list[dict[str, Any]]
    device: dict[str, Any] = field(default_factory=dict)
    framework: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    features: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Done(Event):
    """The worker finished (for `diag env`: with the platforms it saw)."""

    kind: ClassVar[str] = "done"
    platforms: list[str] | None = None


EVENTS: dict[str, type] = {
    c.kind: c for c in (Ready, Result, CaseError, Arithmetic, Platforms, BackendInfo, Done)
}


def parse_event(data: dict[str, Any]) -> Event:
    """The typed event of one protocol line's JSON object.

    Raises:
      ValueError: an unknown `event` kind, or fields that kind does not have.
    """
    cls = EVENTS.get(data.get("event", ""))
    if cls is None:
        raise ValueError(
            f"unknown worker event {data.get('event')!r}; expected one of {', '.join(EVENTS)}"
        )
    return cls(**{k: v for k, v in data.items() if k != "event"})
