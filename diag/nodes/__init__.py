"""Bad-device and bad-host scan: the same deterministic work on every device, then a vote.

Fleets see silent data corruption from a few devices per thousand, and most of it is wrong
*finite* values, not NaN. A single-machine diagnostic cannot tell a wrong result from a right
one without a reference; a vote can. `scan` runs deterministic workloads (bf16 and fp32
matmul chains, a softmax, one training step, or the user's own callable) on every device,
digests every output bit for bit, and compares:

* across devices, per (workload, repeat): the digest a strict majority holds is the reference;
  devices that differ are suspects. With two devices that disagree there is no majority: the
  scan says so and names both unless a stored golden digest breaks the tie;
* across repeats on one device: repeat r uses input ``r % INPUTS_PER_WORKLOAD``, so every input
  is seen several times; a device whose repeats of the same input disagree is intermittent;
* with a golden digest stored for this device kind and jax/jaxlib version (`--save-golden`);
* NaN/Inf counts, and timing: a device whose *fastest* repeat is slower than `slow_factor` times
  the median device is a straggler (`slow`), reported apart from wrong results.

Inputs alternate between two seeded arrays so that a stale output (a device "stuck" on its
previous result) differs from the right one; with one fixed input it would be invisible.

Multi-host scans use JAX's own runtime: `jax.distributed.initialize` and
`jax.experimental.multihost_utils.process_allgather`; every process computes the same verdict
from the gathered digests and process 0 writes it. jax is imported inside functions only:
`import diag` stays framework-free, and ``--host-devices`` must set XLA_FLAGS before jax starts.

Detection: a device that corrupts each call independently with probability p is caught by a
scan of R repeats over W workloads with probability ``1 - (1 - p) ** (R * W)`` (each faulty
call changes the output bits, and the other devices hold a strict majority), see
`detection_probability` and `repeats_for`.
"""

from __future__ import annotations

from diag.errors import UsageError  # noqa: F401  (diag.nodes.UsageError, as before the split)
from diag.nodes.config import misconfigured_lines
from diag.nodes.inject import (
    FAULT_KINDS,
    Injection,
    check_injections,
    detection_probability,
    injection_outcomes,
    parse_injection,
    repeats_for,
)
from diag.nodes.result import NODES_SCHEMA, NodeScan, NodeScanError, NodeVote
from diag.nodes.rundir import write_run
from diag.nodes.scan import EXIT_SELFTEST_MISSED, FRAMEWORKS, scan
from diag.nodes.store import default_golden_dir
from diag.nodes.torch_runtime import detect_framework
from diag.nodes.vote import Observations, analyze
from diag.nodes.workloads import (
    BUILTIN_WORKLOADS,
    INPUTS_PER_WORKLOAD,
    Workload,
    builtin_workload,
    load_workload,
)

__all__ = [
    "BUILTIN_WORKLOADS",
    "EXIT_SELFTEST_MISSED",
    "FAULT_KINDS",
    "FRAMEWORKS",
    "INPUTS_PER_WORKLOAD",
    "NODES_SCHEMA",
    "Injection",
    "NodeScan",
    "NodeScanError",
    "NodeVote",
    "Observations",
    "Workload",
    "analyze",
    "builtin_workload",
    "check_injections",
    "default_golden_dir",
    "detect_framework",
    "detection_probability",
    "injection_outcomes",
    "load_workload",
    "misconfigured_lines",
    "parse_injection",
    "repeats_for",
    "scan",
    "write_run",
]
