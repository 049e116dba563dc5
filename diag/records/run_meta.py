"""run.json's schema (`RunMeta`, `diag.run/1`): a run folder's environment and state, and the
JSON types each field may hold (`RUN_FIELDS`), which `diag.records.results.RunDir.update_meta`
checks and `RunMeta.from_dict` reads back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["INCOMPLETE", "RUN_FIELDS", "RUN_SCHEMA", "RunMeta", "run_verdict"]

RUN_SCHEMA = "diag.run/1"

#: run.json's `verdict` for a run that did not finish (`interrupted`, `aborted`): never a
#: status, so that a script reading the verdict cannot take a run cut short for a pass.
INCOMPLETE = "incomplete"


def run_verdict(state: str, worst: str) -> str:
    """run.json's verdict: `worst` (the worst status of the records written) for a finished
    run, `INCOMPLETE` for one that stopped before every check ran."""
    return worst if state == "finished" else INCOMPLETE


@dataclass
class RunMeta:
    """run.json: a run folder's environment and state (schema `diag.run/1`,
    docs/records.md). The one description of run.json: the runner and `diag nodes` write it
    through `RunDir.update_meta` (which refuses a key not named here), the report reads it
    through `RunMeta.from_dict`.

    Attributes:
      run_id: the run folder's name.
      state: `running`, `finished`, `interrupted` or `aborted`.
      started, finished: Unix times.
      environment: the host environment (`diag.settings.environment.collect`): host, versions,
        `command` (the command line), numerics environment variables, `flags`, `findings`.
      suite: `name`, `path`, `cases` of the suite run.
      backends_planned: the backend labels planned (`jax-cpu`, `jax-cpu+B`).
      backends_skipped: backend -> why it could not run.
      backends: backend label -> what its worker reported at start-up (`device`,
        `framework`, `settings`, `fingerprints`, and with them `features`: the float32
        default-setting arithmetic features of its matmul, `diag.arith.precision.features`).
      ab: an A/B run's setting: `B` (the assignments as given) and `env` (the B side's
        environment additions); None otherwise.
      report_sections: op -> the report section that shows its records (from the probe
        table, `Probe.report_section`).
      counts: records per status.
      phases: backend label -> seconds per phase (`diag.run.runner.PHASES`: start, compile, run,
        transfer, truth, judge, write, wall): where the run's time went.
      verdict: the worst status among records that checked something (`worst_status`) of a
        finished run; `incomplete` (`INCOMPLETE`) for an interrupted or aborted one.
      error: what stopped an `aborted` run.
      command: the diag verb that wrote the folder when it is not `run` (`nodes`).
      exit_code: the exit code `diag nodes` chose; for a `diag run` that did not finish, the
        exit code the process ended with (130 Ctrl-C, 143 SIGTERM, 70 a bug, 2 a full disk).
      nodes: `diag nodes`' summary (verdict, selftest, suspects, devices).
      extra: keys this diag does not know (a newer diag wrote the file), kept as read.
    """

    run_id: str = ""
    state: str = "unknown"
    started: float | None = None
    finished: float | None = None
    environment: dict[str, Any] = field(default_factory=dict)
    suite: dict[str, Any] = field(default_factory=dict)
    backends_planned: list[str] = field(default_factory=list)
    backends_skipped: dict[str, str] = field(default_factory=dict)
    backends: dict[str, Any] = field(default_factory=dict)
    ab: dict[str, Any] | None = None
    report_sections: dict[str, str] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    verdict: str | None = None
    error: str | None = None
    command: str | None = None
    exit_code: int | None = None
    nodes: dict[str, Any] | None = None
    schema: str = RUN_SCHEMA
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def command_line(self) -> str | None:
        """The command line the run was started with (`environment.command`)."""
        value = self.environment.get("command")
        return str(value) if value else None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunMeta:
        """run.json's contents as a RunMeta; a field of the wrong JSON type (a hand-edited or
        damaged file) reads as absent, unknown keys go to `extra`."""
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for name, value in data.items():
            if name not in RUN_FIELDS:
                extra[name] = value
            elif isinstance(value, RUN_FIELDS[name]) and not isinstance(value, bool):
                kwargs[name] = value
        return cls(**kwargs, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object run.json holds (unknown keys kept)."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**self.extra, **data}


# run.json field -> the JSON types it may hold (ints are valid floats).
RUN_FIELDS: dict[str, tuple[type, ...]] = {
    "run_id": (str,),
    "state": (str,),
    "started": (int, float),
    "finished": (int, float),
    "environment": (dict,),
    "suite": (dict,),
    "backends_planned": (list,),
    "backends_skipped": (dict,),
    "backends": (dict,),
    "ab": (dict,),
    "report_sections": (dict,),
    "counts": (dict,),
    "phases": (dict,),
    "verdict": (str,),
    "error": (str,),
    "command": (str,),
    "exit_code": (int,),
    "nodes": (dict,),
    "schema": (str,),
}
