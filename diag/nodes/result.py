"""What a scan says, as types: the vote (`NodeVote`) and the whole scan (`NodeScan`).

The command line, the terminal tables and the library read these by attribute, so a renamed
field is an error where it is read, not a silently empty column. nodes.json (schema
`NODES_SCHEMA`, docs/nodes.md) is `NodeScan.to_dict()` plus the run id; its keys are the field
names. Per-device rows, suspects, hosts and notes stay plain JSON-ready data: they go to
nodes.json, the report and a scheduler's exclusion list as they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from diag.errors import DiagError

__all__ = ["NODES_SCHEMA", "NodeScan", "NodeScanError", "NodeVote"]

NODES_SCHEMA = "diag.nodes/1"


class NodeScanError(DiagError):
    """The scan itself could not run (framework missing, distributed start-up failed, a
    workload raised)."""


@dataclass(frozen=True)
class NodeVote:
    """The verdict of `diag.nodes.analyze` on every device's observations.

    Attributes:
      verdict: "suspect" when any device is a suspect, else "ok" (a scan says
        "misconfigured" when only configurations differ).
      exit_code: 3 (`EXIT_BAD_NODE`) with a suspect (a scan: or a misconfigured host), else 0.
      devices: one dict per device: its identity, ``verdict`` (ok / slow / suspect),
        ``kinds`` of evidence, ``reason``, call counts, ``max_ulp``, timings, ``evidence``.
      suspects: ``{device_id, process_index, host, reason, kinds}`` per suspect device.
      slow: ``{device_id, process_index, host, reason, time_ratio}`` per straggler.
      hosts: one dict per (process, host): devices, suspects, slow, verdict.
      references: how many (workload, repeat) calls had a ``majority``, a ``golden`` digest,
        or neither (``undecided``) as their reference.
      fleet_median_repeat_s: the median device's median time for one repeat of every workload.
      notes: what limits this verdict (too few devices or repeats, mixed kinds, ...).
    """

    verdict: str
    exit_code: int
    devices: list[dict[str, Any]]
    suspects: list[dict[str, Any]]
    slow: list[dict[str, Any]]
    hosts: list[dict[str, Any]]
    references: dict[str, int]
    fleet_median_repeat_s: float
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data, keyed by field name."""
        return dataclasses.asdict(self)


_VOTE_FIELDS = [f.name for f in dataclasses.fields(NodeVote)]


@dataclass(frozen=True, kw_only=True)
class NodeScan(NodeVote):
    """What `diag.nodes.scan` returns: the vote over every device of every process, and what
    the scan covered. Every process holds the same vote; only `process_index` differs (and
    `selftest`, which covers the injections that process was given).

    Attributes:
      process_index, num_processes: this process and how many took part.
      platform, device_kind, versions: the hardware and jax/jaxlib the digests belong to.
      repeats, seed, inputs_per_workload: R, the input seed, inputs per workload.
      workloads: ``{name, shape, dtype, key}`` per workload (key: its golden-store key).
      golden: ``{path, compared, saved}``: the golden store file, the workloads compared with
        it, and how many entries this scan saved.
      injections: the faults this process injected (``kind, rate, device, process, seed,
        text``).
      detection: P(detect) per fault rate for this R x W (``formula``, ``rows``, ...).
      selftest: None without injections, else ``{"verdict": "found" | "missed",
        "injections": injection_outcomes(...)}``.
      local_devices: devices this process scanned.
      compile_seconds, scan_seconds, seconds_per_device, total_seconds: timings.
      framework: "jax" or "torch": whose runtime, workloads and versions these are.
      misconfigured: one entry per process whose configuration fingerprint differs from
        the majority's (`diag.nodes.config.compare`): ``{process_index, host, differs: [{key,
        value, majority}], reason, hardware_suspect}``; judged apart from ``suspects`` (the
        hardware suspects, whose bits differ), each marks the other (``misconfigured`` on a
        suspect, ``hardware_suspect`` here).
      config: ``{processes, keys, reference: {key: majority value}, no_majority}``.
      schema: `NODES_SCHEMA`.
    """

    process_index: int
    num_processes: int
    platform: str
    device_kind: str
    versions: dict[str, str]
    repeats: int
    seed: int
    inputs_per_workload: int
    workloads: list[dict[str, Any]]
    golden: dict[str, Any]
    injections: list[dict[str, Any]]
    detection: dict[str, Any]
    selftest: dict[str, Any] | None
    local_devices: int
    compile_seconds: float
    scan_seconds: float
    seconds_per_device: float
    total_seconds: float
    framework: str = "jax"
    misconfigured: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    schema: str = NODES_SCHEMA

    def to_dict(self) -> dict[str, Any]:
        """The nodes.json data (without ``run_id``): the schema, what the scan covered, then
        the vote, in the order nodes.json has always had; the configuration comparison
        (``framework``, ``misconfigured``, ``config``) after it."""
        data = dataclasses.asdict(self)
        tail = ["framework", "misconfigured", "config"]
        head = ["schema"] + [
            k for k in data if k not in _VOTE_FIELDS and k not in tail and k != "schema"
        ]
        return {k: data[k] for k in head + _VOTE_FIELDS + tail}
