"""One process's share of a scan, the same for every framework: run, digest, keep for ULPs.

The protocol a process follows (`run_local`): build every workload, call each once per device
on an extra input (compile / warm-up, not judged), then for each repeat r, each workload and
each device: put input ``r % INPUTS_PER_WORKLOAD`` on the device, wait, time the call until its
output is ready, copy the output to the host, apply any injected fault, digest its bits. A
framework enters only through a `Runtime` (`diag.nodes.distributed.JaxRuntime`,
`diag.nodes.torch_runtime.TorchRuntime`): how to place an input, wait for an output, copy it to
numpy, gather arrays from every process. The vote never sees a framework.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from diag.errors import DiagError
from diag.nodes.inject import Injection
from diag.nodes.result import NodeScanError
from diag.nodes.workloads import INPUTS_PER_WORKLOAD, Workload
from diag.numerics import bits_digest, is_supported, ulp_distance
from diag.worker.faults import corrupt

__all__ = [
    "DIGEST_BYTES",
    "Device",
    "LocalRun",
    "Runtime",
    "hex_digests",
    "local_ulps",
    "run_local",
]

DIGEST_BYTES = 32  # sha256, `numerics.bits_digest`


@dataclass(frozen=True)
class Device:
    """A device this process scans.

    Attributes:
      id: unique across the job (jax's device id; torch: the global rank, or the CUDA index
        in a single-process scan).
      kind: the device kind (jax ``device_kind``; torch: the GPU name, or "cpu").
      platform: "cpu", "gpu" or "tpu".
      handle: what the framework places arrays on (a jax Device, a torch.device).
    """

    id: int
    kind: str
    platform: str
    handle: Any = None


class Runtime(Protocol):
    """What a scan needs from a framework (one instance per process)."""

    framework: str  # "jax" | "torch"
    process_index: int
    process_count: int
    distributed: bool

    def local_devices(self) -> list[Device]: ...
    def all_devices(self) -> list[tuple[int, int]]: ...  # (device id, process) of every device
    def build(self, workload: Workload) -> Callable: ...
    def put(self, x: np.ndarray, device: Device) -> Any: ...
    def ready(self, y: Any) -> None: ...
    def to_numpy(self, y: Any) -> np.ndarray: ...
    def allgather(self, a: np.ndarray) -> np.ndarray: ...  # [P, *a.shape], process order
    def versions(self) -> dict[str, str]: ...
    def settings(self) -> dict[str, str]: ...  # the framework's part of the fingerprint
    def shutdown(self) -> None: ...


@dataclass
class LocalRun:
    """This process's share: its devices' digests and timings, and the outputs for ULPs."""

    devices: list[Device]
    digests: np.ndarray  # uint8 [d, W, R, 32]
    nan: np.ndarray
    inf: np.ndarray
    times: np.ndarray
    injected: np.ndarray
    outputs: list = field(default_factory=list)  # [d][w][r] host arrays
    compile_s: float = 0.0  # the warm-up calls: compiling for every device


def _nonfinite(arr: np.ndarray) -> tuple[int, int]:
    if not is_supported(arr.dtype):
        return 0, 0
    return int(np.isnan(arr).sum()), int(np.isinf(arr).sum())


def _warm_up(rt: Runtime, devices, fns, workloads, inputs) -> list[list[np.ndarray | None]]:
    """One call per (workload, device) on the extra input; its output is what a "stuck"
    device returns first."""
    last: list[list[np.ndarray | None]] = [[None] * len(fns) for _ in devices]
    for w, fn in enumerate(fns):
        for d, dev in enumerate(devices):
            try:
                y = fn(rt.put(inputs[w][-1], dev))
                rt.ready(y)
                last[d][w] = rt.to_numpy(y)
            except DiagError:
                raise
            except Exception as e:
                raise NodeScanError(
                    f"workload {workloads[w].name} raised on device {dev.id}: "
                    f"{type(e).__name__}: {e}"
                ) from None
    return last


def run_local(
    rt: Runtime,
    devices: Sequence[Device],
    workloads: Sequence[Workload],
    repeats: int,
    seed: int,
    injections: Sequence[Injection],
) -> LocalRun:
    """Run every workload `repeats` times on each local device (the protocol above).

    Raises:
      NodeScanError: a workload raised.
    """
    d_n, w_n = len(devices), len(workloads)
    shape = (d_n, w_n, repeats)
    local = LocalRun(
        list(devices),
        np.zeros(shape + (DIGEST_BYTES,), np.uint8),
        np.zeros(shape, np.int32),
        np.zeros(shape, np.int32),
        np.zeros(shape, np.float64),
        np.zeros(shape, bool),
        [[[None] * repeats for _ in range(w_n)] for _ in range(d_n)],
    )
    fns = [rt.build(w) for w in workloads]
    inputs = [[w.make_input(seed, k) for k in range(INPUTS_PER_WORKLOAD + 1)] for w in workloads]
    pid = rt.process_index
    inj = [[i for i in injections if i.applies_to(dev.id, pid)] for dev in devices]
    rngs = [
        np.random.default_rng([i.seed for i in inj[d]] + [pid, dev.id])
        for d, dev in enumerate(devices)
    ]
    t0 = time.perf_counter()
    last = _warm_up(rt, devices, fns, workloads, inputs)
    local.compile_s = time.perf_counter() - t0
    for r in range(repeats):
        for w, fn in enumerate(fns):
            x = inputs[w][r % INPUTS_PER_WORKLOAD]
            for d, dev in enumerate(devices):
                xd = rt.put(x, dev)
                rt.ready(xd)
                faults = [i for i in inj[d] if rngs[d].random() < i.rate]
                t0 = time.perf_counter()
                y = fn(xd)
                rt.ready(y)
                if any(i.kind == "slow" for i in faults):
                    time.sleep(max(i.delay for i in faults if i.kind == "slow"))
                local.times[d, w, r] = time.perf_counter() - t0
                out = rt.to_numpy(y)
                delivered = out
                for i in faults:
                    if i.kind != "slow":
                        delivered = corrupt(delivered, i.kind, rng=rngs[d], stale=last[d][w])
                last[d][w] = out
                local.injected[d, w, r] = bool(faults)
                local.outputs[d][w][r] = delivered
                # The digest the runner's worker proves inputs with; raw bytes travel (gather).
                digest = bytes.fromhex(bits_digest(delivered))
                local.digests[d, w, r] = np.frombuffer(digest, np.uint8)
                local.nan[d, w, r], local.inf[d, w, r] = _nonfinite(delivered)
    return local


def hex_digests(raw: np.ndarray) -> np.ndarray:
    """uint8 [..., 32] -> str array [...] of hex digests."""
    flat = raw.reshape(-1, raw.shape[-1])
    return np.array([bytes(row).hex() for row in flat], dtype=object).reshape(raw.shape[:-1])


def local_ulps(local: LocalRun, ref: np.ndarray) -> np.ndarray:
    """Max ULP distance of each local output from a local copy of the reference output."""
    d_n, w_n, r_n = local.nan.shape
    out = np.full((d_n, w_n, r_n), np.nan)
    hexes = hex_digests(local.digests)
    for w in range(w_n):
        for r in range(r_n):
            holders = [d for d in range(d_n) if hexes[d, w, r] == ref[w, r]]
            if not holders:
                continue
            good = local.outputs[holders[0]][w][r]
            for d in range(d_n):
                y = local.outputs[d][w][r]
                if (
                    hexes[d, w, r] != ref[w, r]
                    and is_supported(y.dtype)
                    and y.dtype == good.dtype
                    and y.shape == good.shape
                ):
                    out[d, w, r] = float(ulp_distance(y, good).max())
    return out
