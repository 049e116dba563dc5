"""`scan`: run the workloads on every device, gather, vote, and say whether the self-test held.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from diag.errors import EXIT_NUMERICAL_FAILURE, DiagError, UsageError
from diag.faults import corrupt
from diag.nodes import store
from diag.nodes.distributed import (NodeScanError, StdoutToStderr, gather, gather_ulps,
                                    hex_digests, import_jax, init_distributed, jax_versions)
from diag.nodes.inject import (Injection, check_injections, detection_table,
                               injection_outcomes)
from diag.nodes.result import NodeScan
from diag.nodes.vote import Observations, analyze, references
from diag.nodes.workloads import BUILTIN_WORKLOADS, INPUTS_PER_WORKLOAD, Workload
from diag.numerics import bits_digest, is_supported, ulp_distance

#: Exit code when an injected fault was not found and no device is a suspect: the self-test
#: is a check that failed (1), not a bad device (3: none was named), not bad usage (2).
EXIT_SELFTEST_MISSED = EXIT_NUMERICAL_FAILURE
_DIGEST_BYTES = 32  # sha256, `numerics.bits_digest`


def _nonfinite(arr: np.ndarray) -> tuple[int, int]:
    if not is_supported(arr.dtype):
        return 0, 0
    return int(np.isnan(arr).sum()), int(np.isinf(arr).sum())


@dataclass
class _Local:
    """This process's share: its devices' digests and timings, and the outputs for ULPs."""

    devices: list
    digests: np.ndarray   # uint8 [d, W, R, 32]
    nan: np.ndarray
    inf: np.ndarray
    times: np.ndarray
    injected: np.ndarray
    outputs: list = field(default_factory=list)  # [d][w][r] host arrays
    compile_s: float = 0.0  # the warm-up calls: compiling for every device


def _run_local(jax, devices, workloads: Sequence[Workload], repeats: int, seed: int,
               injections: Sequence[Injection], process_index: int) -> _Local:
    d_n, w_n = len(devices), len(workloads)
    shape = (d_n, w_n, repeats)
    local = _Local(devices, np.zeros(shape + (_DIGEST_BYTES,), np.uint8),
                   np.zeros(shape, np.int32), np.zeros(shape, np.int32),
                   np.zeros(shape, np.float64), np.zeros(shape, bool),
                   [[[None] * repeats for _ in range(w_n)] for _ in range(d_n)])
    fns = [w.build() for w in workloads]
    inputs = [[w.make_input(seed, k) for k in range(INPUTS_PER_WORKLOAD + 1)] for w in workloads]
    inj = [[i for i in injections if i.applies_to(dev.id, process_index)] for dev in devices]
    rngs = [np.random.default_rng([i.seed for i in inj[d]] + [process_index, dev.id])
            for d, dev in enumerate(devices)]
    # Warm-up (compile) on the extra input; its output is what a "stuck" device returns first.
    last = [[None] * w_n for _ in range(d_n)]
    t0 = time.perf_counter()
    for w, fn in enumerate(fns):
        for d, dev in enumerate(devices):
            try:
                last[d][w] = np.asarray(fn(jax.device_put(inputs[w][-1], dev)))
            except DiagError:
                raise
            except Exception as e:
                raise NodeScanError(f"workload {workloads[w].name} raised on device {dev.id}: "
                                    f"{type(e).__name__}: {e}") from None
    local.compile_s = time.perf_counter() - t0
    for r in range(repeats):
        for w, fn in enumerate(fns):
            x = inputs[w][r % INPUTS_PER_WORKLOAD]
            for d, dev in enumerate(devices):
                xd = jax.device_put(x, dev)
                jax.block_until_ready(xd)
                faults = [i for i in inj[d] if rngs[d].random() < i.rate]
                t0 = time.perf_counter()
                y = fn(xd)
                jax.block_until_ready(y)
                if any(i.kind == "slow" for i in faults):
                    time.sleep(max(i.delay for i in faults if i.kind == "slow"))
                local.times[d, w, r] = time.perf_counter() - t0
                out = np.asarray(y)
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


def _local_ulps(local: _Local, ref: np.ndarray) -> np.ndarray:
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
                if hexes[d, w, r] != ref[w, r] and is_supported(y.dtype) \
                        and y.dtype == good.dtype and y.shape == good.shape:
                    out[d, w, r] = float(ulp_distance(y, good).max())
    return out


def scan(*, workloads: Optional[Sequence[Workload]] = None, repeats: int = 10, seed: int = 0,
         host_devices: Optional[int] = None, platform: Optional[str] = None,
         injections: Sequence[Injection] = (), distributed: bool = False,
         coordinator: Optional[str] = None, num_processes: Optional[int] = None,
         process_id: Optional[int] = None, init_timeout: int = 60,
         golden_dir: Optional[os.PathLike] = None, save_golden: bool = False,
         use_golden: bool = True, slow_factor: float = 1.5,
         fail_on_slow: bool = False) -> NodeScan:
    """Scan every local device (every device of every process with `distributed`).

    Args:
      workloads: what to run; default every builtin (`BUILTIN_WORKLOADS`).
      repeats: R, calls per device per workload; inputs alternate between two seeded arrays.
      seed: draws the inputs (and is part of the golden key).
      host_devices: force this many CPU devices (sets XLA_FLAGS before jax is imported);
        implies platform "cpu".
      platform: "cpu", "gpu" or "tpu"; default jax's default backend.
      injections: faults diag applies to chosen devices' outputs (self-test).
      distributed: start `jax.distributed` first (auto-detected on TPU pods and SLURM, or
        the explicit `coordinator`, `num_processes`, `process_id`).
      init_timeout: seconds to wait for every process to join.
      golden_dir: the golden store (default `diag.nodes.default_golden_dir()`).
      save_golden: store this scan's digests as golden when every device agrees.
      use_golden: compare with a stored golden digest when there is one.
      slow_factor: straggler threshold, see `analyze`.
      fail_on_slow: stragglers count as suspects.

    Returns:
      A `NodeScan` (``to_dict()`` is the nodes.json data): the vote of `analyze` plus what
      the scan covered, the golden store, injections, detection, ``selftest`` and timings.
      ``exit_code`` is 3 with a suspect, else `EXIT_SELFTEST_MISSED` (1) when an injected
      fault was not found, else 0. Every process returns the same verdict; only
      ``process_index`` differs (and ``selftest``, which covers the injections that process
      was given).

    Raises:
      UsageError: bad arguments, jax already started with another device count, an
        injection that matches no scanned device, or (`diag.flags.BadFlag`) a flag in
        XLA_FLAGS that XLA refuses, found in a throwaway process before jax is imported
        here (XLA would abort this one).
      NodeScanError: jax missing, distributed start-up failed, or a workload raised.
    """
    if repeats < 1:
        raise UsageError(f"--repeats {repeats}: expected at least 1")
    if host_devices is not None and host_devices < 1:
        raise UsageError(f"--host-devices {host_devices}: expected at least 1")
    if slow_factor <= 1:
        raise UsageError(f"--slow-factor {slow_factor:g}: expected a factor above 1")
    workloads = list(workloads) if workloads else list(BUILTIN_WORKLOADS.values())
    names = [w.name for w in workloads]
    if len(set(names)) != len(names):
        raise UsageError(f"workload given twice: {', '.join(names)}")
    t_start = time.perf_counter()
    if "jax" not in sys.modules:
        # XLA aborts the whole process on a flag it does not know; find out in a throwaway one.
        from diag.flags import validate_xla_flags

        validate_xla_flags()
    jax = import_jax(host_devices)
    # Gloo prints on stdout; --json output must stay parseable.
    with StdoutToStderr() if distributed else contextlib.nullcontext():
        if distributed:
            init_distributed(jax, coordinator, num_processes, process_id, init_timeout)
        elif any(v is not None for v in (coordinator, num_processes, process_id)):
            raise UsageError("--coordinator/--num-processes/--process-id need --distributed")
        try:
            platform = platform or ("cpu" if host_devices is not None else None)
            try:
                devices = jax.local_devices(backend=platform) if platform else jax.local_devices()
                every = jax.devices(platform) if platform else jax.devices()
            except RuntimeError as e:
                raise UsageError(f"--platform {platform}: {str(e).splitlines()[0]}") from None
            check_injections(injections, [(int(d.id), int(d.process_index)) for d in every])
            pid, nproc = jax.process_index(), jax.process_count()
            host = socket.gethostname()
            t_run = time.perf_counter()
            local = _run_local(jax, devices, workloads, repeats, seed, injections, pid)
            run_s = time.perf_counter() - t_run
            devs, raw, nan, inf, times, injected = gather(jax, local, pid, host, distributed)
            digests = hex_digests(raw)
            kind, plat = devs[0]["kind"], devs[0]["platform"]
            versions = jax_versions(jax)
            keys = {w.name: w.key(seed) for w in workloads}
            gdir = Path(golden_dir) if golden_dir else store.default_golden_dir()
            gpath = store.golden_path(gdir, plat, kind, versions)
            golden = store.load_golden(gpath, keys) if use_golden else {}
            ref, _ = references(digests, golden, names)
            if distributed:
                counts = [sum(1 for d in devs if d["process_index"] == p) for p in range(nproc)]
                rows = [(p, i) for p in range(nproc) for i in range(counts[p])]
                ulps = gather_ulps(_local_ulps(local, ref), True, (max(counts), rows))
            else:
                ulps = _local_ulps(local, ref)
        finally:
            if distributed:
                try:
                    jax.distributed.shutdown()
                except Exception:  # shutting down is best effort; the verdict is already computed
                    pass
    obs = Observations(devs, names, digests, nan, inf, times, injected, ulps)
    vote = analyze(obs, golden, slow_factor=slow_factor, fail_on_slow=fail_on_slow)
    exit_code, notes = vote.exit_code, list(vote.notes)
    selftest = None
    if injections:
        outcomes = injection_outcomes({**vote.to_dict(), "repeats": repeats, "workloads": names},
                                      injections, slow_factor)
        missed = [o for o in outcomes if not o["found"]]
        selftest = {"verdict": "missed" if missed else "found", "injections": outcomes}
        if missed and not vote.suspects:
            # A self-test that did not see its own fault must not read as a clean fleet.
            exit_code = EXIT_SELFTEST_MISSED
    golden_info: dict[str, Any] = {"path": str(gpath), "compared": sorted(golden),
                                   "saved": 0}
    if save_golden:
        if vote.suspects:
            notes.append("golden not saved: the scan found suspects")
        elif pid == 0:
            store.mark_cache_folder(gdir)
            golden_info["saved"] = store.save_golden(gpath, keys, digests, {
                "platform": plat, "device_kind": kind, **versions, "host": host,
                "devices": len(devs)})
    return NodeScan(
        process_index=pid, num_processes=nproc, platform=plat, device_kind=kind,
        versions=versions, repeats=repeats, seed=seed,
        inputs_per_workload=INPUTS_PER_WORKLOAD,
        workloads=[{"name": w.name, "shape": list(w.shape), "dtype": w.dtype,
                    "key": w.key(seed)} for w in workloads],
        golden=golden_info,
        injections=[{"kind": i.kind, "rate": i.rate, "device": i.device,
                     "process": i.process, "seed": i.seed, "text": i.describe()}
                    for i in injections],
        detection=detection_table(repeats, len(workloads), injections),
        selftest=selftest,
        local_devices=len(devices), compile_seconds=local.compile_s,
        scan_seconds=run_s - local.compile_s,
        seconds_per_device=(run_s - local.compile_s) / max(len(devices), 1),
        total_seconds=time.perf_counter() - t_start,
        **{**vote.to_dict(), "exit_code": exit_code, "notes": notes},
    )
